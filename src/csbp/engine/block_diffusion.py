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

Packed documents (``data.document_mask``, docs/document-masking.md): every sample of a micro-batch
has its own document boundaries, hence its own rows and exchange plan. ``DocumentPlanner`` builds
one ``RankPlan`` per distinct ``doc_ids`` row and ``rank_loss`` runs the model once per sample (every
rank of a sample processes the samples in the same order, so the collectives pair up).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from csbp.attention.documents import Documents
from csbp.attention.layouts import RankLayout, rank_layout
from csbp.attention.rows import Rows
from csbp.attention.transports.factory import build_attention
from csbp.attention.transports.local import LocalAttentionFn
from csbp.engine.context import ParallelContext
from csbp.models.decoder import AttentionFn, Decoder
from csbp.objectives.base import CorruptedBatch
from csbp.objectives.chunked_ce import chunked_weighted_ce, weighted_ce_per_row
from csbp.schedules import SchedulePolicy

TransportName = Literal["collective", "streaming", "halo"]


@dataclass(frozen=True, eq=False)
class RankPlan:
    """The rows a rank holds for one ``(seq_len, block_size)`` and the attention that joins them.

    Attributes:
        rows: packed row metadata (noisy rows first, then clean rows; single-stream: noisy only).
        num_noisy: loss-bearing rows at the front of ``rows``.
        noisy_positions: token positions of the noisy rows.
        clean_positions: token positions of the clean rows (empty for single-stream objectives).
        attention: the ``AttentionFn`` every layer calls.
        rope_positions: RoPE position of every row when it differs from ``rows.pos`` (positions
            restarting at each packed document), else None.
    """

    rows: Rows
    num_noisy: int
    noisy_positions: Tensor
    clean_positions: Tensor
    attention: AttentionFn
    rope_positions: Tensor | None = None
    _indices: dict[torch.device, RowIndex] = field(default_factory=dict, init=False, repr=False)

    def indices(self, device: torch.device) -> RowIndex:
        """The row indices on ``device`` (``positions``: the RoPE positions), moved there once and
        cached (not per step or layer)."""
        index = self._indices.get(device)
        if index is None:
            positions = self.rows.pos if self.rope_positions is None else self.rope_positions
            index = self._indices[device] = RowIndex(
                *(t.to(device) for t in (self.noisy_positions, self.clean_positions, positions))
            )
        return index


class RowIndex(NamedTuple):
    """A ``RankPlan``'s position indices on one device."""

    noisy_positions: Tensor
    clean_positions: Tensor
    positions: Tensor


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
    documents: Documents | None = None,
    reset_positions: bool = False,
    backend: str = "tiles",
    diagonal: str = "auto",
    clean: str = "generic",
) -> RankPlan:
    """Plan this rank's rows and attention (build once per shape, or once per sample's ``documents``;
    every layer reuses it). ``reset_positions`` restarts RoPE positions at each document.
    ``backend``: attention backend of every partial (auto, tiles, flex; csbp.attention.backends);
    ``diagonal``: kernel of the noisy block diagonal (csbp.attention.diagonal); ``clean``: kernel of
    the clean-context partials (generic, pieces, pieces-cudnn; csbp.attention.flash_pieces)."""
    if not uses_clean_stream:
        if window is not None:  # no windowed single-stream mask exists: never ignore a window silently
            raise ValueError(
                f"window={window} needs the two-stream layout (bd3, fast_dllm_v2): single-stream objectives "
                "(mdlm, ar) train full attention; remove the window"
            )
        plan = _single_stream_plan(
            ctx, seq_len, block_size, causal=causal, documents=documents, backend=backend, diagonal=diagonal
        )
    else:
        plan = _two_stream_plan(
            ctx, seq_len, block_size, transport, window, schedule, documents, backend, diagonal, clean
        )
    if reset_positions and documents is not None:
        plan = replace(plan, rope_positions=plan.rows.pos - documents.start[plan.rows.pos])
    return plan


def _two_stream_plan(
    ctx: ParallelContext,
    seq_len: int,
    block_size: int,
    transport: TransportName,
    window: int | None,
    schedule: SchedulePolicy,
    documents: Documents | None,
    backend: str = "tiles",
    diagonal: str = "auto",
    clean: str = "generic",
) -> RankPlan:
    topology = ctx.topology
    topology.validate_sequence(seq_len, block_size)
    layout: RankLayout = rank_layout(
        topology, ctx.coords.local_rank, seq_len, block_size, schedule=schedule, window=window, documents=documents
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
        documents=documents,
        backend=backend,
        diagonal=diagonal,
        clean=clean,
        device=ctx.device,  # CPU rows, plan built where the step runs
    )
    return RankPlan(layout.rows, layout.num_noisy, layout.noisy_positions, layout.clean_positions, attention)


