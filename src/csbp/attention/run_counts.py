"""The counts of ``csbp.attention.counts`` over *runs* of positions, for the cost model at 1M tokens.

``counts.layout_positions`` lists every row a rank holds and ``counts.halo_rows`` marks the
positions its intervals cover in a length-``L`` array: ``O(L)`` per rank, ``O(L·P)`` per layout.
Here a rank's rows are runs ``[start, stop)`` (its noisy blocks or zigzag chunk, its clean chunks or
document prefixes), and per (``L``, ``B``, window, documents) one prefix sum of every row's allowed
pairs turns a run's pairs into two lookups. The halo needs no per-row work either: every interval
of a run of clean rows contains its row and both ends grow with the row, so the run covers one
interval ``[ctx_start(first), ctx_stop(last))``; the noisy rows of a block that share a document
share their interval and rows of later documents see nothing (their document starts after the
block's first row), so each block (or part of one) covers one interval, its first row's. The halo
is the union's length minus the rank's clean rows (which the union contains), and the rows a ring
member sends are the parts of its clean runs the other members' unions hold.

Every function equals its ``counts`` twin exactly (``tests/test_run_counts.py`` compares them on
random documents); the runtime keeps using ``counts``. NumPy only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from csbp.attention.counts import DocBounds, document_bounds, merge_runs, rank_schedule, segment_lengths
from csbp.schedules import SchedulePolicy

Runs = tuple[np.ndarray, np.ndarray]  # (start, stop) int64 of half-open runs of positions


@dataclass(frozen=True)
class RankRuns:
    """One local rank's rows as runs: ``noisy`` (disjoint) and ``clean`` (disjoint, sorted)."""

    noisy: Runs
    clean: Runs

    @property
    def noisy_rows(self) -> int:
        return int((self.noisy[1] - self.noisy[0]).sum())

    @property
    def clean_rows(self) -> int:
        return int((self.clean[1] - self.clean[0]).sum())


@dataclass(frozen=True)
class RankTotals:
    """One local rank's rows, allowed pairs and halo rows (``counts.layout_positions`` lengths,
    ``counts.position_pairs`` summed, ``counts.halo_rows``). ``sent``: clean rows of its shard it
    sends its ring's other members in the halo exchange (what ``layouts.halo_exchange_plan``'s
    ``send_counts`` sum to; 0 without a ring), ``halo`` being what it receives."""

    noisy: int
    clean: int
    pairs: int
    halo: int
    sent: int = 0


def layout_runs(
    seq_len: int,
    block_size: int,
    cp: int,
    bp: int,
    schedule: SchedulePolicy = "dual_end",
    documents: DocBounds | None = None,
    window: int | None = None,
) -> tuple[RankRuns, ...]:
    """Every local rank's rows (``range(max(cp, bp))``) as runs: the positions of
    ``counts.layout_positions`` (one schedule for all ranks; ``window`` prices ``balanced``)."""
    if cp == 1 and bp == 1:
        whole = (np.array([0]), np.array([seq_len]))
        return (RankRuns(whole, whole),)
    if bp == 1:  # zigzag over [x_t ; x_0]: chunk r of 2L is noisy, chunk 2cp-1-r is clean
        chunk = seq_len // cp
        return tuple(
            RankRuns(
                (np.array([r * chunk]), np.array([(r + 1) * chunk])),
                (np.array([(cp - 1 - r) * chunk]), np.array([(cp - r) * chunk])),
            )
            for r in range(cp)
        )
    plan = rank_schedule(seq_len, block_size, cp, bp, schedule, documents, window)
    out = []
    for rank in range(bp):
        blocks = np.asarray(plan.blocks(rank), dtype=np.int64)
        noisy = (blocks * block_size, (blocks + 1) * block_size)
        if cp == 1:  # BP-only: each block's document prefix [d_start, b·B) (no documents: [0, b·B))
            first = blocks * block_size
            begin = documents[0][first] if documents is not None else np.zeros_like(first)
            clean = merge_runs(begin, first)
        else:
            chunk = seq_len // (2 * cp)
            low, high = rank % cp, 2 * cp - 1 - rank % cp
            clean = (np.array([low * chunk, high * chunk]), np.array([(low + 1) * chunk, (high + 1) * chunk]))
        out.append(RankRuns(noisy, clean))
    return tuple(out)


@dataclass(frozen=True)
class RowPairs:
    """Prefix sums ``[L+1]`` of every position's allowed pairs as a noisy and as a clean row."""

    noisy: np.ndarray
    clean: np.ndarray

    def over(self, runs: Runs, clean: bool) -> int:
        prefix = self.clean if clean else self.noisy
        return int((prefix[runs[1]] - prefix[runs[0]]).sum())


ROW_PAIRS_CHUNK = 1 << 20
"""Positions :func:`row_pairs` counts at a time: its temporaries (bounds, terms) stay this size, so
counting ``L`` positions holds about the two ``[L+1]`` prefix sums only (16 bytes per position;
whole-row temporaries peaked at about 80)."""


def row_pairs(
    seq_len: int, block_size: int, window: int | None, documents: DocBounds | None
) -> RowPairs:
    """``counts.position_pairs``' per-row terms for every position, as prefix sums (counted
    :data:`ROW_PAIRS_CHUNK` positions at a time, each chunk's cumulative sum carried on)."""
    noisy_prefix = np.zeros(seq_len + 1, dtype=np.int64)
    clean_prefix = np.zeros(seq_len + 1, dtype=np.int64)
    for first in range(0, seq_len, ROW_PAIRS_CHUNK):
        positions = np.arange(first, min(first + ROW_PAIRS_CHUNK, seq_len), dtype=np.int64)
        n_start, n_stop, c_start, c_stop = document_bounds(positions, positions, block_size, window, documents)
        noisy = (n_stop - n_start).clip(min=0) + segment_lengths(positions, block_size, documents)
        clean = (c_stop - c_start).clip(min=0)
        rows = slice(first + 1, first + 1 + len(positions))
        for terms, prefix in ((noisy, noisy_prefix), (clean, clean_prefix)):
            np.cumsum(terms, out=prefix[rows])
            prefix[rows] += prefix[first]
    return RowPairs(noisy_prefix, clean_prefix)


