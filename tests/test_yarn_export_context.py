"""Under YaRN an export writes ``max_position_embeddings = factor x original_max_position_embeddings``
(YaRN's extended context; transformers 4 derives the factor from that ratio, transformers 5 warns when
they differ), so a run whose YaRN rule does not cover ``data.seq_len`` is refused before training (and
its export refused after), naming where the rule came from and the factor that covers the length,
instead of exporting a model that claims fewer positions than it was trained at. The same holds for a
DFlash drafter, which takes its target's RoPE."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from csbp.cli.dflash_checkpoint import checkpoint_seq_len
from csbp.data import open_artifact
from csbp.dflash.export import export_dflash
from csbp.dflash.verify import TARGET_CONFIG, DFlashVerifyCase, build_models
from csbp.models import Decoder, DecoderConfig, export_hf_checkpoint
from csbp.models.hf_config import yarn_context_problem
from csbp.models.rope import RopeScaling
from csbp.training.export import export_decoder
from csbp.training.model_factory import build_model, check_yarn_context
from csbp.training.preflight import check_run
from test_training_run import config_dict, make_artifact, tiny_config

SHORT = {"type": "yarn", "factor": 2, "original_max_position_embeddings": 8}  # 16 positions; the data: 32


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_artifact(tmp_path_factory.mktemp("data") / "art")


def _from(checkpoint: Path) -> dict[str, Any]:
    shapes = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
    return {**{f"model.{k}": None for k in shapes}, "model.init_from": str(checkpoint)}


def test_the_rule_is_yarns_extended_context() -> None:
    assert yarn_context_problem(RopeScaling("yarn", 4.0, 8), 32) is None  # 32 positions cover 32
    assert yarn_context_problem(RopeScaling("linear", 2.0), 32) is None  # no ratio to keep
    gap = yarn_context_problem(RopeScaling("yarn", 2.0, 8), 32)
    assert gap is not None and (gap.factor, gap.longest) == (4, 16)
    odd = yarn_context_problem(RopeScaling("yarn", 2.5, 7), 16)  # 17.5 positions: no integer carries 2.5
    assert odd is not None and odd.longest is None and odd.factor == 3


def test_a_run_whose_yarn_does_not_cover_seq_len_is_refused_before_training(artifact: Path) -> None:
    cfg = tiny_config(artifact, **{"model.rope_scaling": SHORT})
    with pytest.raises(ValueError) as caught:
        check_run(cfg, check_device=False)
    message = str(caught.value)
    assert message.startswith(
        "model.rope_scaling: yarn extends original_max_position_embeddings 8 by factor 2 to 16 positions, "
        "fewer than data.seq_len 32"
    ) and "\n" not in message
    assert message.endswith("(fix: set model.rope_scaling.factor: 4, or set data.seq_len: 16 or less)")
    check_run(tiny_config(artifact, **{"model.rope_scaling": {**SHORT, "factor": 4}}), check_device=False)


def test_a_checkpoints_own_yarn_is_checked_and_the_fix_overrides_it(artifact: Path, tmp_path: Path) -> None:
    config = DecoderConfig(vocab_size=open_artifact(artifact).vocab_size, hidden_size=32, intermediate_size=64,
                           num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, arch="qwen3",
                           rope_scaling=RopeScaling("yarn", 2.0, 8))
    export_hf_checkpoint(Decoder(config, seed=0), config, tmp_path / "hf")
    cfg = tiny_config(artifact, **_from(tmp_path / "hf"))
    with pytest.raises(ValueError) as caught:
        check_run(cfg, check_device=False)
    assert str(caught.value).startswith(f"model.init_from: {tmp_path / 'hf'}/config.json rope_scaling: yarn extends")
    fix = "set model.rope_scaling: {type: yarn, factor: 4, original_max_position_embeddings: 8}"
    assert fix in str(caught.value)
    check_run(tiny_config(artifact, **_from(tmp_path / "hf"), **{"model.rope_scaling": {**SHORT, "factor": 4}}),
              check_device=False)


def test_the_export_of_such_a_run_is_refused_not_written_short(artifact: Path, tmp_path: Path) -> None:
    # a run from before the check: the export wrote max_position_embeddings 16 for a model trained at 32
    cfg = tiny_config(artifact, **{"model.rope_scaling": {**SHORT, "factor": 4}})
    inputs = check_run(cfg, check_device=False)
    model = build_model(cfg, inputs.decoder_config, device=torch.device("cpu"))
    written = json.loads((export_decoder(cfg, inputs, model, tmp_path / "ok", overwrite=False) / "config.json").read_text())
    assert written["max_position_embeddings"] == 32 and written["rope_scaling"]["factor"] == 4.0
    short = dataclasses.replace(inputs.decoder_config, rope_scaling=RopeScaling("yarn", 2.0, 8))
    old_cfg = tiny_config(artifact, **{"model.rope_scaling": SHORT})
    with pytest.raises(ValueError, match=r"^model.rope_scaling: yarn extends .* to 16 positions, fewer than data.seq_len 32"):
        export_decoder(old_cfg, dataclasses.replace(inputs, decoder_config=short),
                       Decoder(short, seed=0), tmp_path / "short", overwrite=False)
    assert not (tmp_path / "short").exists()


def test_a_drafter_trained_past_its_targets_yarn_context_is_not_exported(tmp_path: Path) -> None:
    _, drafter = build_models(DFlashVerifyCase())
    yarn = RopeScaling(rope_type="yarn", factor=2.0, original_max_position_embeddings=16)
    drafter = type(drafter)(dataclasses.replace(drafter.config, rope_scaling=yarn))
    written = json.loads((export_dflash(drafter, tmp_path / "ok", seq_len=32) / "config.json").read_text())
    assert written["max_position_embeddings"] == 32
    with pytest.raises(ValueError, match=r"^drafter rope_scaling \(its target's\): yarn extends .* to 32 positions, "
                       r"fewer than data.seq_len 64: .*\(fix: train at data.seq_len 32 or less"):
        export_dflash(drafter, tmp_path / "long", seq_len=64)
    assert not (tmp_path / "long").exists()
    # a dflash run is refused before training, naming its target
    with pytest.raises(ValueError, match=r"^objective.dflash.target: /t/config.json rope_scaling: yarn extends .*"
                       r"\(fix: set data.seq_len: 32 or less\)$"):
        check_yarn_context(_seq_len_config(64), dataclasses.replace(TARGET_CONFIG, rope_scaling=yarn), target="/t")


def _seq_len_config(seq_len: int) -> Any:
    """A stand-in run config: only ``data.seq_len`` and ``model.rope_scaling`` are read."""
    return type("Cfg", (), {"data": type("D", (), {"seq_len": seq_len})(), "model": None})()


def test_dflash_export_of_a_checkpoint_reads_its_training_length(tmp_path: Path) -> None:
    config_yaml = yaml.safe_dump({"data": {"seq_len": 4096}, "objective": {"name": "dflash"}})
    (tmp_path / "trainer_state.json").write_text(json.dumps({"config_yaml": config_yaml}))
    assert checkpoint_seq_len(tmp_path) == 4096
    assert checkpoint_seq_len(tmp_path / "missing") is None


def _limit_positions(checkpoint: Path, limit: int) -> Path:
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "max_position_embeddings": limit}))
    return checkpoint


def test_a_drafter_trained_past_its_plain_rope_targets_context_is_refused(artifact: Path, tmp_path: Path) -> None:
    """Without YaRN nothing checked the target's max_position_embeddings: a drafter learnt from a
    frozen target's features at positions the target never saw (out of distribution)."""
    from test_training_dflash import dflash_config, export_target

    target = _limit_positions(export_target(tmp_path / "t", open_artifact(artifact).vocab_size, tokenizer_dir=artifact), 16)
    with pytest.raises(ValueError) as caught:
        check_run(dflash_config(artifact, target), check_device=False)
    assert str(caught.value) == (
        f"objective.dflash.target: {target}/config.json max_position_embeddings 16 is below data.seq_len 32 and no "
        "YaRN rope_scaling extends it: the frozen target never saw positions past 16, so its features there, which "
        "the drafter learns from, are out of distribution (fix: set data.seq_len: 16 or less, or use a copy of the "
        "target whose config.json has rope_scaling: {type: yarn, factor: 2, original_max_position_embeddings: 16})"
    )
    check_run(dflash_config(artifact, _limit_positions(target, 32)), check_device=False)


