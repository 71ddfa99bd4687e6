"""Interval and block-diagonal attention kernels against a dense float64 masked-softmax reference.

Tolerances: float64 ``atol = rtol = 1e-10``; float32 against float64 ``1e-5``. The dense reference
and the row builders here are also used by ``test_local_attention.py``.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from csbp.attention import kernel, tile_plan
from csbp.attention.kernel import (
    block_diagonal_backward,
    block_diagonal_forward,
    build_tile_plan,
    interval_attention_backward,
    interval_attention_forward,
)
from csbp.attention.merge import merge_partials
from csbp.attention.rows import Rows, allow_matrix

TOL64 = {"atol": 1e-10, "rtol": 1e-10}
TOL32 = {"atol": 1e-5, "rtol": 1e-5}


# ----------------------------------------------------------------------------- helpers (shared)


def bd3_rows(
    noisy_pos: list[int], clean_pos: list[int], block_size: int, *, window: int | None = None
) -> Rows:
    """Packed ``[noisy ; clean]`` rows of the BD3 mask (csbp.md §3.3), optionally windowed."""
    noisy, clean = torch.tensor(noisy_pos, dtype=torch.long), torch.tensor(clean_pos, dtype=torch.long)
    noisy_stop = (noisy // block_size) * block_size
    if window is None:
        noisy_start, clean_start = torch.zeros_like(noisy), torch.zeros_like(clean)
        clean_stop = (clean // block_size + 1) * block_size
    else:
        noisy_start = (noisy_stop - (window - 1)).clamp(min=0)
        clean_start, clean_stop = (clean + 1 - window).clamp(min=0), clean + 1
    pos = torch.cat([noisy, clean])
    return Rows(
        pos=pos,
        clean=torch.cat(
            [torch.zeros_like(noisy, dtype=torch.bool), torch.ones_like(clean, dtype=torch.bool)]
        ),
        block=pos // block_size,
        ctx_start=torch.cat([noisy_start, clean_start]),
        ctx_stop=torch.cat([noisy_stop, clean_stop]),
        live=torch.ones(len(pos), dtype=torch.bool),
    )


def with_dead(rows: Rows, dead: list[int]) -> Rows:
    live = rows.live.clone()
    live[dead] = False
    return Rows(rows.pos, rows.clean, rows.block, rows.ctx_start, rows.ctx_stop, live)


def with_padding(rows: Rows, at: list[int]) -> Rows:
    """Insert an invisible (live=False) row before each index in ``at`` (indices into ``rows``)."""
    pad = Rows(
        *(t[:1].clone() for t in (rows.pos, rows.clean, rows.block, rows.ctx_start, rows.ctx_stop)),
        live=torch.zeros(1, dtype=torch.bool),
    )
    parts, prev = [], 0
    for index in sorted(at):
        parts += [rows.select(slice(prev, index)), pad]
        prev = index
    return Rows.cat([*parts, rows.select(slice(prev, None))])


def random_qkv(
    num_q: int,
    num_k: int,
    *,
    heads: int = 4,
    kv_heads: int = 2,
    dim: int = 8,
    samples: int = 2,
    dtype: torch.dtype = torch.float64,
    seed: int = 0,
) -> tuple[Tensor, Tensor, Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(samples, heads, num_q, dim, generator=gen, dtype=dtype)
    k = torch.randn(samples, kv_heads, num_k, dim, generator=gen, dtype=dtype)
    v = torch.randn(samples, kv_heads, num_k, dim, generator=gen, dtype=dtype)
    return q, k, v


def dense_attention_reference(
    q: Tensor, k: Tensor, v: Tensor, allow: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """Masked softmax over ``allow [Nq, Nk]`` with autograd; empty rows give out 0 / lse -inf, no NaN."""
    group = q.shape[1] // k.shape[1]
    k_full, v_full = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    has_key = allow.any(-1)  # [Nq]
    scores = (scale * q @ k_full.transpose(-1, -2)).masked_fill(~allow, float("-inf"))
    scores = scores.masked_fill(~has_key[:, None], 0.0)  # empty rows: finite, output zeroed below
    out = torch.softmax(scores, -1) @ v_full * has_key[:, None]
    lse = torch.logsumexp(scores, -1).masked_fill(~has_key, float("-inf"))
    return out, lse


def reference_grads(q: Tensor, k: Tensor, v: Tensor, allow: Tensor, scale: float, dout: Tensor):
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    out, lse = dense_attention_reference(*leaves, allow, scale)
    (out * dout).sum().backward()
    return out.detach(), lse.detach(), [t.grad for t in leaves]


def mixed_rows() -> tuple[Rows, Rows]:
    """Queries: noisy blocks 0, 2, 3 and clean rows with random windows, two dead rows. Keys: the
    same rows with padding rows inserted (L = 16, B = 4)."""
    rows = bd3_rows([0, 1, 2, 3, 8, 9, 10, 11, 12, 13, 14, 15], list(range(16)), 4)
    gen = torch.Generator().manual_seed(3)
    shrink = torch.randint(0, 6, (len(rows),), generator=gen)
    ctx_start = torch.minimum(rows.ctx_start + shrink, rows.ctx_stop)  # windows of random width
    rows = Rows(rows.pos, rows.clean, rows.block, ctx_start, rows.ctx_stop, rows.live)
    return with_dead(rows, [5, 20]), with_padding(rows, [4, 12, 19, 28, 28])


KEY_SETS = ["same_with_padding", "clean_only", "shuffled"]


def key_rows_for(case: str, q_rows: Rows, padded: Rows) -> Rows:
    if case == "same_with_padding":
        return padded
    if case == "clean_only":  # noisy rows of block 0 see nothing
        return padded.select(padded.clean)
    return padded.select(torch.randperm(len(padded), generator=torch.Generator().manual_seed(1)))


# ----------------------------------------------------------------------------- tests


@pytest.fixture(params=["fused", "fused_masks_per_call", "matmul"])
def kernel_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which tile kernel runs: ATen's fused CPU kernel with the plan's cached masks, the same with
    masks built per call (over the cache budget), or the matmul path other devices run."""
    if request.param == "fused_masks_per_call":
        monkeypatch.setattr(tile_plan, "MASK_CACHE_BYTES", 0)
    if request.param == "matmul":
        monkeypatch.setattr(kernel, "_fused_cpu", lambda q: False)
    return request.param


