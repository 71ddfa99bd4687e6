"""DFlash drafter model: configuration defaults and validation, frozen shared target modules, the
golden masks of objectives.md §5.5 through ``Rows``, train/inference parity (§12 test 4, with an
incremental cache), leakage (§12 test 5) and the DFlash2 convolution (identity start, block-local
taps), and the drafter against an independent transcription of the §5.2 layer formulas. Float64,
tiny shapes; tolerances are stated per assertion."""

from __future__ import annotations

import pytest
import torch

from csbp.dflash.attention import DenseDraftAttention, UnmaskedDraftAttention, dense_draft_masks
from csbp.dflash.config import DFlashConfig, default_target_layer_ids, validate_drafter_target
from csbp.dflash.dflash2 import block_conv
from csbp.dflash.drafter import DFlashDrafter, DraftContextCache
from csbp.dflash.features import capture_target_features
from csbp.dflash.layouts import AnchorPacket, block_query_rows, context_rows
from csbp.dflash.reference import reference_mask
from csbp.dflash.step import forward_packet
from csbp.dflash.verify import TARGET_CONFIG, build_models, make_batch
from csbp.dflash.verify import DFlashVerifyCase as Case
from csbp.models.config import DecoderConfig
from csbp.models.decoder import Decoder

GOLDEN_FULL = """
11......1111....
11......1111....
11......1111....
11......1111....
11111.......1111
11111.......1111
11111.......1111
11111.......1111
"""
GOLDEN_SLIDING_W3 = """
11......1.......
.1......11......
........111.....
........1111....
...11.......1...
....1.......11..
............111.
............1111
"""


def _matrix(text: str) -> torch.Tensor:
    return torch.tensor([[c == "1" for c in line] for line in text.split()], dtype=torch.bool)


def _packet(
    anchors: list[int], keep: list[bool] | None = None, doc_start: list[int] | None = None
) -> AnchorPacket:
    n = len(anchors)
    return AnchorPacket(
        torch.arange(n),
        torch.tensor(anchors),
        torch.tensor(doc_start or [0] * n),
        torch.tensor(keep or [True] * n),
    )


def test_default_target_layer_ids_match_published_configs() -> None:
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(64, 5) == (1, 16, 31, 46, 61)
    assert default_target_layer_ids(40, 5) == (1, 10, 19, 28, 37)
    assert default_target_layer_ids(36, 1) == (18,)
    # Exact halves round to even, as the public readers' Python round() does (a checkpoint without
    # dflash_config.target_layer_ids is read with these): 26.5 -> 26, 16.5 -> 16, 4.5 -> 4.
    assert default_target_layer_ids(38, 5) == (1, 10, 18, 26, 35)
    assert default_target_layer_ids(35, 3) == (1, 16, 32)
    assert default_target_layer_ids(32, 9) == (1, 4, 8, 12, 15, 18, 22, 26, 29)
    with pytest.raises(ValueError, match="target_layer_ids"):
        default_target_layer_ids(4, 3)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"mask_token_id": 64}, "mask_token_id"),
        ({"target_layer_ids": (0, 4)}, "target_layer_ids"),
        ({"layer_types": ("sliding_attention", "full_attention")}, "sliding_window"),
        ({"conv_kernel_size": 2, "conv_group_size": 5}, "conv_group_size"),
    ],
)
def test_config_rejects_bad_fields(options: dict, match: str) -> None:
    base = {"num_layers": 2, "block_size": 4, "mask_token_id": 63, "target_layer_ids": (0, 2)}
    with pytest.raises(ValueError, match=match):
        DFlashConfig.from_target(TARGET_CONFIG, **{**base, **options})


def test_target_mismatches_are_rejected() -> None:
    config = DFlashConfig.from_target(
        TARGET_CONFIG, num_layers=2, block_size=4, mask_token_id=63, target_layer_ids=(0, 3)
    )
    fields = TARGET_CONFIG.__dict__
    for change, match in (
        ({"hidden_size": 64}, "hidden_size"),
        ({"vocab_size": 128}, "vocab_size"),
        ({"num_layers": 3}, "num_target_layers"),
    ):
        with pytest.raises(ValueError, match=match):
            validate_drafter_target(config, DecoderConfig(**{**fields, **change}))
    with pytest.raises(ValueError, match="hidden_size"):
        DFlashDrafter(
            config, target=Decoder(DecoderConfig(**{**fields, "hidden_size": 64, "intermediate_size": 64}))
        )


