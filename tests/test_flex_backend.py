"""The FlexAttention backend against the tiled kernels and the dense reference, on every layout's rows.

On CPU FlexAttention has no backward and its compiled kernel no lse, so these tests check:

* the ``BlockMask`` built from row intervals (no dense mask) is sound on every layout: every
  allowed pair lies in a scheduled block, every block marked full is entirely allowed, and it
  skips what it should;
* the flex forward (eager on CPU: the same ``mask_mod`` over the same rows) equals the tiles and
  the float64 reference in out and lse, with GQA, dead/padding rows and rows that see nothing, and
  the merge of flex partials equals one partial over the union;
* every transport's forward runs through the backend (local, DFlash here; the ring transports in
  their own test files);
* one compiled CPU forward (slow) runs the real block-sparse kernel with this BlockMask.

CUDA-only tests (forward and backward, bf16) are marked ``cuda`` and run in ``make gpu-check``.
"""

from __future__ import annotations

import math

import pytest
import torch

from csbp.attention.backends import (
    BlockDiagonalPartial,
    TilesPartial,
    check_backend_trains_on,
    plan_block_diagonal,
    plan_partial,
    resolve_backend,
)
from csbp.attention.documents import Documents
from csbp.attention.flex import FlexPartial, flex_shape_bucket
from csbp.attention.flex_backward import direct_backward_support, flex_backward_mode
from csbp.attention.flex_block_mask import rows_block_mask
from csbp.attention.layouts import (
    bp_only_layout,
    cp_zigzag_layout,
    csbp_layout,
    rank_layout,
    reference_layout,
)
from csbp.attention.merge import merge_partials
from csbp.attention.rows import Rows, allow_matrix
from csbp.attention.transports.factory import build_attention
from csbp.attention.transports.local import LocalAttentionFn
from csbp.dflash.layouts import block_query_rows, context_rows, full_packet
from csbp.parallel.comm import Comm, TrafficCounter
from csbp.parallel.groups import build_process_groups
from csbp.parallel.launch import run_local
from csbp.topology import Topology
from test_kernel import TOL64, dense_attention_reference, mixed_rows, random_qkv, reference_grads

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile.*")

L, B = 32, 4


def _layout_cases() -> dict[str, tuple[Rows, Rows, bool]]:
    """(query rows, key rows, causal_in_block) of every layout kind, incl. dead and padding rows."""
    cases = {}
    cases["reference"] = (reference_layout(L, B).rows,) * 2 + (False,)
    cases["reference_window"] = (reference_layout(L, B, window=6).rows,) * 2 + (False,)
    cp = cp_zigzag_layout(L, B, 2, 1).rows
    remote = cp_zigzag_layout(L, B, 2, 0).rows
    cases["cp_zigzag_remote"] = (cp, remote, False)
    cases["bp_only"] = (bp_only_layout(L, B, 2, 1).rows,) * 2 + (False,)
    fused = csbp_layout(L, B, 2, 4, 3).rows
    cases["csbp_remote_clean"] = (fused, csbp_layout(L, B, 2, 4, 0).rows.select(slice(8, None)), False)
    cases["causal_in_block"] = (reference_layout(L, B).rows,) * 2 + (True,)
    documents = Documents.from_doc_ids(torch.tensor([0] * 7 + [1] * 13 + [2] * 12))  # starts mid-block
    cases["documents"] = (reference_layout(L, B, documents=documents).rows,) * 2 + (False,)
    cases["cp_documents_remote"] = (
        cp_zigzag_layout(L, B, 2, 1, documents=documents).rows,
        cp_zigzag_layout(L, B, 2, 0, documents=documents).rows,
        False,
    )
    queries, keys = mixed_rows()
    cases["mixed_dead_padding"] = (queries, keys, False)
    anchors = torch.tensor([3, 9, 17, 26])
    packet = full_packet(anchors, torch.tensor([0, 0, 12, 12]))
    packet = type(packet)(packet.anchor_index, packet.anchors, packet.doc_start, torch.tensor([True, False, True, True]))
    block_rows = block_query_rows(packet, B, context="strict", window=7)
    cases["dflash_context"] = (block_rows, context_rows(torch.arange(L)), False)
    cases["dflash_blocks_causal"] = (block_rows, block_rows, True)
    return cases


