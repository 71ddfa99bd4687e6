"""Packed documents in the cost model (``csbp plan --doc-length N``).

The documents are the ones ``csbp bench train|attention|dflash --doc-length N`` and ``csbp verify
--doc-length N`` pack (``csbp.attention.documents.random_documents``, seed 0): a document starts at
every position with probability ``1/N`` (geometric lengths of mean ``N``), and the last one is cut
at the end of the row (a shorter document of its own). Only this import needs torch; without
``--doc-length`` the planner stays torch-free.

Per local rank, with the document mask (csbp's torch-free counting, the rules the runtime plans use):

* BD3 family: the allowed (query, key) pairs (``counts.position_pairs``), the clean rows a BP-only
  rank keeps (its blocks' document prefixes) and the clean rows a ring member receives in the halo
  exchange (``counts.halo_rows``: CSBP, and CP-only ``cp-aware``); plain CP-only still all-gathers.
* DFlash drafters: ``min(anchors, #valid)`` anchors spread evenly over the valid positions
  (``draft_counts.spread_anchors``, the stand-in for one random draw), dealt to the BP ranks by
  context cost, each rank's draft rows' context pairs and the context rows each ring member
  receives in the context exchange, which is used where ``csbp.dflash.exchange`` uses it.

``csbp plan --data ARTIFACT`` plans real rows instead (``RowDocuments``, read by
``csbp.plan.artifact_documents``): every function here takes either key.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from csbp.attention.counts import DocBounds, halo_rows
from csbp.attention.draft_counts import (
    context_exchange_pays,
    context_pairs,
    draft_intervals,
    exchange_recv_rows,
    owner_anchor_indices,
    spread_anchors,
)

DOCUMENT_SEED = 0


@dataclass(frozen=True)
class RowDocuments:
    """One row's real documents (``csbp plan --data``, ``csbp.plan.artifact_documents``): the first
    position of every document in the row, ``starts[0] == 0``. Hashable, so the counting caches
    below key on it exactly as on a ``--doc-length`` mean."""

    seq_len: int
    starts: tuple[int, ...]

    def bounds(self) -> DocBounds:
        """``(start, stop)`` int64 ``[L]``: each position's document span."""
        edges = np.asarray(self.starts, dtype=np.int64)
        lengths = np.diff(np.append(edges, self.seq_len))
        start = np.repeat(edges, lengths)
        return start, np.repeat(edges + lengths, lengths)


DocumentKey = int | RowDocuments
"""What one planned row packs: a ``--doc-length`` mean (geometric draw, seed 0) or a real row."""


@lru_cache(maxsize=64)
def packed_documents(seq_len: int, doc_length: DocumentKey) -> DocBounds:
    """``(start, stop)`` int64 ``[L]`` of the documents ``--doc-length doc_length`` packs, or of a
    real row (read-only)."""
    if isinstance(doc_length, RowDocuments):
        if doc_length.seq_len != seq_len:
            raise ValueError(f"a {doc_length.seq_len}-token document row cannot be planned at L={seq_len}")
        start, stop = doc_length.bounds()
        start.flags.writeable = stop.flags.writeable = False
        return start, stop
    import torch

    from csbp.attention.documents import random_documents

    docs = random_documents(seq_len, doc_length, torch.Generator().manual_seed(DOCUMENT_SEED))
    start, stop = docs.start.numpy().copy(), docs.stop.numpy().copy()
    start.flags.writeable = stop.flags.writeable = False
    return start, stop


def document_count(seq_len: int, doc_length: DocumentKey) -> int:
    """Documents packed into one row."""
    start, _ = packed_documents(seq_len, doc_length)
    return int((start == np.arange(seq_len)).sum())


@lru_cache(maxsize=512)
def document_halo_rows(
    seq_len: int, block: int, cp: int, bp: int, schedule: str, window: int, doc_length: DocumentKey
) -> int:
    """Largest number of clean rows a ring member (any ring of the sample) receives in the halo
    exchange of a layer (``window`` 0: full attention) over packed documents."""
    docs = packed_documents(seq_len, doc_length)
    return max(
        halo_rows(seq_len, block, cp, bp, rank, window=window or None, schedule=schedule, documents=docs)  # type: ignore[arg-type]
        for rank in range(max(cp, bp))
    )


@dataclass(frozen=True)
class DraftCounts:
    """A drafter rank's share of one sample with packed documents (the slowest rank's).

    Attributes:
        anchors: live anchors of the rank with the most context pairs.
        pairs: its draft rows' context pairs per layer window (``{0: full, W: sliding}``).
        recv_rows: per layer window, context rows the worst ring member receives: the context
            exchange's where it is used, else the all-gather's ``(cp-1)·L/cp``.
        exchanged: per layer window, whether the context exchange replaces the all-gather.
    """

    anchors: int
    pairs: dict[int, int]
    recv_rows: dict[int, int]
    exchanged: dict[int, bool]


def draft_counts(
    seq_len: int,
    doc_length: DocumentKey,
    *,
    block: int,
    anchors: int,
    cp: int,
    bp: int,
    transport: str,
    windows: tuple[int, ...],
    context: str = "strict",
) -> DraftCounts:
    """The DFlash drafter counts of layout ``cp x bp`` (``transport`` as ``topology.transport``)."""
    return _draft_counts(seq_len, doc_length, block, anchors, cp, bp, transport, windows, context)


@lru_cache(maxsize=256)
def _draft_counts(
    seq_len: int,
    doc_length: DocumentKey,
    block: int,
    anchors: int,
    cp: int,
    bp: int,
    transport: str,
    windows: tuple[int, ...],
    context: str,
) -> DraftCounts:
    docs = packed_documents(seq_len, doc_length)
    spread = spread_anchors(docs, anchors)
    doc_start = docs[0][spread]
    owners = owner_anchor_indices(spread, doc_start, bp if bp > 1 else 1, context=context)
    per_window = {
        w: [
            draft_intervals(spread[i], doc_start[i], block, context=context, window=w or None) for i in owners
        ]
        for w in windows
    }
    load = [sum(context_pairs(*per_window[w][o]) for w in windows) for o in range(len(owners))]
    slowest = int(np.argmax(load))
    pairs = {w: context_pairs(*per_window[w][slowest]) for w in windows}
    gather = (cp - 1) * seq_len // cp if cp > 1 else 0
    wanted = cp > 1 and (transport == "halo" or (bp > 1 and transport != "streaming" and _packs(docs)))
    recv_rows, exchanged = {}, {}
    for w in windows:
        worst, used = gather, False
        if wanted:
            rings = range(len(owners) // cp) if bp > 1 else range(1)
            worst = 0
            for ring in rings:
                members = [per_window[w][ring * cp + d if bp > 1 else 0] for d in range(cp)]
                recv = exchange_recv_rows(seq_len, cp, members)
                pays = context_exchange_pays(recv, seq_len, cp)  # else the ring keeps the all-gather
                used |= pays
                worst = max(worst, max(recv) if pays else gather)
        recv_rows[w], exchanged[w] = worst, used
    return DraftCounts(len(owners[slowest]), pairs, recv_rows, exchanged)


def _packs(docs: DocBounds) -> bool:
    """The row holds more than one document (``csbp.dflash.exchange.packs_documents``)."""
    return bool(docs[0][-1] > 0)
