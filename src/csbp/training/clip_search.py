"""BD3-LM's data-driven noise clipping: the ``[t_min, t_max]`` window of least loss variance, searched at validation.

BD3-LMs (Arriola et al., 2025, §4) train with the noise level clipped to a window ``t ~ U[β, ω]`` and choose
the window that minimises the variance of the training loss estimator: at each validation, for every
candidate window, the validation batches are corrupted with levels drawn from that window and scored; the
loss of each (sample, block) is the mean over the block's ``B`` positions of the per-token weighted NLL
(``1/t · CE`` on masked supervised tokens, 0 elsewhere); each batch's variance is taken over all its
(sample, block) values (over every data-parallel replica's rows: one global batch), the variances are summed
over the batches, and the window with the least sum trains from the next step on. (The step loop searches
at the validations of ``train.eval_every``'s schedule only: ``StepLoop._scheduled_validation``.) The reference code calls
it ``var_min`` with ``clip_search_widths`` and ``clip_search_delta``; so does csbp's config
(``objective.clip_search_widths``, ``objective.clip_search_delta``).

Candidates: the configured window first, then per width ``w`` the windows ``[i·δ, i·δ + w]`` for
``i = 0, 1, ...`` while ``i·δ + w <= 1``, each lower end raised to :data:`SEARCH_FLOOR` (the NELBO's
``t_min``: ``1/t`` must stay finite). A tie keeps the earlier candidate, so the configured window stays
unless another is strictly better.

Exactness: every candidate is corrupted from the same generator (validation batch ``i``, the replica's dp
rank, slot :data:`CLIP_SEARCH_MICRO_STEP`: paired comparisons, the same draws at every validation), every
noisy row lives on one rank of a replica (its blocks' sums all-reduced over the replica's ranks) and the
``(Σx, Σx², n)`` of each batch are summed over dp, so every layout computes the same variances as one
process, up to the summation order, and every rank picks the same window. The window is saved in the
checkpoint (``trainer_state.json``'s ``clip_window``), so a resumed run trains on it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from csbp.data.artifact import ArtifactSplit
from csbp.engine.block_diffusion import DocumentPlanner, RankPlan, rank_block_losses
from csbp.evaluation.nelbo import EVAL_T_MIN
from csbp.training.step import NELBO_MICRO_STEP, StepRunner, autocast_for, validation_loader

SEARCH_FLOOR = EVAL_T_MIN
"""The lowest noise level a candidate window starts at (bd3lms' ``sampling_eps``)."""
CLIP_SEARCH_MICRO_STEP = NELBO_MICRO_STEP - 1
"""The corruption slot of the search's validation batches (below the validation and NELBO slots)."""

Window = tuple[float, float]


def clip_candidates(widths: Sequence[float], delta: float, configured: Window) -> tuple[Window, ...]:
    """The configured window, then every width's windows stepped by ``delta`` (module docstring), each once."""
    windows = [configured]
    for width in widths:
        for i in range(math.floor((1.0 - width) / delta + 1e-9) + 1):
            low = round(i * delta, 12)
            window = (max(low, SEARCH_FLOOR), min(round(low + width, 12), 1.0))
            if window[0] < window[1] and window not in windows:
                windows.append(window)
    return tuple(windows)


@dataclass(frozen=True)
class ClipSearchResult:
    """The window of least summed variance and every candidate's variance (summed over the batches)."""

    window: Window
    variances: dict[Window, float]

    @property
    def variance(self) -> float:
        return self.variances[self.window]


@torch.no_grad()
def search_clip_window(
    runner: StepRunner, split: ArtifactSplit, *, micro_batch_size: int, num_batches: int, candidates: Sequence[Window]
) -> ClipSearchResult:
    """Score ``num_batches`` validation micro-batches per replica under every candidate window (module
    docstring); the same result on every rank."""
    if not candidates:
        raise ValueError("clip search needs at least one candidate window")
    ctx, device = runner.ctx, runner.ctx.device
    loader = validation_loader(split, micro_batch_size=micro_batch_size, seed=runner.seed, ctx=ctx)
    replica = ctx.model_input_comm("clip_search")
    stats = torch.zeros(num_batches, len(candidates), 3, dtype=torch.float64, device=device)  # Σx, Σx², n
    was_training = runner.model.training
    runner.model.eval()
    try:
        for index in range(num_batches):
            batch = next(loader)
            # packed documents: every window corrupts the same rows, so their plans are the batch's, built once
            plan: RankPlan | list[RankPlan] | None = runner.plan if isinstance(runner.plan, RankPlan) else None
            for slot, (low, high) in enumerate(candidates):
                objective = replace(runner.objective, t_min=low, t_max=high)
                corrupted = runner._corrupt(batch, index, CLIP_SEARCH_MICRO_STEP, objective)
                if plan is None:
                    assert isinstance(runner.plan, DocumentPlanner)
                    plan = runner.plan.plans_for(corrupted.doc_ids)
                with autocast_for(runner.precision, runner.device):
                    sums = rank_block_losses(
                        runner.model, corrupted, plan, ce_chunk_rows=runner.ce_chunk_rows  # type: ignore[arg-type]
                    )
                if replica is not None:
                    sums = replica.all_reduce(sums.to(device))
                block_losses = sums / corrupted.block_size
                stats[index, slot, 0] = block_losses.sum()
                stats[index, slot, 1] = block_losses.square().sum()
                stats[index, slot, 2] = block_losses.numel()
    finally:
        runner.model.train(was_training)
    dp = ctx.dp_comm("clip_search")
    if dp is not None:
        stats = dp.all_reduce(stats)
    total, squares, count = stats.unbind(-1)
    per_batch = (squares - total.square() / count) / (count - 1).clamp(min=1)  # unbiased, as torch.var
    variances = per_batch.sum(0).tolist()
    # the least finite variance, the earlier candidate on a tie; none finite (a non-finite validation loss,
    # which train.nan_policy handles): the first candidate, the configured window
    finite = [slot for slot in range(len(candidates)) if math.isfinite(variances[slot])] or [0]
    best = min(finite, key=lambda slot: (variances[slot], slot))
    return ClipSearchResult(
        window=tuple(candidates[best]),  # type: ignore[arg-type]
        variances={tuple(window): value for window, value in zip(candidates, variances, strict=True)},  # type: ignore[misc]
    )
