"""The cuDNN branch of the flash pieces (``attention.clean: pieces-cudnn``) run on the CPU, and what a
decomposed step moves besides its kernels.

``flash_ops``' cuDNN branch has conventions of its own: an lse ``[Z, H, N, 1]``, ``out`` and ``dout``
handed to the backward with equal strides (else cuDNN copies ``dout``), ``lse = +inf`` for rows that
see nothing. On a GPU the ``cuda``-marked tests check it; here a stand-in for cuDNN's two aten ops
keeps those conventions and computes with ATen's CPU flash kernel, after binding every call to the
real op's meta registration (argument order, GQA shapes, output formats). So CI runs that branch's
own code against the float64 reference.

The same stand-in lets the CPU count the traffic of a step on the GPU branch: training's decomposed
form on one device (clean pieces on cuDNN plus one Flex residual holding the noisy blocks, through the
local transport's autograd Function) and the busiest rank of a CSBP and a CP-only ring (through its
collective transport, ``csbp bench kernels --layouts``' rank step). On a GPU every aten op outside the
kernels is a launch and a pass through memory; the budgets below are what the steps issue today, so a
change that adds an fp32 buffer or a copy of the rows fails here instead of showing up as a slower
device run.
"""

from __future__ import annotations

import collections
from collections.abc import Callable

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten

import csbp.attention.flash_ops as flash_ops
import csbp.attention.flash_pieces as flash_pieces
import csbp.attention.flex as flex_module
import csbp.attention.merge as merge_module
from csbp.attention.backends import plan_partial
from csbp.attention.flash_pieces import FlashPiecesPartial
from csbp.attention.flex_backward import flex_backward_mode
from csbp.attention.layouts import reference_layout
from csbp.attention.rows import allow_matrix
from csbp.attention.transports.local import local_attention_function
from csbp.bench.kernels import build_form
from test_flash_pieces import CASES
from test_flex_direct_backward import needs_direct
from test_kernel import random_qkv, reference_grads

BF16 = {"atol": 3e-2, "rtol": 3e-2}
LOCAL_BUDGET = 16.8
"""At most this many times q's bytes move in and out of memory outside the kernels in one decomposed step."""
CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
CPU_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
REAL_FORWARD = torch.ops.aten._scaled_dot_product_cudnn_attention
REAL_BACKWARD = torch.ops.aten._scaled_dot_product_cudnn_attention_backward


def _meta(x: object) -> object:
    """A meta tensor of ``x``'s shape, strides and dtype (anything else as it is)."""
    if not isinstance(x, torch.Tensor):
        return x
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")