def test_shared_modules_are_frozen_and_not_parameters() -> None:
    target, drafter = build_models(Case())
    names = set(dict(drafter.named_parameters()))
    assert not any("embed" in n or "lm_head" in n for n in names | set(drafter.state_dict()))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.k_norm.weight"} <= names
    assert not any(p.requires_grad for p in target.parameters())
    assert drafter.lm_head_weight is target.lm_head_weight


def test_golden_masks_through_rows() -> None:
    packet = _packet([2, 5])
    keys = context_rows(torch.arange(8))
    full = block_query_rows(packet, 4, context="strict")
    sliding = block_query_rows(packet, 4, context="strict", window=3)
    dense_full, dense_sliding = dense_draft_masks([full, sliding], [False, True], keys)
    assert torch.equal(dense_full, _matrix(GOLDEN_FULL))
    assert torch.equal(dense_sliding, _matrix(GOLDEN_SLIDING_W3))
    anchors, starts = torch.tensor([2, 5]), torch.zeros(2, dtype=torch.long)
    assert torch.equal(reference_mask(8, anchors, starts, 4), _matrix(GOLDEN_FULL))
    assert torch.equal(
        reference_mask(8, anchors, starts, 4, window=3, causal_in_block=True), _matrix(GOLDEN_SLIDING_W3)
    )
    inclusive = dense_draft_masks([block_query_rows(packet, 4, context="inclusive")], [False], keys)[0]
    assert torch.equal(inclusive[:, :8].sum(1), torch.tensor([3] * 4 + [6] * 4))


def _training_hidden(
    drafter: DFlashDrafter, tokens: torch.Tensor, features: torch.Tensor, packet: AnchorPacket
):
    length = tokens.shape[0]
    positions = torch.arange(length)
    return forward_packet(drafter, tokens, packet, features[None], positions, context_rows(positions))[0]


def _inference_hidden(drafter, tokens, features, anchor, cache=None, new_from=0):  # noqa: ANN001, ANN202
    block = drafter.config.block_size
    ids = drafter.block_input_ids(tokens[anchor].view(1))
    positions = torch.arange(new_from, anchor)
    return drafter(
        drafter.embed(ids[None]),
        anchor + torch.arange(block),
        features[None, new_from:anchor],
        positions,
        UnmaskedDraftAttention(),
        cache=cache,
    )[0]


def test_train_inference_parity_with_overlapping_anchors_and_cache() -> None:
    target, drafter = build_models(Case())
    batch = make_batch(1, 16)
    tokens = batch.input_ids[0]
    features = capture_target_features(target, batch.input_ids, (0, 2)).features[0]
    anchors = [3, 4, 9]
    train = _training_hidden(drafter, tokens, features, _packet(anchors)).view(3, 4, -1)
    logits = drafter.logits(train)
    for n, anchor in enumerate(anchors):  # stateless inference: context F[:a], no mask
        expected = drafter.logits(_inference_hidden(drafter, tokens, features, anchor))
        torch.testing.assert_close(logits[n], expected, rtol=0, atol=1e-12)
    cache = DraftContextCache()  # two rounds, cropping after each (the draft cache keeps context only)
    round_one = _inference_hidden(drafter, tokens, features, 3, cache=cache, new_from=0)
    round_two = _inference_hidden(drafter, tokens, features, 9, cache=cache, new_from=3)
    torch.testing.assert_close(drafter.logits(round_one), logits[0], rtol=0, atol=1e-12)
    torch.testing.assert_close(drafter.logits(round_two), logits[2], rtol=0, atol=1e-12)
    cache.crop(4)  # rejected drafts: roll the context back to positions < 4
    round_three = _inference_hidden(drafter, tokens, features, 4, cache=cache, new_from=4)
    torch.testing.assert_close(drafter.logits(round_three), logits[1], rtol=0, atol=1e-12)
    assert len(cache) == 4 and torch.equal(cache.positions, torch.arange(4))


