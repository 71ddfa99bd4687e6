"""Public DFlash checkpoint format (objectives.md §8): the exact safetensors key set (no ``model.``
prefix, no embedding or LM head), the ``config.json`` contract, DFlash2 fields, round trips that
reproduce the drafter exactly, and the validation errors of ``load_dflash``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from csbp.dflash.export import export_dflash, load_dflash
from csbp.dflash.features import capture_target_features
from csbp.dflash.layouts import AnchorPacket, context_rows
from csbp.dflash.step import forward_packet
from csbp.dflash.verify import TARGET_CONFIG, DFlashVerifyCase, build_models, make_batch
from csbp.models.config import DecoderConfig
from csbp.models.decoder import Decoder

LAYER_KEYS = (
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
)


def _hidden(drafter, target) -> torch.Tensor:  # noqa: ANN001
    batch = make_batch(1, 16)
    features = capture_target_features(target, batch.input_ids, (0, 2)).features
    packet = AnchorPacket(
        torch.arange(2),
        torch.tensor([3, 9]),
        torch.zeros(2, dtype=torch.long),
        torch.ones(2, dtype=torch.bool),
    )
    positions = torch.arange(16)
    return forward_packet(drafter, batch.input_ids[0], packet, features, positions, context_rows(positions))


def test_dflash_export_key_set_and_config(tmp_path: Path) -> None:
    target, drafter = build_models(DFlashVerifyCase())
    out = export_dflash(drafter, tmp_path / "drafter")
    keys = set(load_file(str(out / "model.safetensors")))
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    expected |= {f"layers.{i}.{name}" for i in range(2) for name in LAYER_KEYS}
    assert keys == expected
    assert (out / "model.safetensors").stat().st_mode & 0o777 == 0o644  # safetensors alone would write 0600
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    assert (
        config["dflash_config"]["target_layer_ids"] == [0, 2]
        and config["dflash_config"]["mask_token_id"] == 63
    )
    expected_fields = {
        "block_size": 4,
        "num_target_layers": 4,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "vocab_size": 64,
        "layer_types": ["full_attention", "full_attention"],
        "sliding_window": None,
    }
    assert {k: config[k] for k in expected_fields} == expected_fields
    assert config["rope_parameters"]["rope_theta"] == 10000.0
    loaded = load_dflash(out, target)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in drafter.state_dict().items())
    assert torch.equal(_hidden(loaded, target), _hidden(drafter, target))
    with pytest.raises(ValueError, match="already exists"):
        export_dflash(drafter, out)
    export_dflash(drafter, out, overwrite=True, dtype=torch.bfloat16)
    assert load_file(str(out / "model.safetensors"))["fc.weight"].dtype == torch.bfloat16


def test_dflash2_export_round_trip(tmp_path: Path) -> None:
    options = {
        "conv_kernel_size": 2,
        "conv_group_size": 8,
        "selector_rank": 4,
        "selector_top_k": 8,
        "layer_types": ("sliding_attention", "full_attention"),
        "sliding_window": 5,
    }
    target, drafter = build_models(DFlashVerifyCase(drafter_options=options, perturb_extras=True))
    out = export_dflash(drafter, tmp_path / "d2")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert (
        config["conv_kernel_size"],
        config["conv_group_size"],
        config["selector_rank"],
        config["selector_top_k"],
    ) == (2, 8, 4, 8)
    assert config["sliding_window"] == 5 and config["use_sliding_window"] is True
    stored = load_file(str(out / "model.safetensors"))
    keys = set(stored)
    # the released DFlash2 layout (z-lab DFlash2DraftModel checkpoints)
    released = {
        "layers.0.attention_conv.base_kernel": (2, 2, 32),
        "layers.1.attention_conv.kernel_projection.weight": (2 * 2 * 4, 32),
        "layers.0.mlp_conv.base_kernel": (2, 2, 32),
        "layers.1.mlp_conv.kernel_projection.weight": (2 * 2 * 4, 32),
        "candidate_selector.predecessor_codebook": (64, 4),
        "candidate_selector.successor_codebook": (64, 4),
        "candidate_selector.hidden_projection.weight": (4, 32),
    }
    assert {name: tuple(stored[name].shape) for name in released if name in stored} == released
    assert not any("attn_conv" in k or k.startswith("selector.") for k in keys)
    assert not any(k.startswith("model.") or "embed_tokens" in k or "lm_head" in k for k in keys)
    loaded = load_dflash(out, target)
    assert loaded.config == drafter.config
    assert torch.equal(_hidden(loaded, target), _hidden(drafter, target))
    assert torch.equal(loaded.selector.cand_embed, drafter.selector.cand_embed)

    # an export by an earlier csbp (its own tensor names) still loads
    save_file(dict(drafter.state_dict()), str(out / "model.safetensors"))
    assert torch.equal(_hidden(load_dflash(out, target), target), _hidden(drafter, target))
    # a released DFlash2 config: block size and DFlash2 options inside dflash_config only
    moved = {k: config.pop(k) for k in ("block_size", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")}
    (out / "config.json").write_text(json.dumps({**config, "dflash_config": {**config["dflash_config"], **moved}}))
    assert load_dflash(out, target).config == drafter.config
    for option, value in (("output_multiplier", 0.2), ("final_logit_softcapping", 20.0), ("input_embedding_scale", 2.0)):
        (out / "config.json").write_text(json.dumps({**config, "dflash_config": {**config["dflash_config"], **moved, option: value}}))
        with pytest.raises(ValueError, match=f"{option}={value} is not supported"):
            load_dflash(out, target)


def test_load_validation_errors(tmp_path: Path) -> None:
    target, drafter = build_models(DFlashVerifyCase())
    out = export_dflash(drafter, tmp_path / "d")
    wide = Decoder(DecoderConfig(**{**TARGET_CONFIG.__dict__, "hidden_size": 48}))
    with pytest.raises(ValueError, match="hidden_size"):
        load_dflash(out, wide)
    small_vocab = Decoder(DecoderConfig(**{**TARGET_CONFIG.__dict__, "vocab_size": 60}))
    with pytest.raises(ValueError, match="vocab_size"):
        load_dflash(out, small_vocab)
    config = json.loads((out / "config.json").read_text())
    for edit, match in (
        (lambda c: c["dflash_config"].update(target_layer_ids=[0, 7]), "target_layer_ids"),
        (lambda c: c["dflash_config"].pop("mask_token_id"), "mask_token_id"),
        (lambda c: c.update(architectures=["Qwen3ForCausalLM"]), "architectures"),
        (lambda c: c.pop("num_target_layers"), "num_target_layers"),
        # both used to load silently: the public reader would run GELU MLPs / add attention biases
        (lambda c: c.update(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
        (lambda c: c.update(attention_bias=True), "attention_bias=true is not supported"),
    ):
        broken = json.loads(json.dumps(config))
        edit(broken)
        (out / "config.json").write_text(json.dumps(broken))
        with pytest.raises(ValueError, match=match):
            load_dflash(out, target)
    (out / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(out / "model.safetensors"))
    tensors["model.fc.weight"] = tensors.pop("fc.weight")
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="missing"):
        load_dflash(out, target)


def test_a_drafter_refuses_a_target_with_another_rope(tmp_path: Path) -> None:
    """A drafter rotates at its target's positions with the target's RoPE: a target whose scaling
    (or base) differs is refused with one line naming both, while an equivalent spelling loads."""
    from csbp.models.rope import RopeScaling

    yarn = RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=16)
    target_config = DecoderConfig(**{**TARGET_CONFIG.__dict__, "rope_scaling": yarn})
    target = Decoder(target_config)
    _, drafter = build_models(DFlashVerifyCase())
    drafter_config = type(drafter.config)(**{**drafter.config.__dict__, "rope_scaling": yarn})
    out = export_dflash(type(drafter)(drafter_config), tmp_path / "d")
    for other, shown in (
        (DecoderConfig(**{**TARGET_CONFIG.__dict__, "rope_scaling": None}), "no scaling"),
        (DecoderConfig(**{**target_config.__dict__, "rope_theta": 5e5}), "theta=500000"),
        (DecoderConfig(**{**TARGET_CONFIG.__dict__, "rope_scaling": RopeScaling(rope_type="linear", factor=4.0)}), "linear"),
    ):
        with pytest.raises(ValueError, match=rf"drafter {out}: drafter RoPE \(theta=.*yarn: factor=4\.0.*\) differs from the target's \(.*{shown}.*fix: pass the target it was trained against") as caught:
            load_dflash(out, Decoder(other))
        assert "\n" not in str(caught.value)
    spelled = RopeScaling(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0)
    load_dflash(out, Decoder(DecoderConfig(**{**target_config.__dict__, "rope_scaling": spelled})))
    load_dflash(out, target)


def test_bidirectional_sliding_layers_tell_the_public_reader(tmp_path: Path) -> None:
    """The public DFlash reader makes sliding layers causal in the block unless the config says
    ``is_causal: false``; csbp writes it for ``sliding_window_causal: false`` (and only then: ``true``
    would make the full-attention layers causal too) and reads the reader's key back."""
    sliding = {"layer_types": ("sliding_attention", "full_attention"), "sliding_window": 5}
    target, causal = build_models(DFlashVerifyCase(drafter_options=sliding))
    _, bidirectional = build_models(DFlashVerifyCase(drafter_options={**sliding, "sliding_window_causal": False}))
    written = json.loads((export_dflash(causal, tmp_path / "causal") / "config.json").read_text())
    assert "is_causal" not in written
    out = export_dflash(bidirectional, tmp_path / "bidirectional")
    config = json.loads((out / "config.json").read_text())
    assert config["is_causal"] is False
    assert load_dflash(out, target).config.sliding_window_causal is False
    del config["dflash_config"]["sliding_window_causal"]  # a config written by another trainer
    for is_causal, expected in ((False, False), (None, True)):
        (out / "config.json").write_text(json.dumps({**config, "is_causal": is_causal}))
        assert load_dflash(out, target).config.sliding_window_causal is expected
    for edit, match in (
        ({"is_causal": True}, "full-attention draft layers causal"),
        ({"is_causal": False, "dflash_config": {**config["dflash_config"], "sliding_window_causal": True}},
         "contradicts dflash_config.sliding_window_causal"),
    ):
        (out / "config.json").write_text(json.dumps({**config, **edit}))
        with pytest.raises(ValueError, match=match):
            load_dflash(out, target)


