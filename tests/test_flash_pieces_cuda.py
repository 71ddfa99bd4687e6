"""Flash pieces on CUDA (``make gpu-check``'s ``cuda-tests`` stage runs ``pytest -m cuda``): every
layout's clean-context partial cut into FlashAttention-2 or cuDNN pieces (bf16) with a tiles or FlexAttention
residual (on the mixed rows one Flex residual holding the noisy blocks too), forward and backward from the merged statistics against the CPU float64 reference; in
fp32 (no fused kernel) the same plan runs the whole partial generically.

``CSBP_CUDA_TESTS_DEVICE=cpu`` runs the same bodies on the CPU (the ``cpu-flash`` kernel, tiles
residual): a dry run of the test code where no GPU is lent; not part of the suite.
"""

from __future__ import annotations

import math

import pytest
import torch

from csbp.attention.backends import plan_partial
from csbp.attention.flash_ops import flash_kernel
from csbp.attention.flash_pieces import FlashPiecesPartial
from csbp.attention.rows import allow_matrix
from csbp.attention.transports.local import (
    LocalAttentionPlan,
    local_attention_backward,
    local_attention_forward,
)
from csbp.bench.kernel_profile import count_syncs
from test_block_diagonal_cuda import TOL, device_under_test
from test_flash_pieces import CASES
from test_kernel import random_qkv, reference_grads

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile.*"),
]


CASES_AND_DTYPES = [
    pytest.param(case, dtype, id=f"{case}-{name}")
    for case in ("reference", "documents", "csbp_two_peers", "dflash_context")
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float32, "fp32"))
] + [pytest.param("reference_mixed", torch.bfloat16, id="reference_mixed-bf16")]  # fp32: the generic path again
"""Every case in bf16 and fp32; the mixed rows (noisy blocks folded into the Flex residual) in bf16 only:
in fp32 their plan runs generically, as the others' do, and each Flex shape costs the stage a compile."""


@pytest.mark.parametrize("clean", ["pieces", "pieces-cudnn"])
@pytest.mark.parametrize(("case", "dtype"), CASES_AND_DTYPES)
def test_flash_pieces_match_the_cpu_float64_reference(case: str, dtype: torch.dtype, clean: str) -> None:
    dev = device_under_test()
    q_rows, k_rows = CASES[case]
    # one Flex residual compile each; reference_mixed: the noisy blocks folded into that residual
    backend = "flex" if dev.type == "cuda" and case in ("reference", "reference_mixed") else "tiles"
    plan = plan_partial(q_rows.to(dev), k_rows.to(dev), backend=backend, clean=clean, min_rows=4)
    assert isinstance(plan, FlashPiecesPartial) and plan.pieces
    q, k, v = random_qkv(len(q_rows), len(k_rows), heads=4, kv_heads=2, dim=64, samples=1, seed=21)
    dout = torch.randn(q.shape, dtype=q.dtype, generator=torch.Generator().manual_seed(22))
    allow = allow_matrix(q_rows, k_rows)
    out_ref, lse_ref, grads_ref = reference_grads(q, k, v, allow, 1 / math.sqrt(q.shape[-1]), dout)
    qd, kd, vd, doutd = (t.to(dev, dtype) for t in (q, k, v, dout))
    cuda_kernel = "cudnn" if clean == "pieces-cudnn" else "flash"
    expected = "cpu-flash" if dev.type == "cpu" else (cuda_kernel if dtype == torch.bfloat16 else None)
    assert plan.cuda_kernel == cuda_kernel and flash_kernel(qd, cuda_kernel) == expected
    out, lse = plan.forward(qd, kd, vd)
    assert out.dtype == lse.dtype == torch.float32 and out.device == dev
    torch.testing.assert_close(out.cpu().double(), out_ref, **TOL[dtype])
    finite = torch.isfinite(lse_ref)
    torch.testing.assert_close(lse.cpu().double()[finite], lse_ref[finite], **TOL[dtype])
    assert bool(torch.isneginf(lse.cpu()[~finite]).all())
    if dev.type == "cpu" and backend == "flex":
        return
    grads = plan.backward(qd, kd, vd, out, lse, doutd)
    for got, want in zip(grads, grads_ref):
        assert got.dtype == torch.float32 and bool(torch.isfinite(got).all())
        torch.testing.assert_close(got.cpu().double(), want, **TOL[dtype])


