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

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepProfile:
    """One profiled step: kernels launched (CUDA) or aten ops run (CPU), and the costliest ones as
    ``(name, milliseconds, calls)``, largest first."""

    launches: int
    top: tuple[tuple[str, float, int], ...]


def profile_step(step: Callable[[], object], device: torch.device, *, top: int) -> StepProfile:
    """Run ``step`` once under ``torch.profiler`` on ``device`` and summarise it (module docstring)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    if top < 1:
        raise ValueError(f"--profile-top must be >= 1, got {top}")
    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_cuda else [])]
    with profile(activities=activities) as prof:
        step()
        if on_cuda:
            torch.cuda.synchronize(device)
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
    )


def format_profile(profile: StepProfile) -> str:
    """One indented line under a table row: launches, then the costliest kernels."""
    parts = "; ".join(f"{name} {ms:.2f} ms x{calls}" for name, ms, calls in profile.top)
    return f"      {profile.launches} launches; top: {parts}"
