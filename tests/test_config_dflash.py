"""Run config of a DFlash drafter run: the ``objective.dflash`` section and its cross-section rules
(the shared helpers and the other sections: ``test_config.py``)."""

from __future__ import annotations

from typing import Any

import pytest

from csbp.config import config_from_dict
from test_config import dflash_changes, error_lines, with_changes


def test_dflash_section() -> None:
    base = dflash_changes()
    cfg = config_from_dict(with_changes(base | {"objective.dflash.target_layer_ids": [1, 9]}))
    assert cfg.objective.dflash is not None
    assert (cfg.objective.dflash.target_layer_ids, cfg.objective.dflash.max_anchors) == ([1, 9], 512)
    assert cfg.objective.loss_weight == "unit"
    assert cfg.model.hidden_size is None and cfg.model.rope_theta is None  # no decoder defaults filled
    (line,) = error_lines(with_changes(base | {"objective.dflash.max_anchors": 2}))
    assert line.startswith("config.yaml: objective.dflash.max_anchors: max_anchors=2 is below bp=4")


@pytest.mark.parametrize(
    ("changes", "field", "fragment"),
    [
        ({"model.hidden_size": 64, "model.rope_theta": 1e4}, "model", "hidden_size do not apply"),
        ({"model.rope_theta": 1e4}, "model", "rope_theta do not apply"),
        ({"model.arch": "llama"}, "model.arch", "Qwen3-style"),
        ({"objective.dflash.loss": "kl", "objective.dflash.lk_loss_type": "tv"}, "objective.dflash.lk_loss_type",
         "mixes with the hard CE only"),
        ({"objective.dflash.num_draft_layers": 2, "objective.dflash.layer_types": ["full_attention"]},
         "objective.dflash.layer_types", "lists 1 layer, num_draft_layers=2"),
        ({"objective.dflash.layer_types": ["sliding_attention"]}, "objective.dflash.sliding_window", "required"),
        ({"objective.dflash.target_layer_ids": [1, 1]}, "objective.dflash.target_layer_ids", "distinct"),
        ({"objective.denominator": "all_tokens"}, "objective.denominator", "supervised slots"),
        ({"objective.block_size": 1}, "objective.block_size", "no slot to draft"),  # trained at loss 0
        ({"train.fsdp": True, "topology.dp": 2}, "train.fsdp", "holds whole"),
        # an option whose switch is off would be dropped silently (a "DFlash2" run trained plain DFlash)
        ({"objective.dflash.selector_alpha": 0.1, "objective.dflash.selector_warmup_ratio": 0.2},
         "objective.dflash.selector_alpha", "(nor selector_warmup_ratio): the DFlash2 selector is off"),
        ({"objective.dflash.conv_group_size": 8}, "objective.dflash.conv_group_size", "convolution is off"),
        ({"objective.dflash.sliding_window": 16}, "objective.dflash.sliding_window", "no draft layer is sliding"),
        ({"objective.dflash.dpace_alpha": 0.3}, "objective.dflash.dpace_alpha", "weighting: decay"),
        ({"objective.dflash.kl_scale": 0.5}, "objective.dflash.kl_scale", "lk_loss_type: ce is not the mix"),
        ({"objective.dflash.weighting": "dpace", "objective.dflash.gamma": 4.0}, "objective.dflash.gamma",
         "replaces the decay"),
        ({"data.seq_len": 250, "objective.block_size": 4}, "data.seq_len", "2*cp=4 equal zigzag chunks"),
        # the mix takes each micro-batch's own acceptance: accumulation would change the objective
        ({"objective.dflash.lk_loss_type": "lambda", "train.grad_accum": 2}, "train.grad_accum",
         "one acceptance per micro-batch"),
    ],
)
def test_dflash_rules(changes: dict[str, Any], field: str, fragment: str) -> None:
    (line,) = error_lines(with_changes(dflash_changes() | changes))
    assert line.startswith(f"config.yaml: {field}: "), line
    assert fragment in line


def test_dflash_options_with_their_switch_on_load_and_survive_a_full_dump() -> None:
    """The inert-option rule compares with the defaults: a run's saved config.yaml writes every field
    (defaults included) and must load again, and each option loads once its switch is on."""
    on = {
        "objective.dflash.selector_rank": 4, "objective.dflash.selector_alpha": 0.1,
        "objective.dflash.conv_kernel_size": 2, "objective.dflash.conv_group_size": 8,
        "objective.dflash.layer_types": ["sliding_attention"], "objective.dflash.sliding_window": 16,
        "objective.dflash.weighting": "dpace", "objective.dflash.dpace_alpha": 0.3,
        "objective.dflash.gamma": 4.0,  # used by the selector loss
        "objective.dflash.lk_loss_type": "lambda", "objective.dflash.kl_scale": 0.5,
    }
    for changes in ({}, on):
        cfg = config_from_dict(with_changes(dflash_changes() | changes))
        assert config_from_dict(cfg.model_dump(mode="json")) == cfg


def test_dflash_sequence_needs_only_whole_zigzag_chunks() -> None:
    """dflash has no clean stream of blocks: seq_len % block_size and the BD3 block counts do not
    apply, only seq_len % (2*cp) (here cp=2)."""
    cfg = config_from_dict(with_changes(dflash_changes() | {"data.seq_len": 20, "objective.block_size": 8}))
    assert (cfg.data.seq_len, cfg.objective.block_size) == (20, 8)
