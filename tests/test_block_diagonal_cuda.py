"""The fused-SDPA block diagonal on CUDA (``make gpu-check``'s ``cuda-tests`` stage runs ``pytest -m
cuda``): FlashAttention-2 for bf16 (the ``flash`` kernel), the batched matmuls for fp32, forward and
backward through the merge with a tiles context partial against the CPU float64 reference; the
local transport decomposed with ``diagonal="sdpa"`` on ``auto`` (FlexAttention's clean interval
+ SDPA noisy blocks, bf16); DFlash's draft attention (dead anchors) with either diagonal. Flex is
compiled per shape, so only the transport test uses it (the stage has a time budget).

``CSBP_CUDA_TESTS_DEVICE=cpu`` runs the same bodies on the CPU (the ``cpu-flash`` kernel and the
tiles backend): a dry run of the test code where no GPU is lent; not part of the suite.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from csbp.attention.backends import plan_block_diagonal, plan_partial
from csbp.attention.block_diagonal_sdpa import SdpaBlockDiagonalPartial
from csbp.attention.merge import merge_partials
from csbp.attention.rows import allow_matrix
from csbp.attention.transports.local import LocalAttentionFn
from test_block_diagonal_sdpa import blocks_and_context
from test_flex_backend import CASES, B
from test_kernel import random_qkv, reference_grads

DEVICE = os.environ.get("CSBP_CUDA_TESTS_DEVICE", "cuda")
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile.*"),
]
TOL = {torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2}, torch.float32: {"atol": 2e-3, "rtol": 2e-3}}


def device_under_test() -> torch.device:
    """CUDA device 0, or the CPU for the dry run (``CSBP_CUDA_TESTS_DEVICE=cpu``)."""
    return torch.device("cuda", 0) if DEVICE == "cuda" else torch.device("cpu")


def _expected_kernel(dtype: torch.dtype) -> str:
    if device_under_test().type == "cpu":
        return "cpu-flash"
    return "flash" if dtype == torch.bfloat16 else "matmul"


@pytest.mark.parametrize(("dtype", "diagonal"), [(torch.bfloat16, "sdpa"), (torch.bfloat16, "sdpa_fold"),
                                               (torch.float32, "sdpa")], ids=["bf16", "bf16_fold", "fp32"])
@pytest.mark.parametrize("case", ["bd3", "bd3_causal", "dflash_dead_blocks"])
def test_sdpa_block_diagonal_through_the_merge_matches_the_cpu_float64_reference(
    case: str, dtype: torch.dtype, diagonal: str
) -> None:
    dev = device_under_test()
    blocks, context, causal = blocks_and_context(case)
    n_blk = len(blocks)
    q, k, v = random_qkv(n_blk, n_blk + len(context), heads=4, kv_heads=2, dim=64, samples=1, seed=11)
    dout = torch.randn(q.shape, dtype=q.dtype, generator=torch.Generator().manual_seed(12))
    allow = torch.cat([allow_matrix(blocks, blocks, causal_in_block=causal), allow_matrix(blocks, context)], dim=1)
    out_ref, lse_ref, grads_ref = reference_grads(q, k, v, allow, 1 / math.sqrt(q.shape[-1]), dout)

    blocks_d, context_d = blocks.to(dev), context.to(dev)
    block_plan = plan_block_diagonal(blocks_d, block_size=B, backend="auto", causal_in_block=causal, diagonal=diagonal)
    assert isinstance(block_plan, SdpaBlockDiagonalPartial)
    context_plan = plan_partial(blocks_d, context_d, backend="tiles")  # no Flex compile: the block partial is tested
    qd, kd, vd, doutd = (t.to(dev, dtype) for t in (q, k, v, dout))
    assert block_plan.kernel(qd) == _expected_kernel(dtype)
    kv_blk, kv_ctx = (kd[:, :, :n_blk], vd[:, :, :n_blk]), (kd[:, :, n_blk:], vd[:, :, n_blk:])
    out_blk, lse_blk = block_plan.forward(qd, *kv_blk)
    assert out_blk.dtype == lse_blk.dtype == torch.float32 and out_blk.device == dev
    out, lse = merge_partials(out_blk, lse_blk, *context_plan.forward(qd, *kv_ctx))
    dq_blk, dk_blk, dv_blk = block_plan.backward(qd, *kv_blk, out, lse, doutd)
    dq_ctx, dk_ctx, dv_ctx = context_plan.backward(qd, *kv_ctx, out, lse, doutd)
    torch.testing.assert_close(out.cpu().double(), out_ref, **TOL[dtype])
    finite = torch.isfinite(lse_ref)
    torch.testing.assert_close(lse.cpu().double()[finite], lse_ref[finite], **TOL[dtype])
    assert bool(torch.isneginf(lse.cpu()[~finite]).all())
    grads = (dq_blk + dq_ctx, torch.cat([dk_blk, dk_ctx], 2), torch.cat([dv_blk, dv_ctx], 2))
    for got, want in zip(grads, grads_ref):
        assert got.dtype == torch.float32 and bool(torch.isfinite(got).all())
        torch.testing.assert_close(got.cpu().double(), want, **TOL[dtype])


def test_local_transport_decomposed_with_the_sdpa_diagonal_matches_the_reference() -> None:
    dtype, layout = torch.bfloat16, "reference"  # one layout: every new shape compiles Flex (causal: above)
    rows, _, causal = CASES[layout]
    num_noisy = int((~rows.clean).sum())
    q, k, v = random_qkv(len(rows), len(rows), dim=64, samples=1, seed=13)
    dout = torch.randn_like(q)
    out_ref, _, grads_ref = reference_grads(
        q, k, v, allow_matrix(rows, rows, causal_in_block=causal), 1 / math.sqrt(q.shape[-1]), dout
    )
    attention = LocalAttentionFn(
        rows.to(device_under_test()), num_noisy=num_noisy, causal_in_block=causal, backend="auto", diagonal="sdpa"
    )
    assert attention.plan.block_size == B and isinstance(attention.plan.block_plan, SdpaBlockDiagonalPartial)
    leaves = [t.to(device_under_test(), dtype).requires_grad_(True) for t in (q, k, v)]
    out = attention(*leaves, 0)
    out.backward(dout.to(device_under_test(), dtype))
    torch.testing.assert_close(out.detach().cpu().double(), out_ref, **TOL[dtype])
    for leaf, want in zip(leaves, grads_ref):
        torch.testing.assert_close(leaf.grad.cpu().double(), want, **TOL[dtype])


def test_dflash_draft_attention_with_the_sdpa_diagonal_matches_the_matmul_diagonal() -> None:
    from csbp.dflash.attention import ShardedDraftAttention, build_draft_attention_plan

    dev = device_under_test()
    block_rows, ctx_rows, _ = CASES["dflash_context"]
    q, k_blk, v_blk = random_qkv(len(block_rows), len(block_rows), dim=64, samples=1, seed=14)
    _, k_ctx, v_ctx = random_qkv(len(block_rows), len(ctx_rows), dim=64, samples=1, seed=15)
    results = []
    for diagonal in ("sdpa", "matmul"):
        plan = build_draft_attention_plan(
            [block_rows.to(dev)], [True], [0], ctx_rows.to(dev), block_size=B, comm=None, backend="tiles",
            diagonal=diagonal,
        )
        leaves = [t.to(dev, torch.bfloat16).requires_grad_(True) for t in (q, k_ctx, v_ctx, k_blk, v_blk)]
        out = ShardedDraftAttention(plan)(*leaves, 0)
        out.float().square().sum().backward()
        results.append([out.detach().float()] + [leaf.grad.float() for leaf in leaves])
    for got, want in zip(*results):
        assert bool(torch.isfinite(got).all())
        torch.testing.assert_close(got, want, **TOL[torch.bfloat16])