@dataclass(frozen=True, eq=False)
class DocumentPlanner:
    """Builds the ``RankPlan`` of every sample from its packed documents (``build_rank_plan``'s
    arguments besides ``documents``); pass it to ``rank_loss`` in place of a plan."""

    ctx: ParallelContext
    seq_len: int
    block_size: int
    uses_clean_stream: bool = True
    causal: bool = False
    transport: TransportName = "collective"
    window: int | None = None
    schedule: SchedulePolicy = "dual_end"
    reset_positions: bool = False
    backend: str = "tiles"
    diagonal: str = "auto"
    clean: str = "generic"

    def plans_for(self, doc_ids: Tensor) -> list[RankPlan]:
        """One plan per row of ``doc_ids [S', L]`` (rows with equal ids share a plan)."""
        plans: dict[bytes, RankPlan] = {}
        out = []
        for row in doc_ids.detach().cpu():
            key = row.numpy().tobytes()
            if key not in plans:
                plans[key] = build_rank_plan(
                    self.ctx, self.seq_len, self.block_size, uses_clean_stream=self.uses_clean_stream,
                    causal=self.causal, transport=self.transport, window=self.window, schedule=self.schedule,
                    documents=Documents.from_doc_ids(row), reset_positions=self.reset_positions,
                    backend=self.backend, diagonal=self.diagonal, clean=self.clean,
                )
            out.append(plans[key])
        return out


def _single_stream_plan(
    ctx: ParallelContext,
    seq_len: int,
    block_size: int,
    *,
    causal: bool,
    documents: Documents | None = None,
    backend: str = "tiles",
    diagonal: str = "auto",
) -> RankPlan:
    """MDLM (one bidirectional block over the whole sequence) and AR (causal): data parallel only."""
    if ctx.topology.local != 1:
        raise ValueError(
            "single-stream objectives (mdlm, ar) have no clean stream to shard: use topology cp=1, bp=1 "
            f"(got cp={ctx.topology.cp}, bp={ctx.topology.bp}); scale them with dp"
        )
    rows = _single_stream_rows(seq_len)
    if documents is not None:  # one bidirectional (MDLM) or causal (AR) block per document
        rows = replace(rows, block=documents.start.clone())
    attention = LocalAttentionFn(
        rows, num_noisy=seq_len, causal_in_block=causal, backend=backend, diagonal=diagonal, device=ctx.device
    )
    return RankPlan(rows, seq_len, rows.pos, torch.zeros(0, dtype=torch.long), attention)


@lru_cache(maxsize=16)
def _single_stream_rows(seq_len: int) -> Rows:
    pos = torch.arange(seq_len)
    zeros = torch.zeros(seq_len, dtype=torch.long)
    return Rows(pos, torch.zeros(seq_len, dtype=torch.bool), zeros, zeros, zeros, torch.ones(seq_len, dtype=torch.bool))


def rank_inputs(corrupted: CorruptedBatch, plan: RankPlan) -> tuple[Tensor, Tensor]:
    """``(input_ids [S', rows], positions [rows])`` of this rank: its noisy rows then its clean rows."""
    index = plan.indices(corrupted.noisy_ids.device)
    noisy = corrupted.noisy_ids[:, index.noisy_positions]
    if plan.clean_positions.numel() == 0:
        return noisy, index.positions
    clean = corrupted.clean_ids[:, index.clean_positions]
    return torch.cat([noisy, clean], dim=1), index.positions


def sample_rows(batch: CorruptedBatch, rows: slice) -> CorruptedBatch:
    """The rows ``rows`` of a corrupted batch, keeping its (global) normaliser."""
    tensors = {
        name: getattr(batch, name)[rows]
        for name in ("noisy_ids", "clean_ids", "labels", "weights", "doc_ids")
    }
    if batch.noise_levels is not None:
        tensors["noise_levels"] = batch.noise_levels[rows]
    return replace(batch, **tensors)