@pytest.mark.parametrize("form", ["mixed", "folded"])
def test_attention_steps_never_make_the_host_wait_for_the_device(form: str) -> None:
    """One forward + backward through the local transport, as one partial over the mixed rows (a
    CP-only ring step's form) and as cuDNN pieces with the noisy blocks folded into the Flex residual
    (training's decomposed form), calls nothing that synchronises the host with the GPU: the host
    queues the whole step ahead, so launch overhead hides behind the kernels. The rows and shapes of
    the reference_mixed case above (its compiled graphs serve). The counter is checked on ``.item()``."""
    dev = device_under_test()
    backend = "flex" if dev.type == "cuda" else "tiles"
    rows = CASES["reference_mixed"][0].to(dev)
    partial = plan_partial(rows, rows, backend=backend, clean="generic" if form == "mixed" else "pieces-cudnn",
                           min_rows=4)
    assert isinstance(partial, FlashPiecesPartial) == (form == "folded")
    plan = LocalAttentionPlan(rows, rows, int((~rows.clean).sum()), None, False, None, partial)
    q, k, v = (t.to(dev, torch.bfloat16) for t in random_qkv(len(rows), len(rows), heads=4, kv_heads=2, dim=64,
                                                               samples=1, seed=23))
    dout = torch.randn_like(q)

    def step() -> None:
        out, lse = local_attention_forward(q, k, v, plan)
        local_attention_backward(q, k, v, out, lse, dout, plan)

    step()  # compiles first
    assert count_syncs(step, dev) == 0
    if dev.type == "cuda":
        assert count_syncs(lambda: q.sum().item(), dev) == 1


def test_out_and_dq_onto_the_residual_in_bf16_equal_the_fp32_buffers_cast() -> None:
    """The mixed rows in bf16 with ``kernel_dtype``: the forward (cuDNN pieces merged into the Flex
    residual's bf16 out by the compiled merge, rounding once) gives the fp32-buffer path's out and lse,
    and the backward (pieces' dq added into the residual's bf16 dq) its gradients cast to bf16, bit for
    bit: one fp32 add per row."""
    dev = device_under_test()
    backend = "flex" if dev.type == "cuda" else "tiles"
    rows = CASES["reference_mixed"][0].to(dev)
    plan = plan_partial(rows, rows, backend=backend, clean="pieces-cudnn", min_rows=4)
    assert isinstance(plan, FlashPiecesPartial) and plan.one_residual_and_piece_per_row
    q, k, v = (t.to(dev, torch.bfloat16) for t in random_qkv(len(rows), len(rows), heads=4, kv_heads=2, dim=64,
                                                               samples=1, seed=24))
    dout = torch.randn_like(q)
    out, lse = plan.forward(q, k, v)
    onto_out, onto_lse = plan.forward(q, k, v, kernel_dtype=True)
    assert onto_out.dtype == (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    torch.testing.assert_close(onto_out.float(), out.to(onto_out.dtype).float(), rtol=8e-3, atol=1e-5)
    torch.testing.assert_close(onto_lse, lse, rtol=1e-6, atol=1e-6)
    out = out.to(q.dtype)
    general = plan.backward(q, k, v, out, lse, dout)
    onto = plan.backward(q, k, v, out, lse, dout, kernel_dtype=True)
    assert onto[0].dtype == (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    for got, want in zip(onto, general):
        assert torch.equal(got.to(torch.bfloat16), want.to(torch.bfloat16))