def test_leakage_future_features_other_and_dead_blocks() -> None:
    target, drafter = build_models(Case())
    batch = make_batch(1, 16)
    tokens = batch.input_ids[0]
    features = capture_target_features(target, batch.input_ids, (0, 2)).features[0]
    packet = _packet([3, 4, 9, 0], keep=[True, True, True, False])
    base = _training_hidden(drafter, tokens, features, packet).view(4, 4, -1)
    assert torch.isfinite(base).all() and torch.equal(base[3], torch.zeros_like(base[3]))
    future = features.clone()
    future[4:] += torch.randn(
        future[4:].shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64
    )
    moved = _training_hidden(drafter, tokens, future, packet).view(4, 4, -1)
    torch.testing.assert_close(moved[1], base[1], rtol=0, atol=0)  # anchor 4 sees F[:4] only
    torch.testing.assert_close(moved[0], base[0], rtol=0, atol=0)
    assert (moved[2] - base[2]).abs().max() > 1e-3  # anchor 9 does see F[4:9]
    other = tokens.clone()
    other[9] = (other[9] + 1) % 60  # the anchor token of block 2 (another block's embedding)
    dead = _packet([3, 4, 9, 7], keep=[True, True, True, False])  # a different dead block
    changed = _training_hidden(drafter, other, features, dead).view(4, 4, -1)
    torch.testing.assert_close(changed[:2], base[:2], rtol=0, atol=0)
    assert torch.equal(changed[3], torch.zeros_like(changed[3]))
    # Overlapping blocks (objectives.md §9 pitfall 3): block 0 covers positions 3-6 and block 1 covers
    # 4-7, so visibility by position would let block 0 see block 1's anchor row (position 4).
    overlap = tokens.clone()
    overlap[4] = (overlap[4] + 1) % 60  # block 1's anchor token, inside block 0's span
    shifted = _training_hidden(drafter, overlap, features, packet).view(4, 4, -1)
    torch.testing.assert_close(shifted[0], base[0], rtol=0, atol=0)
    torch.testing.assert_close(shifted[2], base[2], rtol=0, atol=0)
    assert (shifted[1] - base[1]).abs().max() > 1e-3  # block 1 does see its own anchor


