"""One dflash training step and one validation pass on this rank, through ``csbp.dflash.DFlashStep``.

A step with ``grad_accum = K`` micro-batches:

1. micro-batch ``k`` draws its anchors from ``corruption_generator(seed, step, dp_rank, micro_step=k)``;
   every rank of one model replica loads the same batch (the loader is keyed by ``dp_rank``) and so
   draws the same anchors, whatever its CP/BP coordinates;
2. target features come from the offline store (rows by ``row_ids``) when configured, else the
   frozen target computes them inside the step;
3. ``DFlashStep`` returns this rank's scaled share of the replica's loss ``L_k`` (a mean over the
   micro-batch's samples, denominators global over the sample group); ``L_k / K`` is
   back-propagated, so after gradient averaging over all ``dp * local`` ranks the gradient is that of
   ``mean over replicas and micro-batches of L_k``, the loss that is logged;
4. the DFlash2 selector loss weight follows training progress ``(step - 1) / max_steps``
   (``selector_warmup_ratio``, ``selector_ramp_ratio``).

Metrics are global sums turned into ratios: ``token_accuracy`` (argmax hits over supervised draft
slots), ``tau_mean`` (the teacher-forced acceptance-length estimate per anchor block, objectives.md §7),
with a selector also ``selector_loss`` and ``candidate_recall``.

Validation scores ``eval_batches`` fixed micro-batches of the validation split (unshuffled loader,
anchors from ``corruption_generator(seed, batch index, dp_rank, EVAL_MICRO_STEP)``, online target
features, the selector at its full weight), so every evaluation of a run is comparable. Under
``lk_loss_type: lambda`` the validation loss mixes CE and TV with ``c`` of the whole pass's acceptance
(logged as ``lk_acceptance``), not each batch's, so its expectation does not depend on
``micro_batch_size``; with one batch it is the training loss of that batch.

``tau_mean`` is a *teacher-forced* estimate: drafts are compared with the data's next tokens, with
the data as context. Serving accepts a draft when it equals the *target's* greedy token, with the
target's own output as context, which a drafter trained to imitate the target matches far more
often (on the demo pair 1.17 teacher-forced against 1.99 served). So validation also runs the
lossless speculative decoding of ``csbp dflash eval`` itself on rank 0
(:func:`csbp.dflash.evaluate.split_acceptance`: ``objective.dflash.eval_prompts`` prompts of the
validation split, ``eval_new_tokens`` new tokens; by default ``csbp dflash eval``'s 8 and 64) and
logs its ``acceptance_length`` and per-position ``accept_rate_<k>``: the run's last
``val_acceptance_length`` is the number ``csbp dflash eval --data`` prints for the export with the
same ``--num-prompts`` and ``--max-new-tokens``.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import Tensor

from csbp.bench.dflash_flops import drafter_step_flops
from csbp.data.artifact import ArtifactSplit
from csbp.dflash.config import DFlashObjectiveConfig
from csbp.dflash.drafter import DFlashDrafter
from csbp.dflash.evaluate import split_acceptance
from csbp.dflash.features import FeatureStore
from csbp.dflash.loss import lambda_ce_coef
from csbp.dflash.rank_plan import build_dflash_rank_plan
from csbp.dflash.step import DFlashBatch, DFlashStep, DFlashStepOutput
from csbp.engine.context import ParallelContext
from csbp.engine.grad_buckets import OverlappedGradientSync
from csbp.objectives.base import corruption_generator
from csbp.training.step import EVAL_MICRO_STEP, EvalResult, StepResult, autocast_for, validation_loader

_LK_SUMS = ("lk_ce", "lk_tv", "prob_sum", "prob_count")
_SUMS = ("loss", "selector", "correct", "supervised", "tau_sum", "live_blocks", "covered", *_LK_SUMS, "model_flops")
"""Per-micro-batch numbers summed over micro-batches and data-parallel replicas."""


def dflash_batch(batch: dict[str, Tensor]) -> DFlashBatch:
    """The loader's ``input_ids`` / ``loss_mask`` / ``doc_ids`` as a ``DFlashBatch`` (CPU)."""
    return DFlashBatch(batch["input_ids"], batch["loss_mask"].bool(), batch["doc_ids"])


def output_sums(out: DFlashStepOutput) -> list[float]:
    """``_SUMS`` of one step output (its metrics are ratios of global sums of the sample group)."""
    metrics = out.metrics
    supervised, live_blocks = metrics["supervised_slots"], metrics["live_blocks"]
    return [
        out.loss_value,
        out.selector_value,
        metrics["token_accuracy"] * supervised,
        supervised,
        metrics["tau_mean"] * live_blocks,
        live_blocks,
        metrics.get("candidate_recall", 0.0) * supervised,
        *(metrics[name] for name in _LK_SUMS),
        out.model_flops or 0.0,
    ]


