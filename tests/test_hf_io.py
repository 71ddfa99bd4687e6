"""Hugging Face import/export (``csbp.models.hf_io``): logits parity with transformers' Qwen3 and
Llama in both directions, config mapping, and clear errors for bad checkpoints.

Everything is offline and tiny (hidden 32, vocab 64); HF models use eager attention.
Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_hf_io.py -q``
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import ModuleType
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import csbp.models.hf_io as hf_io  # noqa: E402
from csbp.models import (  # noqa: E402
    CausalAttention,
    Decoder,
    DecoderConfig,
    decoder_config_from_hf,
    export_hf_checkpoint,
    hf_passthrough_config,
    load_hf_checkpoint,
)

VOCAB = 64
ATOL = 1e-5  # float32 logits of O(1) magnitude



def perturb_(model: torch.nn.Module, seed: int) -> None:
    """O(1) activations and non-unit norm weights, so a wrong mapping cannot hide below the tolerance."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator).to(param.dtype)
            param.copy_(1.0 + 0.2 * noise if "norm" in name else 0.15 * noise)


def make_hf_model(
    transformers: ModuleType, arch: str, *, tie: bool, num_layers: int, bias: bool, rope_theta: float = 5000.0
) -> Any:
    common = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=rope_theta,
        tie_word_embeddings=tie,
        attention_bias=bias,
        attn_implementation="eager",
    )
    if arch == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=16, **common))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(mlp_bias=bias, **common))
    perturb_(model, seed=num_layers)
    return model.eval()


def hf_logits(model: Any, ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids, position_ids=position_ids).logits


def csbp_logits(model: Decoder, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.logits(model(ids, positions, CausalAttention()))


def random_ids(num_samples: int = 2, num_rows: int = 11) -> torch.Tensor:
    return torch.randint(0, VOCAB, (num_samples, num_rows), generator=torch.Generator().manual_seed(0))


def tiny_config(**overrides: Any) -> DecoderConfig:
    fields: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rope_theta=2500.0,
    )
    fields.update(overrides)
    return DecoderConfig(**fields)


# ----------------------------------------------------------------------------- HF -> csbp


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize(
    ("tie", "num_layers", "bias"), [(False, 2, False), (True, 3, False), (False, 4, True)]
)
def test_loaded_checkpoint_matches_hf_logits(
    transformers: ModuleType, tmp_path: Path, arch: str, tie: bool, num_layers: int, bias: bool
) -> None:
    hf_model = make_hf_model(transformers, arch, tie=tie, num_layers=num_layers, bias=bias)
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    model, config = load_hf_checkpoint(tmp_path)
    assert (config.arch, config.tie_embeddings, config.num_layers, config.rope_theta) == (
        arch,
        tie,
        num_layers,
        5000.0,
    )
    assert config.qk_norm == (arch == "qwen3") and config.attention_bias == bias
    assert config.head_dim == (16 if arch == "qwen3" else 8)
    assert model.embed_tokens.weight.dtype == torch.float32
    ids = random_ids()
    reference = hf_logits(hf_model, ids)
    assert reference.abs().max() > 0.5  # the comparison is not between near-zero logits
    torch.testing.assert_close(csbp_logits(model, ids, torch.arange(11)), reference, rtol=0, atol=ATOL)
    # explicit, shifted positions follow HF's position_ids
    shifted = torch.arange(11) + 7
    torch.testing.assert_close(
        csbp_logits(model, ids, shifted),
        hf_logits(hf_model, ids, shifted[None].repeat(2, 1)),
        rtol=0,
        atol=ATOL,
    )


def test_sharded_checkpoint_loads(transformers: ModuleType, tmp_path: Path) -> None:
    hf_model = make_hf_model(transformers, "qwen3", tie=False, num_layers=2, bias=False)
    hf_model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="10KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    model, _ = load_hf_checkpoint(tmp_path)
    ids = random_ids()
    torch.testing.assert_close(
        csbp_logits(model, ids, torch.arange(11)), hf_logits(hf_model, ids), rtol=0, atol=ATOL
    )


