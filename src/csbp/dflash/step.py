"""One DFlash training step on one rank: the library entry point the trainer calls (csbp.md §14).

``build_dflash_rank_plan(ctx, objective)`` (``csbp.dflash.rank_plan``) decides, once, what this
rank holds (its zigzag context shard and, under CSBP, its share of the anchors;
``csbp.dflash.layouts``) and which communicators it uses. ``DFlashStep(drafter, objective, plan)`` then turns a micro-batch of token ids, loss mask
and document ids into the rank's loss::

    anchors    = sample_batch_anchors(batch, ...)        # identical on every rank of a sample
    features   = target features (online: frozen target, context-sharded over the CP ring when
                 cp > 1 (csbp.dflash.target_shard), or on the full rows; or offline rows); with the
                 sharded pass and loss='kl' each sample's teacher rows come from the ring member
                 that holds them, only those the rank's supervised rows read (csbp.dflash.teacher_rows)
    per sample:  my packet of anchors, Rows for full/sliding layers, context rows in ring order
                 hidden = drafter(embed([x_a, M, …]), a + j, F[my context rows], ..., sharded attention)
    loss       = loss_scale · (my rows' share of L) + 0 · Σ hidden

Call ``loss.backward()`` and then average gradients over all ``dp · local`` ranks
(``csbp.engine.grads.average_gradients``): the result equals the single-process gradient of ``L``
(``reference_dflash_loss``) for every layout. Every rank must run the same code path (same
samples, layers and options), so its attention collectives and their backward mirrors line up.

Usage::

    plan = build_dflash_rank_plan(ctx, objective)
    step = DFlashStep(drafter, objective, plan)
    out = step(batch, corruption_generator(seed, step_index, dp_rank), selector_scale=step.selector_scale(p))
    out.loss.backward(); average_gradients(drafter.parameters(), ctx.world_comm("gradients"))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from csbp.attention.layouts import WindowPlan
from csbp.attention.rows import Rows
from csbp.dflash.anchors import sample_anchors, segment_starts
from csbp.dflash.attention import ShardedDraftAttention, build_draft_attention_plan
from csbp.dflash.config import DFlashConfig, DFlashObjectiveConfig
from csbp.dflash.dflash2 import selector_loss_scale
from csbp.dflash.drafter import DFlashDrafter
from csbp.dflash.exchange import sample_context_exchanges
from csbp.dflash.features import TargetFeatures, capture_target_features
from csbp.dflash.layouts import (
    AnchorPacket,
    context_positions,
    context_rows,
    draft_query_rows,
    full_packet,
    owned_packet,
    ring_context_positions,
)
from csbp.dflash.loss import (
    METRIC_NAMES,
    BlockTargets,
    Reduce,
    block_targets,
    rank_dflash_loss,
    supervised_slot_counts,
)
from csbp.dflash.rank_plan import DFlashRankPlan
from csbp.dflash.target_shard import capture_sharded_target_features
from csbp.dflash.teacher_rows import exchange_teacher_rows, ring_teacher_needs
from csbp.parallel.comm import Comm


@dataclass(frozen=True)
class DFlashBatch:
    """A micro-batch: ``input_ids`` int64, ``loss_mask`` bool and ``doc_ids`` int64 (``-1`` padding),
    each ``[S, L]`` and identical on every rank of a sample."""

    input_ids: Tensor
    loss_mask: Tensor
    doc_ids: Tensor

    def __post_init__(self) -> None:
        shape = tuple(self.input_ids.shape)
        if len(shape) != 2:
            raise ValueError(f"DFlashBatch.input_ids must be [S, L], got {shape}")
        for name in ("loss_mask", "doc_ids"):
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(
                    f"DFlashBatch.{name} has shape {tuple(getattr(self, name).shape)}, expected {shape}"
                )

    @property
    def num_samples(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])


def sample_batch_anchors(
    batch: DFlashBatch, objective: DFlashObjectiveConfig, block_size: int, generator: torch.Generator
) -> list[Tensor]:
    """Sorted anchors of every sample, drawn in sample order from one generator."""
    return [
        sample_anchors(
            batch.loss_mask[s],
            batch.doc_ids[s],
            max_anchors=objective.max_anchors,
            method=objective.anchor_sampling,
            block_size=block_size,
            generator=generator,
        )
        for s in range(batch.num_samples)
    ]


@dataclass(frozen=True)
class DFlashStepOutput:
    """``loss`` to back-propagate (this rank, scaled); the rest is detached, for logging, and global
    over the ranks of the sample group: ``loss_value = main + selector_scale·selector``."""

    loss: Tensor
    loss_value: float
    selector_value: float
    metrics: dict[str, float]
    model_flops: float | None = None
    """The micro-batch's drafter model FLOPs over every anchor of its samples (``count_flops``), or None."""