def test_a_decoder_trained_past_its_checkpoints_plain_rope_context_is_warned_about(artifact: Path, tmp_path: Path) -> None:
    """Silent before (the export then raised max_position_embeddings to data.seq_len): training there
    extends the checkpoint's context, a legitimate use, so one warning line names the alternatives."""
    config = DecoderConfig(vocab_size=open_artifact(artifact).vocab_size, hidden_size=32, intermediate_size=64,
                           num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, arch="qwen3")
    hf = _limit_positions(export_hf_checkpoint(Decoder(config, seed=0), config, tmp_path / "hf"), 16)
    warnings: list[str] = []
    check_run(tiny_config(artifact, **_from(hf)), check_device=False, warn=warnings.append)
    assert warnings == [
        f"model.init_from: {hf}/config.json max_position_embeddings 16 is below data.seq_len 32 and no YaRN "
        "rope_scaling extends it: the run trains the checkpoint at positions it never saw, extending its context "
        "(the export records max_position_embeddings 32) (to extend it by RoPE scaling instead: set "
        "model.rope_scaling: {type: yarn, factor: 2, original_max_position_embeddings: 16}; to stay inside: set "
        "data.seq_len: 16 or less)"
    ]
    warnings.clear()  # a run that sets its own RoPE chose how to reach data.seq_len
    check_run(tiny_config(artifact, **_from(hf), **{"model.rope_theta": 2e6}), check_device=False, warn=warnings.append)
    assert warnings == []


def test_config_validate_prints_the_warnings_csbp_train_prints(
    artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``csbp config validate`` ran check_run without ``warn``: it called the config fine and hid the
    lines ``csbp train`` prints for the same config (here: init_from trained past its context)."""
    from csbp.cli.main import main

    config = DecoderConfig(vocab_size=open_artifact(artifact).vocab_size, hidden_size=32, intermediate_size=64,
                           num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, arch="qwen3")
    hf = _limit_positions(export_hf_checkpoint(Decoder(config, seed=0), config, tmp_path / "hf"), 16)
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(config_dict(artifact, **_from(hf))), encoding="utf-8")  # JSON is YAML
    assert main(["config", "validate", str(path)]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"config ok: {path}") and "inputs" in out
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"model.init_from: {hf}/config.json max_position_embeddings 16 is")
