"""Likelihood evaluation of block-diffusion models: the unclipped NELBO (a bound, reported at
validation as ``val_nelbo`` and by ``csbp eval``) and the exact left-to-right NLL of the sampler.

Usage::

    report = evaluate_model(model, artifact.split("val"), settings, EvalOptions(samples=4))
    print(report.format())
"""

from __future__ import annotations

from csbp.evaluation.left_to_right import left_to_right_batches
from csbp.evaluation.nelbo import EVAL_T_MIN, FastDllmV2Nelbo, nelbo_objective, perplexity_bound
from csbp.evaluation.runner import EvalOptions, EvalReport, evaluate_model
from csbp.evaluation.settings import EvalSettings, resolve_settings

__all__ = [
    "EVAL_T_MIN",
    "EvalOptions",
    "EvalReport",
    "EvalSettings",
    "FastDllmV2Nelbo",
    "evaluate_model",
    "left_to_right_batches",
    "nelbo_objective",
    "perplexity_bound",
    "resolve_settings",
]
