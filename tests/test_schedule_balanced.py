"""The document-aware ``balanced`` block schedule: dealing invariants (every block once, every
worker a block, deterministic), ``dual_end`` without documents, better max/mean allowed pairs than
dual-end on skewed documents, the halo plan and the planner following it, and exactness against
one process (float64, loss and every gradient) on multi-process gloo layouts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from csbp.attention.counts import halo_rows, rank_pairs, rank_schedule
from csbp.attention.documents import Documents, random_documents
from csbp.attention.layouts import halo_exchange_plan, rank_layout
from csbp.schedules import balanced_schedule, block_runs, block_schedule, dual_end_schedule
from csbp.topology import Topology


def _bounds(documents: Documents) -> tuple[np.ndarray, np.ndarray]:
    return documents.start.numpy(), documents.stop.numpy()


def _pairs(seq_len: int, block: int, cp: int, bp: int, schedule: str, docs) -> np.ndarray:
    return np.array(
        [sum(rank_pairs(seq_len, block, cp, bp, r, schedule=schedule, documents=docs)) for r in range(bp)]  # type: ignore[arg-type]
    )


@pytest.mark.parametrize(("num_blocks", "workers", "run"), [(32, 4, 1), (33, 4, 2), (7, 4, 1), (5, 5, 1), (40, 3, 4)])
def test_every_block_dealt_once_and_every_worker_has_one(num_blocks: int, workers: int, run: int) -> None:
    units = block_runs(num_blocks, workers, run)
    costs = np.random.default_rng(num_blocks).integers(0, 1000, len(units))
    schedule = balanced_schedule(units, costs, workers, base_loads=list(range(workers)))
    schedule.validate()
    assert sorted(b for w in range(workers) for b in schedule.blocks(w)) == list(range(num_blocks))
    assert schedule.policy == "balanced" and schedule.num_workers == workers
    counts = [len(schedule.blocks(w)) for w in range(workers)]
    assert max(counts) - min(counts) <= 2 * run  # row counts (MLP work, memory) stay even


def test_dealing_is_deterministic_and_follows_the_documents() -> None:
    docs = _bounds(random_documents(512, 40, torch.Generator().manual_seed(3)))
    first = rank_schedule(512, 4, 2, 4, "balanced", docs)
    rank_schedule.__globals__["_document_schedule"].cache_clear()
    again = rank_schedule(512, 4, 2, 4, "balanced", (docs[0].copy(), docs[1].copy()))
    assert first.assignment == again.assignment
    other = _bounds(random_documents(512, 40, torch.Generator().manual_seed(4)))
    assert rank_schedule(512, 4, 2, 4, "balanced", other).assignment != first.assignment


def test_without_documents_balanced_is_dual_end() -> None:
    for num_blocks, workers in [(32, 4), (33, 4), (6, 4)]:
        assert block_schedule(num_blocks, workers, "balanced").assignment == dual_end_schedule(num_blocks, workers).assignment
        assert rank_schedule(num_blocks * 4, 4, 2, workers, "balanced", None).assignment == (
            dual_end_schedule(num_blocks, workers).assignment
        )


def test_one_document_deals_the_dual_end_runs() -> None:
    """One document per row: block costs grow linearly with the index, so the cost pairing of the
    ``2P`` runs is dual-end's and every worker keeps the runs dual-end gives it."""
    one = _bounds(Documents.from_lengths([256]))
    for cp, bp in [(1, 4), (2, 4), (4, 4)]:
        balanced = rank_schedule(256, 4, cp, bp, "balanced", one)
        dual = block_schedule(64, bp, "dual_end")
        assert [balanced.blocks(w) for w in range(bp)] == [dual.blocks(w) for w in range(bp)]


@pytest.mark.parametrize(("cp", "bp"), [(4, 4), (2, 4)])
def test_balanced_beats_dual_end_on_skewed_documents(cp: int, bp: int) -> None:
    """Short documents then one long one at the end: dual-end's pairing by index piles the long
    document's expensive tail onto few ranks; dealing by cost brings the slowest rank nearer the mean."""
    docs = _bounds(Documents.from_lengths([16] * 32 + [512]))
    dual = _pairs(1024, 4, cp, bp, "dual_end", docs)
    balanced = _pairs(1024, 4, cp, bp, "balanced", docs)
    assert balanced.max() / balanced.mean() < dual.max() / dual.mean()
    if cp > 1:  # the clean shards do not move: the total is the same
        assert balanced.sum() == dual.sum()


def test_dealing_rejects_bad_units() -> None:
    with pytest.raises(ValueError, match="once each"):
        balanced_schedule([(0, 1), (1, 2)], [1, 1], 2)
    with pytest.raises(ValueError, match="units cannot give"):
        balanced_schedule([(0, 1, 2, 3)], [1], 2)


