"""DFlash layouts equal one process (csbp.md §14, objectives.md §12 test 11): CP-only (all anchors
on every rank, context K/V zigzag-sharded), CSBP (anchors dealt over BP ranks, packets padded with
dead anchors) and BP-only, on 2, 4 and 8 gloo processes. Rank 0's sample-group loss and averaged
drafter gradients must equal ``reference_dflash_loss`` (dense masks, full logits) to 1e-9
relative in float64, also with DFlash2 modules, sliding layers, D-PACE, the lambda mix and KL.
Only context K/V cross the wire: the attention bytes are checked exactly."""

from __future__ import annotations

import pytest

from csbp.dflash.config import DFlashObjectiveConfig
from csbp.dflash.verify import DFlashVerifyCase, verify_dflash
from csbp.topology import Topology

DFLASH2 = {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 4, "selector_top_k": 40}
SLIDING = {"layer_types": ("sliding_attention", "full_attention"), "sliding_window": 5}

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
]


def _context_kv_bytes(case: DFlashVerifyCase) -> int:
    """Per rank: every sample, layer and direction moves (P-1) shards of L/P rows of K and V."""
    ring = case.topology.cp
    rows = case.seq_len // ring
    per_call = (ring - 1) * rows * 2 * 2 * 8 * 8  # K and V, 2 KV heads, head dim 8, float64
    return case.samples * 2 * 2 * per_call  # samples x layers x (all-gather + reduce-scatter)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES)
def test_layout_equals_reference(case: DFlashVerifyCase) -> None:
    result = verify_dflash(case, timeout_s=240)
    assert result.loss_rel_err <= 1e-9, result
    assert result.grad_rel_err <= 1e-9, result
    assert result.attention_bytes_per_rank == [_context_kv_bytes(case)] * case.topology.world_size
