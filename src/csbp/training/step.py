"""One training step and one validation pass on this rank, through the engine's block-diffusion path.

A step with ``grad_accum = K`` micro-batches (csbp.md §13):

1. corrupt micro-batch ``k`` with ``corruption_generator(seed, step, dp_rank, micro_step=k)``; every
   rank of one model replica loads the same batch and draws the same corruption;
2. the global denominator ``D`` is the sum of the ``K`` micro-batch denominators, all-reduced over
   the data-parallel group: the normaliser of the whole step, never a rank-local count (a step
   supervising nothing at all uses ``D = 1`` and contributes zero loss);
3. forward/backward each micro-batch with :func:`csbp.engine.block_diffusion.rank_loss` against ``D``
   (gradients of the micro-steps sum in ``.grad``);
4. the logged loss is the sum over all ranks of their weighted CE sums, divided by ``D``; the sums
   stay on the device until one all-reduce per step (no host sync per micro-step);
5. with ``grad_sync`` set (the trainer's :class:`~csbp.engine.grad_buckets.OverlappedGradientSync`),
   the last micro-step's backward launches the gradient all-reduce bucket by bucket as it goes.

Precision: ``fp32``/``fp64`` run in the master dtype; ``bf16`` runs the forward under
``torch.autocast(dtype=torch.bfloat16)`` on float32 master weights (the backward follows autocast's
casts; the optimizer updates float32 weights and state).

Validation uses ``eval_batches`` fixed micro-batches: a fresh, unshuffled loader over the
validation rows and corruption seeded by ``(seed, batch index, dp_rank, EVAL_MICRO_STEP)``, so
every evaluation of a run scores the same corrupted batches and val losses are comparable (under the
configured objective, also when ``objective.clip_search_widths`` moves the training noise window).
For the diffusion objectives each validation batch is also scored under the *unclipped* NELBO
(:mod:`csbp.evaluation.nelbo`: noise over ``[1e-3, 1]``, ``1/t`` weights, per supervised token) with
its own fixed corruption (micro-step slot ``NELBO_MICRO_STEP``), through the same ``rank_loss``
path and layout; it is reported as ``val_nelbo`` and ``val_ppl_bound = exp(val_nelbo)``. It costs
one more forward per validation batch (validation's cost doubles; ``eval_batches`` forwards every
``eval_every`` steps).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor, nn

from csbp.data.artifact import ArtifactSplit
from csbp.data.loader import PackedLoader
from csbp.engine.block_diffusion import DocumentPlanner, RankPlan, rank_loss
from csbp.engine.context import ParallelContext
from csbp.engine.grad_buckets import OverlappedGradientSync
from csbp.evaluation.nelbo import nelbo_objective, perplexity_bound
from csbp.objectives.base import CorruptedBatch, Objective, corruption_generator

EVAL_MICRO_STEP = 2**31 - 1
"""Micro-step slot of validation corruption; training never reaches it (``grad_accum`` is small)."""
NELBO_MICRO_STEP = EVAL_MICRO_STEP - 1
"""Micro-step slot of the unclipped-NELBO corruption of validation batches."""


def validation_loader(
    split: ArtifactSplit, *, micro_batch_size: int, seed: int, ctx: ParallelContext
) -> PackedLoader:
    """The fixed, unshuffled validation batches of this data-parallel replica (same every eval)."""
    return PackedLoader(
        split,
        batch_size=micro_batch_size,
        seed=seed,
        dp_rank=ctx.coords.dp_rank,
        dp_size=ctx.topology.dp,
        drop_last=False,
        shuffle=False,
    )


@dataclass(frozen=True)
class StepResult:
    """Global numbers of one step (identical on every rank); ``metrics``: objective-specific extras
    logged next to the loss (dflash: ``token_accuracy``, ``tau_mean``, ...)."""

    loss: float
    denominator: float
    metrics: dict[str, float] = field(default_factory=dict)
    model_flops: float | None = None
    """The step's model FLOPs over every replica (``csbp.training.model_flops``), None where not counted."""


@dataclass(frozen=True)
class EvalResult:
    """Global numbers of one validation pass; ``metrics`` are logged as ``val_<name>``."""

    loss: float
    metrics: dict[str, float] = field(default_factory=dict)


