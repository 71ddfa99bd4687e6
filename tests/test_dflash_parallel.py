"""DFlash layouts equal one process (csbp.md §14, objectives.md §12 test 11): CP-only (all anchors
on every rank, context K/V zigzag-sharded), CSBP (anchors dealt over BP ranks, packets padded with
dead anchors) and BP-only, on 2, 4 and 8 gloo processes. Rank 0's sample-group loss and averaged
drafter gradients must equal ``reference_dflash_loss`` (dense masks, full logits) to 1e-9
relative in float64, also with DFlash2 modules, sliding layers, D-PACE, the lambda mix and KL, and
with random packed documents in every sample (``doc_length``), where CSBP and ``cp-aware`` (CP-only
with ``transport: halo``) exchange only the context rows an anchor may see (``csbp.dflash.exchange``),
and with one document per row, where CSBP's sliding layers exchange only their anchors' window rows
(CP-only keeps the all-gather).
Only context K/V cross the wire: the attention bytes are checked exactly, per rank, against the
all-gather or the exchange plan of every sample and layer; so are the online target pass's bytes
(``dflash.target``: the sharded pass's per-layer K/V all-gather, 0 for ``target_capture:
replicated`` and cp == 1) and, with ``loss='kl'``, the teacher rows' exchange (``dflash.teacher``:
exactly the last hidden rows each ring member's supervised rows read)."""

from __future__ import annotations

import pytest
from torch import Tensor

from csbp.dflash.anchors import segment_starts
from csbp.dflash.config import DFlashConfig, DFlashObjectiveConfig
from csbp.dflash.exchange import sample_context_exchanges
from csbp.dflash.layouts import DFlashLayout, dflash_layout, draft_query_rows, full_packet
from csbp.dflash.step import DFlashBatch, sample_batch_anchors
from csbp.dflash.target_shard import sharded_target_bytes, target_layers_run
from csbp.dflash.teacher_rows import ring_teacher_needs, teacher_exchange_bytes
from csbp.dflash.verify import (
    DFlashVerifyCase,
    anchor_generator,
    build_models,
    make_batch,
    replica_batch,
    verify_dflash,
)
from csbp.topology import Topology

DFLASH2 = {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 4, "selector_top_k": 40}
SLIDING = {"layer_types": ("sliding_attention", "full_attention"), "sliding_window": 5}
ONE_DOCUMENT = ((0,) * 32,) * 2  # both samples of a replica: one 32-token document, no padding

CASES = [
    pytest.param(DFlashVerifyCase(Topology(cp=2)), id="cp2"),
    pytest.param(DFlashVerifyCase(Topology(cp=4)), id="cp4"),
    pytest.param(DFlashVerifyCase(Topology(cp=2, bp=2)), id="csbp-cp2bp2"),
    pytest.param(DFlashVerifyCase(Topology(cp=2, bp=4)), id="csbp-cp2bp4"),
    pytest.param(
        DFlashVerifyCase(Topology(dp=2, cp=2, bp=4), samples=1),
        id="dp2-csbp-cp2bp4-8proc",
        marks=pytest.mark.slow,
    ),
    pytest.param(DFlashVerifyCase(Topology(bp=2, replicate_clean_prefix=True)), id="bp2-only"),
    pytest.param(
        DFlashVerifyCase(
            Topology(cp=2, bp=2),
            drafter_options={**DFLASH2, **SLIDING},
            perturb_extras=True,
            selector_scale=0.5,
            objective=DFlashObjectiveConfig(
                max_anchors=6, gamma=4.0, weighting="dpace", anchor_sampling="locality"
            ),
        ),
        id="csbp-cp2bp2-dflash2-sliding-dpace",
    ),
    pytest.param(
        DFlashVerifyCase(
            Topology(cp=2),
            drafter_options=DFLASH2,
            perturb_extras=True,
            selector_scale=1.0,
            objective=DFlashObjectiveConfig(max_anchors=6, gamma=7.0, lk_loss_type="lambda", kl_scale=0.8),
        ),
        id="cp2-dflash2-lambda",
    ),
    pytest.param(
        DFlashVerifyCase(
            Topology(cp=2, bp=2),
            objective=DFlashObjectiveConfig(max_anchors=5, loss="kl", context="inclusive"),
        ),
        id="csbp-cp2bp2-kl-inclusive",
    ),
    pytest.param(
        DFlashVerifyCase(Topology(cp=4), objective=DFlashObjectiveConfig(max_anchors=5, loss="kl")), id="cp4-kl"
    ),
    pytest.param(
        DFlashVerifyCase(
            Topology(cp=2, bp=2),
            objective=DFlashObjectiveConfig(max_anchors=5, loss="kl", target_capture="replicated"),
        ),
        id="csbp-cp2bp2-kl-replicated",
    ),
    pytest.param(DFlashVerifyCase(Topology(cp=2, bp=4), doc_length=6), id="csbp-cp2bp4-docs"),
    pytest.param(DFlashVerifyCase(Topology(cp=4), doc_length=6, transport="halo"), id="cp4-aware-docs"),
    pytest.param(DFlashVerifyCase(Topology(bp=2, replicate_clean_prefix=True), doc_length=6), id="bp2-only-docs"),
    # one document per row: CSBP's sliding layers exchange their window rows, full layers all-gather
    pytest.param(DFlashVerifyCase(Topology(cp=2, bp=2), drafter_options=SLIDING, doc_ids=ONE_DOCUMENT),
                 id="csbp-cp2bp2-sliding-1doc"),
    pytest.param(DFlashVerifyCase(Topology(cp=2, bp=4), drafter_options=SLIDING, doc_ids=ONE_DOCUMENT,
                                  objective=DFlashObjectiveConfig(max_anchors=8, gamma=7.0, context="inclusive")),
                 id="csbp-cp2bp4-sliding-1doc-inclusive"),
    pytest.param(DFlashVerifyCase(Topology(cp=2), drafter_options=SLIDING, doc_ids=ONE_DOCUMENT),
                 id="cp2-sliding-1doc-gathers"),
]


