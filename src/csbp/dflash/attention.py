"""Draft-layer attention for DFlash: queries are the anchor-block rows, keys are ``[context ;
block rows]`` (objectives.md §5.5, csbp.md §14).

Every callable has the signature of ``DraftAttentionFn``: ``q [S, Hq, N, d]`` of the block rows,
``k_ctx, v_ctx [S, Hkv, M, d]`` of the context rows this process holds (already projected by the
layer's own ``k_proj``/``k_norm``/RoPE and ``v_proj``), ``k_blk, v_blk [S, Hkv, N, d]`` of the
block rows, and the layer index; it returns ``[S, Hq, N, d]`` in the dtype of ``q``.

* ``UnmaskedDraftAttention``: every query sees every key (inference on one block with a context
  strictly before its anchor, objectives.md §7).
* ``DenseDraftAttention``: a dense boolean mask per layer (references and tests).
* ``ShardedDraftAttention``: the training transport over ``Rows`` metadata. Block rows are whole
  anchor blocks (``B`` consecutive rows; dead anchors ``live = False``); context rows are clean
  keys at their positions. Per layer::

      start an async all-gather of my context K/V shard over the CP ring (no-op without a ring)
      block partial: my block rows over themselves (batched blocks / FlexAttention) (dead rows: out 0, lse -inf)
      wait; context partial: my queries x the gathered context rows (tiles / FlexAttention)
      merge online (csbp.md §9.2)

  Backward: the context partial's dK/dV (gathered layout) is reduce-scattered back to the shard
  owners while the block-diagonal backward runs. Only context K/V cross the wire.

  With the *context exchange* (``csbp.dflash.exchange``: packed documents, or a CSBP sliding layer
  kind; a plan per layer kind built once per sample and step) the all-gather is replaced by one variable-split all-to-all of
  only the context rows some anchor of the receiver may see (``csbp.attention.transports.window``'s
  ``send_halo``), started asynchronously and overlapped with the block partial as the all-gather
  is; the context partial runs over ``[my context rows ; received rows]``, and its backward returns
  each received row's dK/dV to its owner (``return_halo_grads``, overlapped with the
  block-diagonal backward), which adds it (``add_halo_grads``).

Shape legend: ``S`` samples, ``Hq``/``Hkv`` heads, ``N`` block rows, ``M`` local context rows,
``P`` ring size, ``d`` head dim.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

from csbp.attention.backends import PartialPlan, plan_block_diagonal, plan_partial
from csbp.attention.kept_forwards import kept_or_computed
from csbp.attention.kernel import DEFAULT_TILE_ROWS
from csbp.attention.layouts import WindowPlan
from csbp.attention.merge import accumulation_dtype, merge_partials, row_delta
from csbp.attention.rows import Rows, allow_matrix
from csbp.attention.transports.exchange import check_ring_comm
from csbp.attention.transports.function import exact_attention_precision
from csbp.attention.transports.window import (
    WindowExchange,
    add_halo_grads,
    build_window_exchange,
    return_halo_grads,
    send_halo,
)
from csbp.dflash.layouts import context_rows as key_rows_at
from csbp.models.attention_fns import masked_attention
from csbp.parallel.comm import Comm


class DraftAttentionFn(Protocol):
    """Attention of block queries over ``[context ; block]`` keys (see the module docstring)."""

    def __call__(
        self, q: Tensor, k_ctx: Tensor, v_ctx: Tensor, k_blk: Tensor, v_blk: Tensor, layer_index: int
    ) -> Tensor: ...


class UnmaskedDraftAttention:
    """Every block row sees every context row and every block row (inference, no mask)."""

    def __call__(
        self, q: Tensor, k_ctx: Tensor, v_ctx: Tensor, k_blk: Tensor, v_blk: Tensor, layer_index: int
    ) -> Tensor:
        k, v = torch.cat((k_ctx, k_blk), dim=2), torch.cat((v_ctx, v_blk), dim=2)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=q.shape[1] != k.shape[1])


class DenseDraftAttention:
    """Attention under one dense boolean mask ``[N, M + N]`` per layer (``True`` = may attend);
    rows without a visible key give 0."""

    def __init__(self, masks: Sequence[Tensor]) -> None:
        self.masks = list(masks)

    def __call__(
        self, q: Tensor, k_ctx: Tensor, v_ctx: Tensor, k_blk: Tensor, v_blk: Tensor, layer_index: int
    ) -> Tensor:
        k, v = torch.cat((k_ctx, k_blk), dim=2), torch.cat((v_ctx, v_blk), dim=2)
        return masked_attention(q, k, v, self.masks[layer_index])


def dense_draft_masks(
    query_rows: Sequence[Rows], causal_in_block: Sequence[bool], context_rows: Rows
) -> list[Tensor]:
    """Per-layer ``[N, M + N]`` masks of the ``Rows`` predicate: keys are ``[context ; block rows]``
    (the block rows are keys too, identified by their block id)."""
    masks = []
    for rows, causal in zip(query_rows, causal_in_block):
        keys = Rows.cat([context_rows, rows])
        masks.append(allow_matrix(rows, keys, causal_in_block=causal))
    return masks


@dataclass(frozen=True, eq=False)
class DraftMaskVariant:
    """The block rows of one layer kind (full or sliding attention) and their two partials (block
    rows over themselves, block rows over the gathered context) on the run's attention backend.
    With a context ``exchange`` the context partial's keys are ``[my context rows ; received rows]``."""

    query_rows: Rows
    causal_in_block: bool
    context_plan: PartialPlan
    block_plan: PartialPlan
    exchange: WindowExchange | None = None


