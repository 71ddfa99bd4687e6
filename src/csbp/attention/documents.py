"""Packed documents as per-position bounds, the form the interval row metadata consumes
(docs/document-masking.md).

A packed row of ``L`` tokens holds several documents. ``Documents`` records, for every position
``p``, the half-open span ``[start[p], stop[p])`` of the document containing it. A document is a
maximal run of equal ``doc_ids`` (a reused id after another document starts a new one, as in
``csbp.dflash.anchors``); padding (``doc_ids == -1``) is a document of its own and is never
supervised.

With document masking on, a row's clean context is clipped to its document
(``ctx_start >= start[p]``, ``ctx_stop <= stop[p]``) and noisy rows attend only to the noisy rows of
their *segment*: the part of their block inside their document (``segment_ids``). Without
documents every segment is a whole block, so ``segment_ids`` is ``p // B``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from csbp.attention.document_draw import random_document_bounds


@dataclass(frozen=True, eq=False)
class Documents:
    """Document spans of every position of one packed sequence (int64 ``[L]`` tensors, CPU)."""

    start: Tensor
    stop: Tensor

    def __post_init__(self) -> None:
        if self.start.dim() != 1 or self.start.shape != self.stop.shape:
            raise ValueError(
                f"Documents.start/stop must be 1-D of equal length, got {tuple(self.start.shape)} "
                f"and {tuple(self.stop.shape)}"
            )

    @property
    def seq_len(self) -> int:
        return int(self.start.shape[0])

    @property
    def num_documents(self) -> int:
        return int((self.start == torch.arange(self.seq_len)).sum())

    @staticmethod
    def from_doc_ids(doc_ids: Tensor) -> Documents:
        """Spans of the maximal runs of equal ids in ``doc_ids [L]``."""
        if doc_ids.dim() != 1 or doc_ids.shape[0] < 1 or doc_ids.is_floating_point():
            raise ValueError(f"doc_ids must be a non-empty 1-D integer tensor, got {doc_ids.dtype} "
                             f"{tuple(doc_ids.shape)}")
        ids = doc_ids.detach().to("cpu", torch.long)
        length = ids.shape[0]
        is_start = torch.ones(length, dtype=torch.bool)
        is_start[1:] = ids[1:] != ids[:-1]
        positions = torch.arange(length)
        start = torch.cummax(torch.where(is_start, positions, 0), 0).values
        is_last = torch.ones(length, dtype=torch.bool)
        is_last[:-1] = is_start[1:]
        stop_rev = torch.cummin(torch.where(is_last, positions + 1, length).flip(0), 0).values
        return Documents(start=start, stop=stop_rev.flip(0))

    @staticmethod
    def from_lengths(lengths: list[int]) -> Documents:
        """Documents of the given lengths packed back to back (``sum(lengths) = L``)."""
        if not lengths or any(n < 1 for n in lengths):
            raise ValueError(f"document lengths must be a non-empty list of positive ints, got {lengths}")
        ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        return Documents.from_doc_ids(ids)

    def segment_ids(self, block_size: int) -> Tensor:
        """int64 ``[L]``: id of each position's segment (its block cut by document starts), increasing
        with the position; equals ``p // block_size`` when no document starts inside a block."""
        positions = torch.arange(self.seq_len)
        new_segment = (positions % block_size == 0) | (self.start == positions)
        return torch.cumsum(new_segment.long(), 0) - 1


def random_documents(seq_len: int, mean_length: int, generator: torch.Generator) -> Documents:
    """Documents of geometric lengths with mean ``mean_length`` packed into ``seq_len`` tokens (the
    last one cut at the end): what ``--doc-length N`` packs in ``csbp verify`` and the benchmarks."""
    if mean_length < 1:
        raise ValueError(f"mean document length must be >= 1, got {mean_length}")
    # A document starts at each position with probability 1/mean_length (position 0 always).
    starts = torch.rand(seq_len, generator=generator) < 1.0 / mean_length
    starts[0] = True
    return Documents.from_doc_ids(torch.cumsum(starts.long(), 0))


def seeded_documents(seq_len: int, mean_length: int, seed: int) -> Documents:
    """``random_documents`` of a fresh generator seeded with ``seed``, drawn with NumPy
    (``csbp.attention.document_draw``, the draw ``csbp plan --doc-length`` prices)."""
    start, stop = random_document_bounds(seq_len, mean_length, seed)
    return Documents(start=torch.from_numpy(start), stop=torch.from_numpy(stop))


def packed_doc_ids(documents: Documents) -> Tensor:
    """int64 ``[L]`` document index of every position (0, 1, ... in order)."""
    return torch.cumsum((documents.start == torch.arange(documents.seq_len)).long(), 0) - 1
