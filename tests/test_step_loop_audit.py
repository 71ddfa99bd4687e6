"""The step loop's contract, checked from outside: the optimizer sees clipped gradients, a non-finite
gradient norm alone stops a step, a skipped step still moves the schedule on, a finite step ends the
skip streak, the hook protocol, ``tokens_per_s`` and the validation NELBO in the summary.

Each test kills a mutant of :mod:`csbp.training.step_loop` or :mod:`csbp.training.nan_policy` that the
other tests let live (a mutation audit). Runs train the tiny decoder of :mod:`test_training_run` on
one CPU process in float32, 2 to 5 steps.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from csbp.training import nan_policy, step_loop, train
from csbp.training.metrics import MetricsWriter
from csbp.training.nan_policy import NonFiniteTraining
from csbp.training.step import StepRunner
from test_training_run import make_artifact, metric_rows, tiny_config

QUIET = {"train.eval_every": 0, "train.save_every": 0}


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_artifact(tmp_path_factory.mktemp("data") / "art")


def poison(monkeypatch: pytest.MonkeyPatch, steps: set[int], *, loss: bool = True) -> None:
    """Steps in ``steps`` get non-finite gradients (an inf), and a NaN loss when ``loss``."""
    real = StepRunner.train_step

    def poisoned(self: StepRunner, batches: list, step: int):  # type: ignore[no-untyped-def]
        result = real(self, batches, step)
        if step not in steps:
            return result
        next(p for p in self.model.parameters() if p.grad is not None).grad.view(-1)[0] = math.inf
        return replace(result, loss=math.nan) if loss else result

    monkeypatch.setattr(StepRunner, "train_step", poisoned)


def test_the_optimizer_steps_on_gradients_clipped_to_grad_clip(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The L2 norm of the gradients AdamW updates with, measured by torch in float64, is
    ``min(grad_norm, optim.grad_clip)`` (a mutant passing no limit to the clipping passed every test:
    AdamW's first update hardly depends on the gradient's scale)."""
    seen: list[float] = []
    real_step = torch.optim.AdamW.step

    def spying(self: torch.optim.AdamW, *args: Any, **kwargs: Any) -> Any:
        grads = [p.grad.to(torch.float64) for group in self.param_groups for p in group["params"] if p.grad is not None]
        seen.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", spying)
    clip = 0.05
    train(tiny_config(artifact, **QUIET, **{"optim.grad_clip": clip, "train.max_steps": 2}), run_dir=tmp_path / "run")
    norms = [row["grad_norm"] for row in metric_rows(tmp_path / "run")]
    assert len(seen) == len(norms) == 2 and all(norm > clip for norm in norms)
    assert seen == pytest.approx([min(norm, clip) for norm in norms], rel=1e-5)


