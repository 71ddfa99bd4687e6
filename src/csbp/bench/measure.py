"""Measurement helpers shared by the benchmarks: peak memory per process and attention FLOPs.

Peak memory: on CUDA the allocator's peak; on CPU the growth of this process's resident set
over the measured region, read from ``/proc/self/status`` after resetting the high-water mark
(``/proc/self/clear_refs``), so torch's own import footprint is not counted.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from csbp.attention.counts import allowed_pairs as count_allowed_pairs
from csbp.attention.rows import Rows

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_bytes(key: str) -> int:
    match = re.search(rf"{key}:\s+(\d+) kB", _STATUS.read_text())
    return int(match.group(1)) * 1024 if match else 0


class PeakMemory:
    """``with PeakMemory(device) as peak: ...`` then ``peak.bytes`` is the region's peak growth."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.bytes = 0
        self._base = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        elif _CLEAR_REFS.exists():
            _CLEAR_REFS.write_text("5")  # reset VmHWM to the current RSS
            self._base = _status_bytes("VmRSS")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.bytes = torch.cuda.max_memory_allocated(self.device) - self._base
        elif _CLEAR_REFS.exists():
            self.bytes = max(0, _status_bytes("VmHWM") - self._base)


def allowed_pairs(rows: Rows, *, block_size: int, causal_in_block: bool = False) -> int:
    """(query, key) pairs the BD3 predicate allows for these query rows over the whole logical
    sequence: ``B`` noisy keys of the own block (or ``j+1`` when causal) plus the clean interval
    (``csbp.attention.counts.allowed_pairs``, the count the cost model uses). With packed documents a
    noisy row sees the keys of its *segment* (the part of its block inside its document); a rank holds
    whole segments, so their sizes are counted among ``rows``."""
    noisy = rows.live & ~rows.clean
    if torch.equal(rows.block[noisy], rows.pos[noisy] // block_size):
        return count_allowed_pairs(
            rows.pos, rows.clean, rows.ctx_start, rows.ctx_stop, rows.live,
            block_size=block_size, causal_in_block=causal_in_block,
        )
    ctx = (rows.ctx_stop - rows.ctx_start).clamp(min=0)
    diag = torch.zeros_like(rows.pos)
    segments, inverse, counts = torch.unique(rows.block[noisy], return_inverse=True, return_counts=True)
    if causal_in_block:
        first = torch.full_like(segments, torch.iinfo(torch.int64).max)
        first = first.scatter_reduce(0, inverse, rows.pos[noisy], reduce="amin")
        diag[noisy] = rows.pos[noisy] - first[inverse] + 1
    else:
        diag[noisy] = counts[inverse]
    return int(((ctx + diag) * rows.live).sum())


def attention_flops(pairs: int, *, num_heads: int, head_dim: int, backward: bool = True) -> int:
    """FLOPs of attention over ``pairs`` allowed pairs: forward ``QKᵀ`` and ``PV`` (2 matmuls,
    ``4·d`` per pair and head); backward recomputes nothing extra here but runs ``dV, dP, dQ, dK``
    plus the score recomputation (5 matmuls, ``10·d``), the usual flash-attention accounting."""
    per_pair = 4 * head_dim + (10 * head_dim if backward else 0)
    return pairs * num_heads * per_pair


@contextmanager
def fixed_mmap_threshold(threshold_bytes: int = 1 << 17) -> Iterator[None]:
    """Launch workers with a fixed glibc mmap threshold (restored afterwards).

    By default glibc raises its threshold each time a large mmapped block is freed, after which
    freed activations stay in the heap and the resident-set growth ``PeakMemory`` reads would
    under-count later steps and layouts. A fixed threshold returns every large block to the OS.
    """
    name = "MALLOC_MMAP_THRESHOLD_"
    previous = os.environ.get(name)
    if previous is None:  # a user's own setting wins
        os.environ[name] = str(threshold_bytes)
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
