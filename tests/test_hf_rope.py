"""Qwen2, Mistral and RoPE scaling (linear, llama3, yarn) against transformers' own models, in float64.

Each case builds a tiny HF model from a config (no downloads), saves it with safetensors, imports it
with csbp and compares logits at positions far beyond ``original_max_position_embeddings`` (64), so
the scaling decides the result; then exports a csbp model and loads it back into transformers.

transformers upcasts to float32, not float64, inside a float64 model (RoPE ``inv_freq`` and angles,
RMSNorm variance), which moves float64 logits by ~1e-6. The float64 reference therefore runs
transformers' own code, rope-init function included, with ``torch.float``/``torch.float32`` aliased
to float64, and ``Tensor.float()`` made a float64 cast (``hf_in_float64``); the float32 tables transformers really uses are checked separately
against csbp's to float32 precision.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_hf_rope.py -q``
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from csbp.dflash.config import DFlashConfig  # noqa: E402
from csbp.dflash.drafter import DFlashDrafter  # noqa: E402
from csbp.dflash.export import export_dflash, load_dflash  # noqa: E402
from csbp.models import CausalAttention, Decoder, DecoderConfig, export_hf_checkpoint, load_hf_checkpoint  # noqa: E402
from csbp.models.hf_config import decoder_config_from_hf, hf_config_from_decoder  # noqa: E402
from csbp.models.rope import RopeScaling, rope_inverse_frequencies  # noqa: E402
from test_generation import (  # noqa: E402
    test_cached_denoise_equals_training_layout_rows as cached_denoise_matches_training_rows,
)

VOCAB = 64
ATOL = 1e-10  # float64 logits of O(1) magnitude
ORIGINAL = 64
POSITIONS = 250 + 41 * torch.arange(11)  # 250 ... 660: beyond factor x original for every case

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": ORIGINAL}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
YARN_DEEPSEEK = {**YARN, "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 0.707, "mscale_all_dim": 1.0,
                 "truncate": False}
YARN_FIXED_FACTOR = {**YARN, "attention_factor": 1.25}
LINEAR = {"rope_type": "linear", "factor": 4.0}



def perturb_(model: torch.nn.Module, seed: int) -> None:
    """O(1) activations and non-unit norm weights, so a wrong mapping cannot hide below the tolerance."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float64).to(param.dtype)
            param.copy_(1.0 + 0.2 * noise if "norm" in name else 0.3 * noise)


def make_hf_model(transformers: ModuleType, arch: str, rope: dict[str, Any] | None, *, tie: bool = False) -> Any:
    common: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=tie,
        attn_implementation="eager",
        rope_parameters={"rope_theta": 5000.0, **(rope or {"rope_type": "default"})},
    )
    if arch == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=16, **common))
    elif arch == "qwen2":
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    elif arch == "mistral":  # head_dim 12, not hidden / heads = 8 (as Mistral-Nemo's 128 is not 5120 / 32)
        model = transformers.MistralForCausalLM(transformers.MistralConfig(head_dim=12, sliding_window=None, **common))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    model = model.to(torch.float64)
    perturb_(model, seed=len(arch) + len(rope or {}))
    return model.eval()


@contextmanager
def hf_in_float64(transformers: ModuleType, hf_model: Any) -> Iterator[None]:
    """Run ``hf_model`` with its float32 upcasts (RoPE tables, RMSNorm) made float64 (module docstring)."""
    rotary = hf_model.model.rotary_emb
    if rotary.rope_type == "default":
        init = type(rotary).compute_default_rope_parameters
    else:
        init = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS[rotary.rope_type]
    patch = pytest.MonkeyPatch()
    try:
        patch.setattr(torch, "float", torch.float64)
        patch.setattr(torch, "float32", torch.float64)
        # transformers < 5.2x upcasts the RoPE angles with ``Tensor.float()`` (5.17, the device image's)
        patch.setattr(torch.Tensor, "float", lambda self, *args, **kwargs: self.to(torch.float64, *args, **kwargs))
        inv_freq, scale = init(hf_model.config)
        assert inv_freq.dtype == torch.float64 and scale == rotary.attention_scaling
        float32_inv_freq, rotary.inv_freq = rotary.inv_freq, inv_freq
        yield
    finally:
        patch.undo()
    rotary.inv_freq = float32_inv_freq


