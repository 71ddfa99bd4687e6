"""Sliding-window CSBP attention transport: one variable-split all-to-all (csbp.md §11).

With a window ``W`` a rank's queries need only a narrow halo of clean rows from the other ring
members. ``layouts.window_exchange_plan`` fixes, per ring, which clean rows each member sends to
each other member; this transport executes it:

* forward: gather the rows I send (destination-major, index built once) from my clean K/V, start
  one asynchronous ``all_to_all`` of K and V together, local partial (queries x own rows: it needs
  no received row, so it overlaps the transfer), wait, sort the received rows by clean position
  (permutation built once), halo partial (queries x received rows), merge;
* backward: halo-partial backward from the final ``(out, lse)``, un-sort, start the reverse
  all-to-all that returns each received row's dK/dV to its owner, local backward (overlapping
  it), wait, add the returned dK/dV at the sent rows (``index_add_``: a row sent to several
  members gets every contribution).

This is the overlap of the collective transport (async all-gather / reduce-scatter around the
local partial). Traffic is the halo only: strictly below the collective transport's full shard
whenever ``W`` is smaller than the shard.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from csbp.attention.backends import PartialPlan, check_backend, check_clean, plan_partial
from csbp.attention.diagonal import check_diagonal_backend
from csbp.attention.kernel import DEFAULT_TILE_ROWS
from csbp.attention.layouts import RankLayout, WindowPlan, bd3_rows
from csbp.attention.merge import accumulation_dtype, merge_into, row_delta
from csbp.attention.rows import Rows
from csbp.attention.transports.exchange import PlanCache, check_packed_inputs, check_ring_comm
from csbp.attention.transports.function import TransportFunction
from csbp.attention.transports.local import (
    LocalAttentionPlan,
    build_local_attention_plan,
    local_attention_backward,
    local_attention_forward,
)
from csbp.parallel.comm import Comm, Pending


@dataclass(frozen=True, eq=False)
class WindowExchange:
    """The exchange of one ring member, built once per device from a ``WindowPlan``.

    Attributes:
        send_index: int64 ``[n_send]``, packed rows of my clean K/V to send, destination-major.
        send_counts / recv_counts: split sizes of the all-to-all (rows per ring member).
        recv_order: int64 ``[n_recv]``, received (source-major) row of each sorted halo row.
        recv_inverse: the inverse permutation (sorted halo row of each received row).
        halo_rows: clean key metadata of the received rows, sorted by position.
    """

    send_index: Tensor
    send_counts: list[int]
    recv_counts: list[int]
    recv_order: Tensor
    recv_inverse: Tensor
    halo_rows: Rows


@dataclass(frozen=True, eq=False)
class WindowAttentionPlan:
    """Everything one call needs besides q/k/v (shared by every layer of the same window)."""

    exchange: WindowExchange
    comm: Comm
    local: LocalAttentionPlan
    query_rows: Rows
    halo_plan: PartialPlan | None  # query_rows x exchange.halo_rows; None when nothing is received
    causal_in_block: bool


def window_forward(q: Tensor, k: Tensor, v: Tensor, plan: WindowAttentionPlan) -> tuple[Tensor, Tensor, Tensor]:
    """``(out [S, Hq, N, d], lse [S, Hq, N], halo_kv [2, S, Hkv, n_recv, d])``."""
    pending = send_halo(k, v, plan.exchange, plan.comm)
    out, lse = local_attention_forward(q, k, v, plan.local)  # overlaps the all-to-all
    halo_kv = pending.wait()
    if plan.halo_plan is not None:
        out_halo, lse_halo = plan.halo_plan.forward(q, halo_kv[0], halo_kv[1])
        merge_into(out, lse, out_halo, lse_halo)  # the local partial's buffers are this call's own
    return out, lse, halo_kv


def window_backward(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, halo_kv: Tensor, dout: Tensor,
    plan: WindowAttentionPlan,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` over the packed rows (accumulation dtype), clean dK/dV summed over the ring."""
    exchange = plan.exchange
    dtype = accumulation_dtype(q, k, v)
    dq_halo, delta = None, None
    if plan.halo_plan is not None:
        delta = row_delta(dout, out, dtype)  # [S, Hq, N], shared with the local partials
        dq_halo, dk_halo, dv_halo = plan.halo_plan.backward(
            q, halo_kv[0], halo_kv[1], out, lse, dout, delta=delta
        )
        grad_halo = torch.stack([dk_halo, dv_halo])  # [2, S, Hkv, n_recv, d], sorted
    else:
        grad_halo = halo_kv.new_zeros(halo_kv.shape, dtype=dtype)
    pending = return_halo_grads(grad_halo, exchange, plan.comm)
    dq, dk, dv = local_attention_backward(q, k, v, out, lse, dout, plan.local, delta=delta)  # overlaps the all-to-all
    if dq_halo is not None:
        dq += dq_halo
    add_halo_grads(dk, dv, pending.wait(), exchange)
    return dq, dk, dv


