"""bf16 autocast must not lower the attention precision (issue 7, defect 2).

The transports' autograd Function (``TransportFunction``) and the DFlash draft attention compute in
their accumulation dtype (fp32 for bf16 / fp32 inputs) in forward *and* backward, with or without
``torch.autocast``: under CPU autocast to bf16 the results are bit-identical to the same call
without autocast, and fp32 inputs stay within fp32 error of the float64 reference (autocast would
otherwise run the forward's score matmuls in bf16, ~1e-2 relative error, while the backward
recomputes them in fp32)."""

from __future__ import annotations

import math

import pytest
import torch

from csbp.attention.rows import allow_matrix
from csbp.attention.transports.local import LocalAttentionFn
from csbp.dflash.attention import ShardedDraftAttention, build_draft_attention_plan, dense_draft_masks
from csbp.dflash.layouts import AnchorPacket, block_query_rows, context_rows
from csbp.models.attention_fns import masked_attention
from test_kernel import bd3_rows, random_qkv, reference_grads

BF16_AUTOCAST = {"device_type": "cpu", "dtype": torch.bfloat16}


def _local_attention() -> tuple[LocalAttentionFn, torch.Tensor]:
    noisy = [4, 5, 6, 7, 12, 13, 14, 15]
    rows = bd3_rows(noisy, list(range(16)), 4)
    return LocalAttentionFn(rows, num_noisy=len(noisy), tile_rows=4), allow_matrix(rows, rows)


def _run(fn, inputs: list[torch.Tensor], dout: torch.Tensor, autocast: bool):  # noqa: ANN001, ANN202
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    with torch.autocast(**BF16_AUTOCAST, enabled=autocast):
        out = fn(*leaves)
    (out.float() * dout).sum().backward()
    return out.detach(), [leaf.grad for leaf in leaves]


def _rel(value: torch.Tensor, ref: torch.Tensor) -> float:
    return float((value.double() - ref).abs().max() / ref.abs().max())


def test_local_attention_under_autocast_equals_no_autocast_for_bf16_inputs() -> None:
    attn, _ = _local_attention()
    q, k, v = (t.to(torch.bfloat16) for t in random_qkv(24, 24, seed=3))
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(4))
    fn = lambda q, k, v: attn(q, k, v, 0)  # noqa: E731
    out_plain, grads_plain = _run(fn, [q, k, v], dout, autocast=False)
    out_auto, grads_auto = _run(fn, [q, k, v], dout, autocast=True)
    assert torch.equal(out_auto, out_plain)
    for grad_auto, grad_plain in zip(grads_auto, grads_plain):
        assert torch.equal(grad_auto, grad_plain)


def test_local_attention_keeps_fp32_precision_under_bf16_autocast() -> None:
    attn, allow = _local_attention()
    q, k, v = random_qkv(24, 24, seed=5)
    dout = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    out_ref, _, grads_ref = reference_grads(q, k, v, allow, 1 / math.sqrt(q.shape[-1]), dout)
    fn = lambda q, k, v: attn(q, k, v, 0)  # noqa: E731
    out, grads = _run(fn, [t.float() for t in (q, k, v)], dout.float(), autocast=True)
    assert out.dtype == torch.float32
    # bf16 score matmuls give ~1e-2 here; fp32 accumulation gives ~1e-7
    assert _rel(out, out_ref) < 1e-5
    for grad, grad_ref in zip(grads, grads_ref):
        assert _rel(grad, grad_ref) < 1e-5


def _draft_case():  # noqa: ANN202
    packet = AnchorPacket(
        torch.arange(3), torch.tensor([3, 4, 9]), torch.tensor([0, 0, 6]), torch.tensor([True, True, False])
    )
    rows = block_query_rows(packet, 4, context="strict")
    keys = context_rows(torch.arange(16))
    plan = build_draft_attention_plan([rows], [False], [0], keys, block_size=4, comm=None)
    gen = torch.Generator().manual_seed(7)
    shapes = [(1, 4, 12, 8), (1, 2, 16, 8), (1, 2, 16, 8), (1, 2, 12, 8), (1, 2, 12, 8)]
    inputs = [torch.randn(shape, generator=gen, dtype=torch.float64) for shape in shapes]
    return ShardedDraftAttention(plan), dense_draft_masks([rows], [False], keys)[0], inputs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dflash_draft_attention_under_autocast(dtype: torch.dtype) -> None:
    attn, mask, inputs = _draft_case()
    dout = torch.randn(1, 4, 12, 8, generator=torch.Generator().manual_seed(8))
    fn = lambda *t: attn(*t, 0)  # noqa: E731
    out_auto, grads_auto = _run(fn, [t.to(dtype) for t in inputs], dout, autocast=True)
    if dtype == torch.bfloat16:
        out_plain, grads_plain = _run(fn, [t.to(dtype) for t in inputs], dout, autocast=False)
        assert torch.equal(out_auto, out_plain)
        for grad_auto, grad_plain in zip(grads_auto, grads_plain):
            assert torch.equal(grad_auto, grad_plain)
        return
    leaves = [t.clone().requires_grad_(True) for t in inputs]
    q, k_ctx, v_ctx, k_blk, v_blk = leaves
    out_ref = masked_attention(q, torch.cat((k_ctx, k_blk), 2), torch.cat((v_ctx, v_blk), 2), mask)
    (out_ref * dout.double()).sum().backward()
    assert _rel(out_auto, out_ref.detach()) < 1e-5
    for grad, leaf in zip(grads_auto, leaves):
        assert _rel(grad, leaf.grad) < 1e-5