def hf_logits(transformers: ModuleType, hf_model: Any, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), hf_in_float64(transformers, hf_model):
        return hf_model(input_ids=ids, position_ids=positions[None].expand(ids.shape[0], -1)).logits


def csbp_logits(model: Decoder, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.logits(model(ids, positions, CausalAttention()))


def random_ids() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, len(POSITIONS)), generator=torch.Generator().manual_seed(0))


CASES = [
    pytest.param("qwen2", None, True, id="qwen2-tied"),
    pytest.param("qwen2", YARN, False, id="qwen2-yarn"),
    pytest.param("llama", LLAMA3, False, id="llama-llama3"),
    pytest.param("mistral", None, True, id="mistral-tied"),
    pytest.param("mistral", YARN, False, id="mistral-yarn"),
    pytest.param("qwen3", YARN, False, id="qwen3-yarn"),
    pytest.param("qwen3", YARN_DEEPSEEK, True, id="qwen3-yarn-mscale-untruncated"),
    pytest.param("qwen3", YARN_FIXED_FACTOR, False, id="qwen3-yarn-attention-factor"),
    pytest.param("qwen3", LINEAR, False, id="qwen3-linear"),
]


@pytest.mark.parametrize(("arch", "rope", "tie"), CASES)
def test_import_matches_transformers_logits(
    transformers: ModuleType, tmp_path: Path, arch: str, rope: Any, tie: bool
) -> None:
    hf_model = make_hf_model(transformers, arch, rope, tie=tie)
    hf_model.save_pretrained(tmp_path, safe_serialization=True)
    model, config = load_hf_checkpoint(tmp_path)
    assert (config.arch, config.tie_embeddings, config.rope_theta) == (arch, tie, 5000.0)
    assert config.qkv_bias == (arch == "qwen2") and not config.attention_bias
    assert config.rope_scaling == RopeScaling.from_dict(rope or {})
    assert model.embed_tokens.weight.dtype == torch.float64
    assert config.head_dim == {"qwen3": 16, "mistral": 12}.get(arch, 8)
    if arch == "qwen2":
        attention = model.layers[0].self_attn
        assert attention.q_proj.bias is not None and attention.o_proj.bias is None

    # the tables transformers really uses (float32) agree with csbp's to float32 precision
    rotary = hf_model.model.rotary_emb
    ours = rope_inverse_frequencies(config.head_dim, config.rope_theta, torch.float64, torch.device("cpu"),
                                    config.rope_scaling)
    torch.testing.assert_close(ours, rotary.inv_freq.to(torch.float64), rtol=1e-6, atol=0)
    scale = config.rope_scaling.attention_scale if config.rope_scaling else 1.0
    assert scale == pytest.approx(rotary.attention_scaling, rel=1e-15)

    ids = random_ids()
    reference = hf_logits(transformers, hf_model, ids, POSITIONS)
    assert reference.abs().max() > 0.5  # the comparison is not between near-zero logits
    torch.testing.assert_close(csbp_logits(model, ids, POSITIONS), reference, rtol=0, atol=ATOL)
    if rope is not None:  # the scaling decides the result at these positions
        plain = Decoder(DecoderConfig(**{**config.__dict__, "rope_scaling": None}), dtype=torch.float64)
        plain.load_state_dict(model.state_dict())
        assert (csbp_logits(plain, ids, POSITIONS) - reference).abs().max() > 1e-3


