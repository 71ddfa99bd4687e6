"""The flash pieces' backward in the kernels' dtype (``kernel_dtype``), as the local transport asks for it.

With one residual and one piece per query row (the mixed rows of one device), ``dq`` is the residual's
with each piece's added in place: one add and one rounding per row, the same values as the fp32 buffer
of the general path cast to the inputs' dtype, without that buffer's fill, add and cast passes.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from csbp.attention.backends import plan_partial
from csbp.attention.flash_pieces import FlashPiecesPartial
from csbp.attention.layouts import reference_layout
from csbp.attention.transports.local import (
    LocalAttentionPlan,
    build_local_attention_plan,
    local_attention_backward,
    local_attention_forward,
    local_attention_function,
)
from test_flash_pieces import CASES
from test_kernel import random_qkv

SCALE = 8**-0.5


def _plan_and_inputs(case: str, dtype: torch.dtype) -> tuple[FlashPiecesPartial, tuple[torch.Tensor, ...]]:
    q_rows, k_rows = CASES[case]
    plan = plan_partial(q_rows, k_rows, backend="tiles", clean="pieces", min_rows=4)
    assert isinstance(plan, FlashPiecesPartial)
    q, k, v = random_qkv(len(q_rows), len(k_rows), dtype=dtype)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    return plan, (q, k, v, dout)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["reference_mixed", "documents_mixed", "cp_zigzag_1_local"])
def test_dq_onto_the_residual_equals_the_fp32_buffer_bit_for_bit(case: str, dtype: torch.dtype) -> None:
    plan, (q, k, v, dout) = _plan_and_inputs(case, dtype)
    assert plan.one_residual_and_piece_per_row
    out, lse = plan.forward(q, k, v, scale=SCALE)
    out = out.to(dtype)  # the transport keeps out in q's dtype for the backward
    general = plan.backward(q, k, v, out, lse, dout, scale=SCALE)
    onto = plan.backward(q, k, v, out, lse, dout, scale=SCALE, kernel_dtype=True)
    for got, want in zip(onto, general):
        assert torch.equal(got.to(dtype), want.to(dtype))


@pytest.mark.parametrize("case", ["csbp_two_peers", "bp_only_mixed", "csbp_3_local", "noisy_keys_between_two_runs"])
def test_several_residuals_or_pieces_sharing_rows_keep_the_fp32_buffers(case: str) -> None:
    """A dense and a causal piece over the same rows (BP-only, CSBP local steps) or two residuals would add
    twice into a kernel-dtype dq (two roundings): those plans keep the fp32 buffer, with or without the flag."""
    plan, (q, k, v, dout) = _plan_and_inputs(case, torch.bfloat16)
    assert not plan.one_residual_and_piece_per_row
    out, lse = plan.forward(q, k, v, scale=SCALE)
    general = plan.backward(q, k, v, out.to(q.dtype), lse, dout, scale=SCALE)
    flagged = plan.backward(q, k, v, out.to(q.dtype), lse, dout, scale=SCALE, kernel_dtype=True)
    for got, want in zip(flagged, general):
        assert got.dtype == torch.float32 and torch.equal(got, want)


class _OutputSizedOps(TorchDispatchMode):
    """Ops writing a q-sized tensor (a full pass over the rows' output), by name."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.names = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        result = func(*args, **(kwargs or {}))
        if isinstance(result, torch.Tensor) and result.numel() == self.numel and not func.is_view:
            self.names.append(func.__name__)
        return result


def test_the_local_transport_hands_back_the_pieces_dq_without_a_buffer_pass() -> None:
    """Through the autograd Function the mixed rows' gradients equal the fp32 path's cast to the inputs'
    dtype, and the backward writes two q-sized tensors fewer (no fp32 dq fill, no final cast)."""
    rows = reference_layout(64, 4).rows
    partial = plan_partial(rows, rows, backend="tiles", clean="pieces", min_rows=4)
    plan = LocalAttentionPlan(rows, rows, 64, None, False, None, partial)
    q, k, v = random_qkv(len(rows), len(rows), dtype=torch.bfloat16)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    local_attention_function(*leaves, plan).backward(dout)
    out, lse = local_attention_forward(q, k, v, plan)
    out = out.to(q.dtype)
    with _OutputSizedOps(q.numel()) as fp32_path:
        expected = local_attention_backward(q, k, v, out, lse, dout, plan)
        expected_dq = expected[0].to(q.dtype)
    with _OutputSizedOps(q.numel()) as onto:
        local_attention_backward(q, k, v, out, lse, dout, plan, kernel_dtype=True)
    for leaf, want in zip(leaves, (expected_dq, *expected[1:])):
        assert torch.equal(leaf.grad, want.to(leaf.dtype))
    assert len(fp32_path.names) - len(onto.names) >= 2, (fp32_path.names, onto.names)


def test_the_decomposed_local_plan_keeps_its_fp32_dq() -> None:
    """With a separate block-diagonal partial the noisy rows' dq adds a second share: kept in fp32."""
    rows = reference_layout(64, 4).rows
    plan = build_local_attention_plan(rows, num_noisy=64, backend="tiles", clean="pieces", diagonal="sdpa")
    assert plan.block_plan is not None
    q, k, v = random_qkv(len(rows), len(rows), dtype=torch.bfloat16)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    out, lse = local_attention_forward(q, k, v, plan)
    grads = local_attention_backward(q, k, v, out.to(q.dtype), lse, dout, plan, kernel_dtype=True)
    assert all(g.dtype == torch.float32 for g in grads)