def rank_loss(
    model: Decoder,
    corrupted: CorruptedBatch,
    plan: RankPlan | DocumentPlanner,
    *,
    global_denominator: float,
    world_size: int,
    ce_chunk_rows: int = 1024,
) -> tuple[Tensor, Tensor]:
    """Forward this rank's rows and return ``(loss_for_backward, weighted_ce_sum)``.

    ``loss_for_backward`` is scaled so that averaging gradients over ``world_size`` ranks gives
    the single-process gradient; ``weighted_ce_sum`` (detached) is this rank's share of the
    numerator, for logging (sum it over ranks and divide by ``global_denominator``). With a
    ``DocumentPlanner`` every sample runs with its own documents' plan.
    """
    if global_denominator <= 0:
        raise ValueError(f"global loss denominator must be positive, got {global_denominator}")
    if isinstance(plan, RankPlan):  # one loss per backward: the LM head's logits may wait for it
        return _plan_loss(model, corrupted, plan, global_denominator, world_size, ce_chunk_rows, keep_logits=True)
    losses, ce_sums = [], []
    for index, sample_plan in enumerate(plan.plans_for(corrupted.doc_ids)):
        one = sample_rows(corrupted, slice(index, index + 1))
        loss, ce_sum = _plan_loss(model, one, sample_plan, global_denominator, world_size, ce_chunk_rows)
        losses.append(loss)
        ce_sums.append(ce_sum)
    return torch.stack(losses).sum(), torch.stack(ce_sums).sum()


def _plan_loss(
    model: Decoder,
    corrupted: CorruptedBatch,
    plan: RankPlan,
    global_denominator: float,
    world_size: int,
    ce_chunk_rows: int,
    *,
    keep_logits: bool = False,
) -> tuple[Tensor, Tensor]:
    input_ids, positions = rank_inputs(corrupted, plan)
    hidden_SRD = model(input_ids, positions, plan.attention)
    noisy_SAD = hidden_SRD[:, : plan.num_noisy]
    index = plan.indices(corrupted.labels.device).noisy_positions
    labels = corrupted.labels[:, index].reshape(-1)
    weights = corrupted.weights[:, index].reshape(-1)
    ce_sum = chunked_weighted_ce(
        noisy_SAD.reshape(-1, noisy_SAD.shape[-1]),
        model.lm_head_weight,
        labels,
        weights.to(noisy_SAD.dtype if noisy_SAD.dtype == torch.float64 else torch.float32),
        chunk_rows=ce_chunk_rows,
        exclude_token=corrupted.exclude_token,
        keep_logits=keep_logits,
    )
    loss = ce_sum * (world_size / global_denominator) + 0.0 * hidden_SRD.sum()
    return loss, ce_sum.detach()


@torch.no_grad()
def rank_block_losses(
    model: Decoder,
    corrupted: CorruptedBatch,
    plan: RankPlan | DocumentPlanner | Sequence[RankPlan],
    *,
    ce_chunk_rows: int = 1024,
) -> Tensor:
    """``[S', N]`` float64: per (sample, diffusion block), the weighted cross-entropy summed over this rank's
    noisy rows in that block (0 where the rank holds none). Every noisy row lives on exactly one rank of a
    replica, so the sum over the replica's ranks is each block's whole loss (``csbp.training.clip_search``).
    ``plan``: a plain plan, a ``DocumentPlanner``, or the planner's plans of these samples (built once and
    shared by every noise window of the same rows)."""
    samples, length = corrupted.labels.shape
    block = corrupted.block_size
    sums = torch.zeros(samples, -(-length // block), dtype=torch.float64, device=corrupted.labels.device)
    # a plain plan runs the whole micro-batch at once; packed documents one sample (plan) at a time
    if isinstance(plan, RankPlan):
        groups = [(slice(0, samples), plan)]
    else:
        sample_plans = plan.plans_for(corrupted.doc_ids) if isinstance(plan, DocumentPlanner) else list(plan)
        if len(sample_plans) != samples:
            raise ValueError(f"{len(sample_plans)} sample plans for a micro-batch of {samples} samples")
        groups = [(slice(index, index + 1), sample_plan) for index, sample_plan in enumerate(sample_plans)]
    for rows, group_plan in groups:
        part = sample_rows(corrupted, rows)
        input_ids, positions = rank_inputs(part, group_plan)
        hidden = model(input_ids, positions, group_plan.attention)[:, : group_plan.num_noisy]
        noisy = group_plan.indices(part.labels.device).noisy_positions
        per_row = weighted_ce_per_row(
            hidden.reshape(-1, hidden.shape[-1]), model.lm_head_weight, part.labels[:, noisy].reshape(-1),
            part.weights[:, noisy].reshape(-1), chunk_rows=ce_chunk_rows, exclude_token=part.exclude_token,
        )
        sums[rows].index_add_(1, noisy // block, per_row.view(hidden.shape[0], -1).to(torch.float64))
    return sums
