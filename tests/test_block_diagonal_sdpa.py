"""The block-diagonal partial as one batched fused SDPA call (``csbp.attention.block_diagonal_sdpa``)
on CPU, against the dense float64 reference and the batched-matmul partial: forward, lse and the
backward from the *merged* statistics (merged with a clean-context partial), in float64 and float32,
with GQA, ``causal_in_block``, one and several samples, whole dead blocks; the kernel choice
(``csbp.attention.diagonal``: the run config's ``attention.diagonal``, threaded to the transports) and
its one-line errors."""

from __future__ import annotations

import math

import pytest
import torch

from csbp.attention.backends import BlockDiagonalPartial, plan_block_diagonal, plan_partial
from csbp.attention.block_diagonal_sdpa import SdpaBlockDiagonalPartial, build_sdpa_block_diagonal
from csbp.attention.diagonal import check_diagonal_backend, resolve_diagonal
from csbp.attention.layouts import reference_layout
from csbp.attention.merge import merge_partials
from csbp.attention.rows import Rows, allow_matrix
from csbp.attention.transports.local import LocalAttentionFn
from test_flex_backend import CASES
from test_kernel import TOL32, TOL64, random_qkv, reference_grads

L, B = 32, 4


def blocks_and_context(case: str) -> tuple[Rows, Rows, bool]:
    """(noisy block rows, clean context key rows, causal_in_block) of a layout."""
    if case == "dflash_dead_blocks":  # anchor 1 is a padding anchor: a whole dead block
        blocks, _, causal = CASES["dflash_blocks_causal"]
        return blocks, CASES["dflash_context"][1], causal
    rows = reference_layout(L, B).rows
    return rows.select(~rows.clean), rows.select(rows.clean), case == "bd3_causal"


