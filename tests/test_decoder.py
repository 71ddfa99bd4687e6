"""Decoder, RoPE and single-process attention callables (``csbp.models``), without transformers.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_decoder.py -q``
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from csbp.models import (
    CausalAttention,
    Decoder,
    DecoderConfig,
    DenseMaskAttention,
    masked_attention,
    rotary_tables,
)

VOCAB = 64


def tiny_config(**overrides: object) -> DecoderConfig:
    fields: dict[str, object] = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rope_theta=5000.0,
    )
    fields.update(overrides)
    return DecoderConfig(**fields)  # type: ignore[arg-type]


def random_model(config: DecoderConfig, dtype: torch.dtype = torch.float64, seed: int = 0) -> Decoder:
    """A decoder with non-trivial norm weights and O(1) activations, so every parameter matters."""
    model = Decoder(config, dtype=dtype, seed=seed)
    generator = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float64).to(dtype)
            param.copy_(1.0 + 0.2 * noise if "norm" in name else 0.15 * noise)
    return model


def random_ids(num_samples: int, num_rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (num_samples, num_rows), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"num_heads": 6, "num_kv_heads": 4}, "num_heads"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"head_dim": 7}, "head_dim"),
        ({"rope_theta": -1.0}, "rope_theta"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
        ({"arch": "gemma"}, "arch"),
        ({"vocab_size": 3.5}, "vocab_size"),
        ({"qk_norm": 1}, "qk_norm"),
    ],
)
def test_config_rejects_invalid_fields(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=f"DecoderConfig.{field}"):
        tiny_config(**overrides)


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize(
    ("qk_norm", "attention_bias", "mlp_bias"), [(True, False, False), (False, True, True)]
)
def test_num_parameters_is_exact(tie: bool, qk_norm: bool, attention_bias: bool, mlp_bias: bool) -> None:
    config = tiny_config(
        tie_embeddings=tie, qk_norm=qk_norm, attention_bias=attention_bias, mlp_bias=mlp_bias, head_dim=12
    )
    model = Decoder(config, device="meta")
    assert config.num_parameters() == sum(p.numel() for p in model.parameters())
    embeddings = config.vocab_size * config.hidden_size * (1 if tie else 2)
    assert config.num_parameters(include_embeddings=False) == config.num_parameters() - embeddings


def test_rope_theta_is_coerced_to_float() -> None:
    assert isinstance(tiny_config(rope_theta=1000000).rope_theta, float)


# ----------------------------------------------------------------------------- init


def test_init_is_deterministic_zero_free_and_dtype_independent() -> None:
    config = tiny_config(attention_bias=True, mlp_bias=True)
    a, b = Decoder(config, seed=3), Decoder(config, seed=3)
    other = Decoder(config, seed=4)
    wide = Decoder(config, seed=3, dtype=torch.float64)
    for (name, pa), pb, po, pw in zip(
        a.named_parameters(), b.parameters(), other.parameters(), wide.parameters()
    ):
        assert torch.equal(pa, pb), name
        assert torch.equal(pw, pa.double()), name  # same draws whatever the dtype
        assert (pa != 0).all(), f"{name} has zero entries"
        if "norm" in name:
            assert torch.equal(pa, torch.ones_like(pa))
        else:
            assert not torch.equal(pa, po), name
            assert abs(pa.std().item() - 0.02) < 0.01, name


def test_tied_head_is_the_embedding() -> None:
    model = Decoder(tiny_config(tie_embeddings=True))
    assert model.lm_head is None and model.lm_head_weight is model.embed_tokens.weight
    hidden = torch.randn(1, 3, 32)
    torch.testing.assert_close(model.logits(hidden), hidden @ model.embed_tokens.weight.T, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- attention from outside


def test_dense_causal_mask_equals_causal_attention() -> None:
    model = random_model(tiny_config(num_layers=3))
    ids, num_rows = random_ids(2, 9), 9
    positions = torch.arange(num_rows)
    reference = model(ids, positions, CausalAttention())
    causal = torch.tril(torch.ones(num_rows, num_rows, dtype=torch.bool))
    torch.testing.assert_close(
        model(ids, positions, DenseMaskAttention(causal)), reference, rtol=0, atol=1e-12
    )
    torch.testing.assert_close(
        model(ids, positions, CausalAttention(positions)), reference, rtol=0, atol=1e-12
    )
    # a different mask must change the result (the callable is really used)
    full = torch.ones(num_rows, num_rows, dtype=torch.bool)
    assert (model(ids, positions, DenseMaskAttention(full)) - reference).abs().max() > 1e-3


def test_shifting_all_positions_leaves_logits_unchanged() -> None:
    model = random_model(tiny_config(tie_embeddings=True))
    ids = random_ids(2, 8)
    positions = torch.arange(8)
    reference = model.logits(model(ids, positions, CausalAttention()))
    shifted = model.logits(model(ids, positions + 1000, CausalAttention()))
    torch.testing.assert_close(shifted, reference, rtol=0, atol=1e-9)
    # a non-uniform change of positions changes the logits
    stretched = model.logits(model(ids, 2 * positions, CausalAttention()))
    assert (stretched - reference).abs().max() > 1e-3


def test_permuted_rows_with_explicit_positions_give_permuted_outputs() -> None:
    model = random_model(tiny_config(num_layers=3))
    ids = random_ids(2, 10)
    positions = torch.arange(10)
    reference = model(ids, positions, CausalAttention())
    order = torch.randperm(10, generator=torch.Generator().manual_seed(5))
    permuted = model(ids[:, order], positions[order], CausalAttention(positions[order]))
    torch.testing.assert_close(permuted, reference[:, order], rtol=0, atol=1e-12)


def test_per_sample_positions_match_separate_runs() -> None:
    model = random_model(tiny_config())
    ids = random_ids(2, 6)
    positions_SN = torch.tensor([[0, 1, 2, 3, 4, 5], [7, 9, 10, 12, 13, 20]])
    together = model(ids, positions_SN, CausalAttention())
    for s in range(2):
        alone = model(ids[s : s + 1], positions_SN[s], CausalAttention())
        torch.testing.assert_close(together[s : s + 1], alone, rtol=0, atol=1e-12)


def test_input_embeds_equal_input_ids() -> None:
    model = random_model(tiny_config())
    ids, positions = random_ids(1, 5), torch.arange(5)
    by_ids = model(ids, positions, CausalAttention())
    by_embeds = model(None, positions, CausalAttention(), input_embeds=model.embed(ids))
    torch.testing.assert_close(by_embeds, by_ids, rtol=0, atol=0)
    with pytest.raises(ValueError, match="exactly one"):
        model(ids, positions, CausalAttention(), input_embeds=model.embed(ids))


def test_kv_extra_equals_attention_over_concatenated_rows() -> None:
    """Extra K/V rows projected by the layer's own k/v/k_norm/RoPE equal running the attention module
    on ``[extra ; rows]`` and keeping the last rows' outputs (same mask restricted to those rows)."""
    config = tiny_config()
    attention_module = random_model(config).layers[1].self_attn
    num_extra, num_rows = 5, 4
    generator = torch.Generator().manual_seed(9)
    extra = torch.randn(2, num_extra, 32, generator=generator, dtype=torch.float64)
    rows = torch.randn(2, num_rows, 32, generator=generator, dtype=torch.float64)
    extra_pos, row_pos = torch.arange(num_extra), torch.tensor([3, 4, 5, 6])
    allow = torch.rand(num_extra + num_rows, num_extra + num_rows, generator=generator) < 0.6
    allow[:, num_extra] = True  # every row sees at least one key

    def tables(pos: torch.Tensor):
        return rotary_tables(pos, head_dim=8, theta=config.rope_theta, model_dtype=torch.float64)

    joint = attention_module(
        torch.cat([extra, rows], dim=1), tables(torch.cat([extra_pos, row_pos])), DenseMaskAttention(allow)
    )
    split = attention_module(
        rows,
        tables(row_pos),
        DenseMaskAttention(allow[num_extra:]),
        kv_extra=extra,
        kv_extra_rotary=tables(extra_pos),
    )
    torch.testing.assert_close(split, joint[:, num_extra:], rtol=0, atol=1e-12)
    layer = random_model(config).layers[0]
    with pytest.raises(ValueError, match="kv_extra_rotary"):
        layer(rows, tables(row_pos), CausalAttention(), kv_extra=extra)


