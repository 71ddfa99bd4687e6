"""Streaming ring attention transport: bounded memory (csbp.md §10).

Same exchanged rows as the collective transport (``exchange.ExchangeSpec``: clean rows for CSBP,
every row for the CP-only baseline), but the shards travel around the ring one hop at a time
instead of being gathered, so a rank holds at most two remote shards at once.

Forward on ring rank ``c`` of ``P``::

    post ring_shift_async(my shard)                 # to c-1, from c+1
    step 0: all my queries x my own rows (local partial, block-diagonal fast path)
    for s in 1 .. P-1:                              # shard of owner (c+s) mod P
        wait; if s < P-1: post the next shift of the received shard (overlaps this step)
        only the query rows whose clean interval (or noisy block) meets that owner's rows,
        precomputed once per owner, attend to it; merge into the running (out, lse) in place

Backward visits the owners in the same order. The clean K/V are **re-circulated** (posted one hop
ahead, overlapping compute) and a dK/dV accumulator travels with them: at step ``s`` rank ``c``
adds its contribution to owner ``(c+s) mod P``'s accumulator (received from ``c+1``, which added
its own one step earlier) and sends it to ``c-1``; the hop after step ``P-1`` lands every
accumulator at its owner, complete. dQ stays local.

The query rows that see one owner are, without documents, a run or two of consecutive packed rows (a
rank's last blocks' noisy and clean rows), found once per owner. A step reads them as slices: one run
is a view of q (and of out, lse, dout and delta in the backward), so nothing is gathered; each run's
result is merged into, or added onto, its own slice in place (``merge.merge_into``: one compiled pass
on CUDA), with no gathered copy of out/lse to merge and write back, and no atomic ``index_add_``.
Packed short documents can cut the rows into dozens of runs: past ``SLICED_RUNS`` they are gathered.

Memory / traffic trade-off: a rank holds at most two K/V shards (the one in use and the one
arriving) and, in the backward, three dK/dV shard buffers (the one being computed, the one
arriving and the one leaving), whatever ``P``; the collective transport holds all ``P-1`` remote
shards from forward to backward. This is paid for by re-sending the K/V in the backward: ``P-1``
extra shard hops per layer, counted in their own category (``<comm.category>_recompute``) so the
forward K/V bytes and the backward dK/dV bytes in ``comm.category`` stay equal to the collective
transport's all-gather and reduce-scatter bytes.
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
    RingTransport,
    pack_shard,
    padded_rows,
    queries_touching,
    recompute_category,
)
from csbp.attention.transports.local import (
    LocalAttentionPlan,
    build_local_attention_plan,
    local_attention_backward,
    local_attention_forward,
)
from csbp.parallel.comm import Comm


@dataclass(frozen=True, eq=False)
class RingStep:
    """One remote step: the owner visited and the query rows that can see its rows.

    Attributes:
        owner: ring rank whose shard is in hand.
        query_index: int64 ``[Ns]``, packed query rows attending to this owner (may be empty).
        query_rows: metadata of those rows.
        key_rows: the owner's wire-shard rows (padding rows dead).
        tile_plan: the partial of ``query_rows`` x ``key_rows`` on the run's backend; None when no
            query row sees the owner.
        runs: per run of consecutive rows in ``query_index``: its slice of the packed rows and of the
            step's rows.
    """

    owner: int
    query_index: Tensor
    query_rows: Rows
    key_rows: Rows
    tile_plan: PartialPlan | None
    runs: tuple[tuple[slice, slice], ...]

    def rows_of(self, x: Tensor) -> Tensor:
        """``x``'s query rows (dim 2) of this step: a view when they are one run, else gathered."""
        if len(self.runs) == 1:
            return x[:, :, self.runs[0][0]]
        return x.index_select(2, self.query_index)

    def merge_into_rows(self, out: Tensor, lse: Tensor, out_step: Tensor, lse_step: Tensor) -> None:
        """Merge the step's partial into the running ``(out, lse)`` over the packed rows, in place."""
        if len(self.runs) <= SLICED_RUNS:
            for rows, step_rows in self.runs:
                merge_into(out[:, :, rows], lse[:, :, rows], out_step[:, :, step_rows], lse_step[:, :, step_rows])
            return
        out_rows, lse_rows = out.index_select(2, self.query_index), lse.index_select(2, self.query_index)
        merge_into(out_rows, lse_rows, out_step, lse_step)
        out.index_copy_(2, self.query_index, out_rows)
        lse.index_copy_(2, self.query_index, lse_rows)

    def add_into_rows(self, dq: Tensor, dq_step: Tensor) -> None:
        """Add the step's dQ onto ``dq``'s packed rows in place."""
        if len(self.runs) <= SLICED_RUNS:
            for rows, step_rows in self.runs:
                dq[:, :, rows] += dq_step[:, :, step_rows]
            return
        dq.index_add_(2, self.query_index, dq_step.to(dq.dtype))