class DFlashStepRunner:
    """Runs dflash training micro-batches and validation passes of one rank (module docstring)."""

    def __init__(
        self,
        drafter: DFlashDrafter,
        objective: DFlashObjectiveConfig,
        ctx: ParallelContext,
        *,
        device: torch.device,
        precision: str,
        seed: int,
        total_steps: int,
        features: FeatureStore | None = None,
        backend: str = "tiles",
        diagonal: str = "auto",
        clean: str = "generic",
        transport: str = "collective",
        eos_id: int | None = None,
        served_prompts: int = 0,
        served_new_tokens: int = 64,
    ) -> None:
        self.drafter = drafter
        self.step_fn = DFlashStep(
            drafter, objective, build_dflash_rank_plan(
                ctx, objective, backend=backend, diagonal=diagonal, clean=clean, transport=transport
            ),
            count_flops=functools.partial(drafter_step_flops, model_flops=True),  # the mfu metric's accounting
        )
        self.ctx = ctx
        self.device = device
        self.precision = precision
        self.seed = seed
        self.total_steps = total_steps
        self.features = features
        self.eos_id = eos_id
        self.served_prompts = served_prompts
        self.served_new_tokens = served_new_tokens
        self.feature_dtype = drafter.fc.weight.dtype
        self.grad_sync: OverlappedGradientSync | None = None
        """Set by the trainer: armed before each step's last backward (gradients averaged in it)."""

    def _run(
        self, batch: dict[str, Tensor], generator: torch.Generator, *, selector_scale: float, online: bool
    ) -> DFlashStepOutput:
        features = None
        if self.features is not None and not online:
            features = self.features.rows(batch["row_ids"].tolist(), dtype=self.feature_dtype)
        with autocast_for(self.precision, self.device):
            return self.step_fn(dflash_batch(batch), generator, features=features, selector_scale=selector_scale)

    def _global(self, sums_K: list[list[float]]) -> dict[str, float]:
        """``_SUMS`` summed over micro-batches and data-parallel replicas (float64)."""
        totals = torch.tensor(sums_K, dtype=torch.float64, device=self.ctx.device).sum(dim=0)
        comm = self.ctx.dp_comm("loss")
        if comm is not None:
            totals = comm.all_reduce(totals)
        return dict(zip(_SUMS, totals.tolist()))

    def _metrics(self, totals: dict[str, float], count: int) -> tuple[float, dict[str, float]]:
        """The mean loss over ``count`` replica micro-batches and the ratio metrics."""
        metrics = {
            "token_accuracy": totals["correct"] / max(totals["supervised"], 1.0),
            "tau_mean": totals["tau_sum"] / max(totals["live_blocks"], 1.0),
        }
        if self.drafter.selector is not None:
            metrics["selector_loss"] = totals["selector"] / count
            metrics["candidate_recall"] = totals["covered"] / max(totals["supervised"], 1.0)
        return totals["loss"] / count, metrics

    def train_step(self, batches: list[dict[str, Tensor]], step: int) -> StepResult:
        """Forward and backward every micro-batch of optimizer step ``step`` (gradients are left in
        ``.grad``, not yet averaged over ranks)."""
        selector_scale = self.step_fn.selector_scale((step - 1) / self.total_steps)
        dp_rank = self.ctx.coords.dp_rank
        sums = []
        for micro, batch in enumerate(batches):
            generator = corruption_generator(self.seed, step, dp_rank, micro_step=micro)
            if self.grad_sync is not None and micro == len(batches) - 1:
                self.grad_sync.arm()  # the last backward overlaps the gradient all-reduce
            out = self._run(batch, generator, selector_scale=selector_scale, online=False)
            (out.loss / len(batches)).backward()
            sums.append(output_sums(out))
        totals = self._global(sums)
        loss, metrics = self._metrics(totals, len(batches) * self.ctx.topology.dp)
        return StepResult(
            loss=loss, denominator=totals["supervised"], metrics=metrics, model_flops=totals["model_flops"]
        )

    @torch.no_grad()
    def evaluate(self, split: ArtifactSplit, *, micro_batch_size: int, num_batches: int) -> EvalResult:
        """Global validation loss and metrics over ``num_batches`` fixed micro-batches per replica."""
        loader = validation_loader(split, micro_batch_size=micro_batch_size, seed=self.seed, ctx=self.ctx)
        was_training = self.drafter.training
        self.drafter.eval()
        selector_scale = self.step_fn.selector_scale(1.0)
        sums = []
        for index in range(num_batches):
            generator = corruption_generator(self.seed, index, self.ctx.coords.dp_rank, micro_step=EVAL_MICRO_STEP)
            sums.append(output_sums(self._run(next(loader), generator, selector_scale=selector_scale, online=True)))
        self.drafter.train(was_training)
        totals = self._global(sums)
        count = num_batches * self.ctx.topology.dp
        loss, metrics = self._metrics(totals, count)
        objective = self.step_fn.objective
        if objective.loss == "ce" and objective.lk_loss_type == "lambda":
            # the mix of the whole pass's acceptance, not the mean of each batch's mix (which depended
            # on micro_batch_size): the loss is linear in c given each batch's CE and TV parts
            c = lambda_ce_coef(objective, totals["prob_sum"], totals["prob_count"])
            main = c * totals["lk_ce"] + (1.0 - c) * totals["lk_tv"]
            loss = (main + selector_scale * totals["selector"]) / count
            metrics["lk_acceptance"] = totals["prob_sum"] / max(totals["prob_count"], 1.0)
        if self.served_prompts > 0:
            metrics.update(self.served_acceptance(split))
        return EvalResult(loss, metrics)

    def served_acceptance(self, split: ArtifactSplit) -> dict[str, float]:
        """``acceptance_length`` and ``accept_rate_<k>`` of lossless speculative decoding on rank 0's
        drafter (module docstring), the same on every rank (broadcast)."""
        names = ["acceptance_length", *(f"accept_rate_{k}" for k in range(1, self.drafter.config.block_size))]
        values = torch.zeros(len(names), dtype=torch.float64, device=self.ctx.device)  # NCCL: not the CPU
        if self.ctx.coords.rank == 0:
            summary = split_acceptance(
                self.drafter.target,
                self.drafter,
                split,
                eos_id=self.eos_id,
                num_prompts=self.served_prompts,
                max_new_tokens=self.served_new_tokens,
            )
            values = torch.tensor(
                [summary.metrics()[name] for name in names], dtype=torch.float64, device=self.ctx.device
            )
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast(values, src=0)
        return dict(zip(names, values.tolist()))