def _fit_meta(got: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    assert got.shape == meta.shape, f"stand-in gave {tuple(got.shape)}, cuDNN's meta {tuple(meta.shape)}"
    return got.to(meta.dtype)


def cudnn_stand_in(calls: list[str]) -> tuple[Callable[..., tuple], Callable[..., tuple]]:
    """``(forward, backward)`` standing in for cuDNN's attention ops; each call first runs the real op
    on meta copies of its arguments, then computes on the CPU in fp32 and returns the meta call's
    formats. ``calls`` collects ``forward`` / ``backward``."""

    def forward(q, k, v, bias, compute_lse, dropout, causal, debug_mask, *, scale):  # noqa: ANN001, ANN202
        assert bias is None and compute_lse and dropout == 0.0 and not debug_mask
        meta = REAL_FORWARD(*(_meta(x) for x in (q, k, v, bias, compute_lse, dropout, causal, debug_mask)), scale=scale)
        calls.append("forward")
        out, lse = CPU_FLASH(q.float(), k.float(), v.float(), 0.0, causal, scale=scale)[:2]
        return (_fit_meta(out, meta[0]), _fit_meta(lse.unsqueeze(-1), meta[1]), *meta[2:])

    def backward(dout, q, k, v, out, lse, seed, offset, bias, cum_q, cum_k, max_q, max_k, dropout, causal, *, scale):  # noqa: ANN001, ANN202, E501
        # equal strides: otherwise cuDNN materialises a dout with out's strides, one more copy per call
        assert dout.stride() == out.stride() and lse.dtype == torch.float32 and lse.is_contiguous()
        args = (dout, q, k, v, out, lse, seed, offset, bias, cum_q, cum_k, max_q, max_k, dropout, causal)
        meta = REAL_BACKWARD(*(_meta(x) for x in args), scale=scale)
        calls.append("backward")
        grads = CPU_FLASH_BACKWARD(
            dout.float(), q.float(), k.float(), v.float(), out.float(), lse.squeeze(-1), 0.0, causal, scale=scale
        )
        return tuple(_fit_meta(g, m) for g, m in zip(grads, meta))

    return forward, backward


@pytest.fixture
def cudnn_on_cpu(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The cuDNN branch taken on the CPU with the stand-in; yields the list of its calls."""
    calls: list[str] = []
    forward, backward = cudnn_stand_in(calls)
    monkeypatch.setattr(flash_ops, "_CUDNN_FORWARD", forward)
    monkeypatch.setattr(flash_ops, "_CUDNN_BACKWARD", backward)
    take_cuda_branch = lambda q, cuda_kernel="flash": cuda_kernel  # noqa: E731
    monkeypatch.setattr(flash_ops, "flash_kernel", take_cuda_branch)
    monkeypatch.setattr(flash_pieces, "flash_kernel", take_cuda_branch)
    return calls


@pytest.mark.parametrize("case", ["reference", "documents", "csbp_two_peers", "dflash_context", "reference_mixed"])
def test_cudnn_pieces_match_the_float64_reference(case: str, cudnn_on_cpu: list[str]) -> None:
    """Every layout's clean-context partial as cuDNN pieces (bf16) with a tiles residual, forward and
    backward from the merged statistics, rows that see nothing included."""
    q_rows, k_rows = CASES[case]
    plan = plan_partial(q_rows, k_rows, backend="tiles", clean="pieces-cudnn", min_rows=4)
    assert isinstance(plan, FlashPiecesPartial) and plan.pieces and plan.cuda_kernel == "cudnn"
    q, k, v = random_qkv(len(q_rows), len(k_rows), heads=4, kv_heads=2, dim=16, samples=1, seed=31)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(32), dtype=q.dtype)
    allow = allow_matrix(q_rows, k_rows)
    out_ref, lse_ref, grads_ref = reference_grads(q, k, v, allow, 16**-0.5, dout)
    qb, kb, vb, doutb = (t.to(torch.bfloat16) for t in (q, k, v, dout))
    out, lse = plan.forward(qb, kb, vb)
    assert cudnn_on_cpu.count("forward") == len(plan.pieces)
    torch.testing.assert_close(out.double(), out_ref, **BF16)
    finite = torch.isfinite(lse_ref)
    torch.testing.assert_close(lse.double()[finite], lse_ref[finite], **BF16)
    assert bool(torch.isneginf(lse[~finite]).all())
    grads = plan.backward(qb, kb, vb, out, lse, doutb)
    assert cudnn_on_cpu.count("backward") == len(plan.pieces)
    for got, want in zip(grads, grads_ref):
        assert bool(torch.isfinite(got).all())
        torch.testing.assert_close(got.double(), want, **BF16)


class PassCounter(TorchDispatchMode):
    """aten ops dispatched outside the kernel calls, with the bytes each reads and writes; views and
    allocations move nothing, and a copy onto its own memory (``x[rows] += y`` writing back the
    view it added into) is skipped by ATen before any kernel, so it is not counted either. An indexed
    write touches only the rows it writes (read too for ``index_add_``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.bytes: collections.Counter[str] = collections.Counter()
        self.kernels: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        result = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.is_view or name in ("empty", "empty_strided", "new_empty", "detach", "alias", "promote_types"):
            return result
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outputs = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
        if name == "copy_" and _same_memory(*inputs[:2]):
            return result
        if name in ("copy_", "fill_", "zero_"):  # the destination is written, not read
            inputs = inputs[1:]
        if name in ("index_put_", "index_copy_", "index_add_"):  # only the indexed rows of the destination
            written = inputs[-1]
            inputs, outputs = inputs[1:], [written] * (2 if name == "index_add_" else 1)
        self.ops[name] += 1
        self.bytes[name] += sum(t.numel() * t.element_size() for t in inputs + outputs)
        return result

    def kernel(self, label: str, fn: Callable[..., object]) -> Callable[..., object]:
        """``fn`` counted as one kernel call, its own ops not (a compiled or fused call on the GPU)."""

        def call(*args: object, **kwargs: object) -> object:
            self.kernels[label] += 1
            with _disable_current_modes():
                return fn(*args, **kwargs)

        return call

    def fused(self, fn: Callable[..., object], writes: int) -> Callable[..., object]:
        """``fn`` as one compiled pass (``csbp.attention.merge.compiled`` on CUDA): one call, whose bytes
        are its tensor arguments read once, its first ``writes`` arguments written (in place) and its
        result written."""

        def call(*args: object) -> object:
            with _disable_current_modes():
                result = fn(*args)
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            written = tensors[:writes] + ([result] if isinstance(result, torch.Tensor) else [])
            self.kernels[fn.__name__.strip("_")] += 1
            self.bytes["(compiled passes)"] += sum(t.numel() * t.element_size() for t in tensors + written)
            return result

        return call


def _same_memory(dst: torch.Tensor, src: torch.Tensor) -> bool:
    return (dst.untyped_storage().data_ptr() == src.untyped_storage().data_ptr()
            and dst.storage_offset() == src.storage_offset() and dst.stride() == src.stride()
            and dst.shape == src.shape and dst.dtype == src.dtype)


@pytest.fixture
def gpu_branch_counter(monkeypatch: pytest.MonkeyPatch, cudnn_on_cpu: list[str]) -> PassCounter:
    """A ``PassCounter`` for which cuDNN's ops and the Flex forward and backward count as kernel calls (the
    cuDNN branch taken, with the stand-in), and the merges and ``row_delta`` that CUDA compiles as one
    pass each."""
    counter = PassCounter()
    for module, name in ((flash_ops, "_CUDNN_FORWARD"), (flash_ops, "_CUDNN_BACKWARD"),
                         (flex_module, "_flex_call"), (flex_module, "direct_flex_backward")):
        monkeypatch.setattr(module, name, counter.kernel(name.strip("_"), getattr(module, name)))
    def compiled_on_the_gpu(fn: Callable[..., object], tensor: torch.Tensor, dtype: torch.dtype) -> object:
        """``merge._on_cuda_compiled`` as on CUDA: fp32 work is one compiled pass."""
        if dtype != torch.float32:
            return fn
        return counter.fused(fn, writes=0 if fn is merge_module._row_delta else 2)

    monkeypatch.setattr(merge_module, "_on_cuda_compiled", compiled_on_the_gpu)
    return counter


def count_second_step(counter: PassCounter, step: Callable[[], None]) -> PassCounter:
    """``step()`` once (it compiles the direct Flex backward), then once more under ``counter``."""
    with flex_backward_mode("direct"):
        step()
        for tally in (counter.kernels, counter.ops, counter.bytes):
            tally.clear()
        with counter:
            step()
    return counter


def bf16_inputs(num_rows: int, num_keys: int) -> tuple[torch.Tensor, ...]:
    """``q, k, v`` needing gradients (16 query / 4 KV heads of 128, bf16) and ``dout``."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 16, num_rows, 128, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(1, 4, num_keys, 128, generator=gen).to(torch.bfloat16) for _ in "kv")
    return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), torch.randn_like(q)


@pytest.fixture
def counted_decomposed_step(gpu_branch_counter: PassCounter) -> Callable[[], tuple[PassCounter, int]]:
    """Counts training's decomposed form (L = 512, B = 64: cuDNN pieces plus one Flex residual with the
    noisy blocks, direct Flex backward) forward and backward through the local transport; gives the
    counter and the bytes of q."""
    seq_len, block = 512, 64
    rows = reference_layout(seq_len, block).rows
    plan = build_form(rows, seq_len, block, "flex", "decomposed", "flex", "pieces-cudnn")
    q, k, v, dout = bf16_inputs(2 * seq_len, 2 * seq_len)

    def step() -> None:
        for leaf in (q, k, v):
            leaf.grad = None
        local_attention_function(q, k, v, plan).backward(dout)

    return lambda: (count_second_step(gpu_branch_counter, step), q.numel() * q.element_size())


@needs_direct
def test_the_decomposed_step_moves_little_besides_its_kernels(
    counted_decomposed_step: Callable[[], tuple[PassCounter, int]],
) -> None:
    """Two causal cuDNN pieces (forward and backward), one Flex residual and two compiled merges (5.7x of
    q's bytes); besides them at most 26 ops, and at most 16.8x q's bytes in all (measured: 25 ops, 16.0x:
    the pieces' row slices of out and dout copied contiguous for cuDNN, 3.8x; their dq/dk/dv added in;
    dk/dv's fp32 buffers and their final cast). At L = 16K on an H200 (q: 128 MiB) that is about 2 GiB,
    ~0.6 ms of a step whose kernels alone take ~15 ms."""
    counter, q_bytes = counted_decomposed_step()
    assert dict(counter.kernels) == {
        "CUDNN_FORWARD": 2, "CUDNN_BACKWARD": 2, "flex_call": 1, "direct_flex_backward": 1, "rounded_merge": 2,
    }
    moved = sum(counter.bytes.values()) / q_bytes
    assert sum(counter.ops.values()) <= 26 and moved <= LOCAL_BUDGET, (sum(counter.ops.values()), moved, counter.bytes)


@needs_direct
def test_the_pass_counter_sees_an_fp32_buffer(
    monkeypatch: pytest.MonkeyPatch, counted_decomposed_step: Callable[[], tuple[PassCounter, int]],
) -> None:
    """The budget above can fail: with the pieces' out and dq in fp32 buffers (their fill, merge and cast
    passes) instead of onto the residual's, the same step moves past it."""
    monkeypatch.setattr(FlashPiecesPartial, "one_residual_and_piece_per_row", False)
    counter, q_bytes = counted_decomposed_step()
    moved = sum(counter.bytes.values()) / q_bytes
    assert moved > LOCAL_BUDGET * 1.2, moved


RANK_KERNELS = {"row_delta": 1, "direct_flex_backward": 1}
RANK_BUDGETS = {  # (topology, transport, clean kernel): (kernel calls, at most ops, at most x q's bytes; measured 2026-12-05)
    ("cp4/bp8", "collective", "pieces-cudnn"): (
        {**RANK_KERNELS, "merge_in_place": 3, "CUDNN_FORWARD": 6, "CUDNN_BACKWARD": 6, "flex_call": 1}, 97, 85.0,
    ),
    ("cp4", "collective", "pieces-cudnn"): (
        {**RANK_KERNELS, "merge_in_place": 2, "rounded_merge": 2, "CUDNN_FORWARD": 3, "CUDNN_BACKWARD": 3,
         "flex_call": 2, "direct_flex_backward": 2}, 58, 72.5,
    ),
    ("cp4/bp8", "streaming", "pieces-cudnn"): (
        {**RANK_KERNELS, "merge_in_place": 8, "CUDNN_FORWARD": 7, "CUDNN_BACKWARD": 7, "flex_call": 1}, 126, 110.0,
    ),
    ("cp4", "streaming", "pieces-cudnn"): (
        {**RANK_KERNELS, "merge_in_place": 4, "rounded_merge": 2, "CUDNN_FORWARD": 5, "CUDNN_BACKWARD": 5,
         "flex_call": 2, "direct_flex_backward": 2}, 101, 112.0,
    ),
    ("cp4/bp8", "collective", "generic"): ({**RANK_KERNELS, "merge_in_place": 1, "flex_call": 2, "direct_flex_backward": 2},
                                           22, 35.0),
    ("cp4", "collective", "generic"): ({**RANK_KERNELS, "merge_in_place": 1, "flex_call": 2, "direct_flex_backward": 2},
                                       22, 44.0),
    ("cp4/bp8", "streaming", "generic"): ({**RANK_KERNELS, "merge_in_place": 6, "flex_call": 4, "direct_flex_backward": 4},
                                          75, 80.5),
    ("cp4", "streaming", "generic"): ({**RANK_KERNELS, "merge_in_place": 3, "flex_call": 4, "direct_flex_backward": 4},
                                      45, 68.5),
}
"""Measured now: collective cp4/bp8 92 ops, 81.4x; cp4 55 ops, 68.8x; streaming cp4/bp8 121 ops, 104.7x;
cp4 96 ops, 106.8x. How they came down (``docs/benchmarks.md``): the collective ranks moved 104.1x (153
ops) and 122.2x (127 ops) before the dK/dV scatter wrote each row once and the merges and ``delta`` ran
compiled (81.4x, 92.4x); the streaming ranks 123.3x (183 ops) and 155.5x (180 ops) before a step read
its query rows as slices and merged and added into them in place instead of gathering them by index,
merging eagerly, writing back by index and ``index_add_``-ing dQ (104.7x, 117.4x); then the remote
partials' out and dQ stayed in the kernels' dtype (the CP-only rank's pieces merge onto their one
residual, rounding once): cp4 79.8x collective, 106.8x streaming; then the collective rank's local
partial's gradients too, each added to once in place (68.8x). The ring's collectives and shifts are
``LocalRing``'s local copies, counted as a wire's buffers would be written and read. With the generic
clean kernel (one Flex call per partial, the default): collective 20 ops, 33.2x and 20 ops, 41.7x;
streaming 71 ops, 76.6x and 42 ops, 65.2x (52.9x, 61.7x, 98.6x and 89.7x while the rings cast the remote
results to fp32 first; the collective ranks 44.9x and 53.7x before their local gradients stayed bf16)."""


@needs_direct
@pytest.mark.parametrize("text, transport, clean", sorted(RANK_BUDGETS))
def test_a_ring_ranks_step_moves_what_it_moved_besides_its_kernels(
    text: str, transport: str, clean: str, gpu_branch_counter: PassCounter,
) -> None:
    """The busiest rank of a CSBP and a CP-only ring (L = 1024, B = 64, cuDNN pieces or one Flex call per
    partial, collective and streaming transports) through ``csbp bench kernels``' rank step: its kernel
    calls, and a budget for the rest (the merges of the local and remote partials, the dK/dV scatter or
    accumulator, ``delta``, the casts)."""
    from csbp.bench.kernel_ranks import busiest_rank, parse_topologies, rank_step

    (topology,) = parse_topologies([text])
    rank, layout, _ = busiest_rank(topology, 1024, 64)
    q, k, v, dout = bf16_inputs(len(layout.rows), len(layout.rows))  # K/V of its own rows; the ring brings the rest
    inputs = tuple(t.detach() for t in (q, k, v, dout))
    with flex_backward_mode("direct"):
        step = rank_step(
            topology, rank, layout, 1024, 64, inputs, backend="flex", clean=clean, transport=transport,
        )
    counter = count_second_step(gpu_branch_counter, step)
    kernels, most_ops, most_moved = RANK_BUDGETS[text, transport, clean]
    moved = sum(counter.bytes.values()) / (q.numel() * q.element_size())
    assert dict(counter.kernels) == kernels
    assert sum(counter.ops.values()) <= most_ops and moved <= most_moved, (sum(counter.ops.values()), moved)