def test_a_non_finite_gradient_norm_with_a_finite_loss_stops_the_run(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``train.nan_policy`` applies when the loss *or* the gradient norm is not finite (a mutant looking
    at the loss alone applied an inf-gradient update)."""
    poison(monkeypatch, {2}, loss=False)
    with pytest.raises(NonFiniteTraining, match=r"^step 2: loss [0-9.]+ and grad_norm inf: not finite"):
        train(tiny_config(artifact, **QUIET), run_dir=tmp_path / "run")


def test_a_skipped_step_moves_the_schedule_on_and_prints_no_step_line(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Step k uses ``lr * (k) / warmup_steps`` during warm-up, a skipped step included: the schedule is
    a function of the step (a mutant not stepping the scheduler on a skip passed). The skipped step
    gets its warning, not a ``step N: loss nan`` console line."""
    lines: list[str] = []
    monkeypatch.setattr(MetricsWriter, "message", lambda self, text: lines.append(text))
    poison(monkeypatch, {2})
    changes = {**QUIET, "train.nan_policy": "skip", "optim.warmup_steps": 4, "train.log_every": 1}
    summary = train(tiny_config(artifact, **changes), run_dir=tmp_path / "run")
    assert summary.skipped_steps == [2]
    lrs = [row["lr"] for row in metric_rows(tmp_path / "run")]
    assert lrs == pytest.approx([3e-3 * k / 4 for k in (1, 2, 3, 4)], rel=1e-12)
    assert [line.split(":")[0] for line in lines if line.startswith("step ")] == ["step 1", "step 3", "step 4"]


def test_a_finite_step_ends_the_skip_streak(artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With room for one skipped step in a row, steps 2 and 4 are skipped and the run goes on: step 3
    ended the streak (mutants that never reset it stopped at step 4)."""
    monkeypatch.setattr(nan_policy, "MAX_SKIPPED_STEPS", 1)
    poison(monkeypatch, {2, 4})
    summary = train(tiny_config(artifact, **QUIET, **{"train.nan_policy": "skip", "train.max_steps": 5}),
                    run_dir=tmp_path / "run")
    assert summary.skipped_steps == [2, 4] and summary.end_step == 5 and len(summary.losses) == 3


class RecordingHook:
    """Stops the run after ``stop_after``; records what the loop told it."""

    def __init__(self, stop_after: int) -> None:
        self.stop_after = stop_after
        self.calls: list[tuple[str, int]] = []

    def on_start(self, loop: Any, start_step: int) -> None:
        self.calls.append(("start", start_step))

    def after_step(self, loop: Any, step: int, step_seconds: float) -> bool:
        assert step_seconds > 0
        self.calls.append(("after", step))
        return step == self.stop_after


def test_the_hook_starts_once_sees_every_step_and_stops_the_run_with_a_checkpoint(
    artifact: Path, tmp_path: Path
) -> None:
    """``StepHook``'s contract (``csbp compare``'s time budget relies on it): ``on_start`` once with the
    start step, ``after_step`` after each step, and True stops the run after that step, checkpointed."""
    hook = RecordingHook(stop_after=3)
    summary = train(tiny_config(artifact, **QUIET, **{"train.max_steps": 10}), run_dir=tmp_path / "run", hook=hook)
    assert hook.calls == [("start", 0), ("after", 1), ("after", 2), ("after", 3)]
    assert summary.end_step == 3 and summary.checkpoint is not None and summary.checkpoint.name == "step_0000003"


def test_tokens_per_s_counts_every_micro_batch_of_the_step(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a clock that moves 0.5 s between its readings, a step takes 0.5 s, so ``tokens_per_s`` is
    twice the step's tokens: micro_batch_size 2 x grad_accum 2 x seq_len 32 = 128 (dp 1)."""
    clock = itertools.count(step=0.5)
    monkeypatch.setattr(step_loop, "time", SimpleNamespace(perf_counter=lambda: next(clock)))
    train(tiny_config(artifact, **QUIET, **{"train.max_steps": 2}), run_dir=tmp_path / "run")
    assert [row["tokens_per_s"] for row in metric_rows(tmp_path / "run")] == [256.0, 256.0]


def test_the_summary_has_the_nelbo_of_every_validation(artifact: Path, tmp_path: Path) -> None:
    """bd3 validates with the unclipped NELBO too: the summary holds it for each validation the
    metrics file records (a mutant that dropped it printed no ``val nelbo`` line)."""
    summary = train(tiny_config(artifact, **{"train.max_steps": 2, "train.save_every": 0}), run_dir=tmp_path / "run")
    logged = [(row["step"], row["val_nelbo"]) for row in metric_rows(tmp_path / "run") if "val_nelbo" in row]
    assert [step for step, _ in logged] == [0, 2]
    assert summary.val_nelbos == logged
    assert any(line.startswith("val nelbo   first") for line in summary.format().splitlines())


def test_validation_scores_eval_batches_and_checkpoints_keep_keep_checkpoints(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``train.eval_batches`` and ``train.keep_checkpoints`` reach the loop (mutants using 1 batch, or
    the default of 2 kept checkpoints, passed); ``elapsed_s`` counts from the invocation's start, so it
    is at least the sum of the steps' own times (``tokens / tokens_per_s``)."""
    asked: list[int] = []
    real = StepRunner.evaluate
    monkeypatch.setattr(StepRunner, "evaluate", lambda self, split, **kw: asked.append(kw["num_batches"]) or real(self, split, **kw))
    changes = {"train.eval_every": 4, "train.eval_batches": 3, "train.save_every": 1, "train.keep_checkpoints": 3}
    train(tiny_config(artifact, **changes), run_dir=tmp_path / "run")
    assert asked == [3, 3]  # the untrained baseline and step 4
    kept = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
    assert kept == ["step_0000002", "step_0000003", "step_0000004"]
    rows = [row for row in metric_rows(tmp_path / "run") if row["step"] > 0]
    step_seconds = [128 / row["tokens_per_s"] for row in rows]
    for index, row in enumerate(rows):
        assert row["elapsed_s"] >= sum(step_seconds[: index + 1])