def test_a_float16_drafter_is_refused_naming_the_flag_that_loads_it(tmp_path: Path) -> None:
    """A float16 drafter loaded as stored (``--dtype auto``) became a float16 module, which csbp does not
    compute in; ``csbp dflash export`` then failed only at the write, naming neither the drafter nor ``--dtype``."""
    target, drafter = build_models(DFlashVerifyCase())
    out = export_dflash(drafter, tmp_path / "d")
    tensors = load_file(str(out / "model.safetensors"))
    save_file({k: v.to(torch.float16) for k, v in tensors.items()}, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match=rf"drafter {out} stores torch.float16 weights.*--dtype bfloat16"):
        load_dflash(out, target)
    assert load_dflash(out, target, dtype=torch.bfloat16).fc.weight.dtype == torch.bfloat16


def test_a_drafter_without_yarn_records_the_context_it_serves(tmp_path: Path) -> None:
    """Without YaRN no max_position_embeddings was written, so readers took Qwen3Config's 32768
    whatever the target's context (SGLang then refuses the drafter under a longer target unless
    SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN is set). Now the larger of the training length and the
    target's max_position_embeddings, those known."""
    _, drafter = build_models(DFlashVerifyCase())

    def written(name: str, **known: int) -> int | None:
        return json.loads((export_dflash(drafter, tmp_path / name, **known) / "config.json").read_text()).get(
            "max_position_embeddings"
        )

    assert written("both", seq_len=4096, target_positions=40960) == 40960
    assert written("longer", seq_len=65536, target_positions=40960) == 65536  # a run from before the refusal
    assert written("target", target_positions=131072) == 131072  # a drafter directory records no seq_len
    assert written("none") is None
