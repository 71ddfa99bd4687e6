"""Run a self-denoising objective on one rank's rows of the ``[x_t ; x_0]`` layout.

The model knows nothing about parallelism: this module picks the rows the rank holds
(:mod:`csbp.attention.layouts`), the attention transport that connects them to the other ranks
(:mod:`csbp.attention.transports.factory`), feeds the model those rows with their explicit
positions, and scores the noisy rows the rank owns with the objective's labels and weights.

Loss scaling (csbp.md §13): a rank returns ``world_size * Σ_owned w·CE / D_global``. Gradients
are then averaged over all ``world_size`` ranks (:mod:`csbp.engine.grads`), which gives exactly
``∇ Σ_all w·CE / D_global``: the single-process gradient. ``D_global`` is the sum of the
objective's denominators over every data-parallel replica (and accumulation micro-step), never a
rank-local count. ``0 · Σ hidden`` is added so every rank back-propagates through its whole graph
and runs every attention collective, even when it owns no supervised row.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

import torch
from torch import Tensor

from csbp.attention.layouts import RankLayout, rank_layout
from csbp.attention.rows import Rows
from csbp.attention.transports.factory import build_attention
from csbp.attention.transports.local import LocalAttentionFn
from csbp.engine.context import ParallelContext
from csbp.models.decoder import AttentionFn, Decoder
from csbp.objectives.base import CorruptedBatch
from csbp.objectives.chunked_ce import chunked_weighted_ce
from csbp.schedules import SchedulePolicy

TransportName = Literal["collective", "streaming"]


@dataclass(frozen=True, eq=False)
class RankPlan:
    """The rows a rank holds for one ``(seq_len, block_size)`` and the attention that joins them.

    Attributes:
        rows: packed row metadata (noisy rows first, then clean rows; single-stream: noisy only).
        num_noisy: loss-bearing rows at the front of ``rows``.
        noisy_positions: token positions of the noisy rows.
        clean_positions: token positions of the clean rows (empty for single-stream objectives).
        attention: the ``AttentionFn`` every layer calls.
    """

    rows: Rows
    num_noisy: int
    noisy_positions: Tensor
    clean_positions: Tensor
    attention: AttentionFn


def build_rank_plan(
    ctx: ParallelContext,
    seq_len: int,
    block_size: int,
    *,
    uses_clean_stream: bool = True,
    causal: bool = False,
    transport: TransportName = "collective",
    window: int | None = None,
    schedule: SchedulePolicy = "dual_end",
    backend: str = "tiles",
) -> RankPlan:
    """Plan this rank's rows and attention (build once per shape; every layer and step reuses it).
    ``backend``: attention backend of every partial (auto, tiles, flex; csbp.attention.backends)."""
    topology = ctx.topology
    if not uses_clean_stream:
        return _single_stream_plan(ctx, seq_len, block_size, causal=causal, backend=backend)
    topology.validate_sequence(seq_len, block_size)
    layout: RankLayout = rank_layout(
        topology, ctx.coords.local_rank, seq_len, block_size, schedule=schedule, window=window
    )
    attention = build_attention(
        topology,
        ctx.coords.local_rank,
        layout,
        ctx.ring_comm(),
        block_size=block_size,
        transport=transport,
        window=window,
        schedule=schedule,
        backend=backend,
    )
    return RankPlan(layout.rows, layout.num_noisy, layout.noisy_positions, layout.clean_positions, attention)


def _single_stream_plan(
    ctx: ParallelContext, seq_len: int, block_size: int, *, causal: bool, backend: str
) -> RankPlan:
    """MDLM (one bidirectional block over the whole sequence) and AR (causal): data parallel only."""
    if ctx.topology.local != 1:
        raise ValueError(
            "single-stream objectives (mdlm, ar) have no clean stream to shard: use topology cp=1, bp=1 "
            f"(got cp={ctx.topology.cp}, bp={ctx.topology.bp}); scale them with dp"
        )
    rows = _single_stream_rows(seq_len)
    attention = LocalAttentionFn(rows, num_noisy=seq_len, causal_in_block=causal, backend=backend)
    return RankPlan(rows, seq_len, rows.pos, torch.zeros(0, dtype=torch.long), attention)


@lru_cache(maxsize=16)
def _single_stream_rows(seq_len: int) -> Rows:
    pos = torch.arange(seq_len)
    zeros = torch.zeros(seq_len, dtype=torch.long)
    return Rows(pos, torch.zeros(seq_len, dtype=torch.bool), zeros, zeros, zeros, torch.ones(seq_len, dtype=torch.bool))


def rank_inputs(corrupted: CorruptedBatch, plan: RankPlan) -> tuple[Tensor, Tensor]:
    """``(input_ids [S', rows], positions [rows])`` of this rank: its noisy rows then its clean rows."""
    device = corrupted.noisy_ids.device
    noisy = corrupted.noisy_ids[:, plan.noisy_positions.to(device)]
    positions = plan.rows.pos.to(device)
    if plan.clean_positions.numel() == 0:
        return noisy, positions
    clean = corrupted.clean_ids[:, plan.clean_positions.to(device)]
    return torch.cat([noisy, clean], dim=1), positions


def rank_loss(
    model: Decoder,
    corrupted: CorruptedBatch,
    plan: RankPlan,
    *,
    global_denominator: float,
    world_size: int,
    ce_chunk_rows: int = 1024,
) -> tuple[Tensor, Tensor]:
    """Forward this rank's rows and return ``(loss_for_backward, weighted_ce_sum)``.

    ``loss_for_backward`` is scaled so that averaging gradients over ``world_size`` ranks gives
    the single-process gradient; ``weighted_ce_sum`` (detached) is this rank's share of the
    numerator, for logging (sum it over ranks and divide by ``global_denominator``).
    """
    if global_denominator <= 0:
        raise ValueError(f"global loss denominator must be positive, got {global_denominator}")
    input_ids, positions = rank_inputs(corrupted, plan)
    hidden_SRD = model(input_ids, positions, plan.attention)
    noisy_SAD = hidden_SRD[:, : plan.num_noisy]
    index = plan.noisy_positions.to(corrupted.labels.device)
    labels = corrupted.labels[:, index].reshape(-1)
    weights = corrupted.weights[:, index].reshape(-1)
    ce_sum = chunked_weighted_ce(
        noisy_SAD.reshape(-1, noisy_SAD.shape[-1]),
        model.lm_head_weight,
        labels,
        weights.to(noisy_SAD.dtype if noisy_SAD.dtype == torch.float64 else torch.float32),
        chunk_rows=ce_chunk_rows,
        exclude_token=corrupted.exclude_token,
    )
    loss = ce_sum * (world_size / global_denominator) + 0.0 * hidden_SRD.sum()
    return loss, ce_sum.detach()