@dataclass(frozen=True, eq=False)
class DraftAttentionPlan:
    """Everything ``ShardedDraftAttention`` needs besides q/k/v; build with ``build_draft_attention_plan``.

    Attributes:
        block_size: rows per anchor block.
        live: ``[N]`` bool, False for the rows of dead (padding) anchors.
        context_rows: the gathered context rows, ring members' shards in ring order.
        variants: one per layer kind; ``layer_variant[i]`` indexes the variant of layer ``i``.
        comm: the CP ring (None or size 1: all context rows are local).
    """

    block_size: int
    live: Tensor
    context_rows: Rows
    variants: tuple[DraftMaskVariant, ...]
    layer_variant: tuple[int, ...]
    comm: Comm | None


def build_draft_attention_plan(
    query_rows: Sequence[Rows],
    causal_in_block: Sequence[bool],
    layer_variant: Sequence[int],
    context_rows: Rows,
    *,
    block_size: int,
    comm: Comm | None,
    tile_rows: int = DEFAULT_TILE_ROWS,
    backend: str = "tiles",
    diagonal: str = "auto",
    clean: str = "generic",
    exchanges: Sequence[WindowPlan | None] | None = None,
) -> DraftAttentionPlan:
    """Plan the attention of one anchor packet; every layer reuses it in forward and backward.
    ``backend`` (``csbp.attention.backends``) is resolved on the rows' device; ``diagonal`` runs the
    blocks over themselves (``csbp.attention.diagonal``); ``clean`` runs the blocks over the context
    (``csbp.attention.backends.CLEAN_KERNELS``: anchors under one whole context shard are one dense piece).
    ``exchanges``: per variant, the context exchange plan of this rank's ring
    (``csbp.dflash.exchange.context_exchange_plan``), or None for the all-gather."""
    if not query_rows or len(query_rows) != len(causal_in_block):
        raise ValueError("build_draft_attention_plan needs one causal flag per query-row variant")
    live = query_rows[0].live
    if len(live) % block_size != 0:
        raise ValueError(f"block rows ({len(live)}) must be whole blocks of block_size={block_size}")
    if any(v not in range(len(query_rows)) for v in layer_variant):
        raise ValueError(f"layer_variant {list(layer_variant)} must index the {len(query_rows)} variants")
    exchanges = list(exchanges) if exchanges is not None else [None] * len(query_rows)
    if len(exchanges) != len(query_rows):
        raise ValueError(f"got {len(exchanges)} exchange plans for {len(query_rows)} query-row variants")
    variants = []
    for rows, causal, exchange_plan in zip(query_rows, causal_in_block, exchanges):
        keys, exchange = context_rows, None
        if exchange_plan is not None:
            ring = check_ring_comm(comm, exchange_plan.cp, comm.rank if comm is not None else 0, "the context exchange")
            device = rows.pos.device
            exchange = build_window_exchange(exchange_plan, ring.rank, key_rows_at, device)
            own = key_rows_at(exchange_plan.owned_positions[ring.rank]).to(device)
            keys = Rows.cat([own, exchange.halo_rows])
        variants.append(
            DraftMaskVariant(
                rows,
                causal,
                plan_partial(rows, keys, backend=backend, tile_rows=tile_rows, clean=clean),
                plan_block_diagonal(
                    rows, block_size=block_size, backend=backend, causal_in_block=causal, diagonal=diagonal
                ),
                exchange,
            )
        )
    return DraftAttentionPlan(block_size, live, context_rows, tuple(variants), tuple(layer_variant), comm)


class ShardedDraftAttention:
    """The training transport (see the module docstring)."""

    def __init__(self, plan: DraftAttentionPlan) -> None:
        self.plan = plan

    def __call__(
        self, q: Tensor, k_ctx: Tensor, v_ctx: Tensor, k_blk: Tensor, v_blk: Tensor, layer_index: int
    ) -> Tensor:
        return _ShardedDraftAttention.apply(q, k_ctx, v_ctx, k_blk, v_blk, self.plan, layer_index)


def _ring(plan: DraftAttentionPlan) -> Comm | None:
    return plan.comm if plan.comm is not None and plan.comm.size > 1 else None


