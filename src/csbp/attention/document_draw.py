"""The random packed documents of ``--doc-length N``, drawn without torch.

``csbp bench train|attention|dflash --doc-length N`` packs documents whose first positions are
drawn as ``torch.rand(L, generator=torch.Generator().manual_seed(seed)) < 1/N`` (position 0
always starts one): a document starts at every position with probability ``1/N``, so lengths are
geometric with mean ``N`` and the last one is cut at the end of the row. ``csbp plan --doc-length``
prices the same documents (seed 0) but must not import torch, so this module draws the same bits
with NumPy: torch's CPU generator is the 32-bit Mersenne Twister seeded with ``init_genrand(seed
mod 2^32)``, which is NumPy's ``RandomState(seed)``, and ``torch.rand`` turns each 32-bit output
``x`` into the float32 ``(x & (2^24 - 1)) · 2^-24`` and compares it with ``1/N`` rounded to
float32. ``csbp.attention.documents.seeded_documents`` wraps this draw for the benchmarks, and
``tests/test_document_draw.py`` checks it against ``torch.rand`` bit for bit.
"""

from __future__ import annotations

import numpy as np

from csbp.attention.counts import DocBounds


def random_document_starts(seq_len: int, mean_length: int, seed: int) -> np.ndarray:
    """Bool ``[L]``: where a document starts (``[0]`` always)."""
    if mean_length < 1:
        raise ValueError(f"mean document length must be >= 1, got {mean_length}")
    if seed < 0:
        raise ValueError(f"the document seed must be >= 0, got {seed}")
    raw = np.random.RandomState(seed & 0xFFFFFFFF).randint(0, 2**32, size=seq_len, dtype=np.uint32)
    uniform = ((raw & 0xFFFFFF).astype(np.float64) * 2.0**-24).astype(np.float32)  # exact
    starts = uniform < np.float32(1.0 / mean_length)
    starts[0] = True
    return starts


def random_document_bounds(seq_len: int, mean_length: int, seed: int) -> DocBounds:
    """``(start, stop)`` int64 ``[L]``: each position's document span for ``random_document_starts``."""
    first = np.flatnonzero(random_document_starts(seq_len, mean_length, seed)).astype(np.int64)
    lengths = np.diff(np.append(first, seq_len))
    return np.repeat(first, lengths), np.repeat(first + lengths, lengths)