def test_layer_outputs_match_hf_hidden_states(transformers: ModuleType, tmp_path: Path) -> None:
    hf_model = make_hf_model(transformers, "qwen3", tie=False, num_layers=4, bias=False)
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    model, _ = load_hf_checkpoint(tmp_path)
    ids = random_ids()
    with torch.no_grad():
        hidden_states = hf_model(input_ids=ids, output_hidden_states=True).hidden_states
        features = model.layer_outputs(ids, torch.arange(11), CausalAttention(), [2, 0])
    expected = torch.cat([hidden_states[3], hidden_states[1]], dim=-1)
    torch.testing.assert_close(features, expected, rtol=0, atol=ATOL)


# ----------------------------------------------------------------------------- csbp -> HF


@pytest.mark.parametrize(
    ("arch", "tie", "bias"),
    [("qwen3", False, False), ("qwen3", True, True), ("llama", False, True), ("llama", True, False)],
)
def test_exported_checkpoint_loads_in_transformers(
    transformers: ModuleType, tmp_path: Path, arch: str, tie: bool, bias: bool
) -> None:
    config = tiny_config(
        arch=arch,
        qk_norm=arch == "qwen3",
        tie_embeddings=tie,
        attention_bias=bias,
        mlp_bias=bias and arch == "llama",
        head_dim=12,
    )
    model = Decoder(config, seed=1)
    perturb_(model, seed=1)
    out = export_hf_checkpoint(model, config, tmp_path / "export", extra_config={"eos_token_id": 3})
    written = json.loads((out / "config.json").read_text())
    assert written["rope_theta"] == 2500.0 and written["eos_token_id"] == 3
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager", dtype=torch.float32, local_files_only=True
    )
    assert type(hf_model).__name__ == hf_io.HF_CLASS_BY_ARCH[arch]
    ids = random_ids()
    torch.testing.assert_close(
        hf_logits(hf_model.eval(), ids), csbp_logits(model, ids, torch.arange(11)), rtol=0, atol=ATOL
    )


def test_export_then_load_round_trips_exactly(tmp_path: Path) -> None:
    config = tiny_config(attention_bias=True)
    model = Decoder(config, seed=2)
    perturb_(model, seed=2)
    token_fields = {"eos_token_id": [5, 6], "bos_token_id": 4, "max_position_embeddings": 4096}
    export_hf_checkpoint(model, config, tmp_path / "ckpt", extra_config=token_fields)
    loaded, loaded_config = load_hf_checkpoint(tmp_path / "ckpt")
    assert loaded_config == config
    for (name, expected), actual in zip(model.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(actual, expected), name
    assert hf_passthrough_config(tmp_path / "ckpt") == {**token_fields, "pad_token_id": None}
    export_hf_checkpoint(
        loaded, loaded_config, tmp_path / "again", extra_config=hf_passthrough_config(tmp_path / "ckpt")
    )
    assert (tmp_path / "again" / "config.json").read_text() == (tmp_path / "ckpt" / "config.json").read_text()
    modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "ckpt").iterdir()}
    assert modes["model.safetensors"] == modes["config.json"] == 0o644  # readable like any export file


def test_export_stores_the_weights_without_a_second_copy() -> None:
    """Weights already on the CPU in the stored dtype are written from the model's own memory (the
    export used to clone every tensor: +32 GB for an 8B float32 model); shared or partial storages
    (tied weights, a view into a larger buffer) are still copied, since safetensors refuses them."""
    model = Decoder(tiny_config(), seed=1)
    state = model.state_dict()
    stored = hf_io.tensors_to_store(state, torch.float32)
    assert all(stored[f"model.{name}" if not name.startswith("lm_head.") else name].data_ptr() == t.data_ptr()
               for name, t in state.items())
    weight = torch.arange(12.0).reshape(3, 4)
    shared = hf_io.tensors_to_store({"a.weight": weight, "b.weight": weight, "c.weight": weight[1:]}, torch.float32)
    pointers = {t.untyped_storage().data_ptr() for t in shared.values()}
    assert len(pointers) == 3 and all(t.untyped_storage().nbytes() == t.nbytes for t in shared.values())
    assert torch.equal(shared["model.c.weight"], weight[1:])
    lone = hf_io.tensors_to_store({"d.weight": weight[1:]}, torch.float32)["model.d.weight"]  # a view, alone
    assert lone.untyped_storage().nbytes() == lone.nbytes and torch.equal(lone, weight[1:])