def test_fresh_dflash2_equals_dflash_and_conv_stays_in_block() -> None:
    target, plain = build_models(Case())
    _, dflash2 = build_models(
        Case(drafter_options={"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 4})
    )
    batch = make_batch(1, 16)
    features = capture_target_features(target, batch.input_ids, (0, 2)).features[0]
    packet = _packet([3, 4, 9])
    a = _training_hidden(plain, batch.input_ids[0], features, packet)
    b = _training_hidden(dflash2, batch.input_ids[0], features, packet)
    assert torch.equal(a, b)
    _, moved = build_models(
        Case(drafter_options={"conv_kernel_size": 2, "conv_group_size": 8}, perturb_extras=True)
    )
    assert (_training_hidden(moved, batch.input_ids[0], features, packet) - a).abs().max() > 1e-3

    generator = torch.Generator().manual_seed(1)
    z = torch.randn(1, 8, 16, generator=generator, dtype=torch.float64)
    kappa = torch.randn(1, 8, 2, 16, generator=generator, dtype=torch.float64)
    out = block_conv(z, kappa, 4)
    z_moved = z.clone()
    z_moved[0, 3] += 1.0  # last row of block 0
    out_moved = block_conv(z_moved, kappa, 4)
    torch.testing.assert_close(out_moved[0, 4:], out[0, 4:], rtol=0, atol=0)  # block 1 untouched
    expected_row_1 = kappa[0, 1, 0] * z[0, 1] + kappa[0, 1, 1] * z[0, 0]
    torch.testing.assert_close(out[0, 1], expected_row_1, rtol=0, atol=1e-15)
    torch.testing.assert_close(out[0, 4], kappa[0, 4, 0] * z[0, 4], rtol=0, atol=1e-15)  # no tap from block 0


def test_dense_attention_matches_sharded_training_path() -> None:
    target, drafter = build_models(
        Case(drafter_options={"layer_types": ("sliding_attention", "full_attention"), "sliding_window": 3})
    )
    batch = make_batch(1, 16)
    features = capture_target_features(target, batch.input_ids, (0, 2)).features[0]
    packet = _packet([3, 4, 9], doc_start=[0, 0, 6])
    keys = context_rows(torch.arange(16))
    rows = [
        block_query_rows(packet, 4, context="strict", window=3),
        block_query_rows(packet, 4, context="strict"),
    ]
    dense = DenseDraftAttention(dense_draft_masks(rows, [True, False], keys))
    ids = drafter.block_input_ids(batch.input_ids[0][packet.anchors])
    expected = drafter(drafter.embed(ids[None]), rows[0].pos, features[None], torch.arange(16), dense)[0]
    torch.testing.assert_close(
        _training_hidden(drafter, batch.input_ids[0], features, packet), expected, rtol=0, atol=1e-12
    )


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """HF rotate-half RoPE on ``[heads, rows, d]`` at ``positions [rows]``."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (torch.arange(half, dtype=torch.float64) * 2 / x.shape[-1])
    angles = positions.double()[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _section_5_2_block(drafter: DFlashDrafter, block_embeds: torch.Tensor, anchor: int, features: torch.Tensor):
    """One block's final hidden states written from objectives.md §5.2 with explicit tensors: the
    fused context ``C = RMSNorm(F·W_fc)`` (positions ``0 … a−1``) is NOT passed through
    ``input_layernorm`` and is projected by every layer's own ``W_k``/``k_norm``/``W_v``; the block
    rows (positions ``a … a+B−1``) attend to ``[C ; block]`` without a mask."""
    cfg = drafter.config
    eps, heads, kv_heads, d = cfg.rms_norm_eps, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    ctx_pos, blk_pos = torch.arange(anchor), anchor + torch.arange(cfg.block_size)
    context = _rms(features[:anchor] @ drafter.fc.weight.t(), drafter.hidden_norm.weight, eps)
    h = block_embeds
    for layer in drafter.layers:
        attn = layer.self_attn
        g = _rms(h, layer.input_layernorm.weight, eps)
        q = (g @ attn.q_proj.weight.t()).view(-1, heads, d).transpose(0, 1)
        q = _rope(_rms(q, attn.q_norm.weight, eps), blk_pos, cfg.rope_theta)
        kv_in = torch.cat([context, g])
        k = (kv_in @ attn.k_proj.weight.t()).view(-1, kv_heads, d).transpose(0, 1)
        k = _rope(_rms(k, attn.k_norm.weight, eps), torch.cat([ctx_pos, blk_pos]), cfg.rope_theta)
        v = (kv_in @ attn.v_proj.weight.t()).view(-1, kv_heads, d).transpose(0, 1)
        k, v = k.repeat_interleave(heads // kv_heads, 0), v.repeat_interleave(heads // kv_heads, 0)
        probs = torch.softmax(q @ k.transpose(1, 2) / d**0.5, dim=-1)
        h = h + (probs @ v).transpose(0, 1).reshape(cfg.block_size, heads * d) @ attn.o_proj.weight.t()
        m = _rms(h, layer.post_attention_layernorm.weight, eps)
        mlp = layer.mlp
        gate = torch.nn.functional.silu(m @ mlp.gate_proj.weight.t()) * (m @ mlp.up_proj.weight.t())
        h = h + gate @ mlp.down_proj.weight.t()
    return _rms(h, drafter.norm.weight, eps)


def test_drafter_equals_the_formulas_of_section_5_2() -> None:
    """The drafter's own layer math against an independent transcription of objectives.md §5.2
    (the parity tests above compare the drafter with itself under two masks). Every weight, the
    RMSNorm scales included (1 at initialisation), is perturbed so a norm applied to the wrong
    stream, a context projected by other weights or a RoPE at other positions shows. Float64, 1e-12."""
    target, drafter = build_models(Case())
    generator = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for param in drafter.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=generator, dtype=torch.float64))
    batch = make_batch(1, 16)
    tokens = batch.input_ids[0]
    features = capture_target_features(target, batch.input_ids, (0, 2)).features[0]
    assert drafter.layers[0].self_attn.q_norm is not None  # the tiny target is Qwen3-like
    with torch.no_grad():
        for anchor in (1, 6, 11):
            embeds = drafter.embed(drafter.block_input_ids(tokens[anchor].view(1))[None])[0]
            expected = _section_5_2_block(drafter, embeds, anchor, features)
            got = _inference_hidden(drafter, tokens, features, anchor)
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
            train = _training_hidden(drafter, tokens, features, _packet([anchor]))
            torch.testing.assert_close(train, expected, rtol=0, atol=1e-12)