CASES = _layout_cases()


def dense_flex_call(q, k, v, block_mask, scale):
    """A dense autograd stand-in for ``flex._flex_call`` over the same ``mask_mod`` (FlexAttention
    refuses CPU inputs that require grad, which ``recompute`` differentiates)."""
    from csbp.masks import dense_mask

    allow = dense_mask(block_mask.mask_mod, q.shape[2], k.shape[2])
    return dense_attention_reference(q, k, v, allow, 1 / math.sqrt(q.shape[-1]) if scale is None else scale)


def pin_flex_backward(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """Run the test with flex backward ``mode``; skip ``direct`` on a torch that cannot trace it."""
    import csbp.attention.flex_backward as flex_backward

    supported, reason = flex_backward.direct_backward_support()
    if mode == "direct" and not supported:
        pytest.skip(f"this torch cannot trace the direct backward: {reason}")
    monkeypatch.setattr(flex_backward, "_mode", mode)


def _scheduled(block_mask, num_q: int, num_k: int, full: bool) -> torch.Tensor:
    """``[Nq, Nk]`` True inside the (full, or partial) blocks of ``block_mask``."""
    num, index = (block_mask.full_kv_num_blocks, block_mask.full_kv_indices) if full else (
        block_mask.kv_num_blocks, block_mask.kv_indices
    )
    q_block, kv_block = block_mask.BLOCK_SIZE
    blocks = torch.zeros(index.shape[-2], index.shape[-1], dtype=torch.bool)
    for row in range(index.shape[-2]):
        blocks[row, index[0, 0, row, : num[0, 0, row]].long()] = True
    dense = blocks.repeat_interleave(q_block, 0).repeat_interleave(kv_block, 1)
    return dense[:num_q, :num_k]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("block", [4, 16])
def test_block_mask_from_intervals_is_sound(name: str, block: int) -> None:
    q_rows, k_rows, causal = CASES[name]
    allow = allow_matrix(q_rows, k_rows, causal_in_block=causal)
    mask = rows_block_mask(q_rows, k_rows, causal_in_block=causal, block=block)
    partial = _scheduled(mask, len(q_rows), len(k_rows), full=False)
    full = _scheduled(mask, len(q_rows), len(k_rows), full=True)
    assert not bool((partial & full).any()), "a block is both partial and full"
    assert bool((partial | full)[allow].all()), "an allowed pair lies in a skipped block"
    assert bool(allow[full].all()), "a block marked full holds a disallowed pair"


def test_block_mask_is_sparse_for_the_bd3_layout() -> None:
    rows = reference_layout(64, 8).rows  # 128 rows, blocks of 8 rows
    mask = rows_block_mask(rows, rows, block=8)
    partial = _scheduled(mask, 128, 128, full=False)
    full = _scheduled(mask, 128, 128, full=True)
    allow = allow_matrix(rows, rows)
    # block-aligned BD3: every scheduled block is exactly an allowed one, and all are full
    assert torch.equal(partial | full, allow)
    assert not bool(partial.any())


@pytest.mark.parametrize("name", list(CASES))
def test_flex_forward_equals_tiles_and_reference(name: str) -> None:
    q_rows, k_rows, causal = CASES[name]
    q, k, v = random_qkv(len(q_rows), len(k_rows), dim=16, seed=7)
    flex = plan_partial(q_rows, k_rows, backend="flex", causal_in_block=causal)
    tiles = plan_partial(q_rows, k_rows, backend="tiles", causal_in_block=causal, tile_rows=8)
    assert isinstance(flex, FlexPartial) and isinstance(tiles, TilesPartial)
    out_flex, lse_flex = flex.forward(q, k, v)
    out_tiles, lse_tiles = tiles.forward(q, k, v)
    allow = allow_matrix(q_rows, k_rows, causal_in_block=causal)
    out_ref, lse_ref = dense_attention_reference(q, k, v, allow, 1 / math.sqrt(q.shape[-1]))
    assert out_flex.dtype == torch.float64
    torch.testing.assert_close(out_flex, out_ref, **TOL64)
    torch.testing.assert_close(out_flex, out_tiles, **TOL64)
    torch.testing.assert_close(lse_flex, lse_ref, **TOL64)  # -inf on rows that see nothing
    torch.testing.assert_close(lse_flex, lse_tiles, **TOL64)


@pytest.mark.parametrize("dim", [8, 16])
def test_narrow_heads_reach_the_kernel_zero_padded_to_16_and_stay_exact(monkeypatch: pytest.MonkeyPatch, dim: int) -> None:
    """FlexAttention's CUDA kernel refuses heads narrower than 16 (inductor: "NYI: embedding dimension ...
    must be at least 16"; the verification and test models have 8, and ``auto`` is flex on CUDA): the
    kernel (forward, and the direct backward where this torch traces it) is handed heads zero-padded to 16
    with the real head dim's scale, and the results, cut back to ``dim``, equal the float64 reference."""
    import csbp.attention.flex as flex_module
    import csbp.attention.flex_backward as flex_backward

    backward_traced = direct_backward_support()[0]  # its probe (cached) runs before the spies
    seen: list[tuple[object, ...]] = []

    def spy_kernel(device: torch.device, dtype: torch.dtype):  # noqa: ANN202
        def call(q, k, v, **kwargs):  # noqa: ANN001, ANN003, ANN202
            seen.append(("forward", q.shape[-1], k.shape[-1], v.shape[-1], kwargs["scale"]))
            return flex_module._eager_flex(q, k, v, **kwargs)
        return call

    direct_call = flex_backward._direct_call

    def spy_direct(q, k, v, lse, dout, grad_lse, block_mask, scale, **kwargs):  # noqa: ANN001, ANN003, ANN202
        seen.append(("backward", q.shape[-1], k.shape[-1], v.shape[-1], dout.shape[-1], scale))
        return direct_call(q, k, v, lse, dout, grad_lse, block_mask, scale, **kwargs)

    monkeypatch.setattr(flex_module, "_kernel", spy_kernel)
    monkeypatch.setattr(flex_backward, "_direct_call", spy_direct)
    q_rows, k_rows, causal = CASES["mixed_dead_padding"]
    q, k, v = random_qkv(len(q_rows), len(k_rows), dim=dim, seed=7)
    allow = allow_matrix(q_rows, k_rows, causal_in_block=causal)
    partial = plan_partial(q_rows, k_rows, backend="flex", causal_in_block=causal)
    out, lse = partial.forward(q, k, v)
    assert seen == [("forward", 16, 16, 16, dim**-0.5 if dim < 16 else None)]
    out_ref, lse_ref = dense_attention_reference(q, k, v, allow, 1 / math.sqrt(dim))
    assert out.shape == q.shape
    torch.testing.assert_close(out, out_ref, **TOL64)
    torch.testing.assert_close(lse, lse_ref, **TOL64)
    if not backward_traced:
        return  # the CPU differentiates flex only by the direct backward (torch 2.11 and later)
    dout = torch.randn_like(q)
    with flex_backward_mode("direct"):
        grads = partial.backward(q, k, v, out, lse, dout)
    assert seen[1] == ("backward", 16, 16, 16, 16, 1 / math.sqrt(dim))
    _, _, grads_ref = reference_grads(q, k, v, allow, 1 / math.sqrt(dim), dout)
    for got, want in zip(grads, grads_ref):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, **TOL64)