def test_export_in_bfloat16_stores_bfloat16(tmp_path: Path) -> None:
    config = tiny_config()
    model = Decoder(config)
    export_hf_checkpoint(model, config, tmp_path / "bf16", dtype=torch.bfloat16)
    assert {t.dtype for t in load_file(str(tmp_path / "bf16" / "model.safetensors")).values()} == {
        torch.bfloat16
    }
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    loaded, _ = load_hf_checkpoint(tmp_path / "bf16")
    assert loaded.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(loaded.embed_tokens.weight, model.embed_tokens.weight.bfloat16())


def test_export_is_atomic_and_refuses_to_clobber(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tiny_config()
    model = Decoder(config)
    target = tmp_path / "ckpt"

    def crash(*args: Any, **kwargs: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(hf_io, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        export_hf_checkpoint(model, config, target)
    assert list(tmp_path.iterdir()) == []  # neither the target nor a staging directory is left
    monkeypatch.undo()

    export_hf_checkpoint(model, config, target)
    with pytest.raises(ValueError, match="already exists .*pass --overwrite"):
        export_hf_checkpoint(model, config, target)
    other = Decoder(config, seed=9)
    export_hf_checkpoint(other, config, target, overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    loaded, _ = load_hf_checkpoint(target)
    assert torch.equal(loaded.norm.weight, other.norm.weight)
    assert torch.equal(loaded.embed_tokens.weight, other.embed_tokens.weight)


def test_export_copies_tokenizer_files(tmp_path: Path) -> None:
    tokenizer_dir = tmp_path / "tok"
    tokenizer_dir.mkdir()
    (tokenizer_dir / "tokenizer.json").write_text('{"version": "1.0"}')
    (tokenizer_dir / "tokenizer_config.json").write_text("{}")
    (tokenizer_dir / "unrelated.txt").write_text("x")
    config = tiny_config()
    out = export_hf_checkpoint(Decoder(config), config, tmp_path / "ckpt", tokenizer_dir=tokenizer_dir)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    (tmp_path / "no_tokenizer").mkdir()
    with pytest.raises(ValueError, match="tokenizer_dir"):
        export_hf_checkpoint(
            Decoder(config), config, tmp_path / "ckpt2", tokenizer_dir=tmp_path / "no_tokenizer"
        )
    assert not (tmp_path / "ckpt2").exists()


def test_export_rejects_inconsistent_requests(tmp_path: Path) -> None:
    config = tiny_config()
    model = Decoder(config)
    with pytest.raises(ValueError, match=r"extra_config must not override.*hidden_size"):
        export_hf_checkpoint(model, config, tmp_path / "a", extra_config={"hidden_size": 64})
    with pytest.raises(ValueError, match="config differs"):
        export_hf_checkpoint(model, tiny_config(rope_theta=1.0), tmp_path / "b")
    llama_with_norm = tiny_config(arch="llama", qk_norm=True)
    with pytest.raises(ValueError, match="qk_norm=False"):
        export_hf_checkpoint(Decoder(llama_with_norm), llama_with_norm, tmp_path / "c")
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- config mapping and errors


def hf_config_dict(**overrides: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
    }
    fields.update(overrides)
    return fields


def test_config_mapping_defaults_and_rope_locations() -> None:
    llama = decoder_config_from_hf(hf_config_dict())
    assert (llama.head_dim, llama.num_kv_heads, llama.rope_theta, llama.tie_embeddings) == (
        8,
        4,
        10000.0,
        False,
    )
    assert decoder_config_from_hf(hf_config_dict(rope_theta=500000.0)).rope_theta == 500000.0
    nested = hf_config_dict(rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rope_theta=None)
    assert decoder_config_from_hf(nested).rope_theta == 1e6
    legacy = hf_config_dict(rope_scaling={"type": "default", "rope_theta": 3e5})
    assert decoder_config_from_hf(legacy).rope_theta == 3e5
    qwen = decoder_config_from_hf(
        hf_config_dict(architectures=["Qwen3ForCausalLM"], tie_word_embeddings=True, num_key_value_heads=2)
    )
    assert (qwen.arch, qwen.qk_norm, qwen.head_dim, qwen.tie_embeddings) == ("qwen3", True, 128, True)
    # without num_key_value_heads a Qwen config has 32 KV heads in transformers (Llama: its heads)
    assert decoder_config_from_hf(hf_config_dict(architectures=["Qwen2ForCausalLM"], num_attention_heads=32,
                                                 hidden_size=256)).num_kv_heads == 32
    assert llama.num_kv_heads == 4


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"architectures": ["GemmaForCausalLM"]}, "unsupported architectures"),
        # MistralConfig's defaults: every layer slides by 4096 within 131072 positions, 8 KV heads
        ({"architectures": ["MistralForCausalLM"]},
         r"sliding_window=4096 \(absent: MistralConfig default\) is below max_position_embeddings=131072 \(absent"),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": None},
         "no num_key_value_heads: transformers reads a MistralForCausalLM config without it as 8 KV heads, not the 4"),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": None, "num_key_value_heads": None},
         "num_key_value_heads is null, which transformers' MistralConfig refuses"),
        # AutoModelForCausalLM would build a Mistral (sliding window and all) from this Llama-named config
        ({"model_type": "mistral", "sliding_window": 4}, r"model_type='mistral' does not match .*LlamaForCausalLM"),
        ({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen2"}, "model_type='qwen2' does not match"),
        ({"architectures": None}, "unsupported architectures"),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 8.0}}, "rope_type='dynamic' is not supported"),
        ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0}}, "rope_type='longrope' is not supported"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0, "low_freq_factor": 1.0}}, "does not apply"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"architectures": ["Qwen3ForCausalLM"], "num_key_value_heads": 2, "use_sliding_window": True,
          "max_window_layers": 1}, r"makes layers \[1\] sliding-window layers"),
        ({"num_hidden_layers": None}, "num_hidden_layers"),
        ({"num_key_value_heads": 3}, "num_kv_heads"),
        # transformers reads these as 32 KV heads; csbp read them as 4
        ({"architectures": ["Qwen3ForCausalLM"]}, "no num_key_value_heads: .* as 32 KV heads, not the 4"),
        ({"architectures": ["Qwen2ForCausalLM"]}, "no num_key_value_heads"),
        # these loaded before: a quantized checkpoint's config, and values transformers' typed configs refuse
        ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config is not supported"),
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, got 'false'"),  # was tied
        ({"attention_bias": 1}, "attention_bias must be true or false"),
        ({"num_attention_heads": 4.5}, "num_attention_heads must be a positive integer, got 4.5"),  # was 4
        ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer"),  # was ZeroDivisionError
        ({"vocab_size": "64"}, "vocab_size must be a positive integer"),
        ({"head_dim": 8.0}, "head_dim must be a positive integer"),
    ],
)
def test_config_mapping_rejects_unsupported(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decoder_config_from_hf(hf_config_dict(**overrides))


@pytest.fixture
def exported(tmp_path: Path) -> Path:
    config = tiny_config()
    return export_hf_checkpoint(Decoder(config), config, tmp_path / "ckpt")


def rewrite_tensors(directory: Path, edit: Any) -> None:
    tensors = load_file(str(directory / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(directory / "model.safetensors"))


def test_missing_tensor_is_named(exported: Path) -> None:
    rewrite_tensors(exported, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_norm\.weight'"):
        load_hf_checkpoint(exported)


def test_wrong_shape_is_named(exported: Path) -> None:
    rewrite_tensors(exported, lambda t: t.update({"model.layers.0.mlp.up_proj.weight": torch.zeros(40, 32)}))
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.up_proj\.weight' has shape \(40, 32\)"):
        load_hf_checkpoint(exported)


def test_unexpected_tensor_is_rejected_but_inv_freq_ignored(exported: Path) -> None:
    rewrite_tensors(
        exported, lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)})
    )
    load_hf_checkpoint(exported)
    rewrite_tensors(exported, lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.ones(32)}))
    with pytest.raises(
        ValueError, match=r"does not explain, e\.g\. 'model\.layers\.0\.self_attn\.q_proj\.bias'"
    ):
        load_hf_checkpoint(exported)