FlopCounter = Callable[[DFlashConfig, AnchorPacket, int, int], int]
"""``(drafter config, a sample's full anchor packet, context rows, seq_len) -> FLOPs``
(``csbp.bench.dflash_flops.drafter_step_flops``)."""


class DFlashStep:
    """Computes one rank's DFlash loss for a micro-batch (module docstring)."""

    def __init__(
        self, drafter: DFlashDrafter, objective: DFlashObjectiveConfig, plan: DFlashRankPlan,
        *, count_flops: FlopCounter | None = None,
    ) -> None:
        self.drafter = drafter
        self.objective = objective
        self.plan = plan
        self.count_flops = count_flops
        """Counts each sample's drafter FLOPs over all its anchors (the trainer's ``mfu``); None: not counted."""

    def selector_scale(self, progress: float) -> float:
        """The selector loss weight at training ``progress`` in ``[0, 1]`` (warm-up and ramp)."""
        o = self.objective
        return selector_loss_scale(
            progress,
            alpha=o.selector_alpha,
            warmup_ratio=o.selector_warmup_ratio,
            ramp_ratio=o.selector_ramp_ratio,
        )

    def __call__(
        self,
        batch: DFlashBatch,
        generator: torch.Generator,
        *,
        features: TargetFeatures | None = None,
        selector_scale: float = 0.0,
    ) -> DFlashStepOutput:
        drafter, objective, layout = self.drafter, self.objective, self.plan.layout
        cfg = drafter.config
        seq_len, block = batch.seq_len, cfg.block_size
        anchors = sample_batch_anchors(batch, objective, block, generator)
        if features is None:
            features = self._capture(batch)
        my_context = context_positions(seq_len, layout.cp, layout.cp_rank)
        self._check_features(features, batch, my_context)
        gathered_rows = context_rows(ring_context_positions(seq_len, layout.cp))
        min_bucket = objective.anchor_bucket_minimum(layout.num_owners)
        device = drafter.fc.weight.device

        hidden_parts, target_parts, all_parts = [], [], []
        flops = 0
        for s in range(batch.num_samples):
            starts_L = segment_starts(batch.doc_ids[s].cpu())
            doc_start = starts_L[anchors[s]]
            every_anchor = full_packet(anchors[s], doc_start)
            all_parts.append(self._targets(batch, s, every_anchor, None))
            if self.count_flops is not None:  # the sample's model work, whatever this rank owns of it
                flops += self.count_flops(cfg, every_anchor, seq_len, seq_len)
            packet = owned_packet(
                anchors[s], doc_start, layout, context=objective.context, min_bucket=min_bucket
            )
            exchanges = sample_context_exchanges(
                cfg, seq_len, layout, anchors[s], starts_L, transport=self.plan.transport,
                context=objective.context, min_bucket=min_bucket,
            )
            features_1MF = features.features[s : s + 1]
            if features.positions is None:
                features_1MF = features_1MF[:, my_context.to(features_1MF.device)]
            hidden_parts.append(
                forward_packet(
                    drafter,
                    batch.input_ids[s],
                    packet,
                    features_1MF,
                    my_context,
                    gathered_rows,
                    context=objective.context,
                    comm=self.plan.ring_comm,
                    backend=self.plan.backend,
                    diagonal=self.plan.diagonal,
                    clean=self.plan.clean,
                    exchanges=exchanges,
                )[0]
            )
            last = None if features.last_hidden is None else features.last_hidden[s]
            held = None
            if last is not None and features.positions is not None:  # the ring's rows my packet reads
                last, held = self._teacher_rows(batch, s, anchors[s], doc_start, last, min_bucket)
            target_parts.append(self._targets(batch, s, packet, last, held))
        hidden_RD = torch.cat(hidden_parts)
        out = rank_dflash_loss(
            hidden_RD,
            drafter.lm_head_weight,
            BlockTargets.cat(target_parts),
            objective,
            block_size=block,
            sample_counts=supervised_slot_counts(all_parts, batch.num_samples),
            reduce=self._reduce(device),
            reduce_batch=self._reduce_batch(device),
            selector=drafter.selector,
            selector_scale=selector_scale,
        )
        loss = layout.loss_scale * out.loss + 0.0 * hidden_RD.sum()
        stats = torch.stack(
            [out.main.double().cpu(), out.selector.double().cpu()]
            + [out.metrics[name] for name in METRIC_NAMES]
        )
        stats = self._reduce(device)(stats)
        main, selector = float(stats[0]), float(stats[1])
        sums = dict(zip(METRIC_NAMES, (float(v) for v in stats[2:])))
        metrics = {
            "token_accuracy": sums["correct"] / max(sums["supervised"], 1.0),
            "tau_mean": sums["tau_sum"] / max(sums["live_blocks"], 1.0),
            "supervised_slots": sums["supervised"],
            "live_blocks": sums["live_blocks"],
            **{name: sums[name] for name in ("lk_ce", "lk_tv", "prob_sum", "prob_count")},
        }
        if drafter.selector is not None:
            metrics["candidate_recall"] = sums["covered"] / max(sums["supervised"], 1.0)
        counted = float(flops) if self.count_flops is not None else None
        return DFlashStepOutput(loss, main + selector_scale * selector, selector, metrics, counted)

    # ---- helpers -------------------------------------------------------------------------------

    def _reduce(self, device: torch.device) -> Reduce:
        def reduce(values: Tensor) -> Tensor:
            if self.plan.owner_comm is None:
                return values
            return self.plan.reduce_sum(values.to(device)).to(values.device)

        return reduce

    def _reduce_batch(self, device: torch.device) -> Reduce:
        def reduce(values: Tensor) -> Tensor:
            return self.plan.reduce_batch(values.to(device)).to(values.device)

        return reduce

    def _capture(self, batch: DFlashBatch) -> TargetFeatures:
        """Online target features: sharded over the CP ring when ``cp > 1`` (unless the objective
        asks for the replicated pass), else the full sequence on this rank."""
        layout, target = self.plan.layout, self.drafter.target
        layer_ids = self.drafter.config.target_layer_ids or ()
        with_last = self.objective.loss == "kl"
        if layout.cp > 1 and self.objective.target_capture == "sharded":
            if self.plan.ring_comm is None:
                raise ValueError(
                    "objective.target_capture='sharded' needs the CP ring comm (cp > 1 without process "
                    "groups); build the plan from a parallel context or use target_capture='replicated'"
                )
            return capture_sharded_target_features(
                target, batch.input_ids, layer_ids, comm=self.plan.ring_comm, cp=layout.cp,
                cp_rank=layout.cp_rank, doc_ids_SL=batch.doc_ids, with_last_hidden=with_last,
                backend=self.plan.backend,
            )
        return capture_target_features(
            target, batch.input_ids, layer_ids, doc_ids_SL=batch.doc_ids, with_last_hidden=with_last
        )

    def _teacher_rows(
        self, batch: DFlashBatch, s: int, anchors: Tensor, doc_start: Tensor, last_MD: Tensor, min_bucket: int
    ) -> tuple[Tensor, Tensor]:
        """``(rows [N, H], positions [N])``: the teacher rows of sample ``s`` from the ring's last hidden
        shards, exactly the rows this rank's supervised draft rows read (``csbp.dflash.teacher_rows``)."""
        layout = self.plan.layout
        if self.plan.ring_comm is None:
            raise ValueError("sharded target features with loss='kl' need the CP ring comm to exchange teacher rows")
        needs = ring_teacher_needs(
            batch.input_ids[s], batch.loss_mask[s], batch.doc_ids[s], anchors, doc_start, layout,
            block_size=self.drafter.config.block_size, context=self.objective.context, min_bucket=min_bucket,
        )
        return exchange_teacher_rows(
            last_MD, needs, self.plan.ring_comm, seq_len=batch.seq_len, cp=layout.cp, cp_rank=layout.cp_rank
        )

    def _check_features(self, features: TargetFeatures, batch: DFlashBatch, my_context: Tensor) -> None:
        cfg = self.drafter.config
        rows = batch.seq_len
        if features.positions is not None:
            if not torch.equal(features.positions.cpu(), my_context):
                raise ValueError(
                    "sharded target features hold other positions than this rank's context rows; "
                    "capture them with this rank's layout (cp, cp_rank)"
                )
            rows = len(my_context)
        expected = (batch.num_samples, rows, cfg.feature_width)
        expected_ids = tuple(cfg.target_layer_ids or ())
        if tuple(features.features.shape) != expected or tuple(features.layer_ids) != expected_ids:
            raise ValueError(
                f"target features {tuple(features.features.shape)} of layers {list(features.layer_ids)} "
                f"do not match the batch and drafter: expected {expected} of layers {list(expected_ids)}"
            )
        if self.objective.loss == "kl" and features.last_hidden is None:
            raise ValueError(
                "objective loss='kl' needs the target's last hidden state: capture with_last_hidden=True"
            )
        if features.last_hidden is not None and features.last_hidden.shape[:2] != features.features.shape[:2]:
            raise ValueError(
                f"target last_hidden {tuple(features.last_hidden.shape)} holds other rows than the features "
                f"{tuple(features.features.shape)}: both are the rank's rows (sharded) or every row"
            )

    def _targets(
        self, batch: DFlashBatch, s: int, packet: AnchorPacket, last_hidden: Tensor | None,
        last_hidden_positions: Tensor | None = None,
    ) -> BlockTargets:
        return block_targets(
            batch.input_ids[s],
            batch.loss_mask[s],
            batch.doc_ids[s],
            packet,
            self.drafter.config.block_size,
            sample=s,
            last_hidden_LD=last_hidden,
            last_hidden_positions=last_hidden_positions,
        )


