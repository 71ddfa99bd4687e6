"""FlexAttention backend on CUDA: forward and backward of every layout's partials against the CPU
float64 reference (bf16 and fp32 tolerances), the transports on ``backend=auto``, no recompilation
across steps (new rows of one shape, and changing document prefixes padded to one shape bucket), merged
partials differentiated both ways (``csbp.attention.flex_backward``: direct and recompute), and
BlockMasks of long rows built without a dense mask. Run by ``make gpu-check``;
skipped without CUDA.

``CSBP_CUDA_TESTS_DEVICE=cpu`` runs the same bodies on the CPU (a dry run of the test code where no
GPU is lent; not part of the suite), on the ``flex`` backend by name (``auto`` is ``tiles`` there):
FlexAttention's forward runs eagerly on the CPU and is checked against the float64 reference; its
backward runs where the direct backward exists (``csbp.attention.flex_backward``: torch 2.11, 2.13, with
aot_eager standing in for the Triton kernel), and is skipped with that reason elsewhere, as is
``recompute`` (FlexAttention's own autograd refuses the CPU). The recompile check compiles with
dynamo's ``eager`` backend there, the long-mask check reads the resident set.
"""

from __future__ import annotations

import math
import os
import time

import pytest
import torch

import csbp.attention.flex_backward as flex_backward
from csbp.attention.backends import plan_partial, resolve_backend
from csbp.attention.flex import FlexPartial
from csbp.attention.flex_block_mask import rows_block_mask
from csbp.attention.layouts import reference_layout
from csbp.attention.merge import merge_partials
from csbp.attention.rows import allow_matrix
from csbp.attention.transports.local import LocalAttentionFn
from csbp.bench.measure import PeakMemory
from test_flex_backend import CASES, B
from test_kernel import random_qkv, reference_grads

DEVICE = os.environ.get("CSBP_CUDA_TESTS_DEVICE", "cuda")
ON_CUDA = DEVICE == "cuda"
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile.*"),
]
CPU_BACKWARD = flex_backward.direct_backward_support()[0]
"""On the CPU a flex partial differentiates only by the direct backward (traced by dynamo, run by
aot_eager); where this torch cannot trace it, the CPU dry run checks the forward only."""
NO_CPU_BACKWARD = "FlexAttention has no CPU backward here (no direct backward): the CPU dry run checks the forward only"
PARTS = ["forward", pytest.param("backward", marks=pytest.mark.skipif(not (ON_CUDA or CPU_BACKWARD),
                                                                      reason=NO_CPU_BACKWARD))]
TOL = {torch.bfloat16: {"atol": 3e-2, "rtol": 3e-2}, torch.float32: {"atol": 2e-3, "rtol": 2e-3}}


def _device() -> torch.device:
    return torch.device("cuda", 0) if ON_CUDA else torch.device("cpu")


def _backend() -> str:
    """``auto`` on CUDA (which must resolve to flex); ``flex`` by name in the CPU dry run."""
    return "auto" if ON_CUDA else "flex"


@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", list(CASES))
def test_flex_partial_forward_and_backward_match_float64_reference(name: str, dtype: torch.dtype, part: str) -> None:
    dev = _device()
    q_rows, k_rows, causal = CASES[name]
    q, k, v = random_qkv(len(q_rows), len(k_rows), dim=16, seed=3)
    dout = torch.randn_like(q)
    allow = allow_matrix(q_rows, k_rows, causal_in_block=causal)
    out_ref, lse_ref, grads_ref = reference_grads(q, k, v, allow, 1 / math.sqrt(q.shape[-1]), dout)
    partial = plan_partial(q_rows.to(dev), k_rows.to(dev), backend=_backend(), causal_in_block=causal)
    assert isinstance(partial, FlexPartial)
    qc, kc, vc, doutc = (t.to(dev, dtype) for t in (q, k, v, dout))
    out, lse = partial.forward(qc, kc, vc)
    assert out.dtype == torch.float32 and out.device == dev  # accumulation dtype
    torch.testing.assert_close(out.cpu().double(), out_ref, **TOL[dtype])
    finite = torch.isfinite(lse_ref)
    torch.testing.assert_close(lse.cpu().double()[finite], lse_ref[finite], **TOL[dtype])
    assert bool(torch.isneginf(lse.cpu()[~finite]).all())
    if part == "backward":
        grads = partial.backward(qc, kc, vc, out, lse, doutc)
        for got, want in zip(grads, grads_ref):
            torch.testing.assert_close(got.cpu().double(), want, **TOL[dtype])


