"""Timing one attention step on a device, as ``csbp bench kernels`` does for every row.

The step is timed between device synchronisations (wall clock, or this process's CPU time with one
thread), its first call apart (on CUDA it holds the FlexAttention compilations, counted by
``compiled_graphs``), and a variant that fails on an accelerator (a kernel this build lacks, out of
memory) leaves a ``nan`` row and one line instead of ending the run (``build_and_time``). Dense SDPA and
the flash pieces' fused kernels over all pairs are the baselines the rates are divided by.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from csbp.attention.backends import check_clean
from csbp.attention.flash_ops import flash_backward, flash_forward
from csbp.devices import synchronize


def check_clean_kernels(names: Sequence[str], device: torch.device, option: str) -> None:
    """One clear ``ValueError`` naming ``option`` unless every name is a clean-context kernel that runs on
    ``device`` (``pieces-cudnn`` needs CUDA: on the CPU it would be ``pieces`` again)."""
    for name in names:
        check_clean(name, where=option)
        if name == "pieces-cudnn" and device.type != "cuda":
            raise ValueError(f"{option} pieces-cudnn needs --device cuda (on CPU it is the same kernel as pieces)")



def timings(
    fn: Callable[[], object], device: torch.device, warmup: int, repeats: int, clock: str = "wall"
) -> tuple[float, tuple[float, ...]]:
    """``(first, repeats)`` seconds of ``fn()``: the first call (warm-up or not: on CUDA it holds the
    FlexAttention compilations) and the ``repeats`` calls after the warm-up; ``clock="cpu"`` counts this
    process's CPU time (one thread, on a shared machine: what other processes do does not count)."""
    now = time.process_time if clock == "cpu" else time.perf_counter
    times = []
    for _ in range(warmup + repeats):
        synchronize(device)
        start = now()
        fn()
        synchronize(device)
        times.append(now() - start)
    return times[0], tuple(times[warmup:])


def build_and_time(
    build: Callable[[], Callable[[], None]], device: torch.device, warmup: int, repeats: int, clock: str, *, label: str,
) -> tuple[Callable[[], None] | None, float, float, tuple[float, ...]]:
    """``(step, build seconds, first call seconds, repeats)`` of the step ``build()`` plans. On an accelerator one
    variant may fail (a kernel this build lacks, out of memory): it says so in one line naming ``label`` and
    gives ``(None, nan, nan, (nan,))``, so the row stays and the rest is measured; on the CPU it raises."""
    now = time.process_time if clock == "cpu" else time.perf_counter
    synchronize(device)
    start = now()
    try:
        step = build()
        synchronize(device)
        build_s = now() - start
        first_s, times = timings(step, device, warmup, repeats, clock)
    except RuntimeError as error:
        if device.type != "cuda":
            raise
        print(f"csbp bench kernels: {label} failed: "
              f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
        torch.cuda.empty_cache()
        return None, math.nan, math.nan, (math.nan,)
    return step, build_s, first_s, times


def compiled_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (each FlexAttention shape, grad mode, ...)."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def median(times: Sequence[float]) -> float:
    return statistics.median(times) if times else math.nan


def dense_sdpa_times(
    q: Tensor, k: Tensor, v: Tensor, dout: Tensor, device: torch.device, warmup: int, repeats: int, clock: str
) -> tuple[float, ...]:
    """Forward + backward of unmasked SDPA over all pairs (GQA without repeating K/V)."""
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]

    def step() -> None:
        out = F.scaled_dot_product_attention(*leaves, enable_gqa=q.shape[1] != k.shape[1])
        out.backward(dout)

    return timings(step, device, warmup, repeats, clock)[1]


def dense_flash_times(
    q: Tensor, k: Tensor, v: Tensor, dout: Tensor, device: torch.device, warmup: int, repeats: int, clock: str,
    kernel: str,
) -> tuple[float, ...]:
    """Forward + backward of ``csbp.attention.flash_ops``' ``kernel`` over all pairs (a flash piece's
    call); nan when the kernel fails on this machine (the rest of the benchmark still runs)."""
    scale = q.shape[-1] ** -0.5

    def step() -> None:
        out, lse = flash_forward(q, k, v, causal=False, scale=scale, cuda_kernel=kernel)
        flash_backward(q, k, v, out, lse, dout, causal=False, scale=scale, cuda_kernel=kernel)

    try:
        return timings(step, device, warmup, repeats, clock)[1]
    except RuntimeError as error:  # e.g. a cuDNN build without this configuration
        print(f"csbp bench kernels: the {kernel} kernel failed on this machine: {str(error).splitlines()[0]}")
        return (float("nan"),)