def _attend(
    q: Tensor, k_ctx: Tensor, v_ctx: Tensor, k_blk: Tensor, v_blk: Tensor, plan: DraftAttentionPlan,
    variant: DraftMaskVariant,
) -> tuple[Tensor, Tensor, Tensor]:
    """The drafter attention's forward: ``(kv_all [2, S, Hkv, keys, d], out [S, Hq, N, d], lse)``, the
    context K/V it attended to (its own and the ring's) and the merged result."""
    ring = _ring(plan)
    pending = None
    if variant.exchange is not None:
        assert ring is not None
        pending = send_halo(k_ctx, v_ctx, variant.exchange, ring)
    else:
        gathered = torch.stack((k_ctx, v_ctx)).permute(3, 0, 1, 2, 4).contiguous()  # [M, 2, S, Hkv, d]
        if ring is not None:
            gathered, pending = ring.all_gather(gathered, async_op=True)
    out_blk, lse_blk = variant.block_plan.forward(q, k_blk, v_blk)  # overlaps the collective
    live = plan.live.to(q.device)
    out_blk = torch.where(live[:, None], out_blk, 0.0)
    lse_blk = torch.where(live, lse_blk, float("-inf"))
    if variant.exchange is not None:  # [2, S, Hkv, M + n_recv, d]: my rows, then the received ones
        assert pending is not None
        kv_all = torch.cat((torch.stack((k_ctx, v_ctx)), pending.wait()), dim=3)
        pending = None  # free the received rows: kv_all holds them
    else:
        if pending is not None:
            gathered = pending.wait()
        kv_all = gathered.permute(1, 2, 3, 0, 4)  # [2, S, Hkv, P*M, d]
    out_ctx, lse_ctx = variant.context_plan.forward(q, kv_all[0], kv_all[1])
    out, lse = merge_partials(out_blk, lse_blk, out_ctx, lse_ctx)
    out = out.to(q.dtype)  # kept as returned, like the transports' (csbp.attention.transports.function)
    return kv_all, out, lse


class _ShardedDraftAttention(torch.autograd.Function):
    """Forward and backward run with autocast off, so both compute in the accumulation dtype (fp32
    for bf16 inputs), as ``csbp.attention.transports.function.TransportFunction`` does."""

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k_ctx: Tensor,
        v_ctx: Tensor,
        k_blk: Tensor,
        v_blk: Tensor,
        plan: DraftAttentionPlan,
        layer_index: int,
    ) -> Tensor:
        with exact_attention_precision(q.device):
            return _ShardedDraftAttention._forward(ctx, q, k_ctx, v_ctx, k_blk, v_blk, plan, layer_index)

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        with exact_attention_precision(dout.device):
            return _ShardedDraftAttention._backward(ctx, dout)

    @staticmethod
    def _forward(
        ctx: Any,
        q: Tensor,
        k_ctx: Tensor,
        v_ctx: Tensor,
        k_blk: Tensor,
        v_blk: Tensor,
        plan: DraftAttentionPlan,
        layer_index: int,
    ) -> Tensor:
        variant = plan.variants[plan.layer_variant[layer_index]]
        # under train.activation_checkpointing: selective, a recompute replays the first forward's results
        kv_all, out, lse = kept_or_computed(lambda: _attend(q, k_ctx, v_ctx, k_blk, v_blk, plan, variant))
        ctx.save_for_backward(q, k_blk, v_blk, kv_all, out, lse)
        ctx.plan, ctx.variant, ctx.num_own = plan, variant, k_ctx.shape[2]
        return out

    @staticmethod
    def _backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k_blk, v_blk, kv_all, out, lse = ctx.saved_tensors
        plan, variant = ctx.plan, ctx.variant
        dtype = accumulation_dtype(q, k_blk, v_blk)
        delta = row_delta(dout, out, dtype)
        dq, dk_all, dv_all = variant.context_plan.backward(q, kv_all[0], kv_all[1], out, lse, dout, delta=delta)
        ring = _ring(plan)
        pending = None
        if variant.exchange is not None:
            assert ring is not None
            own = ctx.num_own
            grad_halo = torch.stack((dk_all[:, :, own:], dv_all[:, :, own:]))  # [2, S, Hkv, n_recv, d]
            pending = return_halo_grads(grad_halo, variant.exchange, ring)
        else:
            dkv_local = torch.stack((dk_all, dv_all)).permute(3, 0, 1, 2, 4).contiguous()  # [P*M, 2, S, Hkv, d]
            if ring is not None:
                dkv_local, pending = ring.reduce_scatter(dkv_local, async_op=True)
        dq_blk, dk_blk, dv_blk = variant.block_plan.backward(q, k_blk, v_blk, out, lse, dout, delta=delta)
        if variant.exchange is not None:
            assert pending is not None
            dk_ctx, dv_ctx = dk_all[:, :, : ctx.num_own], dv_all[:, :, : ctx.num_own]
            add_halo_grads(dk_ctx, dv_ctx, pending.wait(), variant.exchange)
        else:
            if pending is not None:
                dkv_local = pending.wait()
            dk_ctx, dv_ctx = dkv_local.permute(1, 2, 3, 0, 4)  # [2, S, Hkv, M, d] -> K, V
        return (
            (dq + dq_blk).to(q.dtype),
            dk_ctx.to(k_blk.dtype),
            dv_ctx.to(v_blk.dtype),
            dk_blk.to(k_blk.dtype),
            dv_blk.to(v_blk.dtype),
            None,
            None,
        )
