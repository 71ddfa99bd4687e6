"""Where one attention step's time goes: the kernels a profiled forward + backward ran.

``csbp bench kernels --profile-top N`` runs each measured row's step once more under
``torch.profiler`` (after its timed repeats, so the timing is not disturbed) and records how many
kernels it launched and the ``N`` that took the most time. On CUDA these are the device kernels
(launches: what a tile loop's thousands of small ops cost on a GPU; the time: which piece of a
decomposed form dominates, e.g. the clean pieces against the noisy diagonal or the merges); on the
CPU the ``aten::`` operators, by self CPU time.

The first H200 run left a question this answers without another guess: the decomposed form with
cuDNN clean pieces was 0.91-0.95x one Flex call at 16K but 1.25-1.35x at 64K-128K
(``docs/bench/h200-kernels.json``), and only a per-kernel breakdown says which calls hold the 16K
time.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from csbp.devices import synchronize

if TYPE_CHECKING:
    from torch._ops import OpOverload


@dataclass(frozen=True)
class StepProfile:
    """One profiled step: kernels launched (CUDA) or aten ops run (CPU), and the costliest ones as
    ``(name, milliseconds, calls)``, largest first; the device's busy time (their self times summed),
    the unprofiled step's wall time and the host's time to issue it, and its synchronising calls."""

    launches: int
    top: tuple[tuple[str, float, int], ...]
    busy_ms: float = math.nan
    wall_ms: float = math.nan
    issue_ms: float = math.nan
    syncs: int = 0  # CUDA calls that waited for the device (0 on the CPU, where nothing is asynchronous)
    attention_ms: float = math.nan  # of busy_ms, in attention and matmul kernels (``is_attention_kernel``)


ATTENTION_KERNEL_MARKS = (
    "flash", "fmha", "cudnn", "sdpa", "flex_attention", "triton_tem", "gemm", "aten::bmm", "aten::mm", "aten::baddbmm",
    "aten::addmm",
)
"""Parts of the names of kernels that compute attention or matmuls: FlashAttention-2 (``flash_fwd_kernel``,
``flash_bwd_*``), cuDNN's fused attention (``cudnn_generated_*sdpa*``), memory-efficient SDPA (``fmha_*``),
FlexAttention's Triton templates (``triton_tem_fused_flex_attention*``), cuBLAS (``*gemm*``) and, on the CPU,
ATen's flash kernel and matmuls. Every other kernel (element-wise, reductions, copies, casts) is the work
around them that the merges and the transports add."""


def is_attention_kernel(name: str) -> bool:
    """Whether a profiled kernel (or, on the CPU, aten op) computes attention or a matmul."""
    lowered = name.lower()
    return any(mark in lowered for mark in ATTENTION_KERNEL_MARKS)


def profile_step(step: Callable[[], object], device: torch.device, *, top: int) -> StepProfile:
    """Run ``step`` once under ``torch.profiler`` on ``device`` and summarise it (module docstring)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if top < 1:
        raise ValueError(f"--profile-top must be >= 1, got {top}")
    on_cuda = device.type == "cuda"
    syncs = count_syncs(step, device)
    started = time.perf_counter()
    step()
    issued = time.perf_counter()
    synchronize(device)
    wall_ms, issue_ms = (time.perf_counter() - started) * 1e3, (issued - started) * 1e3
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_cuda else [])]
    with _profiler_notices_dropped(), profile(activities=activities) as prof:
        step()
        synchronize(device)
    if on_cuda:
        events = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
    else:
        events = [e for e in prof.key_averages() if e.device_type == DeviceType.CPU and e.key.startswith("aten::")]

    def self_us(event: object) -> float:
        return float(event.self_device_time_total if on_cuda else event.self_cpu_time_total)  # type: ignore[attr-defined]

    ranked = sorted(events, key=self_us, reverse=True)[:top]
    return StepProfile(
        launches=sum(int(e.count) for e in events),
        top=tuple((str(e.key)[:96], self_us(e) / 1e3, int(e.count)) for e in ranked),
        busy_ms=sum(self_us(e) for e in events) / 1e3, wall_ms=wall_ms, issue_ms=issue_ms, syncs=syncs,
        attention_ms=sum(self_us(e) for e in events if is_attention_kernel(str(e.key))) / 1e3,
    )


PROFILER_NOTICES = ("USDT:", "STAGE:")
"""Prefixes of the lines Kineto (torch's profiler library) writes to the process's stderr from C++ at
every profiler start and stop (``USDT:... profiler_start``), whatever ``KINETO_LOG_LEVEL`` says."""


@contextlib.contextmanager
def _profiler_notices_dropped() -> Iterator[None]:
    """Route file descriptor 2 to a temporary file while the profiler runs, then write back every line
    but Kineto's notices: a benchmark's table is not interleaved with them. Anything else written to
    stderr meanwhile (a warning, an error) still reaches it, only after the profiled step."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().splitlines(keepends=True)
                    if not line.decode(errors="replace").startswith(PROFILER_NOTICES)]
            data = memoryview(b"".join(kept))
            while data:
                data = data[os.write(2, data):]


def count_syncs(step: Callable[[], object], device: torch.device) -> int:
    """CUDA calls in one ``step()`` that made the host wait for the device (``.item()``, ``nonzero``, a
    blocking copy, ...): each one stops the host from queueing kernels ahead. 0 on the CPU."""
    if device.type != "cuda":
        step()
        return 0
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        torch.cuda.synchronize(device)
    return sum("synchronizing" in str(w.message) for w in caught)


def count_aten_ops(fn: Callable[[], object]) -> int:
    """aten ops dispatched by ``fn()`` (each one a kernel launch on an accelerator)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Counter(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(
            self, func: OpOverload, types: Sequence[type], args: Sequence[object] = (),
            kwargs: Mapping[str, object] | None = None,
        ) -> object:
            _Counter.calls += 1
            return func(*args, **(kwargs or {}))

    with _Counter():
        fn()
    return _Counter.calls



def format_profile(profile: StepProfile) -> str:
    """One indented line under a table row: launches, the device's busy time against the step's wall
    time (with the host's issue time and its synchronising calls) and split into attention/matmul kernels
    and the rest (element-wise passes, copies, reductions), then the costliest kernels."""
    parts = "; ".join(f"{name} {ms:.2f} ms x{calls}" for name, ms, calls in profile.top)
    timeline = ""
    if not math.isnan(profile.busy_ms):
        timeline = (f"; busy {profile.busy_ms:.2f} of {profile.wall_ms:.2f} ms wall (host issued it in "
                    f"{profile.issue_ms:.2f} ms, {profile.syncs} syncs)")
    if not math.isnan(profile.attention_ms):
        timeline += (f"; attention/matmul kernels {profile.attention_ms:.2f} ms, the rest "
                     f"{profile.busy_ms - profile.attention_ms:.2f} ms")
    return f"      {profile.launches} launches{timeline}; top: {parts}"
