"""The planner's fast counts (``csbp.attention.run_counts``: runs and prefix sums) equal the
per-row counts of ``csbp.attention.counts`` that the runtime's plans are tested against, rank by
rank, on random documents at medium ``L``; and the balanced schedule's prefix-sum pricing deals the
same blocks as pricing every row with ``interval_cover``."""

from __future__ import annotations

import numpy as np
import pytest

from csbp.attention.counts import (
    document_bounds,
    document_schedule,
    halo_rows,
    interval_cover,
    layout_positions,
    merge_runs,
    position_pairs,
    segment_lengths,
)
from csbp.attention.document_draw import random_document_bounds
from csbp.attention.run_counts import rank_totals
from csbp.plan.documents import RowDocuments, layout_totals
from csbp.schedules import balanced_schedule, block_runs, zigzag_array

SEQ_LEN, BLOCK = 3072, 8
DEGREES = [(1, 1), (2, 1), (4, 1), (1, 4), (2, 2), (2, 4), (4, 4), (4, 8), (8, 8)]


def _documents(mean: int | None, seed: int):
    return None if mean is None else random_document_bounds(SEQ_LEN, mean, seed)


def _slow(cp: int, bp: int, schedule: str, window: int | None, docs) -> list[tuple[int, int, int, int]]:
    out = []
    for rank in range(max(cp, bp)):
        noisy, clean, _ = layout_positions(SEQ_LEN, BLOCK, cp, bp, rank, schedule, docs, window)  # type: ignore[arg-type]
        n_pairs, c_pairs = position_pairs(noisy, clean, block_size=BLOCK, window=window, documents=docs)
        halo = halo_rows(SEQ_LEN, BLOCK, cp, bp, rank, window=window, schedule=schedule, documents=docs)  # type: ignore[arg-type]
        out.append((len(noisy), len(clean), n_pairs + c_pairs, halo))
    return out


@pytest.mark.parametrize("mean", [None, 3, 45, 700])
@pytest.mark.parametrize("window", [None, 24])
def test_fast_counts_equal_the_per_row_counts(mean: int | None, window: int | None) -> None:
    docs = _documents(mean, seed=mean or 0)
    for cp, bp in DEGREES:
        for schedule in ("dual_end", "contiguous", "balanced") if bp > 1 else ("dual_end",):
            fast = rank_totals(SEQ_LEN, BLOCK, cp, bp, schedule, window, docs)  # type: ignore[arg-type]
            got = [(t.noisy, t.clean, t.pairs, t.halo) for t in fast]
            assert got == _slow(cp, bp, schedule, window, docs), (cp, bp, schedule)


def test_planner_totals_over_a_real_row_equal_the_per_row_counts() -> None:
    start, _ = random_document_bounds(SEQ_LEN, 200, seed=5)
    row = RowDocuments(SEQ_LEN, tuple(np.flatnonzero(start == np.arange(SEQ_LEN)).tolist()))
    totals = layout_totals(SEQ_LEN, BLOCK, 4, 8, "balanced", 0, row)
    assert [(t.noisy, t.clean, t.pairs, t.halo) for t in totals] == _slow(4, 8, "balanced", None, row.bounds())


def test_merged_runs_are_the_interval_cover() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        start = rng.integers(0, 500, size=40)
        stop = start + rng.integers(-5, 60, size=40)  # empty and overlapping intervals too
        begin, end = merge_runs(start, stop)
        cover = np.zeros(600, dtype=bool)
        for b, e in zip(begin, end, strict=True):
            cover[b:e] = True
        assert np.array_equal(cover, interval_cover(start, stop, 600))
        assert np.all(begin[1:] > end[:-1])  # disjoint, sorted, not touching