@pytest.mark.parametrize(("arch", "rope", "tie"), CASES)
def test_export_loads_in_transformers_with_the_same_logits(
    transformers: ModuleType, tmp_path: Path, arch: str, rope: Any, tie: bool
) -> None:
    config = DecoderConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=12, rope_theta=2500.0, rope_scaling=RopeScaling.from_dict(rope or {}), arch=arch,
        qk_norm=arch == "qwen3", qkv_bias=arch == "qwen2", tie_embeddings=tie,
    )
    model = Decoder(config, dtype=torch.float64, seed=3)
    perturb_(model, seed=3)
    out = export_hf_checkpoint(model, config, tmp_path / "export", extra_config={"max_position_embeddings": 4096})
    written = json.loads((out / "config.json").read_text())
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        out, attn_implementation="eager", dtype=torch.float64, local_files_only=True
    ).eval()
    assert type(hf_model).__name__ == {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                       "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}[arch]
    if arch == "mistral":  # MistralConfig would read an absent window as 4096
        assert written["sliding_window"] is None and hf_model.config.sliding_window is None
        assert "attention_bias" not in written and "mlp_bias" not in written  # no such MistralConfig fields
    expected_rope = {"rope_theta": 2500.0, **(rope or {"rope_type": "default"})}
    assert {k: hf_model.config.rope_parameters.get(k) for k in expected_rope} == expected_rope
    if rope is not None:
        assert written["rope_scaling"] == rope  # transformers 4 reads this one
    if rope is not None and rope["rope_type"] == "yarn":
        assert written["max_position_embeddings"] == 4 * ORIGINAL  # factor x original
    ids = random_ids()
    torch.testing.assert_close(hf_logits(transformers, hf_model, ids, POSITIONS), csbp_logits(model, ids, POSITIONS),
                               rtol=0, atol=ATOL)
    # and back: the same config, the same tensors, the same config.json
    loaded, loaded_config = load_hf_checkpoint(out)
    assert loaded_config == config
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    again = export_hf_checkpoint(loaded, loaded_config, tmp_path / "again",
                                 extra_config={"max_position_embeddings": 4096})
    assert (again / "config.json").read_text() == (out / "config.json").read_text()


# ----------------------------------------------------------------------------- config.json reading


def hf_dict(**overrides: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "architectures": ["Qwen3ForCausalLM"], "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 8, "max_position_embeddings": 40960,
    }
    fields.update(overrides)
    return fields


def test_real_world_rope_configs_import() -> None:
    # Llama-3.1-8B-Instruct's config.json (transformers 4 style)
    llama = decoder_config_from_hf(hf_dict(
        architectures=["LlamaForCausalLM"], rope_theta=500000.0, max_position_embeddings=131072,
        rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    ))
    assert llama.rope_scaling == RopeScaling("llama3", 8.0, 8192, low_freq_factor=1.0, high_freq_factor=4.0)
    assert llama.rope_theta == 500000.0 and not llama.qkv_bias
    # Qwen2.5-7B-Instruct: sliding-window fields present but unused, YaRN added as Qwen documents it
    qwen2_fields = hf_dict(
        architectures=["Qwen2ForCausalLM"], rope_theta=1e6, max_position_embeddings=32768,
        sliding_window=131072, max_window_layers=28, use_sliding_window=False,
        rope_scaling={"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"},
    )
    del qwen2_fields["head_dim"]  # Qwen2 configs have none: hidden / heads
    qwen2 = decoder_config_from_hf(qwen2_fields)
    assert (qwen2.arch, qwen2.qkv_bias, qwen2.attention_bias, qwen2.qk_norm, qwen2.head_dim) == (
        "qwen2", True, False, False, 8)
    assert qwen2.rope_scaling == RopeScaling("yarn", 4.0, 32768)
    assert qwen2.rope_scaling.attention_scale == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    # original_max_position_embeddings left out: HF falls back to max_position_embeddings
    implicit = decoder_config_from_hf(hf_dict(rope_parameters={"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6}))
    assert implicit.rope_scaling == RopeScaling("yarn", 2.0, 40960) and implicit.rope_theta == 1e6
    # a csbp export writes both dicts; a default rope_parameters next to a rope_scaling is fine
    both = hf_config_from_decoder(DecoderConfig(**{**llama.__dict__, "rope_theta": 1e6}), dtype=torch.float32)
    assert decoder_config_from_hf(both).rope_scaling == llama.rope_scaling
    assert decoder_config_from_hf(hf_dict(
        rope_theta=1e6, rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rope_scaling=YARN,
    )).rope_scaling == RopeScaling.from_dict(YARN)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, r"rope_scaling: rope_type='dynamic' is not supp"),
        ({"rope_parameters": {"rope_type": "longrope", "factor": 2.0, "short_factor": [1.0]}},
         r"rope_parameters: rope_type='longrope' is not supported"),
        ({"rope_scaling": {"type": "su", "factor": 2.0}}, r"rope_type='su' is not supported"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 64}},
         r"factor must be a number >= 1"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "beta_fast": 8}},
         r"beta_fast does not apply to rope_type='linear'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}},
         r"low_freq_factor is required for rope_type='llama3'"),
        ({"rope_scaling": {**YARN, "short_factor": [1.0]}}, r"unknown key 'short_factor'"),
        ({"rope_scaling": {**YARN, "beta_fast": 1.0, "beta_slow": 2.0}}, r"beta_fast must exceed beta_slow"),
        ({"rope_scaling": {"rope_type": "linear"}}, r"rope_scaling.factor is required"),
        # transformers 5 would silently take theta 10000 here (rope_scaling wins, rope_parameters' theta is lost)
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "rope_scaling": YARN},
         r"rope_parameters.rope_theta=1000000.0 differs from the rope_theta=10000.0"),
        ({"rope_theta": 1e6, "rope_parameters": {**LINEAR, "rope_theta": 1e6}, "rope_scaling": YARN},
         r"rope_scaling and rope_parameters describe different RoPE scaling"),
        ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True, "max_window_layers": 0},
         r"makes layers \[0, 1\] sliding-window layers"),
    ],
)
def test_unsupported_rope_is_one_clear_error(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decoder_config_from_hf(hf_dict(**overrides))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [  # each was a TypeError/KeyError traceback (float() of an object, an unhashable rope_type, str / str)
        ({"rope_theta": {"base": 10000}}, r"config.json rope_theta must be a number, got \{'base': 10000\}"),
        ({"rope_theta": "1e6"}, r"config.json rope_theta must be a number, got '1e6'"),
        ({"partial_rotary_factor": [0.5]}, r"config.json partial_rotary_factor must be a number"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": [1.0]}},
         r"config.json rope_parameters.rope_theta must be a number"),
        ({"rope_scaling": {"rope_type": ["yarn"], "factor": 2.0}}, r"rope_scaling: rope_type=\['yarn'\] is not supp"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": None}, "max_position_embeddings": "4096"},
         r"config.json max_position_embeddings must be a positive integer, got '4096'"),
        ({"architectures": {"Qwen3ForCausalLM": 1}}, r"unsupported architectures \{'Qwen3ForCausalLM': 1\}"),
        ({"architectures": 3}, r"unsupported architectures 3 in config.json"),
        # json reads Infinity: a theta of inf left every pair but the first unrotated, an eps of inf zeroed the norms
        ({"rope_theta": float("inf")}, r"config.json rope_theta must be finite, got inf"),
        ({"rms_norm_eps": float("inf")}, r"config.json rms_norm_eps must be a positive number, got inf"),
    ],
)
def test_a_malformed_rope_or_architectures_field_is_one_line(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decoder_config_from_hf(hf_dict(**overrides))


def test_export_refuses_layouts_its_family_cannot_hold(tmp_path: Path) -> None:
    shape: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4,
                                 num_kv_heads=2, head_dim=8)
    for fields, message in [
        (dict(arch="qwen2", qk_norm=False), "qkv_bias=True"),
        (dict(arch="qwen2", qk_norm=False, attention_bias=True), "qkv_bias=True"),
        (dict(arch="llama", qk_norm=False, qkv_bias=True), "qkv_bias=False"),
        (dict(arch="qwen3", qkv_bias=True), "qkv_bias=False"),
        (dict(arch="mistral"), "arch='mistral' export needs qk_norm=False"),  # DecoderConfig's default is True
        (dict(arch="mistral", qk_norm=False, attention_bias=True), "attention_bias=False"),
        (dict(arch="mistral", qk_norm=False, qkv_bias=True), "qkv_bias=False"),
        (dict(arch="mistral", qk_norm=False, mlp_bias=True), "mlp_bias=False"),
    ]:
        config = DecoderConfig(**shape, **fields)
        with pytest.raises(ValueError, match=message):
            export_hf_checkpoint(Decoder(config), config, tmp_path / "x")
    with pytest.raises(ValueError, match="set only one"):
        DecoderConfig(**shape, attention_bias=True, qkv_bias=True)
    assert not (tmp_path / "x").exists()