@pytest.mark.parametrize("shuffle_queries", [False, True])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("case", KEY_SETS)
def test_interval_forward_and_backward_match_dense_reference(
    case: str, causal: bool, shuffle_queries: bool, kernel_path: str
) -> None:
    q_rows, padded = mixed_rows()
    k_rows = key_rows_for(case, q_rows, padded)
    dead = [5, 20]
    if shuffle_queries:
        query_order = torch.randperm(len(q_rows), generator=torch.Generator().manual_seed(4))
        q_rows = q_rows.select(query_order)
        dead = [int(i) for i in torch.argsort(query_order)[dead]]
    q, k, v = random_qkv(len(q_rows), len(k_rows))
    dout = torch.randn_like(q)
    scale = 1 / math.sqrt(q.shape[-1])
    allow = allow_matrix(q_rows, k_rows, causal_in_block=causal)
    out_ref, lse_ref, grads_ref = reference_grads(q, k, v, allow, scale, dout)

    plan = build_tile_plan(q_rows, k_rows, tile_rows=4)
    out, lse = interval_attention_forward(q, k, v, q_rows, k_rows, causal_in_block=causal, plan=plan)
    grads = interval_attention_backward(
        q, k, v, q_rows, k_rows, out, lse, dout, causal_in_block=causal, plan=plan
    )

    empty = ~allow.any(-1)
    assert bool(empty[dead].all())
    if case == "clean_only":  # noisy block 0: no own-block keys, empty context
        assert bool(empty[~q_rows.clean & (q_rows.block == 0)].all())
    assert (plan.query_index is not None) == shuffle_queries
    torch.testing.assert_close(out, out_ref, **TOL64)
    torch.testing.assert_close(lse, lse_ref, **TOL64)
    assert bool((out[:, :, empty] == 0).all()) and bool((lse[:, :, empty] == float("-inf")).all())
    for grad, grad_ref in zip(grads, grads_ref):
        assert not grad.isnan().any()
        torch.testing.assert_close(grad, grad_ref, **TOL64)
    assert bool((grads[0][:, :, empty] == 0).all())
    assert plan.keys_reordered == (case == "shuffled" or case == "same_with_padding")