def merged_reference_check(
    case: str, dtype: torch.dtype, heads: tuple[int, int], samples: int, diagonal: str = "sdpa",
    tol: dict[str, float] | None = None,
) -> None:
    """SDPA block partial merged with a tiles context partial == dense reference, forward and backward."""
    blocks, context, causal = blocks_and_context(case)
    n_blk, n_ctx = len(blocks), len(context)
    q, k, v = random_qkv(n_blk, n_blk + n_ctx, heads=heads[0], kv_heads=heads[1], dim=16, samples=samples, seed=3)
    dout = torch.randn(q.shape, dtype=q.dtype, generator=torch.Generator().manual_seed(4))
    allow = torch.cat(
        [allow_matrix(blocks, blocks, causal_in_block=causal), allow_matrix(blocks, context)], dim=1
    )
    scale = 1 / math.sqrt(q.shape[-1])
    out_ref, lse_ref, grads_ref = reference_grads(q, k, v, allow, scale, dout)

    block_plan = plan_block_diagonal(blocks, block_size=B, backend="tiles", causal_in_block=causal, diagonal=diagonal)
    assert isinstance(block_plan, SdpaBlockDiagonalPartial) and block_plan.fold_groups == (diagonal == "sdpa_fold")
    context_plan = plan_partial(blocks, context, backend="tiles")
    qx, kx, vx, doutx = (t.to(dtype) for t in (q, k, v, dout))
    k_blk, v_blk, k_ctx, v_ctx = kx[:, :, :n_blk], vx[:, :, :n_blk], kx[:, :, n_blk:], vx[:, :, n_blk:]
    out_blk, lse_blk = block_plan.forward(qx, k_blk, v_blk)
    assert out_blk.dtype == lse_blk.dtype == torch.promote_types(dtype, torch.float32)  # accumulation dtype
    out, lse = merge_partials(out_blk, lse_blk, *context_plan.forward(qx, k_ctx, v_ctx))
    dq_blk, dk_blk, dv_blk = block_plan.backward(qx, k_blk, v_blk, out, lse, doutx)
    dq_ctx, dk_ctx, dv_ctx = context_plan.backward(qx, k_ctx, v_ctx, out, lse, doutx)
    tol = tol or (TOL64 if dtype == torch.float64 else TOL32)
    torch.testing.assert_close(out.double(), out_ref, **tol)
    finite = torch.isfinite(lse_ref)
    torch.testing.assert_close(lse.double()[finite], lse_ref[finite], **tol)
    assert bool(torch.isneginf(lse[~finite]).all())
    grads = (dq_blk + dq_ctx, torch.cat([dk_blk, dk_ctx], 2), torch.cat([dv_blk, dv_ctx], 2))
    for got, want in zip(grads, grads_ref):
        assert bool(torch.isfinite(got).all())
        torch.testing.assert_close(got.double(), want, **tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("case", ["bd3", "bd3_causal", "dflash_dead_blocks"])
@pytest.mark.parametrize(("heads", "samples"), [((4, 2), 1), ((2, 2), 2), ((4, 1), 2)], ids=["gqa_s1", "mha_s2", "mqa_s2"])
@pytest.mark.parametrize("diagonal", ["sdpa", "sdpa_fold"])
def test_sdpa_block_diagonal_through_the_merge_matches_dense_reference(
    dtype: torch.dtype, case: str, heads: tuple[int, int], samples: int, diagonal: str
) -> None:
    merged_reference_check(case, dtype, heads, samples, diagonal)


@pytest.mark.parametrize("fold", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_equals_batched_matmul_partial_forward_and_backward(causal: bool, fold: bool) -> None:
    rows = reference_layout(64, 8).rows.select(slice(0, 64))
    q, k, v = random_qkv(64, 64, heads=6, kv_heads=2, dim=8, seed=5)
    dout = torch.randn_like(q)
    sdpa = build_sdpa_block_diagonal(rows, block_size=8, causal_in_block=causal, fold_groups=fold)
    matmul = BlockDiagonalPartial(8, causal)
    out, lse = matmul.forward(q, k, v, scale=0.3)
    for got, want in zip(sdpa.forward(q, k, v, scale=0.3), (out, lse)):
        torch.testing.assert_close(got, want, **TOL64)
    out_merged, lse_merged = out * 0.5, lse + 0.7  # any merged statistics: the backward takes them as given
    for got, want in zip(
        sdpa.backward(q, k, v, out_merged, lse_merged, dout, scale=0.3),
        matmul.backward(q, k, v, out_merged, lse_merged, dout, scale=0.3),
    ):
        torch.testing.assert_close(got, want, **TOL64)
    assert sdpa.kernel(q) == "cpu-flash"


def test_bfloat16_inputs_accumulate_in_float32() -> None:
    rows = reference_layout(L, B).rows.select(slice(0, L))
    q, k, v = random_qkv(L, L, dim=16, seed=6)
    partial = build_sdpa_block_diagonal(rows, block_size=B)
    out, lse = partial.forward(*(t.bfloat16() for t in (q, k, v)))
    assert out.dtype == lse.dtype == torch.float32
    out_ref, lse_ref = partial.forward(q, k, v)
    torch.testing.assert_close(out.double(), out_ref, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(lse.double(), lse_ref, atol=3e-2, rtol=3e-2)


def test_local_transport_on_tiles_runs_the_sdpa_diagonal_by_default_from_b16() -> None:
    small = LocalAttentionFn(reference_layout(L, B).rows, num_noisy=L, backend="tiles")
    assert isinstance(small.plan.block_plan, BlockDiagonalPartial)  # B = 4: the batched matmuls
    rows = reference_layout(64, 16).rows
    q, k, v = random_qkv(128, 128, dim=16, seed=7)
    default = LocalAttentionFn(rows, num_noisy=64, backend="tiles")
    assert isinstance(default.plan.block_plan, SdpaBlockDiagonalPartial)
    matmul = LocalAttentionFn(rows, num_noisy=64, backend="tiles", diagonal="matmul")
    assert isinstance(matmul.plan.block_plan, BlockDiagonalPartial)
    leaves = [[t.clone().requires_grad_(True) for t in (q, k, v)] for _ in range(2)]
    outs = [attn(*xs, 0) for attn, xs in zip((default, matmul), leaves)]
    for out in outs:
        out.square().sum().backward()
    torch.testing.assert_close(outs[0], outs[1], **TOL64)
    for a, b in zip(*leaves):
        torch.testing.assert_close(a.grad, b.grad, **TOL64)


@pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile.*")
def test_flex_backend_decomposes_with_the_sdpa_diagonal() -> None:
    rows = reference_layout(L, B).rows
    q, k, v = random_qkv(2 * L, 2 * L, dim=16, seed=8)
    mixed = LocalAttentionFn(rows, num_noisy=L, backend="flex")
    assert mixed.plan.block_size is None  # flex diagonal: one Flex call over the mixed mask
    decomposed = LocalAttentionFn(rows, num_noisy=L, backend="flex", diagonal="sdpa")
    assert decomposed.plan.block_size == B and isinstance(decomposed.plan.block_plan, SdpaBlockDiagonalPartial)
    with torch.no_grad():  # FlexAttention has no CPU backward: forward only here (CUDA: test_flex_cuda.py)
        torch.testing.assert_close(decomposed(q, k, v), mixed(q, k, v), **TOL64)


def test_diagonal_choice_and_errors() -> None:
    assert resolve_diagonal("auto", "tiles", 16) == "sdpa" and resolve_diagonal("auto", "tiles", 8) == "matmul"
    assert resolve_diagonal("auto", "flex", 4) == "flex" and resolve_diagonal("auto", "flex") == "flex"
    assert resolve_diagonal("matmul", "flex") == "matmul"
    with pytest.raises(ValueError, match="diagonal=flex needs attention.backend=flex"):
        resolve_diagonal("flex", "tiles")
    with pytest.raises(ValueError, match="diagonal must be one of"):
        resolve_diagonal("dense", "tiles")
    assert resolve_diagonal("sdpa", "tiles", 4) == "sdpa"  # an explicit choice holds at any B
    with pytest.raises(ValueError, match="diagonal must be one of"):
        plan_block_diagonal(reference_layout(L, B).rows.select(slice(0, L)), block_size=B, diagonal="fast")
    assert check_diagonal_backend("flex", "auto") == "flex"  # flex on CUDA; planning on CPU refuses it
    with pytest.raises(ValueError, match=r"^--diagonal=flex needs attention.backend flex .*got tiles"):
        check_diagonal_backend("flex", "tiles", where="--diagonal")
    with pytest.raises(ValueError, match="diagonal=flex needs attention.backend=flex"):
        LocalAttentionFn(reference_layout(L, B).rows, num_noisy=L, backend="auto", diagonal="flex")  # CPU: tiles


def _edit(rows: Rows, **fields: torch.Tensor) -> Rows:
    values = {name: getattr(rows, name) for name in ("pos", "clean", "block", "ctx_start", "ctx_stop", "live")}
    return Rows(**(values | fields))


def test_rows_that_are_not_whole_blocks_fail_with_one_line() -> None:
    rows = reference_layout(L, B).rows
    noisy = rows.select(slice(0, L))
    shuffled_pos = noisy.pos.clone()
    shuffled_pos[[0, 1]] = shuffled_pos[[1, 0]]
    half_dead = noisy.live.clone()
    half_dead[1] = False
    cases = {
        "divide the 30 rows": (noisy.select(slice(0, 30)), False),
        "noisy rows only": (rows.select(slice(L - 8, L + 8)), False),
        "share one block id": (_edit(noisy, block=noisy.block.roll(1)), False),
        "every block once": (_edit(noisy, block=noisy.block % 2), False),
        "increasing positions": (_edit(noisy, pos=shuffled_pos), True),
        "uniform liveness": (_edit(noisy, live=half_dead), False),
    }
    for message, (bad, causal) in cases.items():
        with pytest.raises(ValueError, match=message):
            build_sdpa_block_diagonal(bad, block_size=B, causal_in_block=causal)
    partial = build_sdpa_block_diagonal(noisy, block_size=B)
    q, k, v = random_qkv(L, L, dim=16)
    with pytest.raises(ValueError, match="built for 32 rows"):
        partial.forward(q[:, :, :16], k[:, :, :16], v[:, :, :16])


def test_flash_calls_match_the_cuda_kernels_signatures_on_fake_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA ``flash`` path's aten calls (argument order, GQA shapes, lse layout) checked against
    the kernels' meta registrations with fake CUDA tensors (no GPU needed). A CPU-only build cannot
    copy fake CUDA tensors, so ``contiguous`` is a clone here."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import csbp.attention.flash_ops as flash_ops

    monkeypatch.setattr(flash_ops, "flash_supported", lambda q: q.dtype == torch.bfloat16)
    if not torch.cuda.is_available():
        monkeypatch.setattr(torch.Tensor, "contiguous", lambda self, memory_format=torch.contiguous_format: (
            self if self.is_contiguous() else self.clone(memory_format=memory_format)))
    rows = reference_layout(64, 16).rows.select(slice(0, 64))
    for causal, fold in ((False, False), (True, False), (False, True)):
        partial = build_sdpa_block_diagonal(rows, block_size=16, causal_in_block=causal, fold_groups=fold)
        with FakeTensorMode(allow_non_fake_inputs=True):
            q = torch.empty(1, 8, 64, 128, dtype=torch.bfloat16, device="cuda")
            k, v = (torch.empty(1, 2, 64, 128, dtype=torch.bfloat16, device="cuda") for _ in "kv")
            assert partial.kernel(q) == "flash"
            out, lse = partial.forward(q, k, v)
            grads = partial.backward(q, k, v, out, lse, torch.empty_like(out))
        assert (out.shape, lse.shape, out.dtype, lse.dtype) == (q.shape, q.shape[:3], torch.float32, torch.float32)
        assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
        assert all(g.dtype == torch.float32 and g.device.type == "cuda" for g in grads)


def flash2_stand_in(calls: list[int]):  # noqa: ANN201
    """``(forward, backward)`` standing in for FlashAttention-2's aten ops on the CPU, with their
    conventions asserted (q's dtype in and out, float32 lse, ``None`` varlen arguments); ``calls``
    collects each forward's batch size."""

    def forward(q, k, v, dropout, causal, debug_mask, *, scale):  # noqa: ANN001, ANN202
        assert q.dtype == k.dtype == v.dtype == torch.bfloat16 and dropout == 0.0 and not debug_mask
        calls.append(q.shape[0])
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.float(), k.float(), v.float(), 0.0, causal, scale=scale
        )
        empty = torch.empty(0)
        return out.to(q.dtype), lse.float(), None, None, q.shape[2], k.shape[2], empty, empty, empty

    def backward(dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout, causal, seed, offset, *, scale):  # noqa: ANN001, ANN202, E501
        assert q.dtype == out.dtype == dout.dtype == torch.bfloat16 and lse.dtype == torch.float32
        assert lse.is_contiguous() and cum_q is None and cum_k is None and (max_q, max_k) == (q.shape[2], k.shape[2])
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.float(), q.float(), k.float(), v.float(), out.float(), lse, 0.0, causal, scale=scale
        )
        return tuple(g.to(q.dtype) for g in grads)

    return forward, backward


def test_cuda_flash_path_with_a_cpu_stand_in_kernel_matches_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA ``flash`` path's own code (casts, layouts, GQA folding, -inf rows, chunks of at most
    ``FLASH_MAX_BATCH`` blocks, the merged out/lse handed to the backward) run on the CPU with a
    stand-in for FlashAttention-2 that keeps its conventions (q's dtype in and out, float32 lse,
    ``None`` varlen arguments): bf16 through the merge against the float64 reference."""
    import csbp.attention.flash_ops as flash_ops

    calls: list[int] = []
    forward, backward = flash2_stand_in(calls)

    monkeypatch.setattr(SdpaBlockDiagonalPartial, "kernel", lambda self, q: "flash")
    monkeypatch.setattr(flash_ops, "flash_kernel", lambda q, cuda_kernel="flash": cuda_kernel)
    monkeypatch.setattr(flash_ops, "_FLASH_FORWARD", forward)
    monkeypatch.setattr(flash_ops, "_FLASH_BACKWARD", backward)
    monkeypatch.setattr(flash_ops, "FLASH_MAX_BATCH", 3)  # 8 (bd3) or 4 (dflash) blocks: calls of <= 3
    bf16 = {"atol": 3e-2, "rtol": 3e-2}
    for case, diagonal in (("bd3", "sdpa"), ("bd3", "sdpa_fold"), ("bd3_causal", "sdpa"), ("dflash_dead_blocks", "sdpa")):
        calls.clear()
        merged_reference_check(case, torch.bfloat16, (4, 2), 1, diagonal, tol=bf16)
        assert calls and max(calls) <= 3 and len(calls) > 1


def test_flash_batches_beyond_the_grid_limit_run_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    import csbp.attention.flash_ops as flash_ops

    monkeypatch.setattr(flash_ops, "FLASH_MAX_BATCH", 3)
    x, y = torch.arange(7), torch.arange(7) * 2
    chunks = flash_ops.batch_chunks(x, y)
    assert [len(c[0]) for c in chunks] == [3, 3, 1]
    assert torch.equal(torch.cat([c[1] for c in chunks]), y)
    assert len(flash_ops.batch_chunks(x[:3], y[:3])) == 1  # within the limit: one call, no slicing


def test_rank_plans_thread_the_diagonal_to_the_local_partial() -> None:
    from csbp.engine.block_diffusion import DocumentPlanner, build_rank_plan
    from csbp.engine.context import single_process_context

    ctx = single_process_context()
    default = build_rank_plan(ctx, 64, 16, backend="tiles")
    assert isinstance(default.attention.plan.block_plan, SdpaBlockDiagonalPartial)  # auto at B = 16
    matmul = build_rank_plan(ctx, 64, 16, backend="tiles", diagonal="matmul")
    assert isinstance(matmul.attention.plan.block_plan, BlockDiagonalPartial)
    planner = DocumentPlanner(ctx, 64, 16, backend="tiles", diagonal="matmul")
    (plan,) = planner.plans_for(torch.zeros(1, 64, dtype=torch.long))
    assert isinstance(plan.attention.plan.block_plan, BlockDiagonalPartial)
    with pytest.raises(ValueError, match="diagonal=flex needs attention.backend flex"):
        build_rank_plan(ctx, 64, 16, backend="tiles", diagonal="flex")


def test_the_run_config_chooses_the_trainers_diagonal() -> None:
    """``attention.diagonal`` of a run config reaches the trainer's rank plan (``rank_plan_for``)."""
    from csbp.config import config_from_dict
    from csbp.engine.context import single_process_context
    from csbp.training.trainer import rank_plan_for
    from test_config import with_changes

    data_parallel = {"topology.cp": 1, "topology.bp": 1, "topology.replicate_clean_prefix": False}
    kinds = {}
    for diagonal in ("auto", "matmul", "sdpa"):
        cfg = config_from_dict(with_changes(data_parallel | {"attention.diagonal": diagonal}))
        assert cfg.objective.block_size == 16 and cfg.attention.backend == "auto"
        kinds[diagonal] = type(rank_plan_for(cfg, single_process_context()).attention.plan.block_plan)
    assert kinds == {"auto": SdpaBlockDiagonalPartial, "matmul": BlockDiagonalPartial, "sdpa": SdpaBlockDiagonalPartial}
    flex_on_auto = config_from_dict(with_changes(data_parallel | {"attention.diagonal": "flex"}))  # valid: CUDA
    with pytest.raises(ValueError, match="diagonal=flex needs attention.backend=flex"):  # the CPU resolves tiles
        rank_plan_for(flex_on_auto, single_process_context())
