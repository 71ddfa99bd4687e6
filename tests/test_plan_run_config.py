"""``csbp plan`` of a run config (``plan.run_config_workload``): the model it prices is the one
csbp trains. References are csbp's own builders (``decoder_config_for_run``, ``drafter_config_for``
and the modules they make, counted on the meta device) and the config fields themselves; the planner
counts every matrix and the two norms of a layer, and leaves out the hidden, final and q/k norm
vectors (``D`` or ``head_dim`` each), so those are subtracted from the real count."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from csbp.dflash.drafter import DFlashDrafter
from csbp.models.decoder import Decoder
from csbp.models.hf_config import decoder_config_from_hf
from csbp.plan.run_config_workload import run_config_workload
from csbp.plan.workload import hf_workload
from csbp.recipes import load_run_config
from csbp.training.dflash_inputs import drafter_config_for
from csbp.training.model_factory import decoder_config_for_run

UNCOUNTED_NORMS = ("hidden_norm.weight", "q_norm.weight", "k_norm.weight")

TARGET = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 6, "intermediate_size": 128, "vocab_size": 256,
    "tie_word_embeddings": False,
}


def _counted(module: torch.nn.Module) -> int:
    """Trainable parameters of ``module`` the planner counts (all but the norm vectors it leaves out)."""
    return sum(
        p.numel() for name, p in module.named_parameters()
        if p.requires_grad and name != "norm.weight" and not name.endswith(UNCOUNTED_NORMS)
    )


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.vocab_size=500", "model.head_dim=48", "model.tie_embeddings=true"],  # head_dim is not D / heads
        ["model.vocab_size=300", "model.num_kv_heads=4", "model.tie_embeddings=false"],
    ],
)
def test_a_run_config_prices_the_decoder_csbp_builds_for_it(overrides: list[str]) -> None:
    """``model.head_dim`` (read as ``D / heads`` instead), ``model.tie_embeddings`` (read as untied) and
    ``model.vocab_size`` each passed every test misread."""
    cfg = load_run_config("demo", overrides)
    workload = run_config_workload(cfg)
    artifact = SimpleNamespace(vocab_size=cfg.model.vocab_size, directory=Path("unused"))
    with torch.device("meta"):
        decoder = Decoder(decoder_config_for_run(cfg, artifact))
    assert workload.model.total_params == _counted(decoder)


def test_a_run_config_without_a_vocabulary_takes_its_artifacts(tmp_path: Path) -> None:
    (tmp_path / "manifest.json").write_text(json.dumps({"tokenizer": {"vocab_size": 4096}}))
    cfg = load_run_config("demo", [f"data.train={tmp_path}"])
    assert cfg.model.vocab_size is None and run_config_workload(cfg).model.vocab == 4096


def test_a_run_config_prices_its_window_and_its_block(tmp_path: Path) -> None:
    """``topology.window`` (every layer attends that far) and, for a model from ``init_from``, the run's
    ``objective.block_size`` over the block its checkpoint was trained with: each was ignored unnoticed."""
    cfg = load_run_config("demo", ["model.vocab_size=512", "topology.window=16"])
    assert [g.window for g in run_config_workload(cfg).model.groups] == [16]
    record = {"objective": {"name": "bd3", "block_size": 16}}
    (tmp_path / "config.json").write_text(json.dumps({**TARGET, "csbp_training": record}))
    cfg = load_run_config("demo", [f"model.init_from={tmp_path}", "model.vocab_size=null", "model.hidden_size=null",
                                   "model.intermediate_size=null", "model.num_layers=null", "model.num_heads=null",
                                   "model.num_kv_heads=null", "model.head_dim=null", "objective.block_size=8"])
    assert run_config_workload(cfg).objective.block == 8
    assert hf_workload(tmp_path).objective.block == 16  # the checkpoint alone: what it trained with


@pytest.mark.parametrize("loss", ["kl", "ce"])
def test_a_dflash_run_config_prices_the_drafter_csbp_builds_for_it(tmp_path: Path, loss: str) -> None:
    """The drafter's matrices (the fusion fc over its fused target layers, the draft MLP width), its
    sliding layers and window, anchors, selector and the target layers its online pass runs: one
    layer past the deepest fused one (layer ``i`` is ``hidden_states[i + 1]``), every layer for the KL
    loss's logits. Misreading any one passed every test."""
    (tmp_path / "config.json").write_text(json.dumps(TARGET))
    kinds = '["full_attention","sliding_attention","sliding_attention"]'
    cfg = load_run_config("dflash-demo", [
        f"objective.dflash.target={tmp_path}", "objective.dflash.num_draft_layers=3", f"objective.dflash.loss={loss}",
        "objective.dflash.intermediate_size=96", f"objective.dflash.layer_types={kinds}",
        "objective.dflash.sliding_window=8", "objective.dflash.target_layer_ids=[1,3]",
        "objective.dflash.max_anchors=24", "objective.dflash.selector_rank=4",
    ])
    workload = run_config_workload(cfg)
    section, target = cfg.objective.dflash, decoder_config_from_hf(TARGET)
    with torch.device("meta"):
        drafter = DFlashDrafter(drafter_config_for(section, target, cfg.objective.block_size, 255), target=Decoder(target))
    model, objective = workload.model, workload.objective
    selector = sum(p.numel() for name, p in drafter.named_parameters() if "selector" in name)
    assert model.body_params + model.extra_params == _counted(drafter) - selector
    assert objective.feature_width == 2 * 64 and model.ffn == 96
    assert sorted((g.count, g.window) for g in model.groups) == [(1, 0), (2, 8)]
    assert (objective.window, objective.anchors, objective.selector_rank) == (8, 24, 4)
    assert workload.target_pass is not None and workload.target_pass.layers == (6 if loss == "kl" else 4)
    assert workload.target_pass.mode == section.target_capture
    features = tmp_path / "features"
    offline = run_config_workload(load_run_config("dflash-demo", [f"objective.dflash.target={tmp_path}",
                                                                  f"objective.dflash.features={features}"]))
    assert offline.target_pass is not None and offline.target_pass.mode == "offline"


def test_an_ar_run_config_is_planned_as_one_causal_stream() -> None:
    """``ar`` is not one of ``--objective``'s choices, but a run config may train it (refusing it survived)."""
    cfg = load_run_config("demo", ["objective.name=ar", "objective.block_size=null", "objective.loss_weight=unit",
                                   "model.vocab_size=512", "topology.cp=1", "topology.bp=1"])
    objective = run_config_workload(cfg).objective
    assert (objective.name, objective.single_stream) == ("ar", True)


def test_window_on_a_drafter_sets_its_layers_and_its_anchor_windows() -> None:
    """The drafter's block-local work reads ``objective.window`` (``plan.drafter``): ``--window`` left it at
    the preset's 2048 unnoticed."""
    from csbp.plan.workload import preset_workload

    drafter = preset_workload("dflash2-qwen3.8").with_options(window=128)
    assert drafter.objective.window == 128 and {g.window for g in drafter.model.groups} == {128}


@pytest.mark.parametrize("flag", ["--block-size", "--window"])
def test_a_block_size_or_window_of_zero_is_one_line(capsys: pytest.CaptureFixture[str], flag: str) -> None:
    from csbp.cli.main import USER_ERROR_EXIT_CODE, main

    code = main(["plan", "--model", "nemotron-3b", "--gpus", "8", "--seq-len", "4096", flag, "0"])
    out, err = capsys.readouterr()
    assert code == USER_ERROR_EXIT_CODE and out == "" and err == f"csbp: error: {flag} must be >= 1, got 0\n"