def test_keys_in_packed_order_with_trailing_padding(kernel_path: str) -> None:
    """Keys already in canonical order followed by dead padding rows (a wire shard padded with
    ``Rows.padded``): no key gather, and the gradients of the used keys land at their own rows (the
    padding rows get zero)."""
    rows = bd3_rows([0, 1, 2, 3, 8, 9, 10, 11], list(range(12)), 4)
    k_rows = rows.padded(len(rows) + 3)
    q, k, v = random_qkv(len(rows), len(k_rows), seed=7)
    dout = torch.randn_like(q)
    out_ref, lse_ref, grads_ref = reference_grads(q, k, v, allow_matrix(rows, k_rows), 1 / math.sqrt(8), dout)
    plan = build_tile_plan(rows, k_rows, tile_rows=4)
    assert plan.key_index is None and plan.num_used_keys == len(rows) < plan.num_keys
    out, lse = interval_attention_forward(q, k, v, rows, k_rows, plan=plan)
    grads = interval_attention_backward(q, k, v, rows, k_rows, out, lse, dout, plan=plan)
    torch.testing.assert_close(out, out_ref, **TOL64)
    torch.testing.assert_close(lse, lse_ref, **TOL64)
    for grad, grad_ref in zip(grads, grads_ref):
        torch.testing.assert_close(grad, grad_ref, **TOL64)
    assert bool((grads[1][:, :, len(rows):] == 0).all()) and bool((grads[2][:, :, len(rows):] == 0).all())


def test_key_split_partials_merge_and_backward_per_subset() -> None:
    q_rows, k_rows = mixed_rows()
    q, k, v = random_qkv(len(q_rows), len(k_rows), seed=5)
    dout = torch.randn_like(q)
    out_all, lse_all = interval_attention_forward(q, k, v, q_rows, k_rows)
    grads_all = interval_attention_backward(q, k, v, q_rows, k_rows, out_all, lse_all, dout)

    in_first = torch.rand(len(k_rows), generator=torch.Generator().manual_seed(2)) < 0.5
    subsets = [torch.nonzero(in_first).flatten(), torch.nonzero(~in_first).flatten()]
    partials = [
        interval_attention_forward(q, k[:, :, s], v[:, :, s], q_rows, k_rows.select(s)) for s in subsets
    ]
    out, lse = merge_partials(*partials[0], *partials[1])
    torch.testing.assert_close(out, out_all, **TOL64)
    torch.testing.assert_close(lse, lse_all, **TOL64)

    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for s in subsets:
        dq_s, dk_s, dv_s = interval_attention_backward(
            q, k[:, :, s], v[:, :, s], q_rows, k_rows.select(s), out, lse, dout
        )
        dq += dq_s
        dk[:, :, s], dv[:, :, s] = dk_s, dv_s
    for grad, grad_all in zip((dq, dk, dv), grads_all):
        torch.testing.assert_close(grad, grad_all, **TOL64)


@pytest.mark.parametrize("tile_rows", [1, 3, 64, 1000])
def test_tile_sizes_give_identical_results(tile_rows: int) -> None:
    q_rows, k_rows = mixed_rows()
    q, k, v = random_qkv(len(q_rows), len(k_rows), seed=7)
    dout = torch.randn_like(q)
    reference_plan = build_tile_plan(q_rows, k_rows, tile_rows=5)
    out_ref, lse_ref = interval_attention_forward(q, k, v, q_rows, k_rows, plan=reference_plan)
    grads_ref = interval_attention_backward(
        q, k, v, q_rows, k_rows, out_ref, lse_ref, dout, plan=reference_plan
    )
    plan = build_tile_plan(q_rows, k_rows, tile_rows=tile_rows)
    out, lse = interval_attention_forward(q, k, v, q_rows, k_rows, plan=plan)
    grads = interval_attention_backward(q, k, v, q_rows, k_rows, out, lse, dout, plan=plan)
    torch.testing.assert_close(out, out_ref, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, lse_ref, atol=1e-12, rtol=1e-12)
    for grad, grad_ref in zip(grads, grads_ref):
        torch.testing.assert_close(grad, grad_ref, atol=1e-12, rtol=1e-12)


def _covered_pairs(plan, num_q: int, num_k: int) -> Tensor:
    """``[Nq, Nk]`` bool: the (query, key) pairs the plan computes, in original row order."""
    covered = torch.zeros(num_q, num_k, dtype=torch.bool)
    q_index = torch.arange(num_q) if plan.query_index is None else plan.query_index
    k_index = torch.arange(plan.num_used_keys) if plan.key_index is None else plan.key_index
    for t in plan.tiles:
        keys = torch.cat([k_index[t.noisy_lo : t.noisy_hi], k_index[t.clean_lo : t.clean_hi]])
        covered[q_index[t.q_lo : t.q_hi, None], keys[None, :]] = True
    return covered


