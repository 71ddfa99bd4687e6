"""The CPU tile kernels: each tile of a ``TilePlan`` through ATen's fused flash-attention kernel
(csbp.md §9.1), used by ``csbp.attention.kernel`` on CPU.

ATen's CPU flash kernel returns the lse from its forward and takes ``out``/``lse`` as inputs to its
backward, so given the *final* merged statistics its backward is exactly the explicit backward of
one key subset. It also runs grouped-query attention natively (query head ``h`` reads KV head
``h // G``), takes strided row slices without a copy and broadcasts a ``[T, C]`` additive mask over
samples and heads. So a tile here is one call on views of the inputs in their own layout
``[S, H, N, d]``: no grouped copy of Q, no pre-scaling, a ``T x C`` mask (not ``T*G x C``) only for
tiles that hold a disallowed pair, built once per plan (``TilePlan.additive_masks``, within a memory
budget; per call beyond it), and the per-tile results joined with one ``cat`` per output instead of
a copy into a preallocated buffer each.

Shape legend: ``S`` samples, ``Hq``/``Hkv`` query/KV heads, ``Nq`` query rows, ``n`` used (live)
keys in canonical order, ``d`` head dim, ``T`` rows of a tile, ``C`` candidate keys of a tile.
"""

from __future__ import annotations

import torch
from torch import Tensor

from csbp.attention.tile_plan import TilePlan, add_tile_keys, additive_mask, gather_tile_keys

_flash_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def fused_interval_forward(
    q: Tensor, k_used: Tensor, v_used: Tensor, plan: TilePlan, causal_in_block: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """``q [S, Hq, Nq, d]`` (canonical query order) over the canonical keys ``k_used, v_used
    [S, Hkv, n, d]`` -> ``(out [S, Hq, Nq, d], lse [S, Hq, Nq])`` in canonical order; rows that see
    no key get ``out = 0``, ``lse = -inf``."""
    masks, additive = plan.tile_strips(causal_in_block), plan.additive_masks(causal_in_block, q.dtype)
    outs: list[Tensor] = []
    lses: list[Tensor] = []
    for q_lo, q_hi, index in _segments(plan):
        if index is None:
            outs.append(q.new_zeros(*q.shape[:2], q_hi - q_lo, v_used.shape[-1]))
            lses.append(q.new_full((*q.shape[:2], q_hi - q_lo), float("-inf")))
            continue
        tile, tile_mask = plan.tiles[index], masks[index]
        k_tile, v_tile = gather_tile_keys(k_used, tile), gather_tile_keys(v_used, tile)
        mask = additive_mask(tile_mask, tile, q.dtype) if additive is None else additive[index]
        out, lse = _flash_forward(q[:, :, q_lo:q_hi], k_tile, v_tile, 0.0, False, attn_mask=mask, scale=scale)
        if tile_mask.empty is not None:
            out = out.masked_fill(tile_mask.empty[:, None], 0.0)
            lse = lse.masked_fill(tile_mask.empty, float("-inf"))
        outs.append(out)
        lses.append(lse)
    return _joined(outs), _joined(lses)


def fused_interval_backward(
    q: Tensor,
    k_used: Tensor,
    v_used: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    plan: TilePlan,
    causal_in_block: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq [S, Hq, Nq, d], dk, dv [S, Hkv, n, d])`` in canonical order from the final merged
    ``out``/``lse [S, Hq, Nq]`` and ``dout`` (all canonical order, accumulation dtype)."""
    masks, additive = plan.tile_strips(causal_in_block), plan.additive_masks(causal_in_block, q.dtype)
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))  # rows that see nothing: P = 0
    dk_used, dv_used = torch.zeros_like(k_used), torch.zeros_like(v_used)
    dqs: list[Tensor] = []
    for q_lo, q_hi, index in _segments(plan):
        if index is None:
            dqs.append(q.new_zeros(*q.shape[:2], q_hi - q_lo, q.shape[-1]))
            continue
        tile = plan.tiles[index]
        rows = slice(q_lo, q_hi)
        k_tile, v_tile = gather_tile_keys(k_used, tile), gather_tile_keys(v_used, tile)
        dq, dk, dv = _flash_backward(
            dout[:, :, rows],
            q[:, :, rows],
            k_tile,
            v_tile,
            out[:, :, rows],
            lse[:, :, rows],
            0.0,
            False,
            attn_mask=additive_mask(masks[index], tile, q.dtype) if additive is None else additive[index],
            scale=scale,
        )
        dqs.append(dq)
        add_tile_keys(dk_used, dk, tile)
        add_tile_keys(dv_used, dv, tile)
    return _joined(dqs), dk_used, dv_used


def _segments(plan: TilePlan) -> list[tuple[int, int, int | None]]:
    """``(q_lo, q_hi, tile index or None)`` covering ``[0, Nq)`` in order; None marks rows of no tile."""
    segments: list[tuple[int, int, int | None]] = []
    stop = 0
    for index, tile in enumerate(plan.tiles):
        if tile.q_lo > stop:
            segments.append((stop, tile.q_lo, None))
        segments.append((tile.q_lo, tile.q_hi, index))
        stop = tile.q_hi
    if plan.num_queries > stop or not segments:
        segments.append((stop, plan.num_queries, None))
    return segments


def _joined(pieces: list[Tensor]) -> Tensor:
    """The row pieces ``[S, H, T_i, ...]`` joined along rows (dim 2)."""
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2)