def _rank_inputs(case: DFlashVerifyCase, rank: int) -> tuple[DFlashLayout, DFlashConfig, DFlashBatch, list[Tensor]]:
    """``rank``'s layout, the drafter config, the rank's batch and its anchors (as the step draws them)."""
    topology = case.topology
    coords = topology.coords(rank)
    layout = dflash_layout(topology, coords.local_rank)
    config = build_models(case)[1].config
    batch = replica_batch(
        make_batch(case.samples * topology.dp, case.seq_len, seed=case.seed, doc_length=case.doc_length,
                   doc_ids=case.doc_ids),
        coords.dp_rank, case.samples,
    )
    anchors = sample_batch_anchors(batch, case.objective, config.block_size, anchor_generator(case, coords.dp_rank))
    return layout, config, batch, anchors


def _target_bytes(case: DFlashVerifyCase, rank: int) -> tuple[int, int]:
    """``(dflash.target, dflash.teacher)`` bytes ``rank`` sends: with the sharded pass (cp > 1), per
    sample, (P-1) shards of L/P rows of every run target layer's K and V, and the teacher rows its ring
    members' supervised rows read from its shard (``loss='kl'``); nothing for the replicated pass."""
    if case.topology.cp == 1 or case.objective.target_capture == "replicated":
        return 0, 0
    layout, config, batch, anchors = _rank_inputs(case, rank)
    target = build_models(case)[0]
    kl = case.objective.loss == "kl"
    layers = target_layers_run(target.config.num_layers, tuple(config.target_layer_ids or ()), with_last_hidden=kl)
    per_sample = sharded_target_bytes(target, case.seq_len, layout.cp, num_layers=layers, element_size=8)
    teacher = 0
    for sample, sample_anchors in enumerate(anchors) if kl else ():
        needs = ring_teacher_needs(
            batch.input_ids[sample], batch.loss_mask[sample], batch.doc_ids[sample], sample_anchors,
            segment_starts(batch.doc_ids[sample])[sample_anchors], layout, block_size=config.block_size,
            context=case.objective.context, min_bucket=case.objective.anchor_bucket_minimum(layout.num_owners),
        )
        row_bytes = target.config.hidden_size * 8
        teacher += teacher_exchange_bytes(needs, seq_len=case.seq_len, cp=layout.cp, rank=layout.cp_rank,
                                          row_bytes=row_bytes)
    return batch.num_samples * per_sample, teacher


def _context_kv_bytes(case: DFlashVerifyCase, rank: int) -> tuple[int, int]:
    """``(expected, all-gather)`` attention bytes of ``rank``: per sample and layer, the all-gather and
    the reduce-scatter move (P-1) shards of L/P rows of K and V each; the exchange moves the rows the
    plan sends forward and the rows it received back."""
    topology = case.topology
    if topology.cp == 1:
        return 0, 0
    layout, config, batch, anchors = _rank_inputs(case, rank)
    row_bytes = 2 * config.num_kv_heads * config.head_dim * 8  # K and V, float64
    gather_rows = 2 * (topology.cp - 1) * (case.seq_len // topology.cp)  # all-gather + reduce-scatter
    expected = all_gather = 0
    for sample, sample_anchors in enumerate(anchors):
        starts = segment_starts(batch.doc_ids[sample])
        layer_kinds = draft_query_rows(
            config, full_packet(sample_anchors, starts[sample_anchors]), context=case.objective.context
        )[2]
        plans = sample_context_exchanges(
            config, case.seq_len, layout, sample_anchors, starts, transport=case.transport,
            context=case.objective.context, min_bucket=case.objective.anchor_bucket_minimum(layout.num_owners),
        ) or [None, None]
        for kind in layer_kinds:
            plan = plans[kind]
            me = layout.cp_rank
            rows = gather_rows if plan is None else sum(plan.send_counts(me)) + sum(plan.recv_counts(me))
            expected += rows * row_bytes
            all_gather += gather_rows * row_bytes
    return expected, all_gather


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES)
def test_layout_equals_reference(case: DFlashVerifyCase) -> None:
    result = verify_dflash(case, timeout_s=240)
    assert result.loss_rel_err <= 1e-9, result
    assert result.grad_rel_err <= 1e-9, result
    expected = [_context_kv_bytes(case, rank) for rank in range(case.topology.world_size)]
    assert result.attention_bytes_per_rank == [moved for moved, _ in expected]
    target = [_target_bytes(case, rank) for rank in range(case.topology.world_size)]
    assert result.target_bytes_per_rank == [moved for moved, _ in target]
    assert result.teacher_bytes_per_rank == [moved for _, moved in target]
    if case.objective.loss == "kl" and case.topology.cp > 1 and case.objective.target_capture == "sharded":
        assert all(moved > 0 for _, moved in target)
    if case.doc_length is not None and case.topology.cp > 1:  # short documents: the exchange moves less
        assert sum(moved for moved, _ in expected) < sum(gathered for _, gathered in expected) // 2
    if case.doc_ids is not None:  # one document: CSBP's sliding layers move less, CP-only all-gathers
        ratio = sum(moved for moved, _ in expected) / sum(gathered for _, gathered in expected)
        assert ratio < 0.85 if case.topology.bp > 1 else ratio == 1.0
