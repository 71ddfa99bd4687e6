"""Torch-free arithmetic of the BD3 layouts: which positions a rank holds, the interval bounds of
its rows, how many (query, key) pairs the mask allows and which clean rows a window layer needs.

This module imports NumPy only, so the cost model (``csbp.plan``) counts rows, pairs and exchanged
rows with exactly the functions the layouts, kernels' benchmarks and transports use
(``csbp.attention.layouts`` builds its tensors from ``layout_positions`` and ``bd3_bounds``,
``csbp.bench.measure.allowed_pairs`` is ``allowed_pairs`` below, ``window_exchange_plan`` covers
intervals with ``interval_cover``): the model and the code cannot drift.

``bd3_bounds`` and ``allowed_pairs`` are written with operators NumPy arrays and torch tensors
share (``//``, ``*``, ``.clip``, ``~``), so they take either.

Packed documents (docs/document-masking.md) enter as ``DocBounds``: NumPy ``(start, stop)`` arrays
``[L]``, the span of the document holding each position (``csbp.attention.documents.Documents``
as arrays). They clip every row's interval to its document and cut a noisy row's block to its
*segment*, exactly as ``csbp.attention.layouts.bd3_rows`` does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np

from csbp.schedules import (
    BlockSchedule,
    SchedulePolicy,
    balanced_schedule,
    block_runs,
    block_schedule,
    zigzag_array,
)

Array = Any  # a 1-D integer/bool NumPy array or torch tensor
DocBounds = tuple[np.ndarray, np.ndarray]  # (start [L], stop [L]) of each position's document


def layout_positions(
    seq_len: int,
    block_size: int,
    cp: int,
    bp: int,
    local_rank: int,
    schedule: SchedulePolicy = "dual_end",
    documents: DocBounds | None = None,
    window: int | None = None,
) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    """``(noisy_positions, clean_positions, owned_blocks)`` of local rank ``local_rank`` (int64, the
    packed order of ``csbp.attention.layouts``) for the layout the degrees name: ``data``
    (``cp == bp == 1``), CP-only zigzag over ``2L`` (``bp == 1``), BP-only clean-prefix replication
    (``cp == 1``) or fused CSBP. With ``documents`` BP-only keeps only each owned block's document
    prefix ``∪ [d_start, b·B)`` (``layouts.bp_only_layout``). ``window`` only enters the
    ``balanced`` schedule's costs (``rank_schedule``). Validation of the degrees and ``seq_len`` is
    the caller's (``csbp.topology.Topology``)."""
    if cp == 1 and bp == 1:
        positions = np.arange(seq_len, dtype=np.int64)
        return positions, positions, tuple(range(seq_len // block_size))
    if bp == 1:
        logical = zigzag_array(2 * seq_len, cp, local_rank)  # sorted indices into [x_t ; x_0]
        noisy = logical[logical < seq_len]
        return noisy, logical[logical >= seq_len] - seq_len, tuple(np.unique(noisy // block_size).tolist())
    blocks = rank_schedule(seq_len, block_size, cp, bp, schedule, documents, window).blocks(local_rank)
    noisy = (np.asarray(blocks, dtype=np.int64)[:, None] * block_size + np.arange(block_size)).reshape(-1)
    if cp == 1 and documents is not None:
        noisy_start, noisy_stop, _, _ = document_bounds(noisy, noisy[:0], block_size, None, documents)
        clean = np.flatnonzero(interval_cover(noisy_start, noisy_stop, seq_len)).astype(np.int64)
    elif cp == 1:
        clean = np.arange(max(blocks) * block_size, dtype=np.int64)
    else:
        clean = zigzag_array(seq_len, cp, local_rank % cp)
    return noisy, clean, blocks


def rank_schedule(
    seq_len: int,
    block_size: int,
    cp: int,
    bp: int,
    schedule: SchedulePolicy = "dual_end",
    documents: DocBounds | None = None,
    window: int | None = None,
) -> BlockSchedule:
    """The block schedule over the ``bp`` BP ranks of one sample: ``block_schedule(N, bp, schedule)``,
    or for ``"balanced"`` with packed ``documents`` or a sliding ``window`` shorter than the row the
    cost-aware ``document_schedule`` (every rank derives the same one from the sample's documents
    and the window; without either a block's cost is its index, which dual-end already balances)."""
    if schedule == "balanced" and (documents is not None or (window is not None and window < seq_len)):
        if documents is None:  # one document spanning the row: only the window shapes the costs
            documents = _bounds_from_starts(np.zeros(1, dtype=np.int64), seq_len)
        return document_schedule(seq_len, block_size, cp, bp, documents, window)
    return block_schedule(seq_len // block_size, bp, schedule)


DOCUMENT_SCHEDULES_KEPT = 8
"""Schedules ``document_schedule`` keeps (least recently used dropped). Its only repeated asks are one
row's, back to back: the rank's own layout, then every ring member's in the halo exchange plan
(``csbp plan`` caches the totals above it and asks each key once). Training packs new documents
into every row, so an entry is never asked for again after its step, and each holds ``L / B``
Python ints (about 2.5 MB at 1M tokens, ``B = 16``): 512 kept ones held 1.3 GB per rank."""


def document_schedule(
    seq_len: int, block_size: int, cp: int, bp: int, documents: DocBounds, window: int | None = None
) -> BlockSchedule:
    """``schedules.balanced_schedule`` with the document mask's costs. The dealt units are the
    ``2·bp`` runs of ``N / (2·bp)`` blocks dual-end pairs (finer runs balance little better and
    scatter a rank's blocks over more documents, which costs halo rows). A unit costs the allowed
    pairs of its noisy rows (``block_costs``: per row its document prefix, at most ``window - 1``
    keys of it, plus its segment); in BP-only (``cp == 1``) also those of the clean prefix it makes
    its owner recompute. A CSBP worker (``cp > 1``) starts loaded with its zigzag clean shard's
    pairs, which stay where they are. Cached per distinct documents and window."""
    start, _ = documents
    starts = np.flatnonzero(start == np.arange(len(start))).astype(np.int64)
    return _document_schedule(seq_len, block_size, cp, bp, starts.tobytes(), window)


def block_costs(
    seq_len: int, block_size: int, documents: DocBounds, window: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """``(noisy pairs, clean pairs)`` int64 ``[L]``: the (query, key) pairs the mask allows the
    noisy and the clean row of each position (``position_pairs`` per row): a noisy row sees its
    in-document clean prefix, with a window only its last ``window - 1`` positions, plus its
    segment; a clean row its in-document causal (block-causal without a window) prefix, with a
    window at most ``window`` keys of it."""
    positions = np.arange(seq_len, dtype=np.int64)
    n_start, n_stop, c_start, c_stop = document_bounds(positions, positions, block_size, window, documents)
    noisy = (n_stop - n_start).clip(min=0) + segment_lengths(positions, block_size, documents)
    return noisy, (c_stop - c_start).clip(min=0)


@lru_cache(maxsize=DOCUMENT_SCHEDULES_KEPT)
def _document_schedule(
    seq_len: int, block_size: int, cp: int, bp: int, starts_bytes: bytes, window: int | None
) -> BlockSchedule:
    noisy_prefix, clean_prefix, block_start = _document_row_costs(seq_len, block_size, starts_bytes, window)
    num_blocks = seq_len // block_size
    units = block_runs(num_blocks, bp, max(1, num_blocks // (2 * bp)))
    costs = []
    for unit in units:
        cost = int(noisy_prefix[(unit[-1] + 1) * block_size] - noisy_prefix[unit[0] * block_size])
        if cp == 1:  # BP-only: the unit's clean prefix (its blocks' [d_start, b·B)), recomputed by its owner
            blocks = np.arange(unit[0], unit[-1] + 1, dtype=np.int64)
            begin, end = merge_runs(block_start[blocks], blocks * block_size)
            cost += int((clean_prefix[end] - clean_prefix[begin]).sum())
        costs.append(cost)
    base_loads = None
    if cp > 1:
        chunk = seq_len // (2 * cp)
        ends = clean_prefix[np.arange(0, seq_len + 1, chunk)]
        chunk_pairs = ends[1:] - ends[:-1]
        shard = [int(chunk_pairs[c] + chunk_pairs[2 * cp - 1 - c]) for c in range(cp)]  # zigzag chunks
        base_loads = [shard[w % cp] for w in range(bp)]
    dealt = balanced_schedule(units, costs, bp, base_loads=base_loads)
    # The dealing prices units additively, which over-counts the clean prefix two units of a BP-only
    # rank share, and can end above plain dual-end: price both exactly and keep dual-end's blocks when
    # its slowest rank is strictly lighter (deterministic, so the same on every rank).
    dual = block_schedule(num_blocks, bp, "dual_end")
    prices = (noisy_prefix, clean_prefix, block_start, base_loads)
    if max(_rank_loads(dual, block_size, cp, *prices)) < max(_rank_loads(dealt, block_size, cp, *prices)):
        return BlockSchedule(dual.assignment, num_blocks, "balanced")
    return dealt


def _rank_loads(
    schedule: BlockSchedule,
    block_size: int,
    cp: int,
    noisy_prefix: np.ndarray,
    clean_prefix: np.ndarray,
    block_start: np.ndarray,
    base_loads: list[int] | None,
) -> list[int]:
    """Per BP rank, the (query, key) pairs the mask allows its rows (``rank_pairs``, from the prefix
    sums): its blocks' noisy rows, plus in BP-only the clean rows of the union of their document
    prefixes ``[d_start, b·B)``, else its zigzag clean shard (``base_loads``)."""
    loads = []
    for rank in range(schedule.num_workers):
        blocks = np.asarray(schedule.blocks(rank), dtype=np.int64)
        load = int((noisy_prefix[(blocks + 1) * block_size] - noisy_prefix[blocks * block_size]).sum())
        if cp == 1:
            begin, end = merge_runs(block_start[blocks], blocks * block_size)
            load += int((clean_prefix[end] - clean_prefix[begin]).sum())
        elif base_loads is not None:
            load += base_loads[rank]
        loads.append(load)
    return loads


ROW_COSTS_KEPT = 16
"""Rows whose costs ``_document_row_costs`` keeps: ``csbp plan --data`` prices at most 16 rows
(``plan.artifact_documents.SAMPLE_ROWS``) under every ``(cp, bp)``, each row's costs computed once."""
ROW_COSTS_BYTES = 80 << 20
"""...and at most this many bytes of them (least recently used dropped first, the newest always
kept): the 16 rows of at most ``2^22`` tokens ``csbp plan --data`` prices take 64 MiB. Training
packs new documents into every row, so its kept rows are never asked for again; without this bound
16 rows at 1M tokens held about 400 MiB per rank (with each row's block starts a view that kept its
``[L]`` document starts alive)."""
_row_costs_kept: OrderedDict[tuple[int, int, bytes, int | None], tuple[np.ndarray, ...]] = OrderedDict()
_row_costs_bytes = 0


def _document_row_costs(
    seq_len: int, block_size: int, starts_bytes: bytes, window: int | None
) -> tuple[np.ndarray, ...]:
    """``_row_costs``, kept for the most recently asked rows (``ROW_COSTS_KEPT``, ``ROW_COSTS_BYTES``)."""
    global _row_costs_bytes
    key = (seq_len, block_size, starts_bytes, window)
    costs = _row_costs_kept.pop(key, None)
    if costs is None:
        costs = _row_costs(seq_len, block_size, starts_bytes, window)
        _row_costs_bytes += sum(array.nbytes for array in costs)
    _row_costs_kept[key] = costs  # the most recent last
    while len(_row_costs_kept) > 1 and (
        len(_row_costs_kept) > ROW_COSTS_KEPT or _row_costs_bytes > ROW_COSTS_BYTES
    ):
        _, dropped = _row_costs_kept.popitem(last=False)
        _row_costs_bytes -= sum(array.nbytes for array in dropped)
    return costs


def _row_costs(seq_len: int, block_size: int, starts_bytes: bytes, window: int | None) -> tuple[np.ndarray, ...]:
    """Prefix sums ``[L+1]`` of every row's pairs as a noisy and as a clean row (``block_costs``),
    and each block's first row's document start (BP-only recomputes ``[d_start, b·B)`` with or
    without a window, ``layout_positions``): what every ``(cp, bp)`` of ``_document_schedule``
    prices its units with. Every array owns its memory (a view would keep the ``[L]`` one it
    slices alive, uncounted)."""
    documents = _bounds_from_starts(np.frombuffer(starts_bytes, dtype=np.int64), seq_len)
    noisy, clean = block_costs(seq_len, block_size, documents, window)
    zero = np.zeros(1, dtype=np.int64)
    block_start = documents[0][::block_size].copy()
    return np.concatenate([zero, np.cumsum(noisy)]), np.concatenate([zero, np.cumsum(clean)]), block_start


def _bounds_from_starts(starts: np.ndarray, seq_len: int) -> DocBounds:
    """``(start, stop)`` per position of the documents starting at ``starts`` (sorted, from 0)."""
    index = np.searchsorted(starts, np.arange(seq_len), side="right") - 1
    stops = np.append(starts[1:], seq_len)
    return starts[index], stops[index]


EXCHANGE_MAX_SHARE = 0.9
"""A halo exchange (BD3's ``WindowAttention``, DFlash's context exchange) replaces the all-gather
only when its busiest ring member moves at most this share of the rows the all-gather moves per
member and direction, in its busier direction (``max(sent, received)``; ``exchange_pays``). Why a
margin and not any saving:

* a collective takes as long as its busiest member's traffic, not the ring's total (links are full
  duplex: a member's larger direction; a member can send more than any member receives, a row of
  its shard that several members need goes to each);
* the variable-split all-to-all adds work the all-gather lacks, per moved row: the sender's
  ``index_select`` into a packed buffer, the receiver's reordering ``index_select`` and contiguous
  copy, and in the backward the ``index_add_`` of the returned dK/dV. About four extra passes over
  the moved bytes in memory: at 4.8 TB/s HBM (H200) against 450 GB/s NVLink per direction that is
  up to ~0.4 of those rows' link time if nothing overlapped it; the transports issue the all-to-all
  asynchronously behind the other partials' compute, so only part of it stays exposed;
* NCCL reaches a lower bus bandwidth on uneven all-to-all splits than on the ring all-gather.

A 10% margin keeps the exchange wherever it clearly wins (short documents and windows receive a few
percent to about half of the all-gather's rows) and the all-gather where the two are a wash (long
documents, windows about as long as the row). It is this cost argument's, not a measurement's:
timing both on the 2-core CPU machine (gloo, 2 ranks, the same rows) gave 0.8-1.3x, noise larger
than the effect."""


def exchange_pays(traffic_rows: Sequence[int], gather_rows: int) -> bool:
    """Whether a ring whose members would move ``traffic_rows`` rows in a halo exchange (each
    member's busier direction, ``max(sent, received)``) uses it instead of an all-gather that moves
    ``gather_rows`` rows per member and direction (``EXCHANGE_MAX_SHARE``). The one rule: the
    runtime (``attention.transports.factory``, ``dflash.exchange``) and the planner
    (``plan.model``, ``plan.documents``) call it with the same counts."""
    return max(traffic_rows, default=0) <= EXCHANGE_MAX_SHARE * gather_rows


def bd3_bounds(
    noisy_pos: Array, clean_pos: Array, *, block_size: int, window: int | None
) -> tuple[Array, Array, Array, Array]:
    """``(noisy_start, noisy_stop, clean_start, clean_stop)``: the clean interval (token units) each
    noisy and each clean row of the BD3 mask may see (csbp.md §3.3); see ``layouts`` for the table."""
    noisy_stop = (noisy_pos // block_size) * block_size  # the noisy block's first position
    if window is None:
        return noisy_pos * 0, noisy_stop, clean_pos * 0, (clean_pos // block_size + 1) * block_size
    noisy_start = (noisy_stop - (window - 1)).clip(min=0)
    return noisy_start, noisy_stop, (clean_pos + 1 - window).clip(min=0), clean_pos + 1


def document_bounds(
    noisy_pos: np.ndarray,
    clean_pos: np.ndarray,
    block_size: int,
    window: int | None,
    documents: DocBounds | None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``bd3_bounds`` clipped to each row's document (``layouts.bd3_rows``): ``ctx_start >=
    d_start`` for every row, ``ctx_stop <= d_stop`` for clean rows."""
    n_start, n_stop, c_start, c_stop = bd3_bounds(noisy_pos, clean_pos, block_size=block_size, window=window)
    if documents is None:
        return n_start, n_stop, c_start, c_stop
    start, stop = documents
    return (
        np.maximum(n_start, start[noisy_pos]),
        n_stop,
        np.maximum(c_start, start[clean_pos]),
        np.minimum(c_stop, stop[clean_pos]),
    )


def segment_lengths(noisy_pos: np.ndarray, block_size: int, documents: DocBounds | None) -> np.ndarray:
    """Noisy keys each noisy row sees: its block (``B``), or with documents its *segment*, the part
    of its block inside its document (``Documents.segment_ids``)."""
    first = (noisy_pos // block_size) * block_size
    if documents is None:
        return np.full(len(noisy_pos), block_size, dtype=np.int64)
    start, stop = documents
    return np.minimum(first + block_size, stop[noisy_pos]) - np.maximum(first, start[noisy_pos])


def allowed_pairs(
    pos: Array,
    clean: Array,
    ctx_start: Array,
    ctx_stop: Array,
    live: Array,
    *,
    block_size: int,
    causal_in_block: bool = False,
) -> int:
    """(query, key) pairs the BD3 predicate allows for these query rows over the whole logical
    sequence: ``B`` noisy keys of the own block (``j+1`` when causal) plus the clean interval."""
    ctx = (ctx_stop - ctx_start).clip(min=0)
    diag = pos % block_size + 1 if causal_in_block else pos * 0 + block_size
    return int(((ctx + diag * ~clean) * live).sum())


def interval_cover(ctx_start: np.ndarray, ctx_stop: np.ndarray, length: int) -> np.ndarray:
    """Bool ``[length]``: positions inside at least one row's ``[ctx_start, ctx_stop)``."""
    start = np.clip(ctx_start, 0, length)
    stop = np.clip(ctx_stop, 0, length)
    nonempty = stop > start
    delta = np.zeros(length + 1, dtype=np.int64)  # +1 at each start, -1 at each stop
    np.add.at(delta, start[nonempty], 1)
    np.add.at(delta, stop[nonempty], -1)
    return np.cumsum(delta)[:length] > 0


def merge_runs(start: np.ndarray, stop: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of half-open intervals as sorted disjoint runs ``(start, stop)`` int64 (empty
    intervals dropped): ``interval_cover`` without the length-``L`` array."""
    keep = stop > start
    start, stop = start[keep], stop[keep]
    if not len(start):
        return start.astype(np.int64), stop.astype(np.int64)
    order = np.argsort(start, kind="stable")
    start, stop = start[order], stop[order]
    reach = np.maximum.accumulate(stop)
    new = np.ones(len(start), dtype=bool)
    new[1:] = start[1:] > reach[:-1]  # a gap before this interval starts a new run
    firsts = np.flatnonzero(new)
    lasts = np.append(firsts[1:], len(start)) - 1
    return start[firsts].astype(np.int64), reach[lasts].astype(np.int64)


def rank_pairs(
    seq_len: int,
    block_size: int,
    cp: int,
    bp: int,
    local_rank: int,
    *,
    window: int | None = None,
    schedule: SchedulePolicy = "dual_end",
    documents: DocBounds | None = None,
) -> tuple[int, int]:
    """``(noisy-query pairs, clean-query pairs)`` the mask allows for local rank ``local_rank``'s rows."""
    noisy, clean, _ = layout_positions(seq_len, block_size, cp, bp, local_rank, schedule, documents, window)
    return position_pairs(noisy, clean, block_size=block_size, window=window, documents=documents)


def position_pairs(
    noisy: np.ndarray,
    clean: np.ndarray,
    *,
    block_size: int,
    window: int | None = None,
    documents: DocBounds | None = None,
) -> tuple[int, int]:
    """``(noisy-query pairs, clean-query pairs)`` the BD3 mask allows for rows at these positions
    (with ``documents``: the document mask's)."""
    if documents is None:
        n_start, n_stop, c_start, c_stop = bd3_bounds(noisy, clean, block_size=block_size, window=window)
        no, yes = np.zeros(len(noisy), dtype=bool), np.ones(len(clean), dtype=bool)
        noisy_pairs = allowed_pairs(noisy, no, n_start, n_stop, ~no, block_size=block_size)
        clean_pairs = allowed_pairs(clean, yes, c_start, c_stop, yes, block_size=block_size)
        return noisy_pairs, clean_pairs
    n_start, n_stop, c_start, c_stop = document_bounds(noisy, clean, block_size, window, documents)
    noisy_pairs = (n_stop - n_start).clip(min=0) + segment_lengths(noisy, block_size, documents)
    return int(noisy_pairs.sum()), int((c_stop - c_start).clip(min=0).sum())


def window_halo_rows(
    seq_len: int,
    block_size: int,
    cp: int,
    bp: int,
    local_rank: int,
    window: int,
    schedule: SchedulePolicy = "dual_end",
) -> int:
    """Clean rows local rank ``local_rank`` of a fused CSBP ring receives in a window layer: the
    positions its rows' intervals cover that its own zigzag shard does not hold (what
    ``window_exchange_plan``'s ``recv_counts`` sum to)."""
    return halo_rows(seq_len, block_size, cp, bp, local_rank, window=window, schedule=schedule)


def halo_rows(
    seq_len: int,
    block_size: int,
    cp: int,
    bp: int,
    local_rank: int,
    *,
    window: int | None = None,
    schedule: SchedulePolicy = "dual_end",
    documents: DocBounds | None = None,
) -> int:
    """Clean rows local rank ``local_rank`` of a ring (CSBP, or CP-only ``cp-aware`` when
    ``bp == 1``) receives in the halo exchange of a layer (``window`` None: full attention): the
    positions its rows' (document-clipped) intervals cover that its own clean shard does not hold,
    what ``layouts.halo_exchange_plan``'s ``recv_counts`` sum to."""
    noisy, clean, _ = layout_positions(seq_len, block_size, cp, bp, local_rank, schedule, documents, window)
    n_start, n_stop, c_start, c_stop = document_bounds(noisy, clean, block_size, window, documents)
    need = interval_cover(np.concatenate([n_start, c_start]), np.concatenate([n_stop, c_stop]), seq_len)
    need[clean] = False
    return int(need.sum())
