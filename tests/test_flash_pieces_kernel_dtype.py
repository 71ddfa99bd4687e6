"""The flash pieces in the kernels' dtype (``kernel_dtype``), as the local and ring transports ask for them.

With one residual and one piece per query row (the mixed rows of one device, a CP-only rank's remote
partial), ``out`` and ``dq`` are the residual's with each piece's merged or added into its rows in place,
rounding once: the values of the general path's fp32 buffers cast to the inputs' dtype, without those
buffers' fill, merge and cast passes. The ring then merges them into its fp32 result.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import csbp.attention.merge as merge_module
from csbp.attention.backends import plan_partial
from csbp.attention.flash_pieces import FlashPiecesPartial
from csbp.attention.layouts import reference_layout
from csbp.attention.merge import merge_into_rounded, merge_partials
from csbp.attention.transports.local import (
    LocalAttentionPlan,
    build_local_attention_plan,
    local_attention_backward,
    local_attention_forward,
    local_attention_function,
)
from test_flash_pieces import CASES
from test_flex_direct_backward import flex_trains_on_cpu, needs_direct  # noqa: F401 - flex_trains_on_cpu: a fixture
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
    dtype (from the same forward), and the backward writes two q-sized tensors fewer (no fp32 dq
    buffer, no final cast)."""
    rows = reference_layout(64, 4).rows
    partial = plan_partial(rows, rows, backend="tiles", clean="pieces", min_rows=4)
    plan = LocalAttentionPlan(rows, rows, 64, None, False, None, partial)
    q, k, v = random_qkv(len(rows), len(rows), dtype=torch.bfloat16)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    local_attention_function(*leaves, plan).backward(dout)
    out, lse = local_attention_forward(q, k, v, plan, kernel_dtype=True)  # the Function's forward
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


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["reference_mixed", "documents_mixed", "cp_zigzag_1_local"])
def test_out_onto_the_residual_equals_the_fp32_buffer(case: str, dtype: torch.dtype) -> None:
    """The forward with ``kernel_dtype``: the residual's out with each piece merged into its rows in
    place (one rounding) gives the general path's out and lse."""
    plan, (q, k, v, _) = _plan_and_inputs(case, dtype)
    out, lse = plan.forward(q, k, v, scale=SCALE)
    onto_out, onto_lse = plan.forward(q, k, v, scale=SCALE, kernel_dtype=True)
    tol = {"rtol": 1e-13, "atol": 1e-13} if dtype == torch.float64 else {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(onto_out.to(out.dtype), out, **tol)
    torch.testing.assert_close(onto_lse, lse, **tol)


def test_merge_into_rounded_rounds_the_fp32_merge_once() -> None:
    """bf16 ``out`` rows merged in place equal the fp32 merge of the same partials cast once, bit for
    bit, also for rows empty in one partial or in both; the compiled form (traced with dynamic shapes,
    run eagerly here) gives the same at two row counts."""
    gen = torch.Generator().manual_seed(7)
    for rows in (12, 20):
        out = torch.randn(1, 2, rows, 8, generator=gen).to(torch.bfloat16)
        out2 = torch.randn(1, 2, rows, 8, generator=gen).to(torch.bfloat16)
        lse, lse2 = torch.randn(1, 2, rows, generator=gen), torch.randn(1, 2, rows, generator=gen)
        lse[..., 0], lse2[..., 1], lse[..., 2], lse2[..., 2] = (float("-inf"),) * 4
        out[..., 0, :], out2[..., 1, :], out[..., 2, :], out2[..., 2, :] = (0.0,) * 4
        want_out, want_lse = merge_partials(out, lse, out2, lse2)
        for merge in (merge_into_rounded, torch.compile(merge_module._rounded_merge, backend="aot_eager",
                                                        dynamic=True, fullgraph=True)):
            got_out, got_lse = out.clone(), lse.clone()
            merge(got_out[:, :, : rows - 1], got_lse[:, :, : rows - 1], out2[:, :, : rows - 1], lse2[:, :, : rows - 1])
            assert torch.equal(got_out[:, :, : rows - 1], want_out[:, :, : rows - 1].to(torch.bfloat16))
            assert torch.equal(got_lse[:, :, : rows - 1], want_lse[:, :, : rows - 1])
            assert torch.equal(got_out[:, :, -1], out[:, :, -1])  # rows outside the view untouched
    with pytest.raises(ValueError, match="accumulation dtype"):
        merge_into_rounded(out, lse.to(torch.bfloat16), out2, lse2)


def _ring_rank_errors(transport: str, clean: str, dtype: torch.dtype) -> list[torch.Tensor]:
    """Out, dq, dk, dv of the busiest CP-only cp4 rank (L = 512, B = 32, 8/2 heads of 32) through the
    ring ``transport`` (``LocalRing``), Flex backend, clean kernel ``clean``, inputs drawn in bf16 and run in
    ``dtype`` (float64: tiles, the reference)."""
    from csbp.attention.flex_backward import flex_backward_mode
    from csbp.attention.transports.factory import build_attention
    from csbp.bench.kernel_ranks import LocalRing, busiest_rank, parse_topologies

    (topology,) = parse_topologies(["cp4"])
    rank, layout, _ = busiest_rank(topology, 512, 32)
    gen = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(1, h, len(layout.rows), 32, generator=gen).bfloat16().to(dtype) for h in (8, 2, 2, 8))
    leaves = [x.requires_grad_() for x in (q, k, v)]
    with flex_backward_mode("direct"):
        attention = build_attention(
            topology, rank, layout, LocalRing(4, rank % 4), block_size=32, device=torch.device("cpu"),
            backend="tiles" if dtype == torch.float64 else "flex", clean=clean, transport=transport,
        )
        out = attention(*leaves)
        out.backward(dout)
    return [out.detach()] + [leaf.grad for leaf in leaves]