SLICED_RUNS = 4
"""At most this many runs of query rows are merged run by run, into slices; more (many short documents)
are gathered once, merged, and written back by index, a fixed number of launches whatever the runs."""


@dataclass(frozen=True, eq=False)
class StreamingPlan:
    """Everything one call needs besides q/k/v (built once per device, shared by every layer)."""

    spec: ExchangeSpec
    comm: Comm
    local: LocalAttentionPlan
    steps: tuple[RingStep, ...]  # steps 1 .. P-1 in visiting order


def streaming_forward(q: Tensor, k: Tensor, v: Tensor, plan: StreamingPlan) -> tuple[Tensor, Tensor]:
    """``(out [S, Hq, N, d], lse [S, Hq, N])`` in the accumulation dtype."""
    spec, comm = plan.spec, plan.comm
    pending = None
    if plan.steps:
        pending = comm.ring_shift_async(pack_shard(k, v, spec.exchange_start, spec.shard_rows))
    out, lse = local_attention_forward(q, k, v, plan.local)  # step 0, overlaps the first hop
    for index, step in enumerate(plan.steps):
        kv = pending.wait()  # [2, S, Hkv, n, d] of step.owner
        if index + 1 < len(plan.steps):
            pending = comm.ring_shift_async(kv)
        if step.tile_plan is None:
            continue
        # out_step as its kernels leave it (bf16 from Flex / the pieces): merge_into casts as it reads
        out_step, lse_step = step.tile_plan.forward(step.rows_of(q), kv[0], kv[1], kernel_dtype=True)
        step.merge_into_rows(out, lse, out_step, lse_step)
    return out, lse


