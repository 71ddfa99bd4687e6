"""RoPE scaling set on a run (``model.rope_scaling``, ``model.rope_theta`` over ``model.init_from``):
the config section's one-line errors, the model factory's overrides, and a short training run from a
Qwen2 checkpoint whose ``config.yaml`` and final export record the new RoPE.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_rope_config.py -q``
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from csbp.cli.config_cmd import summary_rows
from csbp.config import config_from_dict, dump_config
from csbp.data import open_artifact
from csbp.models import CausalAttention, Decoder, DecoderConfig, export_hf_checkpoint, load_hf_checkpoint
from csbp.models.rope import RopeScaling
from csbp.training.model_factory import build_model, decoder_config_for_run
from test_config import dflash_changes, error_lines, with_changes
from test_training_run import make_artifact, tiny_config, train

YARN = {"type": "yarn", "factor": 4, "original_max_position_embeddings": 32}


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_artifact(tmp_path_factory.mktemp("data") / "art")


def test_rope_scaling_section_parses_and_is_recorded() -> None:
    cfg = config_from_dict(with_changes({"model.rope_scaling": YARN}))
    assert cfg.model.rope_scaling is not None
    assert cfg.model.rope_scaling.to_rope_scaling() == RopeScaling("yarn", 4.0, 32)
    again = config_from_dict(yaml.safe_load(dump_config(cfg)))  # what the run directory's config.yaml holds
    assert again.model.rope_scaling == cfg.model.rope_scaling
    synonym = config_from_dict(with_changes({"model.rope_scaling": {**YARN, "rope_type": "yarn"}}))
    assert synonym.model.rope_scaling == cfg.model.rope_scaling
    llama3 = {"type": "llama3", "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4,
              "original_max_position_embeddings": 8192}
    assert config_from_dict(with_changes({"model.rope_scaling": llama3})).model.rope_scaling is not None


@pytest.mark.parametrize(
    ("rope_scaling", "line"),
    [
        ({"type": "dynamic", "factor": 2}, "model.rope_scaling.type: got 'dynamic' (fix: use 'linear', 'llama3' or "
                                            "'yarn')"),
        ({"rope_type": "longrope", "factor": 2}, "model.rope_scaling.type: got 'longrope'"),
        ({"type": "yarn", "factor": 4}, "model.rope_scaling.original_max_position_embeddings: required for "
                                        "rope_type='yarn'"),
        ({"type": "linear", "factor": 2, "beta_fast": 8}, "model.rope_scaling.beta_fast: does not apply to "
                                                          "rope_type='linear'"),
        ({**YARN, "factor": 0.5}, "model.rope_scaling.factor: must be >= 1"),
        ({**YARN, "beta_fast": 1, "beta_slow": 2}, "model.rope_scaling.beta_fast: must exceed beta_slow"),
        ({**YARN, "scale": 2}, "model.rope_scaling.scale: unknown key"),
        ({**YARN, "rope_type": "linear"}, "model.rope_scaling.rope_type: 'linear' differs from type='yarn'"),
    ],
)
def test_rope_scaling_errors_are_one_line(rope_scaling: dict[str, Any], line: str) -> None:
    (error,) = error_lines(with_changes({"model.rope_scaling": rope_scaling}))
    assert error.startswith(f"config.yaml: {line}"), error


@pytest.mark.parametrize(
    ("rope_scaling", "fix"),
    [
        ({"type": "yarn", "factor": 4}, "set model.rope_scaling.original_max_position_embeddings: Context length "
                                        "before the extension (llama3, yarn: required)"),
        ({"type": "linear", "factor": 2, "beta_fast": 8}, "remove model.rope_scaling.beta_fast"),
        ({**YARN, "beta_fast": 1, "beta_slow": 2}, "set beta_fast above beta_slow (unset: 32 and 1)"),
        ({"type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 1,
          "original_max_position_embeddings": 8192}, "set high_freq_factor above low_freq_factor (Llama 3.1: 4 and 1)"),
    ],
)
def test_rope_scaling_rule_errors_say_the_fix(rope_scaling: dict[str, Any], fix: str) -> None:
    # these lines used to end with the problem alone, without the (fix: ...) every config error has
    (error,) = error_lines(with_changes({"model.rope_scaling": rope_scaling}))
    assert error.endswith(f" (fix: {fix})"), error


def test_dflash_drafter_takes_the_targets_rope() -> None:
    (error,) = error_lines(with_changes(dflash_changes() | {"model.rope_scaling": YARN}))
    assert error.startswith("config.yaml: model: rope_scaling do not apply to a dflash drafter"), error


def _qwen2_checkpoint(path: Path, vocab_size: int) -> Decoder:
    config = DecoderConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=8, rope_theta=1e4, arch="qwen2", qk_norm=False, qkv_bias=True)
    model = Decoder(config, dtype=torch.float32, seed=5)
    export_hf_checkpoint(model, config, path, extra_config={"max_position_embeddings": 32, "bos_token_id": 1})
    return model


def _from(checkpoint: Path, **changes: Any) -> dict[str, Any]:
    shapes = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
    return {**{f"model.{k}": None for k in shapes}, "model.init_from": str(checkpoint), **changes}


def test_init_from_takes_the_runs_rope(artifact: Path, tmp_path: Path) -> None:
    source = _qwen2_checkpoint(tmp_path / "hf", open_artifact(artifact).vocab_size)
    cfg = tiny_config(artifact, **_from(tmp_path / "hf", **{"model.rope_scaling": YARN, "model.rope_theta": 5e4}))
    config = decoder_config_for_run(cfg, open_artifact(artifact))
    assert config.rope_scaling == RopeScaling("yarn", 4.0, 32) and config.rope_theta == 5e4
    assert (config.arch, config.qkv_bias) == ("qwen2", True)
    model = build_model(cfg, config, device=torch.device("cpu"))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), source.state_dict().values()))
    # the same weights under the new RoPE: different logits beyond the original 32 positions
    ids, positions = torch.arange(6)[None], 100 + torch.arange(6)
    with torch.no_grad():
        assert not torch.allclose(model.logits(model(ids, positions, CausalAttention())),
                                  source.logits(source(ids, positions, CausalAttention())), atol=1e-3)
    unchanged = decoder_config_for_run(tiny_config(artifact, **_from(tmp_path / "hf")), open_artifact(artifact))
    assert unchanged == source.config  # nothing set: the checkpoint's RoPE
    # `csbp config validate` names the checkpoint's family, not the unused model.arch default (qwen3)
    assert dict(summary_rows(cfg))["model"] == f"Qwen2ForCausalLM from {tmp_path / 'hf'}, RoPE replaced by yarn x4"


def test_training_run_records_the_rope_in_its_config_and_export(artifact: Path, tmp_path: Path) -> None:
    _qwen2_checkpoint(tmp_path / "hf", open_artifact(artifact).vocab_size)
    cfg = tiny_config(artifact, **_from(tmp_path / "hf", **{"model.rope_scaling": YARN}))
    run_dir = tmp_path / "run"
    train(cfg, run_dir=run_dir, max_steps=1)
    recorded = yaml.safe_load((run_dir / "config.yaml").read_text())["model"]["rope_scaling"]
    assert recorded["type"] == "yarn" and recorded["factor"] == 4.0
    exported = json.loads((run_dir / "final" / "config.json").read_text())
    assert exported["architectures"] == ["Qwen2ForCausalLM"]
    assert exported["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    assert exported["max_position_embeddings"] == 128 and exported["bos_token_id"] == 1
    _, final_config = load_hf_checkpoint(run_dir / "final")  # what csbp generate / eval load
    assert final_config.rope_scaling == RopeScaling("yarn", 4.0, 32)


def test_from_scratch_models_take_rope_scaling_and_the_qwen2_layout(artifact: Path) -> None:
    vocab = open_artifact(artifact)
    qwen2 = decoder_config_for_run(tiny_config(artifact, **{"model.arch": "qwen2", "model.rope_scaling": YARN}), vocab)
    assert (qwen2.qkv_bias, qwen2.attention_bias, qwen2.qk_norm, qwen2.rope_theta) == (True, False, False, 1e6)
    assert qwen2.rope_scaling == RopeScaling("yarn", 4.0, 32)
    # a layout the final export could not write fails before training, not after it
    # (said in YAML terms by the config rules: it read "arch='llama' export needs qk_norm=False")
    with pytest.raises(ValueError, match=r"model.qk_norm: true does not fit model.arch: llama, whose Hugging Face "
                       r"layout has no query/key norms .*\(fix: set model.qk_norm: false, or remove it"):
        decoder_config_for_run(tiny_config(artifact, **{"model.arch": "llama", "model.qk_norm": True}), vocab)


def test_a_llama_whose_heads_do_not_divide_hidden_fails_before_training(artifact: Path) -> None:
    """transformers' LlamaConfig refuses it, so the final export would fail after training; one fix is named."""
    vocab = open_artifact(artifact)
    changes = {"model.arch": "llama", "model.qk_norm": False, "model.num_heads": 3, "model.num_kv_heads": 1}
    with pytest.raises(ValueError) as caught:
        decoder_config_for_run(tiny_config(artifact, **changes), vocab)
    message = str(caught.value)
    assert message.startswith("model.arch: arch='llama' export: hidden_size=") and message.count("(fix:") == 1