def covered_intervals(
    runs: RankRuns, seq_len: int, block_size: int, window: int | None, documents: DocBounds | None
) -> Runs:
    """The intervals the rank's rows see (``document_bounds``), one per clean run and one per
    (part of a) noisy block: ``counts.halo_rows``' cover is their union."""
    n_first, n_last = runs.noisy
    first_block, last_block = n_first // block_size, (n_last - 1) // block_size
    per_run = last_block - first_block + 1  # blocks each noisy run touches
    offsets = np.arange(int(per_run.sum()), dtype=np.int64) - np.repeat(np.cumsum(per_run) - per_run, per_run)
    blocks = np.repeat(first_block, per_run) + offsets
    p0 = np.maximum(blocks * block_size, np.repeat(n_first, per_run))  # the rank's first row in each block
    c_first, c_last = runs.clean
    n_start, n_stop, _, _ = document_bounds(p0, p0[:0], block_size, window, documents)
    _, _, a_start, _ = document_bounds(c_first[:0], c_first, block_size, window, documents)
    _, _, _, b_stop = document_bounds(c_last[:0], c_last - 1, block_size, window, documents)
    start = np.clip(np.concatenate([n_start, a_start]), 0, seq_len)
    stop = np.clip(np.concatenate([n_stop, b_stop]), 0, seq_len)
    return start, stop


def rank_totals(
    seq_len: int,
    block_size: int,
    cp: int,
    bp: int,
    schedule: SchedulePolicy = "dual_end",
    window: int | None = None,
    documents: DocBounds | None = None,
    *,
    pairs: RowPairs | None = None,
    runs: tuple[RankRuns, ...] | None = None,
) -> tuple[RankTotals, ...]:
    """Rows, pairs and halo rows of every local rank (``pairs``/``runs``: precomputed
    ``row_pairs``/``layout_runs`` of these arguments, to share them across windows)."""
    pairs = pairs or row_pairs(seq_len, block_size, window, documents)
    runs = runs or layout_runs(seq_len, block_size, cp, bp, schedule, documents, window)
    covers = [merge_runs(*covered_intervals(rank, seq_len, block_size, window, documents)) for rank in runs]
    sent = [0] * len(runs)
    if cp > 1:  # ring members are local ranks ring·cp + d (``halo_exchange_plan``)
        for ring in range(len(runs) // cp):
            members = range(ring * cp, (ring + 1) * cp)
            sent[ring * cp : (ring + 1) * cp] = _ring_sent([covers[e] for e in members], [runs[d].clean for d in members])
    out = []
    for rank, (begin, end), rank_sent in zip(runs, covers, sent, strict=True):
        out.append(
            RankTotals(
                rank.noisy_rows,
                rank.clean_rows,
                pairs.over(rank.noisy, clean=False) + pairs.over(rank.clean, clean=True),
                int((end - begin).sum()) - rank.clean_rows,
                rank_sent,
            )
        )
    return tuple(out)


def _ring_sent(covers: list[Runs], cleans: list[Runs]) -> list[int]:
    """Per ring member ``d``, the rows of its clean runs every other member's cover holds, summed over
    the members (``sum(_covered(covers[e], cleans[d]) for e != d)``, which took ``cp^2`` NumPy calls
    per ring: minutes for ``csbp plan --gpus 1024``): how many covers hold each position (their
    depth) integrated over ``d``'s clean runs, less the positions ``d``'s own cover holds."""
    begin, end = np.concatenate([c[0] for c in covers]), np.concatenate([c[1] for c in covers])
    if not len(begin):
        return [0] * len(cleans)
    edges = np.concatenate([begin, end])
    order = np.argsort(edges, kind="stable")
    edges = edges[order]
    depth = np.cumsum(np.concatenate([np.ones_like(begin), -np.ones_like(end)])[order])  # on [edges[i], edges[i+1])
    area = np.concatenate([[0], np.cumsum(depth[:-1] * np.diff(edges))])  # depth integrated up to edges[i]

    def below(x: np.ndarray) -> np.ndarray:  # depth integrated over positions < x
        i = np.searchsorted(edges, x, side="right") - 1
        at = np.maximum(i, 0)
        return np.where(i >= 0, area[at] + depth[at] * (x - edges[at]), 0)

    held = [int((below(c[1]) - below(c[0])).sum()) for c in cleans]
    return [total - _covered(cover, clean) for total, cover, clean in zip(held, covers, cleans, strict=True)]


def _covered(cover: Runs, within: Runs) -> int:
    """Positions of the disjoint runs ``within`` that the sorted disjoint runs ``cover`` hold."""
    begin, end = cover
    prefix = np.concatenate([[0], np.cumsum(end - begin)])

    def upto(x: np.ndarray) -> np.ndarray:  # covered positions below x
        i = np.searchsorted(begin, x, side="right")  # runs starting at or before x
        last = np.maximum(i - 1, 0)
        partial = np.where(i > 0, np.minimum(x, end[last]) - begin[last], 0)
        return prefix[last] + partial.clip(min=0) * (i > 0)

    if not len(begin):
        return 0
    return int((upto(within[1]) - upto(within[0])).sum())