def test_a_single_file_next_to_a_shard_index_is_refused(exported: Path) -> None:
    # transformers reads model.safetensors and ignores the index; csbp read the shards: a stale copy
    # of either would load other weights than transformers does.
    load_hf_checkpoint(exported)
    (exported / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"model.norm.weight": "model-00001-of-00001.safetensors"}})
    )
    with pytest.raises(ValueError, match=r"both model\.safetensors and model\.safetensors\.index\.json"):
        load_hf_checkpoint(exported)


def test_a_tensor_in_two_shards_is_refused(exported: Path) -> None:
    # Which copy wins differs between readers (csbp kept the last shard read): a tensor must be in the
    # one shard the index names.
    tensors = load_file(str(exported / "model.safetensors"))
    (exported / "model.safetensors").unlink()
    names = sorted(tensors)
    first, second = names[: len(names) // 2], names[len(names) // 2 :]
    save_file({n: tensors[n] for n in first}, str(exported / "a.safetensors"))
    save_file({n: tensors[n] for n in second}, str(exported / "b.safetensors"))
    weight_map = {**dict.fromkeys(first, "a.safetensors"), **dict.fromkeys(second, "b.safetensors")}
    (exported / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    load_hf_checkpoint(exported)
    stale = {n: tensors[n] for n in second}
    stale[first[0]] = torch.zeros_like(tensors[first[0]])
    save_file(stale, str(exported / "b.safetensors"))
    with pytest.raises(ValueError, match=rf"tensor '{first[0]}' is in shard b\.safetensors .* the index names a\.safetensors"):
        load_hf_checkpoint(exported)
    del weight_map[first[0]]  # unlisted and in both shards
    (exported / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match="it is in another shard too"):
        load_hf_checkpoint(exported)


def test_unknown_architecture_and_missing_files(exported: Path, tmp_path: Path) -> None:
    config_file = exported / "config.json"
    hf_config = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**hf_config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architectures"):
        load_hf_checkpoint(exported)
    config_file.write_text(json.dumps(hf_config))
    (exported / "model.safetensors").rename(exported / "pytorch_model.bin")
    with pytest.raises(ValueError, match="never loaded"):
        load_hf_checkpoint(exported)
    with pytest.raises(ValueError, match="config.json not found"):
        load_hf_checkpoint(tmp_path / "nowhere")


def test_a_float16_checkpoint_names_itself_and_the_flag_that_loads_it(tmp_path: Path) -> None:
    """``--dtype auto`` on a float16 checkpoint (Llama 2's) said only "pass dtype=torch.bfloat16",
    a Python argument, without naming the checkpoint."""
    config = tiny_config()
    out = export_hf_checkpoint(Decoder(config), config, tmp_path / "ckpt")
    rewrite_tensors(out, lambda t: t.update({name: v.to(torch.float16) for name, v in t.items()}))
    with pytest.raises(ValueError, match=rf"checkpoint {tmp_path / 'ckpt'} stores torch.float16 weights.*--dtype bfloat16"):
        load_hf_checkpoint(out)
    model, _ = load_hf_checkpoint(out, dtype=torch.bfloat16)
    assert model.embed_tokens.weight.dtype == torch.bfloat16