@needs_direct
@pytest.mark.usefixtures("flex_trains_on_cpu")
@pytest.mark.parametrize("transport", ["collective", "streaming"])
def test_a_rings_remote_pieces_in_the_kernels_dtype_are_as_accurate_as_one_flex_call(
    transport: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The ring transports take their remote partial's out and dq in the kernels' dtype; for the CP-only
    rank's pieces that is their merge onto the one Flex residual, rounded once, as a fused kernel's
    output is. Against float64, out, dq, dk and dv are then as accurate as with the remote partial run
    as one Flex call (relative error norms at most 5% above it; measured 6-20% below), both within twice
    bf16's unit roundoff (measured 1.2-1.6 times it), and the rounded merge did run."""
    rounded = []
    monkeypatch.setattr(merge_module, "_rounded_merge", lambda *a: rounded.append(1) or _ROUNDED_MERGE(*a))
    reference = _ring_rank_errors(transport, "generic", torch.float64)
    pieces = _ring_rank_errors(transport, "pieces", torch.bfloat16)
    assert rounded, "the remote pieces did not merge onto their residual"
    one_call = _ring_rank_errors(transport, "generic", torch.bfloat16)
    for name, got, flex, want in zip(("out", "dq", "dk", "dv"), pieces, one_call, reference):
        error, flex_error = ((x.double() - want).norm() / want.norm() for x in (got, flex))
        assert error <= 1.05 * flex_error and flex_error <= 2 * 2**-9, (name, float(error), float(flex_error))


_ROUNDED_MERGE = merge_module._rounded_merge


@needs_direct
@pytest.mark.usefixtures("flex_trains_on_cpu")
@pytest.mark.parametrize("transport", ["collective", "streaming"])
def test_a_rings_single_flex_call_results_in_the_kernels_dtype_change_no_bit(
    transport: str, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A Flex partial's out and gradients are its kernel's bf16 whatever ``kernel_dtype``: taking them as they
    are (no cast pass) and merging or adding them into fp32, or adding the remote dQ and dK/dV onto the local
    bf16 gradients once, in place, gives the same bits as casting everything to fp32 first."""
    from csbp.attention.flex import FlexPartial

    as_kernel_left = _ring_rank_errors(transport, "generic", torch.bfloat16)
    forward, backward = FlexPartial.forward, FlexPartial.backward
    monkeypatch.setattr(FlexPartial, "forward", lambda self, *a, **kw: forward(self, *a, **{**kw, "kernel_dtype": False}))
    monkeypatch.setattr(FlexPartial, "backward", lambda self, *a, **kw: backward(self, *a, **{**kw, "kernel_dtype": False}))
    in_fp32 = _ring_rank_errors(transport, "generic", torch.bfloat16)
    for name, got, want in zip(("out", "dq", "dk", "dv"), as_kernel_left, in_fp32):
        assert torch.equal(got, want), name