def forward_packet(
    drafter: DFlashDrafter,
    tokens_L: Tensor,
    packet: AnchorPacket,
    features_1MF: Tensor,
    context_positions_M: Tensor,
    gathered_context_rows: Rows,
    *,
    context: str = "strict",
    comm: Comm | None = None,
    backend: str = "tiles",
    diagonal: str = "auto",
    clean: str = "generic",
    exchanges: list[WindowPlan | None] | None = None,
) -> Tensor:
    """Hidden states ``[1, n·B, D]`` of a packet's blocks ``[x_a, M, …]`` (dead blocks: zeros).

    ``features_1MF`` are the context rows this rank holds at ``context_positions_M``;
    ``gathered_context_rows`` describe every ring member's rows in ring order (this rank's alone
    when ``comm`` is None). Full-attention and sliding layers get their own ``Rows``;
    ``exchanges`` (``context_exchanges``) replaces the all-gather of a layer kind by the context exchange.
    """
    cfg = drafter.config
    device = drafter.fc.weight.device
    variants, causal, layer_variant = draft_query_rows(cfg, packet, context=context)
    plan = build_draft_attention_plan(
        [v.to(device) for v in variants],
        causal,
        layer_variant,
        gathered_context_rows.to(device),
        block_size=cfg.block_size,
        comm=comm,
        backend=backend,
        diagonal=diagonal,
        clean=clean,
        exchanges=exchanges,
    )
    ids = drafter.block_input_ids(tokens_L.cpu()[packet.anchors], packet.keep).to(device)
    return drafter(
        drafter.embed(ids[None]),
        variants[0].pos,
        features_1MF.to(device),
        context_positions_M,
        ShardedDraftAttention(plan),
        live_rows_N=variants[0].live,
    )
