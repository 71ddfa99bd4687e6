"""Packed documents in the cost model (``csbp plan --doc-length N``).

The documents are the ones ``csbp bench train|attention|dflash --doc-length N`` and ``csbp verify
--doc-length N`` pack (``csbp.attention.documents.random_documents``, seed 0): a document starts at
every position with probability ``1/N`` (geometric lengths of mean ``N``), and the last one is cut
at the end of the row (a shorter document of its own). They are drawn with NumPy
(``csbp.attention.document_draw``, the same bits as ``torch.rand``), so the planner never imports
torch.

Rows, pairs and halo rows are counted over runs of positions (``csbp.attention.run_counts``) and
cached per layout and documents, so a 1M-token plan counts each layout once.

Per local rank, with the document mask (csbp's torch-free counting, the rules the runtime plans use):

* BD3 family: the allowed (query, key) pairs (``counts.position_pairs``), the clean rows a BP-only
  rank keeps (its blocks' document prefixes) and the clean rows a ring member receives in the halo
  exchange (``counts.halo_rows``: CSBP, and CP-only ``cp-aware``); plain CP-only still all-gathers.
* DFlash drafters: ``min(anchors, #valid)`` anchors spread evenly over the valid positions
  (``draft_counts.spread_anchors``, the stand-in for one random draw), dealt to the BP ranks by
  context cost, each rank's draft rows' context pairs and the context rows each ring member
  receives in the context exchange, which is used where ``csbp.dflash.exchange`` uses it: every
  layer kind of a row that packs documents (CSBP; CP-only with ``halo``), and CSBP's sliding kinds
  also in a one-document row (``one_document``, what ``csbp.plan.drafter`` prices without
  ``--doc-length``).

``csbp plan --data ARTIFACT`` plans real rows instead (``RowDocuments``, read by
``csbp.plan.artifact_documents``): every function here takes either key.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from csbp.attention.counts import DocBounds
from csbp.attention.document_draw import random_document_bounds
from csbp.attention.draft_counts import (
    context_exchange_pays,
    context_pairs,
    draft_intervals,
    exchange_rows,
    owner_anchor_indices,
    spread_anchors,
)
from csbp.attention.run_counts import RankRuns, RankTotals, RowPairs, layout_runs, rank_totals, row_pairs

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


def one_document(seq_len: int) -> RowDocuments:
    """A row that is a single document (no ``--doc-length``): the key whose drafter counts price
    CSBP's sliding-kind context exchange of one-document rows."""
    return RowDocuments(seq_len, (0,))


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
    start, stop = random_document_bounds(seq_len, doc_length, DOCUMENT_SEED)
    start.flags.writeable = stop.flags.writeable = False
    return start, stop


def document_count(seq_len: int, doc_length: DocumentKey) -> int:
    """Documents packed into one row."""
    start, _ = packed_documents(seq_len, doc_length)
    return int((start == np.arange(seq_len)).sum())


def document_halo_rows(
    seq_len: int, block: int, cp: int, bp: int, schedule: str, window: int, doc_length: DocumentKey | None
) -> int:
    """Largest number of clean rows a ring member (any ring of the sample) receives in the halo
    exchange of a layer (``window`` 0: full attention) over packed documents (``None``: one per row)."""
    return max(t.halo for t in layout_totals(seq_len, block, cp, bp, schedule, window, doc_length))


def halo_traffic_rows(
    seq_len: int, block: int, cp: int, bp: int, schedule: str, window: int, doc_length: DocumentKey | None
) -> int:
    """Rows of the busiest direction of the busiest ring member (any ring) in a layer's halo
    all-to-all: ``max`` over members of ``max(sent, received)``. Links are full duplex, a member's
    sends and receives run at once, and every member waits for the whole exchange before its halo
    partial, so this member's larger direction is the exchange's time. A member can send more than
    any member receives: a row of its shard that several members' documents need goes to each."""
    totals = layout_totals(seq_len, block, cp, bp, schedule, window, doc_length)
    return max(max(t.halo, t.sent) for t in totals)


