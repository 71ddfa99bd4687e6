"""The cost model of ``csbp plan``: it counts with csbp's own layout arithmetic, it is importable
without torch, and with the packaged calibration it reproduces the published CSBP runs it was not
fitted on (held-out points: ``fit: false`` in ``published-csbp-runs.json``)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from csbp.attention.counts import rank_pairs, window_halo_rows
from csbp.attention.layouts import rank_layout, window_exchange_plan
from csbp.bench.measure import allowed_pairs
from csbp.plan.calibration import packaged_calibration
from csbp.plan.fit import fit_published, published_observations
from csbp.plan.hardware import hardware
from csbp.plan.layout import Layout, parse_topology
from csbp.plan.model import GIB, predict
from csbp.plan.search import candidate_layouts, rank
from csbp.plan.workload import preset_workload
from csbp.topology import Topology

CAL = packaged_calibration("h200")


def test_plan_modules_import_without_torch():
    code = (
        "import sys\n"
        "import csbp.plan.model, csbp.plan.search, csbp.plan.fit, csbp.plan.drafter, csbp.plan.calibration\n"
        "assert 'torch' not in sys.modules, 'csbp.plan imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize(
    ("cp", "bp", "schedule", "window"),
    [
        (1, 1, "dual_end", None),
        (4, 1, "dual_end", None),
        (1, 4, "dual_end", 8),
        (2, 4, "dual_end", None),
        (2, 4, "contiguous", 8),
        (4, 4, "dual_end", 8),
    ],
)
def test_model_counts_equal_the_layouts_rows_and_pairs(cp, bp, schedule, window):
    seq_len, block = 128, 4
    topology = Topology(cp=cp, bp=bp, replicate_clean_prefix=cp == 1 and bp > 1)
    for rank_ in range(topology.local):
        layout = rank_layout(topology, rank_, seq_len, block, schedule=schedule, window=window)
        rows = layout.rows
        noisy_pairs, clean_pairs = rank_pairs(seq_len, block, cp, bp, rank_, window=window, schedule=schedule)
        assert noisy_pairs == allowed_pairs(rows.select(slice(0, layout.num_noisy)), block_size=block)
        assert clean_pairs == allowed_pairs(rows.select(slice(layout.num_noisy, None)), block_size=block)
        if window is not None and cp > 1 and bp > 1:
            plan = window_exchange_plan(seq_len, block, cp, bp, rank_ // cp, window, schedule)
            assert window_halo_rows(seq_len, block, cp, bp, rank_, window, schedule) == sum(
                plan.recv_counts(rank_ % cp)
            )


def test_allowed_pairs_dense_mask_agreement():
    """The shared pair count equals the number of True entries of the mask the kernels use."""
    from csbp.attention.rows import allow_matrix

    layout = rank_layout(Topology(cp=2, bp=2), 1, 64, 4)
    full = rank_layout(Topology(), 0, 64, 4).rows
    assert allowed_pairs(layout.rows, block_size=4) == int(allow_matrix(layout.rows, full).sum())


def test_traffic_identities_of_the_published_14b_runs_are_exact():
    workload = preset_workload("nemotron-14b")
    hw = hardware("h200", gpus=16)
    for topo, gib in (("dp2/cp8", 210.0), ("dp2/cp8/bp8", 105.0)):
        layout = Layout(*parse_topology(topo), placement="striped", sharding="zero2")
        assert predict(workload, layout, 262144, hw, CAL).kv_bytes / GIB == pytest.approx(gib)


def _held_out(metric_set):
    return [o for o in published_observations() if not o.fit and o.metric in metric_set]


def test_held_out_dense_throughput_and_memory_within_15_percent():
    points = [o for o in _held_out({"tok_s", "mem_gib"}) if not o.workload.objective.is_drafter]
    assert len(points) >= 12
    errors = {o.label: o.predicted(CAL) / o.value - 1 for o in points}
    within = [label for label, err in errors.items() if abs(err) <= 0.15]
    assert len(within) >= 0.9 * len(points), errors


def _speedup(workload, seq_len, topo_cp, topo_csbp):
    obs = {o.label: o for o in published_observations() if o.metric == "tok_s"}
    cp = obs[f"{workload} {seq_len}K {topo_cp} dual_end tok_s"]
    csbp = obs[f"{workload} {seq_len}K {topo_csbp} dual_end tok_s"]
    return csbp.value / cp.value, csbp.predicted(CAL) / cp.predicted(CAL)


@pytest.mark.parametrize(
    ("workload", "seq_len", "cp", "csbp"),
    [
        ("nemotron-3b", 256, "dp4/cp4", "dp4/cp4/bp4"),
        ("nemotron-8b", 256, "dp4/cp4", "dp4/cp4/bp4"),
        ("nemotron-14b", 256, "dp2/cp8", "dp2/cp8/bp8"),
        ("nemotron-14b", 64, "dp8/cp2", "dp8/cp2/bp2"),
        ("nemotron-14b", 128, "dp4/cp4", "dp4/cp4/bp4"),
    ],
)
def test_dense_csbp_over_cp_speedups_within_10_percent(workload, seq_len, cp, csbp):
    published, predicted = _speedup(workload, seq_len, cp, csbp)
    assert predicted == pytest.approx(published, rel=0.10)


def test_every_published_oom_verdict_is_right_and_every_run_fits():
    for obs in published_observations():
        if obs.metric == "oom":
            assert not obs.predict(CAL).fits, obs.label
        elif obs.metric in ("tok_s", "mem_gib") and "not published" not in obs.label:
            assert obs.predict(CAL).fits, obs.label


def test_packaged_published_calibration_is_the_fit_of_the_fit_points():
    fitted = fit_published()
    for name in fitted.fit:
        assert getattr(CAL, name) == pytest.approx(getattr(fitted, name), rel=1e-6), name


def test_search_ranks_feasible_first_and_explains():
    workload = preset_workload("nemotron-14b")
    hw = hardware("h200", gpus=16)
    plan = rank(workload, candidate_layouts(workload, 16, 262144), 262144, hw, CAL)
    speeds = [p.tokens_per_s for p in plan.feasible]
    assert speeds == sorted(speeds, reverse=True) and all(p.fits for p in plan.feasible)
    assert plan.infeasible and not any(p.fits for p in plan.infeasible)
    assert plan.best.layout.kind == "csbp" and "CP-only" in plan.why
    assert "checkpoints" in plan.infeasible[0].oom_reason()


def test_drafter_at_1m_needs_csbp_to_fit_two_ranks_per_sample():
    workload = preset_workload("dflash2-qwen3.8")
    hw = hardware("h100", gpus=8)
    seq_len = 1 << 20
    plan = rank(workload, candidate_layouts(workload, 8, seq_len), seq_len, hw, CAL)
    assert plan.best.layout.name == "dp4/cp2/bp2"
    dp4_cp2 = [p for p in plan.infeasible if p.layout.name == "dp4/cp2"]
    assert dp4_cp2 and "target features" in dp4_cp2[0].mem_terms
    # csbp's DFlashStep projects every context row it holds: more memory, the published pick no longer fits
    csbp_step = workload.with_options(drafter_context="all")
    plan = rank(csbp_step, candidate_layouts(csbp_step, 8, seq_len), seq_len, hw, CAL)
    assert "dp4/cp2/bp2" in {p.layout.name for p in plan.infeasible}
    assert plan.best.tokens_per_s < 0.5 * 147_000


def test_invalid_layouts_are_never_proposed_and_bad_notation_fails_closed():
    workload = preset_workload("nemotron-3b")
    for layout in candidate_layouts(workload, 8, 4096):
        layout.topology.validate_sequence(4096, workload.objective.block)
    with pytest.raises(ValueError, match="dpA/cpB/bpC"):
        parse_topology("dp2/tp4")
    with pytest.raises(ValueError, match="multiple of cp"):
        parse_topology("cp4/bp2")


@pytest.mark.parametrize("doc_length", [None, 4])
def test_a_drafter_prices_the_anchors_csbp_draws_not_more(doc_length):
    """csbp draws ``min(max_anchors, #valid)`` anchors (``csbp.dflash.anchors``): 2048 anchors of a
    1024-token row are its 1023 valid positions (fewer with 4-token documents), and the step, memory
    and tokens/s are those of that many (the model priced all 2048: twice the draft work)."""
    from csbp.attention.draft_counts import spread_anchors
    from csbp.plan.documents import one_document, packed_documents

    workload = preset_workload("dflash2-qwen3.8").with_options(doc_length=doc_length)
    seq_len, hw = 1024, hardware("h100", gpus=8)
    bounds = packed_documents(seq_len, doc_length or one_document(seq_len))
    valid = len(spread_anchors(bounds, 10**9))  # every position whose next token is in its document
    assert valid == seq_len - 1 if doc_length is None else 600 < valid < seq_len - 1
    for layout in (Layout(8, checkpointing="none"), Layout(4, 2, 2, checkpointing="none")):
        asked, drawn = (predict(w, layout, seq_len, hw, CAL) for w in (workload, workload.with_options(anchors=valid)))
        assert asked.step_s == pytest.approx(drawn.step_s, rel=1e-12)
        assert asked.mem_bytes == pytest.approx(drawn.mem_bytes, rel=1e-12)
        assert asked.tokens_per_s * asked.step_s == pytest.approx(layout.dp * valid * 7, rel=1e-12)


@pytest.mark.parametrize("preset, layout", [("nemotron-14b", Layout(2, 4, 4)), ("dflash2-qwen3.8", Layout(4, 2, 2))])
def test_a_global_batch_of_k_micro_steps_costs_k_micro_steps(preset, layout):
    """A step of ``k`` accumulated micro-batches runs ``k`` forwards and backwards; the tokens per second
    stay those of one micro-step, but for the once-per-step costs amortised over more tokens. Nothing held
    the ``k``: dropped from either model, the planner priced k-times-larger batches at one micro-step."""
    workload, hw = preset_workload(preset), hardware("h200", gpus=layout.world)
    seq_len = 65536
    one = predict(workload, layout, seq_len, hw, CAL)
    four = predict(workload, layout, seq_len, hw, CAL, global_batch=4 * layout.dp * layout.micro_batch)
    three_more = four.step_s - one.step_s  # three more micro-steps: their compute, at least, and their traffic
    assert 3 * (one.fwd_s + one.bwd_s) * (1 - 1e-9) <= three_more <= 3 * (one.fwd_s + one.bwd_s + one.exposed_kv_s) * (1 + 1e-9)
    assert four.kv_bytes == pytest.approx(4 * one.kv_bytes, rel=1e-12)
    assert one.tokens_per_s <= four.tokens_per_s < 1.2 * one.tokens_per_s


def test_the_logits_chunk_is_the_rows_a_rank_holds_when_fewer_than_a_chunk():
    """The LM-head loss runs ``ce_chunk_rows`` (1024) rows of logits at a time, fewer when a rank holds
    fewer (BD3: its 2L rows); the fp32 logits and their gradient, 8 bytes per row and vocabulary entry.
    Pricing a whole chunk for short rows passed every test."""
    workload = preset_workload("nemotron-3b")
    for seq_len, rows in ((128, 256), (256, 512), (65536, 1024)):
        prediction = predict(workload, Layout(8), seq_len, hardware("h200", gpus=8), CAL)
        assert prediction.mem_terms["logits chunk"] == 8 * rows * workload.model.vocab, seq_len