def autocast_for(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """``torch.autocast`` to bfloat16 for ``bf16``, else nothing (fp32/fp64 run in the master dtype)."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def corrupted_on(batch: CorruptedBatch, device: torch.device) -> CorruptedBatch:
    """``batch`` with its tensors on ``device``."""
    if device.type == "cpu":
        return batch
    moved = {
        name: getattr(batch, name).to(device)
        for name in ("noisy_ids", "clean_ids", "labels", "weights", "doc_ids")
    }
    return replace(batch, **moved)


class StepRunner:
    """Runs training micro-batches and validation passes of one rank (see the module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        objective: Objective,
        plan: RankPlan | DocumentPlanner,
        ctx: ParallelContext,
        *,
        device: torch.device,
        precision: str,
        seed: int,
        ce_chunk_rows: int,
        flops: Callable[[CorruptedBatch], int] | None = None,
    ) -> None:
        self.model = model
        self.objective = objective
        self.plan = plan
        self.ctx = ctx
        self.device = device
        self.precision = precision
        self.seed = seed
        self.ce_chunk_rows = ce_chunk_rows
        self.flops = flops
        """Model FLOPs of a corrupted micro-batch, counted on the host (None: the step reports none)."""
        self.grad_sync: OverlappedGradientSync | None = None
        """Set by the trainer: armed before each step's last backward (gradients averaged in it)."""
        self.validation_objective = objective
        """The objective ``val_loss`` scores: the configured one, kept when ``objective.clip_search_widths``
        moves the training objective's noise window (csbp.training.clip_search), so the curve stays comparable."""
        self.nelbo_objective = nelbo_objective(objective)
        """The unclipped-NELBO objective scored at validation (None for ``ar``)."""

    def _corrupt(
        self, batch: dict[str, Tensor], step: int, micro_step: int, objective: Objective | None = None
    ) -> CorruptedBatch:
        return corrupted_on(self._corrupt_on_host(batch, step, micro_step, objective), self.device)

    def _corrupt_on_host(
        self, batch: dict[str, Tensor], step: int, micro_step: int, objective: Objective | None = None
    ) -> CorruptedBatch:
        generator = corruption_generator(self.seed, step, self.ctx.coords.dp_rank, micro_step=micro_step)
        return (objective or self.objective).corrupt(batch, generator)

    def _sum_floats_over_dp(self, values: list[float]) -> list[float]:
        """``values`` each summed over the dp group in float64, in one all-reduce."""
        comm = self.ctx.dp_comm("loss")
        if comm is None:
            return values
        total = torch.tensor(values, dtype=torch.float64, device=self.ctx.device)
        return comm.all_reduce(total).tolist()

    def _sum_over(self, value: float | Tensor, comm_kind: str) -> float:
        """``value`` summed over the dp group (``"dp"``) or every rank (``"world"``), in float64
        (a tensor ``value`` is read on the host once, after the reduction)."""
        comm = self.ctx.dp_comm("loss") if comm_kind == "dp" else self.ctx.world_comm("loss")
        if comm is None:
            return float(value)
        if isinstance(value, Tensor):
            total = value.detach().to(device=self.ctx.device, dtype=torch.float64).reshape(1).clone()
        else:
            total = torch.tensor([value], dtype=torch.float64, device=self.ctx.device)
        return float(comm.all_reduce(total).item())

    def _weighted_ce(self, corrupted: CorruptedBatch, denominator: float) -> tuple[Tensor, Tensor]:
        with autocast_for(self.precision, self.device):
            return rank_loss(
                self.model,  # type: ignore[arg-type]
                corrupted,
                self.plan,
                global_denominator=denominator,
                world_size=self.ctx.world_size,
                ce_chunk_rows=self.ce_chunk_rows,
            )

    def train_step(self, batches: list[dict[str, Tensor]], step: int) -> StepResult:
        """Forward and backward every micro-batch of optimizer step ``step`` (gradients are left in
        ``.grad``, not yet averaged over ranks)."""
        on_host = [self._corrupt_on_host(batch, step, micro) for micro, batch in enumerate(batches)]
        flops = sum(self.flops(c) for c in on_host) if self.flops is not None else 0
        corrupted = [corrupted_on(c, self.device) for c in on_host]
        denominator, step_flops = self._sum_floats_over_dp([sum(c.denominator() for c in corrupted), float(flops)])
        denominator = max(denominator, 1.0)
        ce_total = torch.zeros((), dtype=torch.float64, device=self.device)  # no host sync per micro-step
        for micro, batch in enumerate(corrupted):
            if self.grad_sync is not None and micro == len(corrupted) - 1:
                self.grad_sync.arm()  # the last backward overlaps the gradient all-reduce
            loss, ce_sum = self._weighted_ce(batch, denominator)
            loss.backward()
            ce_total = ce_total + ce_sum.detach().to(torch.float64)
        return StepResult(
            loss=self._sum_over(ce_total, "world") / denominator, denominator=denominator,
            model_flops=step_flops if self.flops is not None else None,
        )

    @torch.no_grad()
    def evaluate(self, split: ArtifactSplit, *, micro_batch_size: int, num_batches: int) -> EvalResult:
        """Global validation loss over ``num_batches`` fixed micro-batches per data-parallel replica,
        and the unclipped NELBO of the same batches (``metrics["nelbo"]``, ``metrics["ppl_bound"]``)."""
        loader = validation_loader(split, micro_batch_size=micro_batch_size, seed=self.seed, ctx=self.ctx)
        was_training = self.model.training
        self.model.eval()
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        ce_total, nelbo_total = zero, zero
        local_denominator, nelbo_denominator = 0.0, 0.0
        for index in range(num_batches):
            batch = next(loader)
            corrupted = self._corrupt(batch, index, EVAL_MICRO_STEP, self.validation_objective)
            local_denominator += corrupted.denominator()
            _, ce_sum = self._weighted_ce(corrupted, 1.0)
            ce_total = ce_total + ce_sum.to(torch.float64)
            if self.nelbo_objective is not None:
                unclipped = self._corrupt(batch, index, NELBO_MICRO_STEP, self.nelbo_objective)
                nelbo_denominator += unclipped.denominator()
                _, nelbo_sum = self._weighted_ce(unclipped, 1.0)
                nelbo_total = nelbo_total + nelbo_sum.to(torch.float64)
        self.model.train(was_training)
        denominator = max(self._sum_over(local_denominator, "dp"), 1.0)
        metrics: dict[str, float] = {}
        if self.nelbo_objective is not None:
            nelbo = self._sum_over(nelbo_total, "world") / max(self._sum_over(nelbo_denominator, "dp"), 1.0)
            metrics = {"nelbo": nelbo, "ppl_bound": perplexity_bound(nelbo)}
        return EvalResult(self._sum_over(ce_total, "world") / denominator, metrics)