def build_window_exchange(
    plan: WindowPlan,
    ring_rank: int,
    key_rows: Callable[[Tensor], Rows],
    device: torch.device,
    *,
    send_offset: int = 0,
) -> WindowExchange:
    """Ring member ``ring_rank``'s side of ``plan`` on ``device``. ``key_rows`` turns sorted
    positions into key metadata (the received rows); ``send_offset`` is the index of the first
    exchanged row in the rank's K/V (its noisy rows come first in a packed BD3 layout)."""
    recv_positions = plan.recv_positions(ring_rank)  # source-major
    recv_order = torch.argsort(recv_positions)
    return WindowExchange(
        send_index=(plan.send_index(ring_rank) + send_offset).to(device),
        send_counts=plan.send_counts(ring_rank),
        recv_counts=plan.recv_counts(ring_rank),
        recv_order=recv_order.to(device),
        recv_inverse=torch.argsort(recv_order).to(device),
        halo_rows=key_rows(recv_positions[recv_order]).to(device),
    )


def send_halo(k: Tensor, v: Tensor, exchange: WindowExchange, comm: Comm) -> Pending:
    """Start the forward all-to-all of ``k, v [S, Hkv, n, d]``; ``wait()`` returns the received rows
    ``[2, S, Hkv, n_recv, d]`` sorted by position (K then V)."""
    send = torch.stack([k.index_select(2, exchange.send_index), v.index_select(2, exchange.send_index)])
    _, pending = comm.all_to_all(
        send.movedim(3, 0), exchange.send_counts, exchange.recv_counts, async_op=True
    )  # [n_recv, 2, S, Hkv, d], source-major
    assert pending is not None
    return pending.then(lambda received: received.index_select(0, exchange.recv_order).movedim(0, 3).contiguous())


def return_halo_grads(grad_halo: Tensor, exchange: WindowExchange, comm: Comm) -> Pending:
    """Start the backward all-to-all: the received rows' dK/dV ``[2, S, Hkv, n_recv, d]`` (sorted) go
    back to their owners; ``wait()`` returns what came back for my sent rows,
    ``[2, S, Hkv, n_send, d]`` (destination-major)."""
    grad_received = grad_halo.index_select(3, exchange.recv_inverse).movedim(3, 0)  # [n_recv, 2, S, Hkv, d]
    _, pending = comm.all_to_all(grad_received, exchange.recv_counts, exchange.send_counts, async_op=True)
    assert pending is not None
    return pending.then(lambda grad_sent: grad_sent.movedim(0, 3))  # [n_send, ...] -> [2, S, Hkv, n_send, d]


def add_halo_grads(dk: Tensor, dv: Tensor, grad_sent: Tensor, exchange: WindowExchange) -> None:
    """Add the returned dK/dV at the sent rows (``index_add_``: a row sent to several members gets
    every contribution)."""
    dk.index_add_(2, exchange.send_index, grad_sent[0].to(dk.dtype))
    dv.index_add_(2, exchange.send_index, grad_sent[1].to(dv.dtype))


