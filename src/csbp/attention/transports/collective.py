"""All-gather / reduce-scatter attention transport (csbp.md §9), for CSBP and the CP-only baseline.

One generic transport, parametrised by *which* packed rows the ring exchanges
(``exchange.ExchangeSpec``):

* **CSBP** (``csbp_exchange_spec``): only the clean rows. Noisy K/V never leave the rank.
* **CP-only baseline** (``cp_exchange_spec``): every row, noisy and clean, as generic context
  parallelism does over ``[x_t ; x_0]``. It runs the same kernels with the same overlap; remote
  noisy keys no local query can see are still transferred but skipped by the tile plan.

Forward (per layer)::

    pack my exchanged K/V (padded to the ring's largest shard); start an async all-gather
    local partial: all my queries x my own rows (block-diagonal fast path for whole noisy blocks)
    wait; pick the other members' live rows (owner-major -> canonical order, index built once)
    remote partial: all my queries x remote rows (tiled interval kernel); online-softmax merge

Backward: the remote partial's backward runs first from the final ``(out, lse)``; its dK/dV is
scattered into the gathered layout (zeros at own and padding rows) and an async reduce-scatter
returns every owner its summed gradient while the local backward runs; the owner adds it to its
exchanged rows.

Traffic per rank and layer (``n`` exchanged rows of the largest shard, element size ``e``): forward
``(P-1)·2·S·Hkv·n·d·e`` bytes, backward the same in the accumulation dtype. The gathered remote
K/V (``(P-1)·n`` rows) is kept for the backward; use the streaming transport to bound memory.

Usage::

    attn = CollectiveAttention(layout, csbp_exchange_spec(layout, ...), Comm(ring_group, counter))
    out = attn(q, k, v, layer_index)   # q [S, Hq, N, d], k/v [S, Hkv, N, d] over layout.rows
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from csbp.attention.backends import PartialPlan, plan_partial
from csbp.attention.merge import accumulation_dtype, merge_into, row_delta
from csbp.attention.rows import Rows
from csbp.attention.transports.exchange import (
    ExchangeSpec,
    RemoteKeys,
    RingTransport,
    pack_shard,
    remote_keys,
    scatter_remote,
    select_remote,
)
from csbp.attention.transports.local import (
    LocalAttentionPlan,
    build_local_attention_plan,
    local_attention_backward,
    local_attention_forward,
)
from csbp.parallel.comm import Comm


@dataclass(frozen=True, eq=False)
class CollectivePlan:
    """Everything one call needs besides q/k/v (built once per device, shared by every layer).

    Attributes:
        spec: which rows each ring member exchanges.
        comm: counted collectives over the ring.
        local: queries x own rows.
        query_rows: this rank's packed rows (the queries of the remote partial).
        remote: the other members' live rows in a gathered buffer, canonical order.
        remote_plan: the partial of ``query_rows`` x ``remote.rows`` on the run's backend; None when
            there is no remote row.
        causal_in_block: lower-triangular block-diagonal part.
    """

    spec: ExchangeSpec
    comm: Comm
    local: LocalAttentionPlan
    query_rows: Rows
    remote: RemoteKeys
    remote_plan: PartialPlan | None
    causal_in_block: bool


def collective_forward(q: Tensor, k: Tensor, v: Tensor, plan: CollectivePlan) -> tuple[Tensor, Tensor, Tensor]:
    """``(out [S, Hq, N, d], lse [S, Hq, N], remote_kv [2, S, Hkv, R, d])``; out/lse in accumulation dtype."""
    spec = plan.spec
    shard = pack_shard(k, v, spec.exchange_start, spec.shard_rows)  # [2, S, Hkv, n, d]
    _, pending = plan.comm.all_gather(shard, async_op=True)
    out, lse = local_attention_forward(q, k, v, plan.local)  # overlaps the all-gather
    gathered = pending.wait()  # [P*2, S, Hkv, n, d], owner-major
    remote_kv = select_remote(gathered, plan.remote)  # [2, S, Hkv, R, d]
    del gathered, pending  # keep only the remote rows, not the padded gathered buffer
    if plan.remote_plan is not None:
        # the remote out as its kernels leave it (bf16 from Flex / the pieces): merge_into casts as it reads
        out_remote, lse_remote = plan.remote_plan.forward(q, remote_kv[0], remote_kv[1], kernel_dtype=True)
        merge_into(out, lse, out_remote, lse_remote)  # the local partial's buffers are this call's own
    return out, lse, remote_kv


def collective_backward(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, remote_kv: Tensor, dout: Tensor,
    plan: CollectivePlan,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` over the packed rows (the accumulation dtype, or the kernels' where a fused kernel
    left the local partial's), dK/dV of exchanged rows summed over every ring member's queries."""
    spec = plan.spec
    dtype = accumulation_dtype(q, k, v)
    delta = row_delta(dout, out, dtype)  # [S, Hq, N]
    dq_remote = None
    if plan.remote_plan is not None:
        # in the kernels' dtype where they leave it (no cast pass): added into fp32 below, cast as scattered
        dq_remote, dk_remote, dv_remote = plan.remote_plan.backward(
            q, remote_kv[0], remote_kv[1], out, lse, dout, delta=delta, kernel_dtype=True
        )
        grad_gathered = scatter_remote(
            dk_remote, dv_remote, plan.remote, spec.ring_rank, spec.ring_size, spec.shard_rows, dtype=dtype
        )  # [P*2, S, Hkv, n, d]
    else:
        grad_gathered = k.new_zeros(spec.ring_size * 2, *k.shape[:2], spec.shard_rows, k.shape[-1], dtype=dtype)
    _, pending = plan.comm.reduce_scatter(grad_gathered, async_op=True)
    # overlaps the reduce-scatter; in the kernels' dtype where one kernel leaves them: each gets exactly one
    # in-place add below, computed in fp32 and rounded once, the bits of an fp32 sum cast by the caller
    dq, dk, dv = local_attention_backward(q, k, v, out, lse, dout, plan.local, delta=delta, kernel_dtype=True)
    grad_own = pending.wait()  # [2, S, Hkv, n, d]: my exchanged rows' dK/dV from the other members
    if dq_remote is not None:
        dq += dq_remote
    rows = slice(spec.exchange_start, None)
    dk[:, :, rows] += grad_own[0, :, :, : spec.num_exchanged]
    dv[:, :, rows] += grad_own[1, :, :, : spec.num_exchanged]
    return dq, dk, dv


class CollectiveAttention(RingTransport[CollectivePlan]):
    """All-gather / reduce-scatter attention over ``layout.rows`` (the decoder's ``AttentionFn``);
    arguments as in :class:`~csbp.attention.transports.exchange.RingTransport`."""

    name = "CollectiveAttention"
    forward_fn = staticmethod(collective_forward)
    backward_fn = staticmethod(collective_backward)

    def _build_plan(self, device: torch.device) -> CollectivePlan:
        rows = self.layout.rows.to(device)
        spec = self.spec.to(device)
        remote = remote_keys(spec)
        remote_plan = None
        if len(remote) > 0:
            remote_plan = plan_partial(
                rows, remote.rows, backend=self.backend, causal_in_block=self.causal_in_block, tile_rows=self.tile_rows,
                clean=self.clean,
            )
        local = build_local_attention_plan(
            rows, num_noisy=self.layout.num_noisy, causal_in_block=self.causal_in_block, tile_rows=self.tile_rows,
            backend=self.backend, diagonal=self.diagonal, clean=self.clean,
        )
        return CollectivePlan(spec, self.comm, local, rows, remote, remote_plan, self.causal_in_block)