@pytest.mark.parametrize("shuffle_keys", [False, True])
def test_tile_plan_is_sparse_and_covers_the_mask_for_bd3_layout(shuffle_keys: bool) -> None:
    seq_len, block_size = 256, 4
    rows = bd3_rows(list(range(seq_len)), list(range(seq_len)), block_size)
    k_rows = rows
    if shuffle_keys:
        k_rows = rows.select(torch.randperm(len(rows), generator=torch.Generator().manual_seed(0)))
    plan = build_tile_plan(rows, k_rows, tile_rows=16)
    allow = allow_matrix(rows, k_rows)
    dense_pairs = len(rows) * len(k_rows)
    assert int(allow.sum()) == seq_len * block_size + seq_len**2  # csbp.md §3.1 size
    assert plan.keys_reordered == shuffle_keys
    assert plan.query_index is None  # packed order: tile rows are original rows
    assert plan.num_candidate_pairs < 0.3 * dense_pairs
    covered = _covered_pairs(plan, len(rows), len(k_rows))
    assert int(covered.sum()) == plan.num_candidate_pairs  # tiles never compute a pair twice
    assert not bool((allow & ~covered).any())
    # keys marked visible to the whole tile need no mask: check they are, and that they are most pairs
    k_index = torch.arange(len(k_rows)) if plan.key_index is None else plan.key_index
    unmasked_pairs = 0
    for t in plan.tiles:
        tile_keys = k_index[t.full_lo : t.full_hi]
        assert bool(allow[t.q_lo : t.q_hi, tile_keys].all())
        unmasked_pairs += (t.q_hi - t.q_lo) * len(tile_keys)
    assert unmasked_pairs > 0.6 * plan.num_candidate_pairs
    # the first tile (noisy blocks 0-3) touches its own 16 noisy keys and the 12 clean keys before
    # block 3, nothing of the later blocks
    first = plan.tiles[0]
    assert (first.q_hi - first.q_lo, first.num_keys) == (16, 16 + 12)


