"""DFlash validation under ``lk_loss_type: lambda``: the CE/TV mix takes the acceptance of the whole
validation pass, not of each batch, so the validation loss is one statistic of the pass."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from csbp.data import open_artifact
from csbp.engine.context import single_process_context
from csbp.training.dflash_step import DFlashStepRunner
from csbp.training.drafter import build_drafter
from csbp.training.preflight import check_run
from test_training_dflash import dflash_config, export_target
from test_training_run import make_artifact


def test_lambda_validation_mixes_with_the_acceptance_of_the_whole_pass(tmp_path: Path) -> None:
    """Each eval batch mixed CE and TV with its own acceptance and the mixes were averaged, so
    val_loss depended on micro_batch_size (c is not linear in the acceptance). Now
    val_loss = c(A)·CE + (1 − c(A))·TV, A the pass's acceptance (logged as lk_acceptance), CE and TV the
    pass's val_loss under lk_loss_type ce and tv (same anchors, same drafter)."""
    artifact = make_artifact(tmp_path / "art")
    target = export_target(tmp_path / "target", open_artifact(artifact).vocab_size, tokenizer_dir=artifact)
    cfg = dflash_config(artifact, target, **{"train.precision": "fp64", "model.dtype": "float64"})
    inputs = check_run(cfg, check_device=False)
    assert inputs.dflash is not None and inputs.val_split is not None
    drafter = build_drafter(cfg, inputs.dflash, device=torch.device("cpu"))
    base = dataclasses.replace(inputs.dflash.objective, kl_scale=0.9, kl_decay=3.0)

    def evaluate(lk_loss_type: str, num_batches: int = 3) -> tuple[float, dict[str, float]]:
        objective = dataclasses.replace(base, lk_loss_type=lk_loss_type)
        runner = DFlashStepRunner(drafter, objective, single_process_context(), device=torch.device("cpu"),
                                  precision="fp64", seed=0, total_steps=1)
        result = runner.evaluate(inputs.val_split, micro_batch_size=1, num_batches=num_batches)
        return result.loss, result.metrics

    mixed, metrics = evaluate("lambda")
    ce, _ = evaluate("ce")
    tv, _ = evaluate("tv")
    acceptance = metrics["lk_acceptance"]
    assert 0.0 < acceptance < 1.0
    c = 0.9 * math.exp(-3.0 * acceptance)
    assert mixed == pytest.approx(c * ce + (1.0 - c) * tv, rel=1e-12)
    # one batch: the pass is the batch, and the value is the training loss of that batch as before
    one, one_metrics = evaluate("lambda", num_batches=1)
    ce1, tv1 = evaluate("ce", 1)[0], evaluate("tv", 1)[0]
    c1 = 0.9 * math.exp(-3.0 * one_metrics["lk_acceptance"])
    assert one == pytest.approx(c1 * ce1 + (1.0 - c1) * tv1, rel=1e-12)