def test_rows_that_see_nothing_and_empty_partials() -> None:
    q_rows, k_rows, _ = CASES["dflash_context"]
    dead = ~q_rows.live
    q, k, v = random_qkv(len(q_rows), len(k_rows), dim=16, seed=3)
    out, lse = plan_partial(q_rows, k_rows, backend="flex").forward(q, k, v)
    assert bool(dead.any()) and torch.equal(out[:, :, dead], torch.zeros_like(out[:, :, dead]))
    assert bool(torch.isneginf(lse[:, :, dead]).all()) and not bool(torch.isnan(out).any())
    nobody = Rows(k_rows.pos, k_rows.clean, k_rows.block, k_rows.ctx_start, k_rows.ctx_stop, torch.zeros_like(k_rows.live))
    empty = plan_partial(q_rows, nobody, backend="flex")
    assert empty.block_mask is None
    out, lse = empty.forward(q, k, v)
    assert not bool(out.any()) and bool(torch.isneginf(lse).all())


def test_a_partial_forward_takes_inputs_that_require_grad_on_the_cpu() -> None:
    """Inside the transports' autograd Function q/k/v still require grad; FlexAttention refuses such CPU
    inputs even under no_grad, so the partial hands it detached views (16-wide heads and rows filling a
    shape bucket: no padding copy that would hide it)."""
    rows = reference_layout(64, 4).rows
    assert flex_shape_bucket(len(rows)) == len(rows)
    q, k, v = (t.requires_grad_(True) for t in random_qkv(len(rows), len(rows), dim=16, seed=4))
    out, lse = plan_partial(rows, rows, backend="flex").forward(q, k, v)
    want, _ = plan_partial(rows, rows, backend="flex").forward(*(t.detach() for t in (q, k, v)))
    assert not out.requires_grad and torch.equal(out, want)


