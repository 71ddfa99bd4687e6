"""Block-sparse attention kernels over interval row metadata, returning ``(out, lse)`` partials with
an explicit backward (csbp.md §3.2, §9.1, §9.2). Pure PyTorch; runs on CPU and GPU.

Every transport computes attention as partials over key subsets (the local noisy block, clean
K/V from other ranks, ...), merges them with ``csbp.attention.merge`` and computes the backward of
each subset from the *final* merged ``(out, lse)``, so the dK/dV of a subset can be routed to the
rank that owns those rows. Hence the API:

* ``interval_attention_forward(q, k, v, q_rows, k_rows)`` -> ``(out, lse)`` over one key set under
  the ``Rows`` predicate (``csbp.attention.rows.allow_matrix``);
* ``interval_attention_backward(..., out, lse, dout)`` -> ``(dq, dk, dv)`` for that key set, using
  ``P = exp(scale*QK^T - lse)``, ``D = rowsum(dout*out)``, ``dV = P^T dout``,
  ``dS = P*(dout V^T - D)``, ``dQ = scale dS K``, ``dK = scale dS^T Q``;
* ``block_diagonal_forward`` / ``block_diagonal_backward``: the dense fast path for noisy rows
  that are whole blocks attending only to their own block (batched matmuls, no loop over blocks).

**Tiling.** The interval kernels loop over the tiles of a ``TilePlan`` (``csbp.attention.tile_plan``,
re-exported here): ``build_tile_plan(q_rows, k_rows)`` once per step, passed to every layer's
forward and backward, so the work is proportional to the mask, not to ``Nq * Nk``. Each tile's
mask comes from the plan (evaluated once per step from ``csbp.masks.rows_mask``). On CPU a tile
runs through ATen's fused flash-attention kernel with that mask as an additive bias
(``csbp.attention.fused_cpu``): its forward returns the lse, and its backward takes ``out``/``lse``
as inputs, so it is given the *final* merged statistics, which is exactly the explicit backward
below. Elsewhere the tile runs as matmuls and an explicit softmax (the code below).

**Dtypes.** Scores, statistics and results are in the accumulation dtype (``merge.accumulation_dtype``:
float64 for float64 inputs, float32 otherwise, including bf16/fp16): ``out``, ``lse``, ``dq``,
``dk`` and ``dv`` are returned in that dtype; callers cast. Rows that see no key get ``out = 0``,
``lse = -inf`` and zero gradients, never NaN. ``scale`` defaults to ``1/sqrt(d)``.

Shape legend: ``S`` samples, ``Hq``/``Hkv`` query/KV heads, ``G = Hq // Hkv`` query heads per KV
head (query head ``h`` uses KV head ``h // G``), ``Nq``/``Nk`` rows, ``d`` head dim, ``T`` rows of
a tile, ``C`` candidate keys of a tile, ``nb`` blocks of ``B`` rows. Internally queries live in a
grouped layout ``[S, Hkv, Nq, G, d]`` so a tile is one ``[S, Hkv, T*G, d]`` matmul operand.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from csbp.attention.fused_cpu import fused_interval_backward, fused_interval_forward
from csbp.attention.merge import accumulation_dtype, row_delta
from csbp.attention.rows import Rows
from csbp.attention.tile_plan import (
    DEFAULT_TILE_ROWS,
    TilePlan,
    add_tile_keys,
    build_tile_plan,
    gather_tile_keys,
    mask_tile_scores,
)

__all__ = [
    "DEFAULT_TILE_ROWS",
    "TilePlan",
    "block_diagonal_backward",
    "block_diagonal_forward",
    "build_tile_plan",
    "interval_attention_backward",
    "interval_attention_forward",
]


def interval_attention_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_rows: Rows,
    k_rows: Rows,
    *,
    scale: float | None = None,
    causal_in_block: bool = False,
    plan: TilePlan | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention of ``q [S, Hq, Nq, d]`` over ``k, v [S, Hkv, Nk, d]`` under the ``Rows`` predicate.

    Returns ``out [S, Hq, Nq, d]`` and ``lse [S, Hq, Nq]`` in the accumulation dtype. ``plan`` must
    come from ``build_tile_plan(q_rows, k_rows)``; it is built here when omitted.
    """
    plan = _checked_plan(q, k, v, q_rows, k_rows, plan)
    dtype = accumulation_dtype(q, k, v)
    scale = resolve_scale(scale, q)
    k_used, v_used = _canonical_keys(k, plan, dtype), _canonical_keys(v, plan, dtype)  # [S, Hkv, n, d]
    if _fused_cpu(q):
        out, lse = fused_interval_forward(
            _canonical_rows(q, plan, dtype), k_used, v_used, plan, causal_in_block, scale
        )
        return _original_rows(out, plan), _original_rows(lse, plan)
    num_samples, num_kv_heads, group = q.shape[0], k.shape[1], q.shape[1] // k.shape[1]
    q_scaled = _grouped_rows(q, num_kv_heads, plan.query_index, dtype) * scale  # [S, Hkv, Nq, G, d]
    out_g = q_scaled.new_zeros(*q_scaled.shape[:-1], v.shape[-1])  # [S, Hkv, Nq, G, d]
    lse_g = q_scaled.new_full(q_scaled.shape[:-1], float("-inf"))  # [S, Hkv, Nq, G]
    for tile, strips in zip(plan.tiles, plan.tile_strips(causal_in_block)):
        rows = slice(tile.q_lo, tile.q_hi)
        num_rows = tile.q_hi - tile.q_lo
        q_tile = q_scaled[:, :, rows].reshape(num_samples, num_kv_heads, num_rows * group, -1)
        k_tile, v_tile = gather_tile_keys(k_used, tile), gather_tile_keys(v_used, tile)
        scores = q_tile @ k_tile.transpose(-1, -2)  # [S, Hkv, T*G, C]
        mask_tile_scores(scores, strips, group)
        out_tile, lse_tile = _softmax_forward(scores, v_tile)
        out_g[:, :, rows] = out_tile.view(num_samples, num_kv_heads, num_rows, group, -1)
        lse_g[:, :, rows] = lse_tile.view(num_samples, num_kv_heads, num_rows, group)
    inverse = plan.query_inverse
    return _ungrouped_rows(out_g, inverse), _ungrouped_lse(lse_g, inverse)


