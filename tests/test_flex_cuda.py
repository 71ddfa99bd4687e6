"""FlexAttention backend on CUDA: forward and backward of every layout's partials against the CPU
float64 reference (bf16 and fp32 tolerances), the transports on ``backend=auto``, no recompilation
across steps, and BlockMasks of long rows built without a dense mask. Run by ``make gpu-check``;
skipped without CUDA."""

from __future__ import annotations

import math
import time

import pytest
import torch

from csbp.attention.backends import plan_partial, resolve_backend
from csbp.attention.flex import FlexPartial, rows_block_mask
from csbp.attention.layouts import reference_layout
from csbp.attention.rows import allow_matrix
from csbp.attention.transports.local import LocalAttentionFn
from test_flex_backend import CASES, B
from test_kernel import random_qkv, reference_grads

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run by make gpu-check)"),
]

CUDA = torch.device("cuda")
TOL = {torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2}, torch.float32: {"atol": 2e-3, "rtol": 2e-3}}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", list(CASES))
def test_flex_partial_forward_and_backward_match_float64_reference(name: str, dtype: torch.dtype) -> None:
    q_rows, k_rows, causal = CASES[name]
    q, k, v = random_qkv(len(q_rows), len(k_rows), dim=16, seed=3)
    dout = torch.randn_like(q)
    allow = allow_matrix(q_rows, k_rows, causal_in_block=causal)
    out_ref, lse_ref, grads_ref = reference_grads(q, k, v, allow, 1 / math.sqrt(q.shape[-1]), dout)
    partial = plan_partial(q_rows.to(CUDA), k_rows.to(CUDA), backend="auto", causal_in_block=causal)
    assert isinstance(partial, FlexPartial)
    qc, kc, vc, doutc = (t.to(CUDA, dtype) for t in (q, k, v, dout))
    out, lse = partial.forward(qc, kc, vc)
    assert out.dtype == torch.float32  # accumulation dtype
    grads = partial.backward(qc, kc, vc, out, lse, doutc)
    torch.testing.assert_close(out.cpu().double(), out_ref, **TOL[dtype])
    finite = torch.isfinite(lse_ref)
    torch.testing.assert_close(lse.cpu().double()[finite], lse_ref[finite], **TOL[dtype])
    assert bool(torch.isneginf(lse.cpu()[~finite]).all())
    for got, want in zip(grads, grads_ref):
        torch.testing.assert_close(got.cpu().double(), want, **TOL[dtype])


@pytest.mark.parametrize("layout", ["reference", "bp_only", "reference_window", "causal_in_block"])
def test_local_transport_on_auto_backend_is_exact_through_the_merge(layout: str) -> None:
    rows, _, causal = CASES[layout]
    num_noisy = int((~rows.clean).sum())
    q, k, v = random_qkv(len(rows), len(rows), dim=16, seed=5)
    dout = torch.randn_like(q)
    out_ref, _, grads_ref = reference_grads(
        q, k, v, allow_matrix(rows, rows, causal_in_block=causal), 1 / math.sqrt(q.shape[-1]), dout
    )
    attention = LocalAttentionFn(rows, num_noisy=num_noisy, causal_in_block=causal, backend="auto")
    leaves = [t.to(CUDA, torch.float32).requires_grad_(True) for t in (q, k, v)]
    out = attention(*leaves, 0)
    out.backward(dout.to(CUDA, torch.float32))
    torch.testing.assert_close(out.detach().cpu().double(), out_ref, **TOL[torch.float32])
    for leaf, want in zip(leaves, grads_ref):
        torch.testing.assert_close(leaf.grad.cpu().double(), want, **TOL[torch.float32])


def test_dflash_draft_attention_on_flex_matches_tiles() -> None:
    from csbp.dflash.attention import ShardedDraftAttention, build_draft_attention_plan

    block_rows, ctx_rows, _ = CASES["dflash_context"]
    q, k_blk, v_blk = random_qkv(len(block_rows), len(block_rows), dim=16, seed=8)
    _, k_ctx, v_ctx = random_qkv(len(block_rows), len(ctx_rows), dim=16, seed=9)
    results = []
    for backend in ("flex", "tiles"):
        plan = build_draft_attention_plan(
            [block_rows.to(CUDA)], [True], [0], ctx_rows.to(CUDA), block_size=B, comm=None, backend=backend
        )
        leaves = [t.to(CUDA).requires_grad_(True) for t in (q, k_ctx, v_ctx, k_blk, v_blk)]
        out = ShardedDraftAttention(plan)(*leaves, 0)
        out.sum().backward()
        results.append([out.detach()] + [leaf.grad for leaf in leaves])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_new_rows_of_the_same_shapes_do_not_recompile() -> None:
    torch._dynamo.utils.counters.clear()
    for window in (None, 7, 3):
        rows = reference_layout(256, 16, window=window).rows.to(CUDA)
        q, k, v = (t.to(CUDA, torch.bfloat16) for t in random_qkv(len(rows), len(rows), dim=64, samples=1))
        plan_partial(rows, rows, backend="flex").forward(q, k, v)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    assert resolve_backend("auto", CUDA) == "flex"


def test_long_block_mask_is_built_from_intervals_without_a_dense_mask() -> None:
    rows = reference_layout(65536, 128).rows.to(CUDA)  # 128K x 128K rows: a dense bool mask is 16 GiB
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    mask = rows_block_mask(rows, rows)
    torch.cuda.synchronize()
    assert time.perf_counter() - start < 5.0
    assert torch.cuda.max_memory_allocated() < 2**30
    assert mask.kv_num_blocks.shape[-1] == 1024