def test_merged_flex_partials_equal_one_partial_over_the_union() -> None:
    rows = reference_layout(L, B, window=9).rows
    noisy, clean = rows.select(~rows.clean), rows.select(rows.clean)
    q, k, v = random_qkv(len(rows), len(rows), dim=16, seed=5)
    split = len(noisy)
    part_noisy = plan_partial(rows, noisy, backend="flex").forward(q, k[:, :, :split], v[:, :, :split])
    part_clean = plan_partial(rows, clean, backend="flex").forward(q, k[:, :, split:], v[:, :, split:])
    out, lse = merge_partials(*part_noisy, *part_clean)
    out_all, lse_all = plan_partial(rows, rows, backend="flex").forward(q, k, v)
    torch.testing.assert_close(out, out_all, **TOL64)
    torch.testing.assert_close(lse, lse_all, **TOL64)


@pytest.mark.parametrize("causal", [False, True])
def test_flex_block_diagonal_equals_batched_blocks(causal: bool) -> None:
    rows = reference_layout(L, B).rows.select(slice(0, L))  # noisy rows: whole blocks
    q, k, v = random_qkv(L, L, dim=16, seed=2)
    flex = plan_block_diagonal(rows, block_size=B, backend="flex", causal_in_block=causal)
    tiles = plan_block_diagonal(rows, block_size=B, backend="tiles", causal_in_block=causal, diagonal="matmul")
    assert isinstance(tiles, BlockDiagonalPartial)
    for got, want in zip(flex.forward(q, k, v), tiles.forward(q, k, v)):
        torch.testing.assert_close(got, want, **TOL64)


@pytest.mark.parametrize("layout", ["reference", "bp_only"])
def test_local_transport_forward_on_flex_equals_tiles(layout: str) -> None:
    rows = CASES[layout][0]
    num_noisy = int((~rows.clean).sum())
    q, k, v = random_qkv(len(rows), len(rows), dim=16, seed=4)
    with torch.no_grad():
        out_flex = LocalAttentionFn(rows, num_noisy=num_noisy, backend="flex")(q, k, v)
        out_tiles = LocalAttentionFn(rows, num_noisy=num_noisy, backend="tiles")(q, k, v)
    torch.testing.assert_close(out_flex, out_tiles, **TOL64)


def test_dflash_draft_attention_forward_on_flex_equals_tiles() -> None:
    from csbp.dflash.attention import ShardedDraftAttention, build_draft_attention_plan

    block_rows, ctx_rows, _ = CASES["dflash_context"]
    q, k_blk, v_blk = random_qkv(len(block_rows), len(block_rows), dim=16, seed=8)
    _, k_ctx, v_ctx = random_qkv(len(block_rows), len(ctx_rows), dim=16, seed=9)
    outs = []
    for backend in ("flex", "tiles"):
        plan = build_draft_attention_plan(
            [block_rows], [True], [0, 0], ctx_rows, block_size=B, comm=None, backend=backend
        )
        with torch.no_grad():
            outs.append(ShardedDraftAttention(plan)(q, k_ctx, v_ctx, k_blk, v_blk, 1))
    torch.testing.assert_close(outs[0], outs[1], **TOL64)