@lru_cache(maxsize=1024)
def layout_totals(
    seq_len: int, block: int, cp: int, bp: int, schedule: str, window: int, doc_length: DocumentKey | None
) -> tuple[RankTotals, ...]:
    """Per local rank of layout ``cp x bp``: rows, allowed pairs and halo rows of a layer
    (``window`` 0: full attention) over packed documents (``None``: one document per row), counted
    over runs (``csbp.attention.run_counts``, equal to ``csbp.attention.counts`` row by row). The
    row pairs and the ranks' runs are cached apart, shared by every layout and window that needs
    them: planning at 1M tokens counts each once."""
    docs = None if doc_length is None else packed_documents(seq_len, doc_length)
    return rank_totals(
        seq_len,
        block,
        cp,
        bp,
        schedule,  # type: ignore[arg-type]
        window or None,
        docs,
        pairs=_row_pairs(seq_len, block, window, doc_length),
        runs=_layout_runs(seq_len, block, cp, bp, schedule, doc_length, window if schedule == "balanced" else 0),
    )


@lru_cache(maxsize=32)  # two int64 [L+1] arrays each: 16 MiB at 1M tokens
def _row_pairs(seq_len: int, block: int, window: int, doc_length: DocumentKey | None) -> RowPairs:
    docs = None if doc_length is None else packed_documents(seq_len, doc_length)
    return row_pairs(seq_len, block, window or None, docs)


@lru_cache(maxsize=8)
def _layout_runs(
    seq_len: int, block: int, cp: int, bp: int, schedule: str, doc_length: DocumentKey | None, window: int = 0
) -> tuple[RankRuns, ...]:
    """``window`` (0: full attention) prices the ``balanced`` schedule (the caller passes 0 for the
    others, so their runs stay shared across windows)."""
    docs = None if doc_length is None else packed_documents(seq_len, doc_length)
    return layout_runs(seq_len, block, cp, bp, schedule, docs, window or None)  # type: ignore[arg-type]


@dataclass(frozen=True)
class DraftCounts:
    """A drafter rank's share of one sample with packed documents (the slowest rank's).

    Attributes:
        anchors: live anchors of the rank with the most context pairs.
        live: live anchors of the whole sample, ``min(max_anchors, #valid)`` (what it trains).
        pairs: its draft rows' context pairs per layer window (``{0: full, W: sliding}``).
        recv_rows: per layer window, context rows the worst ring member receives: the context
            exchange's where it is used, else the all-gather's ``(cp-1)·L/cp``.
        traffic_rows: per layer window, rows of the busiest direction of the busiest ring member
            (``max(sent, received)``, what the exchange's time follows; the all-gather's rows where
            it is kept).
        exchanged: per layer window, whether the context exchange replaces the all-gather
            (``csbp.dflash.exchange.context_exchange_kinds``: a full-attention window ``0`` only in a
            row that packs documents, or under ``halo``; a sliding window also in a one-document
            row under CSBP; and only where it pays).
    """

    anchors: int
    pairs: dict[int, int]
    recv_rows: dict[int, int]
    exchanged: dict[int, bool]
    traffic_rows: dict[int, int]
    live: int


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
    # csbp.dflash.exchange.context_exchange_kinds: full kinds need documents (or halo), sliding
    # kinds of a CSBP ring exchange their window rows in a one-document row too
    wanted_full = cp > 1 and (transport == "halo" or (bp > 1 and transport != "streaming" and _packs(docs)))
    wanted_sliding = wanted_full or (cp > 1 and bp > 1 and transport != "streaming")
    recv_rows, exchanged, traffic_rows = {}, {}, {}
    for w in windows:
        worst, busiest, used = gather, gather, False
        if wanted_sliding if w else wanted_full:
            rings = range(len(owners) // cp) if bp > 1 else range(1)
            worst = busiest = 0
            for ring in rings:
                members = [per_window[w][ring * cp + d if bp > 1 else 0] for d in range(cp)]
                recv, sent = exchange_rows(seq_len, cp, members)
                traffic = [max(r, t) for r, t in zip(recv, sent, strict=True)]
                pays = context_exchange_pays(traffic, seq_len, cp)  # else the ring keeps the all-gather
                used |= pays
                worst = max(worst, max(recv) if pays else gather)
                busiest = max(busiest, max(traffic) if pays else gather)
        recv_rows[w], exchanged[w], traffic_rows[w] = worst, used, busiest
    return DraftCounts(len(owners[slowest]), pairs, recv_rows, exchanged, traffic_rows, len(spread))


def _packs(docs: DocBounds) -> bool:
    """The row holds more than one document (``csbp.dflash.exchange.packs_documents``)."""
    return bool(docs[0][-1] > 0)
