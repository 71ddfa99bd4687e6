"""Local (no-communication) attention Function against the dense float64 reference: forward and
gradients at ``atol = rtol = 1e-10``, gradcheck, float32 at ``1e-5``."""

from __future__ import annotations

import math

import pytest
import torch

from csbp.attention.rows import Rows, allow_matrix
from csbp.attention.transports.local import (
    LocalAttentionFn,
    build_local_attention_plan,
    local_attention,
    local_attention_forward,
)
from test_kernel import TOL32, TOL64, bd3_rows, random_qkv, reference_grads, with_dead

BLOCK = 4


def bp_only_rows(*, window: int | None = None) -> tuple[Rows, int]:
    """A BP-only rank: noisy blocks 1 and 3 (L = 16, B = 4) and the clean prefix up to block 3."""
    noisy = [4, 5, 6, 7, 12, 13, 14, 15]
    return bd3_rows(noisy, list(range(16)), BLOCK, window=window), len(noisy)


def check_against_reference(
    attn: LocalAttentionFn, rows: Rows, key_rows: Rows, causal: bool, seed: int
) -> None:
    q, k, v = random_qkv(len(rows), len(key_rows), seed=seed)
    dout = torch.randn_like(q)
    allow = allow_matrix(rows, key_rows, causal_in_block=causal)
    out_ref, lse_ref, grads_ref = reference_grads(q, k, v, allow, 1 / math.sqrt(q.shape[-1]), dout)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = attn(*leaves, 0)
    (out * dout).sum().backward()
    torch.testing.assert_close(out.detach(), out_ref, **TOL64)
    for leaf, grad_ref in zip(leaves, grads_ref):
        torch.testing.assert_close(leaf.grad, grad_ref, **TOL64)
    _, lse = local_attention_forward(q, k, v, attn.plan)
    torch.testing.assert_close(lse, lse_ref, **TOL64)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [None, 6])
def test_block_diagonal_fast_path_matches_dense_reference(causal: bool, window: int | None) -> None:
    rows, num_noisy = bp_only_rows(window=window)
    attn = LocalAttentionFn(rows, num_noisy=num_noisy, causal_in_block=causal, tile_rows=4)
    assert attn.plan.block_size == BLOCK
    assert attn.plan.interval_plan.tile_plan.num_keys == len(rows) - num_noisy  # clean keys only
    check_against_reference(attn, rows, rows, causal, seed=1)


@pytest.mark.parametrize(
    "case", ["partial_block", "dead_noisy_row", "repeated_block", "no_noisy_rows", "only_noisy_rows"]
)
def test_interval_only_layouts_match_dense_reference(case: str) -> None:
    if case == "partial_block":
        rows, num_noisy = bd3_rows([4, 5, 6, 7, 12, 13], list(range(16)), BLOCK), 6
    elif case == "dead_noisy_row":
        rows, num_noisy = with_dead(bp_only_rows()[0], [2, 9]), 8
    elif case == "repeated_block":
        rows, num_noisy = bd3_rows([4, 5, 12, 13, 6, 7, 14, 15], list(range(16)), BLOCK), 8
    elif case == "no_noisy_rows":
        rows, num_noisy = bd3_rows([], list(range(12)), BLOCK), 0
    else:
        rows, num_noisy = bd3_rows(list(range(8)), [], BLOCK), 8
    attn = LocalAttentionFn(rows, num_noisy=num_noisy, tile_rows=3)
    expected_block = BLOCK if case == "only_noisy_rows" else None
    assert attn.plan.block_size == expected_block
    check_against_reference(attn, rows, rows, causal=False, seed=2)