def test_backend_resolution_and_fail_closed() -> None:
    assert resolve_backend("auto", "cpu") == "tiles"
    assert resolve_backend("auto", "cuda") == "flex"
    assert check_backend_trains_on("tiles", "cpu") == "tiles"
    with pytest.raises(ValueError, match="attention.backend=flex cannot train on cpu"):
        check_backend_trains_on("flex", "cpu")
    with pytest.raises(ValueError, match="attention backend must be one of"):
        resolve_backend("triton", "cpu")
    rows = CASES["reference"][0]
    q, k, v = random_qkv(len(rows), len(rows), dim=16)
    partial = plan_partial(rows, rows, backend="flex")
    out, lse = partial.forward(q, k, v)
    with pytest.raises(NotImplementedError, match="FlexAttention has no CPU backward"), flex_backward_mode("recompute"):
        partial.backward(q, k, v, out, lse, torch.ones_like(out))
    # csbp verify may run flex on the CPU, where the direct backward exists (and then only there)
    if direct_backward_support()[0]:
        assert check_backend_trains_on("flex", "cpu", verification=True) == "flex"
    with pytest.raises(ValueError, match="--backend=flex cannot train on cpu"):
        check_backend_trains_on("flex", "cpu", where="--backend")


def test_flex_on_cpu_for_verification_needs_the_direct_backward(monkeypatch: pytest.MonkeyPatch) -> None:
    import csbp.attention.backends as backends_module

    monkeypatch.setattr(backends_module, "direct_backward_support", lambda: (False, "Unsupported: old dynamo"))
    with pytest.raises(ValueError) as error:
        check_backend_trains_on("flex", "cpu", where="--backend", verification=True)
    assert str(error.value) == (
        "--backend=flex on cpu needs FlexAttention's direct backward, which this torch's compiler cannot trace "
        "(Unsupported: old dynamo); use --backend tiles, torch 2.11 or later, or a CUDA device"
    )


def test_cli_refuses_flex_on_cpu_before_launching(capsys: pytest.CaptureFixture[str]) -> None:
    from csbp.cli.main import main

    assert main(["bench", "attention", "--nproc", "1", "--backend", "flex"]) == 2
    assert "--backend=flex cannot train on cpu" in capsys.readouterr().err
    assert main(["bench", "attention", "--nproc", "1", "--backend", "tiles", "--diagonal", "flex"]) == 2
    assert "--diagonal=flex needs attention.backend flex" in capsys.readouterr().err


@pytest.mark.slow
def test_compiled_cpu_flex_kernel_runs_the_interval_block_mask() -> None:
    """The real block-sparse kernel (inductor, CPU: inference only, no lse) with our BlockMask."""
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)
    torch._dynamo.utils.counters.clear()
    for window in (None, 5):  # same shapes, new rows: must not recompile
        rows = reference_layout(64, 8, window=window).rows
        q, k, v = random_qkv(len(rows), len(rows), dim=16, dtype=torch.float32, seed=1)
        mask = rows_block_mask(rows, rows, block=32)
        with torch.no_grad():
            out = compiled(q, k, v, block_mask=mask, enable_gqa=True)
        want, _ = plan_partial(rows, rows, backend="tiles").forward(q, k, v)
        torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


# ----------------------------------------------------------------------------- ring transports


RING_SETUPS = (  # (topology, transport, window): CP-only, CSBP collective / streaming, windowed CSBP
    (Topology(cp=2), "collective", None),
    (Topology(cp=2, bp=2), "collective", None),
    (Topology(cp=2, bp=2), "streaming", None),
    (Topology(cp=2, bp=2), "collective", 5),
)