def test_num_parameters_counts_qkv_biases() -> None:
    config = DecoderConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=12, arch="qwen2", qk_norm=False, qkv_bias=True)
    assert config.num_parameters() == sum(p.numel() for p in Decoder(config).parameters())


# ----------------------------------------------------------------------------- the same tables everywhere


def scaled_model(rope: dict[str, Any]) -> Decoder:
    config = DecoderConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=8, rope_theta=500.0, rope_scaling=RopeScaling.from_dict(rope))
    model = Decoder(config, dtype=torch.float64, seed=4)
    model.init_weights(torch.Generator().manual_seed(5), std=0.3)
    return model.eval()


@pytest.mark.parametrize("rope", [{**YARN, "original_max_position_embeddings": 4}, {**LLAMA3, "factor": 2.0,
                                  "original_max_position_embeddings": 8}])
def test_kv_cache_decoding_uses_the_training_tables(rope: dict[str, Any]) -> None:
    """The cached block forward of ``csbp generate`` equals the ``[x_t ; x_0]`` training forward
    (tests/test_generation.py's oracle) under RoPE scaling that matters at these positions."""
    model = scaled_model(rope)
    assert model.rotary(torch.arange(16)).cos.ne(scaled_model({}).rotary(torch.arange(16)).cos).any()
    cached_denoise_matches_training_rows(model)