@pytest.mark.parametrize("mode", ["direct", "recompute"])
@pytest.mark.parametrize("name", list(CASES))
def test_merged_partials_backward_matches_float64_reference(name: str, mode: str) -> None:
    """Two flex partials (the keys' halves) merged in fp32, each differentiated from the merged
    statistics by ``mode`` (``direct``: the compiled backward kernel, no forward), summed; bf16."""
    dtype = torch.bfloat16
    if mode == "direct" and not flex_backward.direct_backward_support()[0]:
        pytest.skip(f"this torch cannot trace the direct backward: {flex_backward.direct_backward_support()[1]}")
    if mode == "recompute" and not ON_CUDA:
        pytest.skip("recompute differentiates FlexAttention's own call, which has no CPU backward")
    dev = _device()
    q_rows, k_rows, causal = CASES[name]
    split = len(k_rows) // 2
    q, k, v = random_qkv(len(q_rows), len(k_rows), dim=16, seed=4)
    dout = torch.randn_like(q)
    _, _, grads_ref = reference_grads(q, k, v, allow_matrix(q_rows, k_rows, causal_in_block=causal),
                                      1 / math.sqrt(q.shape[-1]), dout)
    qc, kc, vc, doutc = (t.to(dev, dtype) for t in (q, k, v, dout))
    halves = (slice(0, split), slice(split, None))
    plans = [plan_partial(q_rows.to(dev), k_rows.select(h).to(dev), backend="flex", causal_in_block=causal)
             for h in halves]
    outs = [p.forward(qc, kc[:, :, h], vc[:, :, h]) for p, h in zip(plans, halves)]
    out, lse = merge_partials(*outs[0], *outs[1])
    dq, dk, dv = (torch.zeros(t.shape, device=dev) for t in (q, k, v))
    with flex_backward.flex_backward_mode(mode):
        for plan, h in zip(plans, halves):
            dq_h, dk_h, dv_h = plan.backward(qc, kc[:, :, h], vc[:, :, h], out, lse, doutc)
            dq += dq_h
            dk[:, :, h] += dk_h
            dv[:, :, h] += dv_h
    for got, want in zip((dq, dk, dv), grads_ref):
        torch.testing.assert_close(got.cpu().double(), want, **TOL[dtype])


@pytest.mark.parametrize("part", PARTS)
@pytest.mark.parametrize("layout", ["reference", "bp_only", "reference_window", "causal_in_block"])
def test_local_transport_on_auto_backend_is_exact_through_the_merge(layout: str, part: str) -> None:
    dev = _device()
    rows, _, causal = CASES[layout]
    num_noisy = int((~rows.clean).sum())
    q, k, v = random_qkv(len(rows), len(rows), dim=16, seed=5)
    dout = torch.randn_like(q)
    out_ref, _, grads_ref = reference_grads(
        q, k, v, allow_matrix(rows, rows, causal_in_block=causal), 1 / math.sqrt(q.shape[-1]), dout
    )
    attention = LocalAttentionFn(rows, num_noisy=num_noisy, causal_in_block=causal, backend=_backend())
    leaves = [t.to(dev, torch.float32).requires_grad_(part == "backward") for t in (q, k, v)]
    out = attention(*leaves, 0)
    assert out.device == dev
    torch.testing.assert_close(out.detach().cpu().double(), out_ref, **TOL[torch.float32])
    if part == "backward":
        out.backward(dout.to(dev, torch.float32))
        for leaf, want in zip(leaves, grads_ref):
            torch.testing.assert_close(leaf.grad.cpu().double(), want, **TOL[torch.float32])


