"""The unclipped NELBO of the self-denoising objectives: a likelihood bound, not the training loss.

Training may clip the noise level to ``[t_min, t_max]`` (the demo recipe uses ``[0.3, 0.8]``) or use
unit weights; that objective is not renormalised (objectives.md §3.4), so it bounds nothing and is
not comparable across recipes. Evaluation uses the *unclipped* NELBO: the same corruption and label map
as the trained objective, with the noise level over the full range and the NELBO weight ``1/t`` of
the linear schedule (move chance ``p = t``, as bd3lms), normalised per supervised token.

The range is ``t ∈ [EVAL_T_MIN, 1]`` with ``EVAL_T_MIN = 1e-3`` (bd3lms' evaluation range). At
``t = 0`` the weight ``1/t`` makes the estimator's variance infinite (``E[(m/t)²] = 1/t`` is not
integrable), so a small floor is needed. With ``τ`` marginally uniform in every slot and
``t = a + (1 − a)·τ``, the per-token estimator

    NELBO_a = E_{t ~ U[a, 1]} [ Σ_i m_i · (1/t_blk(i)) · CE_i ] / Z

is unbiased for ``(1/(1 − a)) ∫_a^1 g(t) dt`` (``g``: the NELBO integrand). It differs from the full
``∫_0^1 g`` by ``O(a)`` relative (``g`` is bounded near 0), i.e. ~0.1%. Closed form used by the tests:
for a predictor uniform over ``V'`` classes, ``E[m_i / t] = 1`` for any ``a``, so ``NELBO_a = log V'``
exactly in expectation (and per draw it equals ``log V' · Σ m_i/t_i / Z``).

**Levels from the rotated lattice, whatever the training scheme.** Unbiasedness needs the level
of *every* slot to be marginally uniform. The rotated lattice's are; a stratified draw as MDLM and
bd3lms make it ("antithetic" sampling) gives slot ``k = s·N + b`` a level in its own stratum
``[k/K, (k+1)/K)`` at every draw (csbp's ``stratified`` now deals the strata in a random order, but
the estimate keeps the lattice, whose draws are reproducible from one number). Training shuffles rows, which makes a row's stratum random (not
that of a block within it); an evaluation reads a fixed split in a fixed order, so row ``s`` of
each batch (and, for bd3, block ``b`` within it) kept the same stratum at every draw. The estimate then converged to a number that
depends on where each row sits in its batch, off the bound by more than the standard error over
draws can show (``tests/test_evaluation_estimator.py``: 0.66 against 0.93 for a loss that grows
with the masking). Both schemes space the batch's levels ``1/K`` apart, so the variance reduction is
the same.

Per objective:

* ``bd3``: one level per (sample, block) over ``[a, 1]``, rotated lattice, ``1/t``;
* ``mdlm``: one level per sequence over ``[a, 1]``, rotated lattice, ``1/t``;
* ``fast_dllm_v2``: complementary views of one draw with move chance ``p ~ U[a, 1 − a]`` per
  (sample, block); view 1 masks with probability ``p`` (weight ``1/p``), view 2 with ``1 − p``
  (weight ``1/(1 − p)``); each view is an unbiased estimate of the block NELBO over ``[a, 1 − a]``
  and the reported number is their mean (weights ``1/(2p)`` and ``1/(2(1 − p))``), per targetable
  token (token shift: position 0 and document starts are never targets, so the bound is on
  ``log p(x_1.. | x_0)``); the mask-token logit is excluded, as the sampler does (training keeps
  it). The label map is training's, so a block's first token is scored from the last row of the
  previous block *as corrupted in that view* (objectives.md §4, "quirk of the training mask"),
  whereas ``csbp generate`` commits it from the completed block: the number bounds the NLL of a
  model whose block-first predictions see a randomly corrupted previous block, not exactly that of
  the sampler (the LTR NLL is exact for the sampler);
* ``ar``: none (its ``val_loss`` is already the exact NLL).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import Tensor

from csbp.objectives.ar import ArObjective
from csbp.objectives.base import CorruptedBatch, Objective, read_batch
from csbp.objectives.bd3 import Bd3Objective
from csbp.objectives.chunked_ce import IGNORE_INDEX
from csbp.objectives.fast_dllm_v2 import FastDllmV2Objective, draw_views, shifted_labels
from csbp.objectives.mdlm import MdlmObjective

EVAL_T_MIN = 1e-3
"""Lower end of the evaluation noise range (bd3lms evaluates with ``[1e-3, 1]``)."""

NELBO_NOISE_SCHEME = "rotated_lattice"
"""The NELBO's noise levels, whatever the trained scheme: every slot marginally uniform (docstring)."""


@dataclass(frozen=True)
class FastDllmV2Nelbo:
    """Fast-dLLM v2's complementary views reweighted into a NELBO (see the module docstring)."""

    mask_token_id: int
    block_size: int
    t_min: float = EVAL_T_MIN
    name: ClassVar[str] = "fast_dllm_v2_nelbo"

    def __post_init__(self) -> None:
        if not 0.0 < self.t_min < 0.5:
            raise ValueError(f"fast_dllm_v2 NELBO t_min={self.t_min} must lie in (0, 0.5)")

    def corrupt(self, batch: Mapping[str, Tensor], generator: torch.Generator) -> CorruptedBatch:
        views = draw_views(
            batch, generator, mask_token_id=self.mask_token_id, block_size=self.block_size,
            low=self.t_min, high=1.0 - self.t_min,
        )
        input_ids, loss_mask, doc_ids = read_batch(batch)
        assert views.noise_levels is not None  # [2S, N]: p for view 1, 1 - p for view 2
        chance_RL = views.noise_levels.repeat_interleave(self.block_size, dim=1).to(input_ids.device)
        # Row i-1 carries target i: its weight is 1 / (probability that view masks token i), halved
        # so that the two views' sum over the targetable-token count is their mean NELBO.
        inverse_RL = torch.zeros_like(chance_RL)
        inverse_RL[:, :-1] = 0.5 / chance_RL[:, 1:]
        labelled = views.labels != IGNORE_INDEX
        weights = torch.where(labelled, inverse_RL, torch.zeros_like(inverse_RL)).to(torch.float32)
        targetable = shifted_labels(input_ids, loss_mask, doc_ids) != IGNORE_INDEX
        # The mask-token logit is excluded, as the sampler does: a model of data never emits [M].
        return replace(
            views, weights=weights, exclude_token=self.mask_token_id, loss_normaliser=float(targetable.sum())
        )


def nelbo_objective(objective: Objective, t_min: float = EVAL_T_MIN) -> Objective | None:
    """The unclipped-NELBO version of ``objective`` (None for ``ar``, whose loss is the exact NLL)."""
    unbiased = {"noise_scheme": NELBO_NOISE_SCHEME, "loss_weight": "inv_t", "denominator": "supervised_tokens"}
    if isinstance(objective, Bd3Objective):
        return replace(objective, t_min=t_min, t_max=1.0, resample=False, **unbiased)
    if isinstance(objective, MdlmObjective):
        return replace(objective, eps=t_min, **unbiased)
    if isinstance(objective, FastDllmV2Objective):
        return FastDllmV2Nelbo(objective.mask_token_id, objective.block_size, t_min)
    if isinstance(objective, ArObjective):
        return None
    raise ValueError(f"no NELBO is defined for objective {getattr(objective, 'name', objective)!r}")


def perplexity_bound(nelbo_per_token: float) -> float:
    """``exp(NELBO)`` (``inf`` past float range): an upper bound on the perplexity."""
    try:
        return math.exp(nelbo_per_token)
    except OverflowError:
        return math.inf