@pytest.mark.parametrize(("cp", "bp"), [(4, 4), (1, 4)])
def test_balanced_beats_dual_end_on_random_documents(cp: int, bp: int) -> None:
    wins = 0
    for seed in range(4):
        docs = _bounds(random_documents(2048, 128, torch.Generator().manual_seed(seed)))
        dual, balanced = _pairs(2048, 8, cp, bp, "dual_end", docs), _pairs(2048, 8, cp, bp, "balanced", docs)
        assert balanced.max() <= dual.max()
        wins += balanced.max() < dual.max()
    assert wins >= 3


def test_halo_plan_and_counts_follow_the_balanced_schedule() -> None:
    """The runtime's layouts own the dealt blocks, and the halo plan sends each ring member exactly
    ``counts.halo_rows`` rows (what ``csbp plan`` prices)."""
    documents = random_documents(256, 24, torch.Generator().manual_seed(1))
    docs = _bounds(documents)
    schedule = rank_schedule(256, 4, 2, 4, "balanced", docs)
    assert schedule.assignment != block_schedule(64, 4, "dual_end").assignment
    topology = Topology(cp=2, bp=4)
    for rank in range(4):
        layout = rank_layout(topology, rank, 256, 4, schedule="balanced", documents=documents)
        assert layout.owned_blocks == schedule.blocks(rank)
    for ring in range(2):
        plan = halo_exchange_plan(256, 4, 2, 4, ring, schedule="balanced", documents=documents)
        for member in range(2):
            expected = halo_rows(256, 4, 2, 4, ring * 2 + member, schedule="balanced", documents=docs)
            assert sum(plan.recv_counts(member)) == expected


def test_planner_prices_the_balanced_schedule() -> None:
    from csbp.plan.layout import Layout
    from csbp.plan.model import rank_counts
    from csbp.plan.search import candidate_layouts, describe, schedules_for
    from csbp.plan.workload import preset_workload

    workload = preset_workload("nemotron-8b").with_options(doc_length=64)
    assert schedules_for(workload, Layout(1, 2, 2)) == ("dual_end", "balanced")
    assert schedules_for(workload, Layout(1, 4, 1)) == ("dual_end",)
    assert schedules_for(preset_workload("nemotron-8b"), Layout(1, 2, 2)) == ("dual_end",)
    layouts = candidate_layouts(workload, 4, 4096)
    assert any(lay.schedule == "balanced" and lay.kind == "csbp" for lay in layouts)
    assert "balanced" in describe(Layout(1, 2, 2, schedule="balanced"))
    dual = [c.pairs for c in rank_counts(4096, 32, 2, 2, "dual_end", 0, 64)]
    balanced = [c.pairs for c in rank_counts(4096, 32, 2, 2, "balanced", 0, 64)]
    assert sum(balanced) == sum(dual) and max(balanced) <= max(dual)


def _differs(case) -> bool:
    from csbp.engine.verify import corrupted_batch

    t = case.topology
    for row in corrupted_batch(case, t.dp).doc_ids:
        docs = _bounds(Documents.from_doc_ids(row))
        if rank_schedule(case.seq_len, case.block_size, t.cp, t.bp, "balanced", docs).assignment != (
            block_schedule(case.seq_len // case.block_size, t.bp, "dual_end").assignment
        ):
            return True
    return False


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("topology", "window", "transport"),
    [
        (Topology(cp=2, bp=2), None, "collective"),
        (Topology(bp=2, replicate_clean_prefix=True), None, "collective"),
        (Topology(cp=2, bp=4), 5, "collective"),
        (Topology(cp=2, bp=2), None, "streaming"),
    ],
    ids=["csbp-cp2bp2-halo", "bp2", "csbp-cp2bp4-window5", "csbp-cp2bp2-streaming"],
)
def test_balanced_schedule_equals_single_process(topology: Topology, window: int | None, transport: str) -> None:
    from csbp.engine.verify import VerifyCase, verify

    case = VerifyCase(topology, seq_len=64, doc_length=12, window=window, transport=transport, schedule="balanced")  # type: ignore[arg-type]
    assert _differs(case), "the documents must move blocks, or this test checks dual-end again"
    result = verify(case, timeout_s=240)
    assert result.ok, (result.loss_rel_err, result.grad_rel_err, result.worst_param)


def test_config_accepts_the_balanced_schedule_and_refuses_unknown_ones() -> None:
    from pydantic import ValidationError

    from csbp.config.schema import TopologySection

    assert TopologySection(cp=2, bp=2, schedule="balanced").schedule == "balanced"
    with pytest.raises(ValidationError, match="schedule"):
        TopologySection(cp=2, bp=2, schedule="by_document")  # type: ignore[arg-type]