def _balanced_by_rows(cp: int, bp: int, docs, window: int | None = None) -> tuple:
    """``counts.document_schedule`` as it priced units before: every row, ``interval_cover`` (the
    pairs under ``window``; BP-only's recomputed prefix is the whole document prefix regardless)."""
    positions = np.arange(SEQ_LEN, dtype=np.int64)
    n_start, n_stop, _, _ = document_bounds(positions, positions, BLOCK, None, docs)
    w_start, w_stop, c_start, c_stop = document_bounds(positions, positions, BLOCK, window, docs)
    row_pairs = (w_stop - w_start).clip(min=0) + segment_lengths(positions, BLOCK, docs)
    clean_pairs = (c_stop - c_start).clip(min=0)
    units = block_runs(SEQ_LEN // BLOCK, bp, max(1, SEQ_LEN // BLOCK // (2 * bp)))
    costs = []
    for unit in units:
        rows = slice(unit[0] * BLOCK, (unit[-1] + 1) * BLOCK)
        cost = int(row_pairs[rows].sum())
        if cp == 1:
            cost += int(clean_pairs[interval_cover(n_start[rows], n_stop[rows], SEQ_LEN)].sum())
        costs.append(cost)
    base = None
    if cp > 1:
        shard = [int(clean_pairs[zigzag_array(SEQ_LEN, cp, c)].sum()) for c in range(cp)]
        base = [shard[w % cp] for w in range(bp)]
    return balanced_schedule(units, costs, bp, base_loads=base).assignment


@pytest.mark.parametrize("mean", [2, 30, 400, 5000])
@pytest.mark.parametrize("window", [None, 40])
def test_balanced_schedule_prices_units_as_every_row_does(mean: int, window: int | None) -> None:
    docs = _documents(mean, seed=mean)
    for cp, bp in [(1, 2), (1, 8), (2, 2), (2, 8), (4, 4), (8, 8)]:
        got = document_schedule(SEQ_LEN, BLOCK, cp, bp, docs, window).assignment
        assert got == _balanced_by_rows(cp, bp, docs, window), (cp, bp)


@pytest.mark.parametrize(("cp", "bp"), [(2, 1), (4, 1), (2, 2), (2, 4), (4, 4), (4, 8)])
@pytest.mark.parametrize("window", [None, 7])
def test_sent_and_received_rows_are_the_halo_exchange_plans(cp: int, bp: int, window: int | None) -> None:
    """Each ring member's rows sent and received equal the runtime plan's ``send_counts`` and
    ``recv_counts`` (the halo model prices the busier direction of the busiest member)."""
    import torch

    from csbp.attention.documents import Documents
    from csbp.attention.layouts import halo_exchange_plan

    seq_len, block = 512, 4
    start, stop = random_document_bounds(seq_len, 20, seed=3)
    docs = Documents(torch.from_numpy(start), torch.from_numpy(stop))
    for schedule in ("dual_end", "balanced") if bp > 1 else ("dual_end",):
        totals = rank_totals(seq_len, block, cp, bp, schedule, window, (start, stop))  # type: ignore[arg-type]
        for ring in range(max(cp, bp) // cp):
            plan = halo_exchange_plan(seq_len, block, cp, bp, ring, window=window, schedule=schedule, documents=docs)  # type: ignore[arg-type]
            for member in range(cp):
                rank = totals[ring * cp + member]
                assert (rank.sent, rank.halo) == (sum(plan.send_counts(member)), sum(plan.recv_counts(member)))


def test_a_ring_s_sent_rows_take_one_pass_per_member(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each member's sent rows summed ``_covered`` over every other member: ``cp^2`` NumPy passes per
    ring, which made ``csbp plan --gpus 1024`` take minutes. The totals are unchanged (the tests above)."""
    from csbp.attention import run_counts

    calls = []
    real = run_counts._covered
    monkeypatch.setattr(run_counts, "_covered", lambda *a: calls.append(1) or real(*a))
    run_counts.rank_totals(SEQ_LEN, BLOCK, 16, 16)
    assert len(calls) <= 16


@pytest.mark.parametrize(("window", "mean"), [(None, None), (48, 7), (None, 30)])
def test_row_pairs_counted_a_chunk_at_a_time_equal_one_pass(
    monkeypatch: pytest.MonkeyPatch, window: int | None, mean: int | None
) -> None:
    """Whole-row temporaries peaked at about 80 bytes per token; chunks (here 7 and 64 positions, the
    cumulative sum carried across) give the same prefix sums, exactly."""
    from csbp.attention import run_counts

    docs = _documents(mean, 3)
    whole = run_counts.row_pairs(SEQ_LEN, BLOCK, window, docs)
    for chunk in (7, 64):
        monkeypatch.setattr(run_counts, "ROW_PAIRS_CHUNK", chunk)
        parts = run_counts.row_pairs(SEQ_LEN, BLOCK, window, docs)
        assert np.array_equal(parts.noisy, whole.noisy) and np.array_equal(parts.clean, whole.clean)
    positions = np.arange(SEQ_LEN, dtype=np.int64)  # and both are the per-row terms' prefix sums
    _, _, c_start, c_stop = document_bounds(positions, positions, BLOCK, window, docs)
    assert np.array_equal(np.diff(whole.clean), (c_stop - c_start).clip(min=0)) and whole.clean[0] == 0