def _ring_forwards(rank: int, world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Worker: every ring setup's forward on this rank with the flex and the tiles backend."""
    results = []
    for topology, transport, window in RING_SETUPS:
        groups = build_process_groups(topology)
        layout = rank_layout(topology, groups.coords.local_rank, L, B, window=window)
        q, k, v = random_qkv(len(layout.rows), len(layout.rows), dim=16, seed=11 + rank)
        outs = []
        for backend in ("flex", "tiles"):
            attention = build_attention(
                topology, groups.coords.local_rank, layout, Comm(groups.ring, TrafficCounter()),
                block_size=B, transport=transport, window=window, backend=backend,
            )
            with torch.no_grad():
                outs.append(attention(q, k, v, 0))
        results.append((outs[0], outs[1]))
    return results


@pytest.mark.slow
@pytest.mark.multiprocess
def test_ring_transports_forward_on_flex_equal_tiles() -> None:
    """CP-only, CSBP collective, streaming and windowed transports: every partial through flex."""
    for rank_results in run_local(_ring_forwards, 2, timeout_s=240.0):
        for (flex_out, tiles_out), setup in zip(rank_results, RING_SETUPS):
            torch.testing.assert_close(flex_out, tiles_out, **TOL64, msg=lambda m, s=setup: f"{s}: {m}")


@pytest.mark.parametrize("mode", ["recompute", "direct"])
def test_flex_backward_through_the_merge_is_exact(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """The backward through the merge, with the flex forward kernel replaced by a dense autograd
    softmax over the same ``rows_mask`` (FlexAttention refuses CPU inputs that require grad): two
    partials (noisy keys, clean keys) merged, each differentiated from the merged statistics
    (``recompute``: the chain rule through the stand-in; ``direct``: FlexAttention's backward operator,
    traced by dynamo and run by aot_eager), summed, equal the float64 reference gradients."""
    import csbp.attention.flex as flex_module

    pin_flex_backward(monkeypatch, mode)
    monkeypatch.setattr(flex_module, "_flex_call", dense_flex_call)
    monkeypatch.setattr(flex_module, "_has_flex_backward", lambda device: True)
    rows = reference_layout(L, B, window=9).rows
    split = int((~rows.clean).sum())
    q, k, v = random_qkv(len(rows), len(rows), dim=16, seed=12)
    dout = torch.randn_like(q)
    parts = [
        (plan_partial(rows, rows.select(slice(0, split)), backend="flex"), slice(0, split)),
        (plan_partial(rows, rows.select(slice(split, None)), backend="flex"), slice(split, None)),
    ]
    outs = [p.forward(q, k[:, :, keys], v[:, :, keys]) for p, keys in parts]
    out, lse = merge_partials(*outs[0], *outs[1])
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for partial, keys in parts:
        dq_p, dk_p, dv_p = partial.backward(q, k[:, :, keys], v[:, :, keys], out, lse, dout)
        dq += dq_p
        dk[:, :, keys] += dk_p
        dv[:, :, keys] += dv_p
    _, _, grads_ref = reference_grads(q, k, v, allow_matrix(rows, rows), 1 / math.sqrt(q.shape[-1]), dout)
    for got, want in zip((dq, dk, dv), grads_ref):
        torch.testing.assert_close(got, want, **TOL64)


def test_float64_flex_on_cuda_runs_the_eager_kernel_and_is_refused_for_training() -> None:
    """The compiled FlexAttention kernel cannot be built in float64 on CUDA (a Triton compilation error
    on an H200, torch 2.11: the template accumulates in float32). Float64 goes to the exact eager form,
    for ``csbp verify --device cuda``; training in float64 with flex on CUDA is refused up front."""
    from csbp.attention.flex import _eager_flex, _eager_on_cuda, _kernel

    cuda = torch.device("cuda")
    assert _kernel(cuda, torch.float64) is _eager_flex
    assert _kernel(torch.device("cpu"), torch.float32) is _eager_flex
    meta64 = torch.empty(1, dtype=torch.float64, device="meta")
    assert not _eager_on_cuda(meta64)  # only CUDA routes the direct backward to recompute
    with pytest.raises(ValueError) as error:
        check_backend_trains_on("auto", "cuda", float64=True)
    assert str(error.value) == (
        "attention.backend=auto runs FlexAttention on CUDA, which cannot train in float64 (its compiled kernel has "
        "no float64 form); set attention.backend to tiles, or train.precision to fp32 or bf16"
    )
    assert check_backend_trains_on("auto", "cuda", float64=True, verification=True) == "flex"
    assert check_backend_trains_on("tiles", "cuda", float64=True) == "tiles"
    assert check_backend_trains_on("auto", "cuda") == "flex"