def test_rows_without_visible_keys_are_zero_with_finite_gradients() -> None:
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 5, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, 6, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, 6, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    allow = torch.rand(2, 5, 6, generator=generator) < 0.5
    allow[0, 1] = False
    allow[1, 3] = False
    allow[:, 0, 0] = True
    out = masked_attention(q, k, v, allow)
    assert torch.equal(out[0, :, 1], torch.zeros_like(out[0, :, 1]))
    assert torch.equal(out[1, :, 3], torch.zeros_like(out[1, :, 3]))
    # reference for the live rows: explicit softmax with GQA head mapping h -> h // 2
    scores = torch.einsum("shnd,shkd->shnk", q, k.repeat_interleave(2, dim=1)) / 8**0.5
    scores = scores.masked_fill(~allow[:, None], float("-inf"))
    expected = torch.einsum(
        "shnk,shkd->shnd", torch.softmax(scores, -1).nan_to_num(0.0), v.repeat_interleave(2, dim=1)
    )
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    out.square().sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and torch.isfinite(t.grad).all()


def test_attention_callable_with_wrong_output_shape_is_rejected() -> None:
    model = Decoder(tiny_config())
    with pytest.raises(ValueError, match="attention callable returned shape"):
        model(random_ids(1, 4), torch.arange(4), lambda q, k, v, layer_index: q[:, :, :2])