def test_dflash_drafter_follows_the_targets_rope(tmp_path: Path) -> None:
    target = scaled_model(YARN)
    config = DFlashConfig.from_target(target.config, num_layers=1, block_size=4, mask_token_id=3)
    assert (config.rope_theta, config.rope_scaling) == (500.0, target.config.rope_scaling)
    drafter = DFlashDrafter(config, target=target, dtype=torch.float64)
    positions = torch.arange(100, 140)
    assert torch.equal(drafter.rotary(positions).cos, target.rotary(positions).cos)
    assert torch.equal(drafter.rotary(positions).sin, target.rotary(positions).sin)
    out = export_dflash(drafter, tmp_path / "drafter")
    written = json.loads((out / "config.json").read_text())
    assert written["rope_scaling"] == YARN
    # as for a target export: readers deriving YaRN's factor from max_position_embeddings / original agree
    # (the drafter wrote none: Qwen3Config's 32768 there, factor 512 instead of 4)
    assert written["max_position_embeddings"] == YARN["factor"] * YARN["original_max_position_embeddings"]
    assert load_dflash(out, target).config == config


@pytest.mark.parametrize("field", ["rope_theta", "rms_norm_eps"])
def test_a_decoder_config_refuses_an_infinite_rope_theta_or_norm_eps(field: str) -> None:
    with pytest.raises(ValueError, match=rf"DecoderConfig.{field} must be positive and finite, got inf"):
        DecoderConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4, num_kv_heads=2,
                      head_dim=8, **{field: float("inf")})