def test_causal_blocks_out_of_position_order_take_the_interval_path() -> None:
    """Causal attention inside a block follows positions, not row order: whole blocks whose rows are
    not in increasing position order must not take the block-diagonal path (its triangle is by row)."""
    rows = bd3_rows([7, 6, 5, 4, 12, 14, 13, 15], list(range(16)), BLOCK)
    attn = LocalAttentionFn(rows, num_noisy=8, causal_in_block=True, tile_rows=4)
    assert attn.plan.block_size is None
    check_against_reference(attn, rows, rows, causal=True, seed=3)
    assert LocalAttentionFn(rows, num_noisy=8, causal_in_block=False).plan.block_size == BLOCK


def test_separate_key_rows_match_dense_reference() -> None:
    """DFlash-like: queries are draft blocks, keys are ``[context (clean) ; draft rows]``."""
    draft = bd3_rows([8, 9, 10, 11, 12, 13, 14, 15], [], BLOCK)
    context = bd3_rows([], list(range(12)), BLOCK)
    key_rows = Rows.cat([context, draft])
    attn = LocalAttentionFn(draft, num_noisy=len(draft), key_rows=key_rows, causal_in_block=True)
    assert attn.plan.block_size is None
    check_against_reference(attn, draft, key_rows, causal=True, seed=3)


def test_gradcheck_tiny_case() -> None:
    rows = bd3_rows([2, 3, 4, 5], [0, 1, 2, 3], 2)
    plan = build_local_attention_plan(rows, num_noisy=4, tile_rows=2)
    assert plan.block_size == 2
    q, k, v = (
        t.requires_grad_(True)
        for t in random_qkv(len(rows), len(rows), heads=2, kv_heads=1, dim=2, samples=1, seed=4)
    )
    assert torch.autograd.gradcheck(lambda q, k, v: local_attention(q, k, v, plan), (q, k, v))


def test_float32_and_bfloat16_agree_with_float64() -> None:
    rows, num_noisy = bp_only_rows()
    attn = LocalAttentionFn(rows, num_noisy=num_noisy)
    q, k, v = random_qkv(len(rows), len(rows), seed=5)
    dout = torch.randn_like(q)
    results = {}
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        leaves = [t.detach().to(dtype).requires_grad_(True) for t in (q, k, v)]
        out = attn(*leaves)
        (out * dout.to(dtype)).sum().backward()
        assert out.dtype == dtype and all(leaf.grad.dtype == dtype for leaf in leaves)
        results[dtype] = [out.detach().double()] + [leaf.grad.double() for leaf in leaves]
    for low, high in zip(results[torch.float32], results[torch.float64]):
        torch.testing.assert_close(low, high, **TOL32)
    for low, high in zip(results[torch.bfloat16], results[torch.float64]):
        torch.testing.assert_close(low, high, atol=6e-2, rtol=6e-2)


def test_bf16_attention_saves_its_output_in_bf16_for_the_backward() -> None:
    """The merge runs in fp32, but the backward keeps ``out`` as returned (bf16, as FlashAttention does):
    no fp32 copy of every layer's attention output waits for the backward; only the lse is fp32."""
    rows, num_noisy = bp_only_rows()
    attn = LocalAttentionFn(rows, num_noisy=num_noisy)
    q, k, v = (t.to(torch.bfloat16).requires_grad_(True) for t in random_qkv(len(rows), len(rows), seed=6))
    out = attn(q, k, v)
    saved = out.grad_fn.saved_tensors
    assert [t.dtype for t in saved] == [torch.bfloat16] * 4 + [torch.float32]  # q, k, v, out; lse
    assert saved[3].data_ptr() == out.data_ptr()  # the output itself, no copy


def test_invalid_plans_raise() -> None:
    rows, num_noisy = bp_only_rows()
    with pytest.raises(ValueError, match="num_noisy"):
        build_local_attention_plan(rows, num_noisy=len(rows) + 1)
    with pytest.raises(ValueError, match="packed"):
        build_local_attention_plan(rows, num_noisy=num_noisy - 1)
    attn = LocalAttentionFn(rows, num_noisy=num_noisy)
    q, k, v = random_qkv(len(rows), len(rows) - 1)
    with pytest.raises(ValueError, match="rows"):
        attn(q, k, v)