def interval_attention_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_rows: Rows,
    k_rows: Rows,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    *,
    scale: float | None = None,
    causal_in_block: bool = False,
    plan: TilePlan | None = None,
    delta: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq [S, Hq, Nq, d], dk, dv [S, Hkv, Nk, d])`` of this key set's share of attention.

    ``out``/``lse`` are the *final* merged output and log-sum-exp of the query rows over all key
    sets, ``dout`` the gradient of ``out``. ``delta = rowsum(dout * out)`` ``[S, Hq, Nq]`` may be
    passed when computed once for several key sets. Results are in the accumulation dtype; dq is
    this key set's contribution (sum the dq of all key sets).
    """
    plan = _checked_plan(q, k, v, q_rows, k_rows, plan)
    dtype = accumulation_dtype(q, k, v)
    scale = resolve_scale(scale, q)
    k_used, v_used = _canonical_keys(k, plan, dtype), _canonical_keys(v, plan, dtype)  # [S, Hkv, n, d]
    if _fused_cpu(q):  # the fused backward computes delta = rowsum(dout * out) itself
        dq, dk_used, dv_used = fused_interval_backward(
            _canonical_rows(q, plan, dtype),
            k_used,
            v_used,
            _canonical_rows(out, plan, dtype),
            _canonical_rows(lse, plan, dtype),
            _canonical_rows(dout, plan, dtype),
            plan,
            causal_in_block,
            scale,
        )
        return _original_rows(dq, plan), _original_keys(dk_used, plan), _original_keys(dv_used, plan)
    num_samples, num_kv_heads, group = q.shape[0], k.shape[1], q.shape[1] // k.shape[1]
    if delta is None:
        delta = row_delta(dout, out, dtype)
    q_scaled = _grouped_rows(q, num_kv_heads, plan.query_index, dtype) * scale  # [S, Hkv, Nq, G, d]
    dout_g = _grouped_rows(dout, num_kv_heads, plan.query_index, dtype)  # [S, Hkv, Nq, G, d]
    lse_g = _grouped_lse(lse, num_kv_heads, plan.query_index, dtype)  # [S, Hkv, Nq, G]
    delta_g = _grouped_lse(delta, num_kv_heads, plan.query_index, dtype)  # [S, Hkv, Nq, G]
    dq_g = torch.zeros_like(q_scaled)
    dk_used, dv_used = torch.zeros_like(k_used), torch.zeros_like(v_used)
    for tile, strips in zip(plan.tiles, plan.tile_strips(causal_in_block)):
        rows = slice(tile.q_lo, tile.q_hi)
        num_rows = tile.q_hi - tile.q_lo
        flat = (num_samples, num_kv_heads, num_rows * group)
        k_tile, v_tile = gather_tile_keys(k_used, tile), gather_tile_keys(v_used, tile)
        scores = q_scaled[:, :, rows].reshape(*flat, -1) @ k_tile.transpose(-1, -2)  # [S, Hkv, T*G, C]
        mask_tile_scores(scores, strips, group)
        dq_tile, dk_tile, dv_tile = _softmax_backward(
            scores,
            lse_g[:, :, rows].reshape(flat),
            delta_g[:, :, rows].reshape(flat),
            q_scaled[:, :, rows].reshape(*flat, -1),
            k_tile,
            v_tile,
            dout_g[:, :, rows].reshape(*flat, -1),
            scale,
        )
        dq_g[:, :, rows] = dq_tile.view(num_samples, num_kv_heads, num_rows, group, -1)
        add_tile_keys(dk_used, dk_tile, tile)
        add_tile_keys(dv_used, dv_tile, tile)
    dq = _ungrouped_rows(dq_g, plan.query_inverse)
    return dq, _original_keys(dk_used, plan), _original_keys(dv_used, plan)


def block_diagonal_forward(
    q: Tensor, k: Tensor, v: Tensor, *, block_size: int, scale: float | None = None, causal: bool = False
) -> tuple[Tensor, Tensor]:
    """Each block of ``block_size`` consecutive rows attends only to itself (lower-triangular by row
    order inside the block when ``causal``). ``q [S, Hq, N, d]``, ``k, v [S, Hkv, N, d]`` hold the
    same rows. Returns ``(out [S, Hq, N, d], lse [S, Hq, N])`` in the accumulation dtype."""
    _check_block_inputs(q, k, v, block_size)
    dtype = accumulation_dtype(q, k, v)
    scale = resolve_scale(scale, q)
    q_scaled = _blocked_queries(q, k.shape[1], block_size, dtype) * scale  # [S, Hkv, nb, G*B, d]
    scores = q_scaled @ _blocked_keys(k, block_size, dtype).transpose(-1, -2)  # [S, Hkv, nb, G*B, B]
    if causal:
        _mask_causal_blocks(scores, q.shape[1] // k.shape[1], block_size)
    out_b, lse_b = _softmax_forward(scores, _blocked_keys(v, block_size, dtype))
    return _unblocked_rows(out_b, q.shape[1]), _unblocked_rows(lse_b.unsqueeze(-1), q.shape[1]).squeeze(-1)


def block_diagonal_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    *,
    block_size: int,
    scale: float | None = None,
    causal: bool = False,
    delta: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` of the block-diagonal share of attention from the final merged
    ``out``/``lse`` and ``dout`` (see ``interval_attention_backward``); accumulation dtype."""
    _check_block_inputs(q, k, v, block_size)
    dtype = accumulation_dtype(q, k, v)
    scale = resolve_scale(scale, q)
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    if delta is None:
        delta = row_delta(dout, out, dtype)
    q_scaled = _blocked_queries(q, num_kv_heads, block_size, dtype) * scale  # [S, Hkv, nb, G*B, d]
    k_b, v_b = _blocked_keys(k, block_size, dtype), _blocked_keys(v, block_size, dtype)  # [S, Hkv, nb, B, d]
    scores = q_scaled @ k_b.transpose(-1, -2)  # [S, Hkv, nb, G*B, B]
    if causal:
        _mask_causal_blocks(scores, num_heads // num_kv_heads, block_size)
    lse_b = _blocked_queries(lse.unsqueeze(-1), num_kv_heads, block_size, dtype).squeeze(-1)
    delta_b = _blocked_queries(delta.unsqueeze(-1), num_kv_heads, block_size, dtype).squeeze(-1)
    dout_b = _blocked_queries(dout, num_kv_heads, block_size, dtype)
    dq_b, dk_b, dv_b = _softmax_backward(scores, lse_b, delta_b, q_scaled, k_b, v_b, dout_b, scale)
    return _unblocked_rows(dq_b, num_heads), dk_b.flatten(2, 3), dv_b.flatten(2, 3)


# ----------------------------------------------------------------------------- softmax core


def _fused_cpu(q: Tensor) -> bool:
    """On CPU a tile runs through ATen's fused flash-attention kernel (forward with lse, and the
    backward from given ``out``/``lse``: exactly the explicit backward from merged statistics)."""
    return q.device.type == "cpu"


def _softmax_forward(scores: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """``scores [..., R, C]`` (scaled, masked with -inf; consumed), ``v [..., C, d]`` ->
    ``(out [..., R, d], lse [..., R])`` with empty rows ``0`` / ``-inf``."""
    row_max = scores.amax(-1, keepdim=True)
    row_max = row_max.masked_fill(row_max == float("-inf"), 0.0)
    probs = scores.sub_(row_max).exp_()
    row_sum = probs.sum(-1, keepdim=True)  # >= 1 for a row with a key (its max term is exp(0))
    out = (probs @ v).div_(row_sum.clamp_min(1.0))
    lse = (row_max + row_sum.log()).squeeze(-1)
    return out, lse


def _softmax_backward(
    scores: Tensor,
    lse: Tensor,
    delta: Tensor,
    q_scaled: Tensor,
    k: Tensor,
    v: Tensor,
    dout: Tensor,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """From masked ``scores [..., R, C]`` (consumed), final ``lse``/``delta [..., R]`` -> ``(dq [..., R, d],
    dk [..., C, d], dv [..., C, d])``. ``q_scaled`` already carries ``scale``."""
    lse_safe = lse.masked_fill(lse == float("-inf"), float("inf"))  # empty rows: P = 0
    probs = scores.sub_(lse_safe.unsqueeze(-1)).exp_()
    dv = probs.transpose(-1, -2) @ dout
    dscores = probs.mul_((dout @ v.transpose(-1, -2)).sub_(delta.unsqueeze(-1)))
    dq = (dscores @ k).mul_(scale)
    dk = dscores.transpose(-1, -2) @ q_scaled
    return dq, dk, dv


# ----------------------------------------------------------------------------- layouts


def _grouped_rows(x: Tensor, num_kv_heads: int, index: Tensor | None, dtype: torch.dtype) -> Tensor:
    """``[S, Hq, N, d]`` -> ``[S, Hkv, N, G, d]`` in canonical row order and ``dtype``."""
    if index is not None:
        x = x.index_select(2, index)
    return x.unflatten(1, (num_kv_heads, -1)).transpose(2, 3).to(dtype).contiguous()


def _grouped_lse(x: Tensor, num_kv_heads: int, index: Tensor | None, dtype: torch.dtype) -> Tensor:
    """``[S, Hq, N]`` -> ``[S, Hkv, N, G]``."""
    return _grouped_rows(x.unsqueeze(-1), num_kv_heads, index, dtype).squeeze(-1)


def _ungrouped_rows(x_g: Tensor, inverse: Tensor | None) -> Tensor:
    """``[S, Hkv, N, G, d]`` in canonical order -> ``[S, Hq, N, d]`` in original order."""
    x = x_g.transpose(2, 3).flatten(1, 2)
    return x if inverse is None else x.index_select(2, inverse)


def _ungrouped_lse(lse_g: Tensor, inverse: Tensor | None) -> Tensor:
    return _ungrouped_rows(lse_g.unsqueeze(-1), inverse).squeeze(-1)


def _canonical_rows(x: Tensor, plan: TilePlan, dtype: torch.dtype) -> Tensor:
    """``[S, H, Nq, ...]`` -> canonical query order (``plan.query_index``) in ``dtype``."""
    x = x if plan.query_index is None else x.index_select(2, plan.query_index)
    return x.to(dtype)


def _original_rows(x: Tensor, plan: TilePlan) -> Tensor:
    """``[S, H, Nq, ...]`` in canonical query order -> original order."""
    return x if plan.query_inverse is None else x.index_select(2, plan.query_inverse)


def _canonical_keys(x: Tensor, plan: TilePlan, dtype: torch.dtype) -> Tensor:
    """``[S, Hkv, Nk, d]`` -> the used keys in canonical order ``[S, Hkv, n, d]``."""
    x = x[:, :, : plan.num_used_keys] if plan.key_index is None else x.index_select(2, plan.key_index)
    return x.to(dtype)


def _original_keys(x: Tensor, plan: TilePlan) -> Tensor:
    """Canonical key gradient ``[S, Hkv, n, d]`` -> ``[S, Hkv, Nk, d]`` (0 for unused keys)."""
    if plan.key_index is None and plan.num_used_keys == plan.num_keys:
        return x
    full = x.new_zeros(*x.shape[:2], plan.num_keys, x.shape[-1])
    if plan.key_index is None:
        full[:, :, : plan.num_used_keys] = x
    else:
        full.index_copy_(2, plan.key_index, x)
    return full


def _blocked_queries(x: Tensor, num_kv_heads: int, block_size: int, dtype: torch.dtype) -> Tensor:
    """``[S, Hq, N, d]`` -> ``[S, Hkv, nb, G*B, d]`` (head-major inside a block)."""
    x = x.unflatten(1, (num_kv_heads, -1)).unflatten(3, (-1, block_size))  # [S, Hkv, G, nb, B, d]
    return x.transpose(2, 3).flatten(3, 4).to(dtype).contiguous()


def _blocked_keys(x: Tensor, block_size: int, dtype: torch.dtype) -> Tensor:
    """``[S, Hkv, N, d]`` -> ``[S, Hkv, nb, B, d]``."""
    return x.unflatten(2, (-1, block_size)).to(dtype)


def _unblocked_rows(x_b: Tensor, num_heads: int) -> Tensor:
    """``[S, Hkv, nb, G*B, d]`` -> ``[S, Hq, N, d]``."""
    num_kv_heads = x_b.shape[1]
    x = x_b.unflatten(3, (num_heads // num_kv_heads, -1)).transpose(2, 3)  # [S, Hkv, G, nb, B, d]
    return x.flatten(3, 4).flatten(1, 2)


def _mask_causal_blocks(scores: Tensor, group: int, block_size: int) -> None:
    """-inf above the diagonal of every ``[B, B]`` block of ``scores [S, Hkv, nb, G*B, B]``, in place."""
    above = torch.ones(block_size, block_size, dtype=torch.bool, device=scores.device).triu_(1)
    scores.view(*scores.shape[:3], group, block_size, block_size).masked_fill_(above, float("-inf"))


# ----------------------------------------------------------------------------- validation


def resolve_scale(scale: float | None, q: Tensor) -> float:
    """The softmax scale: ``scale``, or ``1/sqrt(d)`` when it is None."""
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"attention expects q [S, Hq, Nq, d] and k, v [S, Hkv, Nk, d], got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on S (dim 0) and d (dim 3)")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads Hq={q.shape[1]} must be a multiple of KV heads Hkv={k.shape[1]}")


def _checked_plan(
    q: Tensor, k: Tensor, v: Tensor, q_rows: Rows, k_rows: Rows, plan: TilePlan | None
) -> TilePlan:
    _check_qkv(q, k, v)
    if len(q_rows) != q.shape[2] or len(k_rows) != k.shape[2]:
        raise ValueError(
            f"q_rows/k_rows have {len(q_rows)}/{len(k_rows)} rows but q/k have {q.shape[2]}/{k.shape[2]}"
        )
    if plan is None:
        plan = build_tile_plan(q_rows, k_rows)
    elif (plan.num_queries, plan.num_keys) != (q.shape[2], k.shape[2]):
        raise ValueError(
            f"plan was built for {plan.num_queries} queries x {plan.num_keys} keys, got "
            f"{q.shape[2]} x {k.shape[2]}; rebuild it with build_tile_plan(q_rows, k_rows)"
        )
    if plan.query_rows.pos.device != q.device:
        raise ValueError(
            f"rows are on {plan.query_rows.pos.device} but q on {q.device}; use Rows.to(q.device)"
        )
    return plan


def _check_block_inputs(q: Tensor, k: Tensor, v: Tensor, block_size: int) -> None:
    _check_qkv(q, k, v)
    if k.shape[2] != q.shape[2]:
        raise ValueError(
            f"block-diagonal attention needs the same rows for q and k, got {q.shape[2]} and {k.shape[2]}"
        )
    if block_size < 1 or q.shape[2] % block_size != 0:
        raise ValueError(f"block_size={block_size} must be >= 1 and divide the number of rows {q.shape[2]}")