@pytest.mark.parametrize("causal", [False, True])
def test_additive_masks_are_the_predicate_and_cached_within_budget(
    causal: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = bd3_rows(list(range(32)), list(range(32)), 4)
    plan = build_tile_plan(rows, rows, tile_rows=8)
    allow = allow_matrix(rows, rows, causal_in_block=causal)
    masks = plan.additive_masks(causal, torch.float32)
    assert masks is not None and plan.additive_masks(causal, torch.float32) is masks  # built once
    assert all(m is not None for m in masks)  # two blocks per tile: every tile holds a disallowed pair
    one_block_tiles = build_tile_plan(rows, rows, tile_rows=4).additive_masks(causal, torch.float32)
    assert one_block_tiles is not None and any(m is None for m in one_block_tiles)  # no mask where none is needed
    for tile, mask in zip(plan.tiles, masks):
        keys = torch.cat([torch.arange(tile.noisy_lo, tile.noisy_hi), torch.arange(tile.clean_lo, tile.clean_hi)])
        tile_allow = allow[tile.q_lo : tile.q_hi][:, keys]
        expected = torch.zeros(tile_allow.shape).masked_fill(~tile_allow, float("-inf"))
        torch.testing.assert_close(torch.zeros(tile_allow.shape) if mask is None else mask, expected)
    # over the clean keys every tile (noisy or clean rows) ends in the same block-causal corner: one buffer
    shared = build_tile_plan(rows, rows.select(slice(32, None)), tile_rows=8).additive_masks(causal, torch.float32)
    assert shared is not None and len(shared) == 8
    assert len({m.untyped_storage().data_ptr() for m in shared if m is not None}) == 1
    monkeypatch.setattr(tile_plan, "MASK_CACHE_BYTES", 1)  # over budget: callers build one tile's at a time
    assert build_tile_plan(rows, rows, tile_rows=8).additive_masks(causal, torch.float32) is None


def test_skipped_tiles_and_empty_inputs() -> None:
    q_rows = with_dead(bd3_rows([0, 1, 2, 3], [0, 1, 2, 3], 2), [0, 1])
    k_rows = bd3_rows([4, 5], [], 2)  # keys of another block only
    plan = build_tile_plan(q_rows, k_rows, tile_rows=2)
    assert plan.tiles == ()
    q, k, v = random_qkv(len(q_rows), len(k_rows))
    out, lse = interval_attention_forward(q, k, v, q_rows, k_rows, plan=plan)
    assert bool((out == 0).all()) and bool((lse == float("-inf")).all())
    dq, dk, dv = interval_attention_backward(
        q, k, v, q_rows, k_rows, out, lse, torch.randn_like(q), plan=plan
    )
    assert bool((dq == 0).all()) and bool((dk == 0).all()) and bool((dv == 0).all())
    no_keys = Rows.empty()
    out, lse = interval_attention_forward(q, k[:, :, :0], v[:, :, :0], q_rows, no_keys)
    assert out.shape == q.shape and bool((lse == float("-inf")).all())


@pytest.mark.parametrize("heads", [(4, 2), (2, 2), (4, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_block_diagonal_matches_interval_path(causal: bool, heads: tuple[int, int]) -> None:
    block_size = 4
    rows = bd3_rows(list(range(4, 20)), [], block_size)
    q, k, v = random_qkv(len(rows), len(rows), heads=heads[0], kv_heads=heads[1], seed=11)
    dout = torch.randn_like(q)
    out_ref, lse_ref = interval_attention_forward(q, k, v, rows, rows, causal_in_block=causal)
    grads_ref = interval_attention_backward(
        q, k, v, rows, rows, out_ref, lse_ref, dout, causal_in_block=causal
    )
    out, lse = block_diagonal_forward(q, k, v, block_size=block_size, causal=causal)
    grads = block_diagonal_backward(q, k, v, out, lse, dout, block_size=block_size, causal=causal)
    torch.testing.assert_close(out, out_ref, **TOL64)
    torch.testing.assert_close(lse, lse_ref, **TOL64)
    for grad, grad_ref in zip(grads, grads_ref):
        torch.testing.assert_close(grad, grad_ref, **TOL64)


def test_explicit_scale_and_float32_agree_with_float64() -> None:
    q_rows, k_rows = mixed_rows()
    q, k, v = random_qkv(len(q_rows), len(k_rows), seed=13)
    dout = torch.randn_like(q)
    plan = build_tile_plan(q_rows, k_rows, tile_rows=8)
    out64, lse64 = interval_attention_forward(q, k, v, q_rows, k_rows, scale=0.3, plan=plan)
    grads64 = interval_attention_backward(q, k, v, q_rows, k_rows, out64, lse64, dout, scale=0.3, plan=plan)
    allow = allow_matrix(q_rows, k_rows)
    out_ref, _, _ = reference_grads(q, k, v, allow, 0.3, dout)
    torch.testing.assert_close(out64, out_ref, **TOL64)

    q32, k32, v32, dout32 = (t.float() for t in (q, k, v, dout))
    out32, lse32 = interval_attention_forward(q32, k32, v32, q_rows, k_rows, scale=0.3, plan=plan)
    grads32 = interval_attention_backward(
        q32, k32, v32, q_rows, k_rows, out32, lse32, dout32, scale=0.3, plan=plan
    )
    assert out32.dtype == torch.float32 and grads32[1].dtype == torch.float32
    torch.testing.assert_close(out32.double(), out64, **TOL32)
    torch.testing.assert_close(lse32.double(), lse64, **TOL32)
    for grad32, grad64 in zip(grads32, grads64):
        torch.testing.assert_close(grad32.double(), grad64, **TOL32)


def test_bfloat16_inputs_accumulate_in_float32() -> None:
    q_rows, k_rows = mixed_rows()
    q, k, v = random_qkv(len(q_rows), len(k_rows), seed=17)
    out_bf, lse_bf = interval_attention_forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), q_rows, k_rows)
    out, lse = interval_attention_forward(q, k, v, q_rows, k_rows)
    assert out_bf.dtype == torch.float32 and lse_bf.dtype == torch.float32
    torch.testing.assert_close(out_bf.double(), out, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(lse_bf.double(), lse, atol=3e-2, rtol=3e-2)


def test_invalid_inputs_raise() -> None:
    q_rows, k_rows = mixed_rows()
    q, k, v = random_qkv(len(q_rows), len(k_rows), heads=3, kv_heads=2)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        interval_attention_forward(q, k, v, q_rows, k_rows)
    q, k, v = random_qkv(len(q_rows), len(k_rows))
    with pytest.raises(ValueError, match="rows"):
        interval_attention_forward(q, k, v, q_rows, q_rows)
    plan = build_tile_plan(q_rows, q_rows)
    with pytest.raises(ValueError, match="rebuild"):
        interval_attention_forward(q, k, v, q_rows, k_rows, plan=plan)
    with pytest.raises(ValueError, match="tile_rows"):
        build_tile_plan(q_rows, k_rows, tile_rows=0)
    with pytest.raises(ValueError, match="block_size"):
        block_diagonal_forward(q, q[:, :2], q[:, :2], block_size=5)