def streaming_backward(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, plan: StreamingPlan
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` over the packed rows (accumulation dtype), dK/dV of exchanged rows summed over
    every ring member's queries."""
    spec, comm = plan.spec, plan.comm
    dtype = accumulation_dtype(q, k, v)
    kv_pending = None
    if plan.steps:
        kv_pending = comm.ring_shift_async(
            pack_shard(k, v, spec.exchange_start, spec.shard_rows), category=recompute_category(comm)
        )
    delta = row_delta(dout, out, dtype) if plan.steps else None  # [S, Hq, N], shared by every step
    dq, dk, dv = local_attention_backward(q, k, v, out, lse, dout, plan.local, delta=delta)  # overlaps the first hop
    if not plan.steps:
        return dq, dk, dv
    grad_pending = None
    for index, step in enumerate(plan.steps):
        kv = kv_pending.wait()  # [2, S, Hkv, n, d] of step.owner
        if index + 1 < len(plan.steps):
            kv_pending = comm.ring_shift_async(kv, category=recompute_category(comm))
        # the owner's accumulator, from ring rank c+1 (None at the first step): this rank's share is added onto it
        received = None if grad_pending is None else grad_pending.wait()
        grad_kv = _step_backward(q, kv, out, lse, dout, delta, dq, step, received, dtype)
        grad_pending = comm.ring_shift_async(grad_kv)  # to c-1; the last hop reaches the owner
    grad_own = grad_pending.wait()  # [2, S, Hkv, n, d]: my rows' dK/dV from every other member
    rows = slice(spec.exchange_start, None)
    dk[:, :, rows] += grad_own[0, :, :, : spec.num_exchanged]
    dv[:, :, rows] += grad_own[1, :, :, : spec.num_exchanged]
    return dq, dk, dv


def _step_backward(
    q: Tensor, kv: Tensor, out: Tensor, lse: Tensor, dout: Tensor, delta: Tensor, dq: Tensor,
    step: RingStep, received: Tensor | None, dtype: torch.dtype,
) -> Tensor:
    """The owner's dK/dV accumulator ``[2, S, Hkv, n, d]`` with this rank's share for the shard ``kv``
    added (onto ``received`` in place, or a new one at the first step); adds its dQ into ``dq``."""
    if step.tile_plan is None:
        return kv.new_zeros(kv.shape, dtype=dtype) if received is None else received
    dq_rows, dk_shard, dv_shard = step.tile_plan.backward(
        step.rows_of(q), kv[0], kv[1], step.rows_of(out), step.rows_of(lse), step.rows_of(dout),
        delta=step.rows_of(delta), kernel_dtype=True,
    )  # in the kernels' dtype where they leave it: added into the fp32 dq and accumulator, cast as they go
    step.add_into_rows(dq, dq_rows)
    if received is None:  # the first step: a new accumulator, the kernels' dK/dV cast as they are written
        grad_kv = kv.new_empty(kv.shape, dtype=dtype)
        grad_kv[0].copy_(dk_shard)
        grad_kv[1].copy_(dv_shard)
        return grad_kv
    received[0] += dk_shard
    received[1] += dv_shard
    return received


class StreamingAttention(RingTransport[StreamingPlan]):
    """Ring-streaming attention over ``layout.rows`` (the decoder's ``AttentionFn``).

    Arguments as in ``CollectiveAttention``; ``comm`` must be the ring (P2P shifts to neighbours).
    """

    name = "StreamingAttention"
    forward_fn = staticmethod(streaming_forward)
    backward_fn = staticmethod(streaming_backward)

    def _build_plan(self, device: torch.device) -> StreamingPlan:
        rows = self.layout.rows.to(device)
        spec = self.spec.to(device)
        steps = []
        for offset in range(1, spec.ring_size):
            owner = (spec.ring_rank + offset) % spec.ring_size
            key_rows = padded_rows(spec.member_rows[owner], spec.shard_rows)
            query_index = queries_touching(rows, key_rows)
            query_rows = rows.select(query_index)
            tile_plan = None
            if query_index.numel() > 0:
                tile_plan = plan_partial(
                    query_rows, key_rows, backend=self.backend, causal_in_block=self.causal_in_block,
                    tile_rows=self.tile_rows, clean=self.clean,
                )
            steps.append(RingStep(owner, query_index, query_rows, key_rows, tile_plan, _row_runs(query_index)))
        local = build_local_attention_plan(
            rows, num_noisy=self.layout.num_noisy, causal_in_block=self.causal_in_block, tile_rows=self.tile_rows,
            backend=self.backend, diagonal=self.diagonal, clean=self.clean,
        )
        return StreamingPlan(spec, self.comm, local, tuple(steps))


def _row_runs(query_index: Tensor) -> tuple[tuple[slice, slice], ...]:
    """Per maximal run of consecutive rows in the increasing ``query_index``: its slice of the packed
    rows and of the step's rows (read once, when the plan is built)."""
    index = query_index.tolist()
    runs, first = [], 0
    for i in range(1, len(index) + 1):
        if i == len(index) or index[i] != index[i - 1] + 1:
            runs.append((slice(index[first], index[i - 1] + 1), slice(first, i)))
            first = i
    return tuple(runs)
