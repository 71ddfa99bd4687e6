"""The CPU tile kernels: each tile of a ``TilePlan`` through ATen's fused flash-attention kernel
(csbp.md §9.1), used by ``csbp.attention.kernel`` on CPU.

ATen's CPU flash kernel returns the lse from its forward and takes ``out``/``lse`` as inputs to its
backward, so given the *final* merged statistics its backward is exactly the explicit backward of
one key subset. A tile is one call on row slices (views) of the inputs:

* **grouped rows.** The ``G`` query heads that share a KV head are folded into the rows
  (``[S, Hkv, Nq*G, d]``, one copy of Q per call): the kernel picks its query block size from the
  number of rows (32 rows below 192, 64 below 768, 256 above), and a 128-row tile of ``G = 2``
  runs 64-row blocks, which measured ~13% faster per pair at L = 4096 than the kernel's own GQA
  over 128 rows (and the same at L = 1024, where the copies weigh more);
* **masks built once per plan.** Only tiles holding a disallowed pair get an additive mask
  (``TilePlan.additive_masks``, ``[T*G, C]``, built at the first call and reused by every layer's
  forward and backward, tiles ending in the same pattern sharing one buffer, while they fit
  ``tile_plan.MASK_CACHE_BYTES``; one tile's at a time beyond);
* the scale goes to the kernel (no scaled copy of Q), and each tile's result is copied once,
  ungrouped, into the output (no preallocated grouped buffer, no transposing copy afterwards).

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
    group = q.shape[1] // k_used.shape[1]
    q_g = _grouped(q, k_used.shape[1])  # [S, Hkv, Nq*G, d]
    masks, additive = plan.tile_strips(causal_in_block), plan.additive_masks(causal_in_block, q.dtype, group)
    outs: list[Tensor] = []
    lses: list[Tensor] = []
    for q_lo, q_hi, index in _segments(plan):
        rows = slice(q_lo * group, q_hi * group)
        if index is None:
            outs.append(q_g.new_zeros(*q_g.shape[:2], rows.stop - rows.start, v_used.shape[-1]))
            lses.append(q_g.new_full((*q_g.shape[:2], rows.stop - rows.start), float("-inf")))
            continue
        tile, tile_mask = plan.tiles[index], masks[index]
        k_tile, v_tile = gather_tile_keys(k_used, tile), gather_tile_keys(v_used, tile)
        mask = additive_mask(tile_mask, tile, q.dtype, group) if additive is None else additive[index]
        out, lse = _flash_forward(q_g[:, :, rows], k_tile, v_tile, 0.0, False, attn_mask=mask, scale=scale)
        if tile_mask.empty is not None:
            empty = tile_mask.empty.repeat_interleave(group)  # [T*G]
            out = out.masked_fill(empty[:, None], 0.0)
            lse = lse.masked_fill(empty, float("-inf"))
        outs.append(out)
        lses.append(lse)
    return _ungrouped_join(outs, group), _ungrouped_join(lses, group)


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
    group = q.shape[1] // k_used.shape[1]
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))  # rows that see nothing: P = 0
    q_g, out_g, lse_g, dout_g = (_grouped(x, k_used.shape[1]) for x in (q, out, lse, dout))
    masks, additive = plan.tile_strips(causal_in_block), plan.additive_masks(causal_in_block, q.dtype, group)
    dk_used, dv_used = torch.zeros_like(k_used), torch.zeros_like(v_used)
    dqs: list[Tensor] = []
    for q_lo, q_hi, index in _segments(plan):
        rows = slice(q_lo * group, q_hi * group)
        if index is None:
            dqs.append(q_g.new_zeros(*q_g.shape[:2], rows.stop - rows.start, q.shape[-1]))
            continue
        tile = plan.tiles[index]
        k_tile, v_tile = gather_tile_keys(k_used, tile), gather_tile_keys(v_used, tile)
        dq, dk, dv = _flash_backward(
            dout_g[:, :, rows],
            q_g[:, :, rows],
            k_tile,
            v_tile,
            out_g[:, :, rows],
            lse_g[:, :, rows],
            0.0,
            False,
            attn_mask=additive_mask(masks[index], tile, q.dtype, group) if additive is None else additive[index],
            scale=scale,
        )
        dqs.append(dq)
        add_tile_keys(dk_used, dk, tile)
        add_tile_keys(dv_used, dv, tile)
    return _ungrouped_join(dqs, group), dk_used, dv_used


def _grouped(x: Tensor, num_kv_heads: int) -> Tensor:
    """``[S, Hq, N, ...]`` -> ``[S, Hkv, N*G, ...]``, row ``n*G + g`` holding query head ``h*G + g`` of
    row ``n`` (a view when ``G = 1``)."""
    x = x.unflatten(1, (num_kv_heads, -1)).transpose(2, 3)  # [S, Hkv, N, G, ...]
    return x.flatten(2, 3) if x.shape[3] == 1 else x.contiguous().flatten(2, 3)


def _ungrouped_join(pieces: list[Tensor], group: int) -> Tensor:
    """The grouped row pieces ``[S, Hkv, T_i*G, ...]`` (consecutive rows) as one ``[S, Hq, N, ...]``:
    one copy per piece straight into the result (not a ``cat`` and then a transposing copy)."""
    if group == 1:
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2)
    first = pieces[0]
    num_rows = sum(piece.shape[2] for piece in pieces) // group
    result = first.new_empty(first.shape[0], first.shape[1], group, num_rows, *first.shape[3:])
    start = 0
    for piece in pieces:
        stop = start + piece.shape[2] // group
        result[:, :, :, start:stop] = piece.unflatten(2, (-1, group)).transpose(2, 3)
        start = stop
    return result.flatten(1, 2)


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
