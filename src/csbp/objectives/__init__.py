"""Self-denoising objectives (BD3-LM, Fast-dLLM v2, MDLM, AR) and the chunked LM-head loss.

An objective's ``corrupt(batch, generator)`` returns a layout-independent
:class:`~csbp.objectives.base.CorruptedBatch`; the engine scores the noisy rows each rank owns with
:func:`~csbp.objectives.chunked_ce.chunked_weighted_ce` and divides by the global denominator.
:func:`~csbp.objectives.base.objective_loss` is the single-process oracle.

Usage::

    objective = build_objective("bd3", mask_token_id=63, block_size=4)
    corrupted = objective.corrupt({"input_ids": ids_SL}, corruption_generator(seed, step, dp_rank))
    loss = objective_loss(hidden_SLD, lm_head.weight, corrupted)
"""

from __future__ import annotations

from typing import Any

from csbp.objectives.ar import ArObjective
from csbp.objectives.base import CorruptedBatch, Objective, corruption_generator, objective_loss
from csbp.objectives.bd3 import Bd3Objective
from csbp.objectives.chunked_ce import IGNORE_INDEX, chunked_weighted_ce, token_accuracy
from csbp.objectives.fast_dllm_v2 import FastDllmV2Objective, fast_dllm_v2_views
from csbp.objectives.mdlm import MdlmObjective
from csbp.objectives.noise import clip_levels, rotated_lattice_levels, stratified_levels

SELF_DENOISING_OBJECTIVES: dict[str, type] = {
    "bd3": Bd3Objective,
    "fast_dllm_v2": FastDllmV2Objective,
    "mdlm": MdlmObjective,
    "ar": ArObjective,
}


def build_objective(name: str, **options: Any) -> Objective:
    """Instantiate a self-denoising objective by name with its dataclass fields as keywords."""
    if name not in SELF_DENOISING_OBJECTIVES:
        raise ValueError(f"objective {name!r} is not one of {tuple(SELF_DENOISING_OBJECTIVES)}")
    try:
        return SELF_DENOISING_OBJECTIVES[name](**options)
    except TypeError as error:
        raise ValueError(f"objective {name!r}: invalid options {sorted(options)} ({error})") from None


__all__ = [
    "IGNORE_INDEX",
    "SELF_DENOISING_OBJECTIVES",
    "ArObjective",
    "Bd3Objective",
    "CorruptedBatch",
    "FastDllmV2Objective",
    "MdlmObjective",
    "Objective",
    "build_objective",
    "chunked_weighted_ce",
    "clip_levels",
    "corruption_generator",
    "fast_dllm_v2_views",
    "objective_loss",
    "rotated_lattice_levels",
    "stratified_levels",
    "token_accuracy",
]