def test_causal_attention_without_positions_needs_square_scores() -> None:
    q, kv = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match="as many keys as queries"):
        CausalAttention()(q, kv, kv, 0)


def test_attention_receives_layer_indices_in_order() -> None:
    model = Decoder(tiny_config(num_layers=3))
    seen: list[int] = []

    def recording_attention(q, k, v, layer_index):
        seen.append(layer_index)
        return CausalAttention()(q, k, v, layer_index)

    model(random_ids(1, 4), torch.arange(4), recording_attention)
    assert seen == [0, 1, 2]


# ----------------------------------------------------------------------------- RoPE, dtypes, gradients


def test_rope_is_a_rotation_and_identity_at_position_zero() -> None:
    x = torch.randn(1, 2, 3, 8, dtype=torch.float64)
    tables = rotary_tables(torch.tensor([0, 5, 123456]), head_dim=8, theta=10000.0, model_dtype=torch.float64)
    rotated = tables.apply(x)
    torch.testing.assert_close(rotated[:, :, 0], x[:, :, 0], rtol=0, atol=0)

    def pair_norms(t: torch.Tensor) -> torch.Tensor:  # channels i and i + d/2 rotate together
        return t[..., :4] ** 2 + t[..., 4:] ** 2

    torch.testing.assert_close(pair_norms(rotated), pair_norms(x), rtol=0, atol=1e-12)
    # channel 0 rotates by exactly the position (frequency theta**0 = 1)
    angle = torch.atan2(rotated[0, 0, 1, 4], rotated[0, 0, 1, 0]) - torch.atan2(x[0, 0, 1, 4], x[0, 0, 1, 0])
    assert abs(torch.remainder(angle - 5.0 + torch.pi, 2 * torch.pi).item() - torch.pi) < 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_models_track_float64(dtype: torch.dtype) -> None:
    config = tiny_config()
    wide = random_model(config, torch.float64)
    narrow = Decoder(config, dtype=dtype)
    narrow.load_state_dict({k: v.to(dtype) for k, v in wide.state_dict().items()})
    ids, positions = random_ids(2, 7), torch.arange(7)
    reference = wide.logits(wide(ids, positions, CausalAttention()))
    logits = narrow.logits(narrow(ids, positions, CausalAttention()))
    assert logits.dtype == dtype
    tolerance = 1e-5 if dtype == torch.float32 else 0.05
    scale = reference.abs().max().item()
    assert (logits.double() - reference).abs().max().item() < tolerance * max(scale, 1.0)


@pytest.mark.parametrize("tie", [False, True])
def test_every_parameter_receives_a_gradient(tie: bool) -> None:
    model = random_model(tiny_config(tie_embeddings=tie, attention_bias=True))
    hidden = model(random_ids(2, 6), torch.arange(6), CausalAttention())
    model.logits(hidden).logsumexp(-1).sum().backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


def test_shape_errors_name_the_argument() -> None:
    model = Decoder(tiny_config())
    with pytest.raises(ValueError, match="positions must be"):
        model(random_ids(2, 4), torch.arange(5), CausalAttention())
    with pytest.raises(ValueError, match="input_ids must be"):
        model(torch.zeros(4, dtype=torch.long), torch.arange(4), CausalAttention())
    with pytest.raises(ValueError, match="dtype"):
        Decoder(tiny_config(), dtype=torch.float16)
    with pytest.raises(ValueError, match="bool"):
        DenseMaskAttention(torch.ones(3, 3))
    assert dataclasses.is_dataclass(model.config)