class WindowAttention:
    """Sliding-window CSBP attention over ``layout.rows`` (the decoder's ``AttentionFn``).

    Args:
        layout: this rank's rows, built with the same window (``csbp_layout(..., window=W)``).
        plan: ``window_exchange_plan(...)`` of this rank's ring, same window and schedule.
        ring_rank: this rank's index in the ring (``local_rank % cp``).
        comm: ``Comm`` over the ring group.
        causal_in_block, tile_rows, backend, diagonal, clean: as in ``CollectiveAttention``.
    """

    def __init__(
        self,
        layout: RankLayout,
        plan: WindowPlan,
        ring_rank: int,
        comm: Comm,
        *,
        causal_in_block: bool = False,
        tile_rows: int = DEFAULT_TILE_ROWS,
        backend: str = "tiles",
        diagonal: str = "auto",
        clean: str = "generic",
        device: torch.device | str | None = None,
    ) -> None:
        if not 0 <= ring_rank < plan.cp:
            raise ValueError(f"ring_rank must be in [0, {plan.cp}) for this window plan, got {ring_rank}")
        _check_plan_serves_layout(layout, plan, ring_rank)
        self.comm = check_ring_comm(comm, plan.cp, ring_rank, "WindowAttention")
        self.layout, self.window_plan, self.ring_rank = layout, plan, ring_rank
        self.causal_in_block, self.tile_rows = causal_in_block, tile_rows
        self.backend = check_backend(backend)
        self.diagonal = check_diagonal_backend(diagonal, backend, where="diagonal")
        self.clean = check_clean(clean)
        self._plans = PlanCache(self._build_plan, layout.rows.pos.device if device is None else device)

    def _build_plan(self, device: torch.device) -> WindowAttentionPlan:
        plan = self.window_plan

        def key_rows(positions: Tensor) -> Rows:
            return bd3_rows(torch.zeros(0, dtype=torch.long), positions, block_size=plan.block_size)

        exchange = build_window_exchange(
            plan, self.ring_rank, key_rows, device, send_offset=self.layout.num_noisy
        )
        rows = self.layout.rows.to(device)
        halo_plan = None
        if len(exchange.halo_rows) > 0:
            halo_plan = plan_partial(
                rows, exchange.halo_rows, backend=self.backend, causal_in_block=self.causal_in_block,
                tile_rows=self.tile_rows, clean=self.clean,
            )
        local = build_local_attention_plan(
            rows, num_noisy=self.layout.num_noisy, causal_in_block=self.causal_in_block, tile_rows=self.tile_rows,
            backend=self.backend, diagonal=self.diagonal, clean=self.clean,
        )
        return WindowAttentionPlan(exchange, self.comm, local, rows, halo_plan, self.causal_in_block)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, layer_index: int = 0) -> Tensor:
        check_packed_inputs(q, k, v, len(self.layout.rows), "WindowAttention")
        return TransportFunction.apply(q, k, v, self._plans.get(q.device), window_forward, window_backward)


def _check_plan_serves_layout(layout: RankLayout, plan: WindowPlan, ring_rank: int) -> None:
    """The layout's clean rows are the plan's shard for ``ring_rank``, and every clean position its
    query rows may see is either its own or received."""
    own = plan.owned_positions[ring_rank]
    if not torch.equal(layout.clean_positions.cpu(), own):
        raise ValueError(
            f"layout's clean rows are not the clean shard the window plan assigns to ring rank {ring_rank}: "
            "build layout and plan for the same topology, local rank and schedule"
        )
    available = torch.zeros(plan.seq_len + 1, dtype=torch.long)  # [L+1] 1 where a clean row is at hand
    available[own] = 1
    available[plan.recv_positions(ring_rank)] = 1
    prefix = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(available[:-1], 0)])  # [L+1]
    rows = layout.rows.to("cpu")
    start = rows.ctx_start.clamp(0, plan.seq_len)
    stop = torch.maximum(rows.ctx_stop.clamp(0, plan.seq_len), start)
    covered = (prefix[stop] - prefix[start]) == (stop - start)
    if not bool(covered[rows.live].all()):
        raise ValueError(
            f"the window plan (window={plan.window}) does not deliver every clean row this layout's queries "
            "may attend to: build the layout with the same window and the plan with the same schedule"
        )