@pytest.mark.parametrize("part", PARTS)
def test_dflash_draft_attention_on_flex_matches_tiles(part: str) -> None:
    from csbp.dflash.attention import ShardedDraftAttention, build_draft_attention_plan

    dev = _device()
    block_rows, ctx_rows, _ = CASES["dflash_context"]
    q, k_blk, v_blk = random_qkv(len(block_rows), len(block_rows), dim=16, seed=8)
    _, k_ctx, v_ctx = random_qkv(len(block_rows), len(ctx_rows), dim=16, seed=9)
    results = []
    for backend in ("flex", "tiles"):
        plan = build_draft_attention_plan(
            [block_rows.to(dev)], [True], [0], ctx_rows.to(dev), block_size=B, comm=None, backend=backend
        )
        leaves = [t.to(dev).requires_grad_(part == "backward") for t in (q, k_ctx, v_ctx, k_blk, v_blk)]
        out = ShardedDraftAttention(plan)(*leaves, 0)
        if part == "backward":
            out.sum().backward()
        results.append([out.detach()] + ([leaf.grad for leaf in leaves] if part == "backward" else []))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_new_rows_of_the_same_shapes_do_not_recompile() -> None:
    """New rows (windows) of the same shapes reuse one graph. On CUDA through the partial's own
    compiled call; in the CPU dry run, where the partial runs FlexAttention eagerly, the same call
    compiled with dynamo's ``eager`` backend (dynamo's guards, which decide recompilation, are the
    same whatever backend generates the kernel)."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    dev = _device()
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    traced = None if ON_CUDA else torch.compile(flex_attention, dynamic=False, backend="eager")
    graphs = []  # graphs after each window: the first compiles, the others must reuse them
    for window in (None, 7, 3):
        rows = reference_layout(256, 16, window=window).rows.to(dev)
        q, k, v = (t.to(dev, torch.bfloat16) for t in random_qkv(len(rows), len(rows), dim=64, samples=1))
        partial = plan_partial(rows, rows, backend="flex")
        partial.forward(q, k, v)
        if traced is not None:
            traced(q, k, v, block_mask=partial.block_mask, enable_gqa=True, return_aux=AuxRequest(lse=True))
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[0] >= 1 and graphs == [graphs[0]] * 3, graphs
    assert resolve_backend("auto", torch.device("cuda")) == "flex"


def test_changing_documents_reuse_one_graph_per_shape_bucket() -> None:
    """A BP-only rank's rows (its blocks plus their document prefix) change size with every batch of
    packed documents; padded to one shape bucket, three draws of three sizes compile one graph (one
    compile, to spare the stage's budget; the CPU dry run traces the call with dynamo's ``eager``)."""
    from torch.nn.attention.flex_attention import AuxRequest, flex_attention

    from csbp.attention.documents import random_documents
    from csbp.attention.flex import flex_shape_bucket
    from csbp.attention.layouts import bp_only_layout

    dev = _device()
    draws, sizes = [], set()
    for seed in range(200):  # three draws of distinct sizes in the 768-row bucket
        documents = random_documents(1024, 96, torch.Generator().manual_seed(seed))
        rows = bp_only_layout(1024, 16, 4, 1, documents=documents).rows
        if flex_shape_bucket(len(rows)) == 768 and len(rows) not in sizes:
            sizes.add(len(rows))
            draws.append(rows)
        if len(draws) == 3:
            break
    assert len(draws) == 3, sizes
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    traced = None if ON_CUDA else torch.compile(flex_attention, dynamic=False, backend="eager")
    graphs = []
    for rows in draws:
        rows = rows.to(dev)
        q, k, v = (t.to(dev, torch.bfloat16) for t in random_qkv(len(rows), len(rows), dim=64, samples=1))
        partial = plan_partial(rows, rows, backend="flex")
        partial.forward(q, k, v)  # forward only: dynamo's guards, which decide recompilation, are the backward's too
        if not ON_CUDA:
            traced(*partial._padded(q, k, v), block_mask=partial.block_mask, enable_gqa=True,
                   return_aux=AuxRequest(lse=True))
        graphs.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    assert graphs[0] >= 1 and graphs == [graphs[0]] * 3, graphs


def test_long_block_mask_is_built_from_intervals_without_a_dense_mask() -> None:
    dev = _device()
    rows = reference_layout(65536, 128).rows.to(dev)  # 128K x 128K rows: a dense bool mask is 16 GiB
    with PeakMemory(dev) as peak:  # CUDA: allocator peak; CPU: resident-set growth
        start = time.perf_counter()
        mask = rows_block_mask(rows, rows)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        seconds = time.perf_counter() - start
    assert seconds < 5.0
    assert peak.bytes < 2**30
    assert mask.kv_num_blocks.shape[-1] == 1024
