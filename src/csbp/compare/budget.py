"""The training clock of ``csbp compare``: evaluate at equal time points, stop at the budget.

The clock is the sum over steps of the step's seconds (loading the batch, forward, backward,
gradient synchronisation and the optimizer step), the largest over all ranks, so every rank takes
the same decisions. Evaluations and checkpoints are outside it. With budget ``S`` and ``K`` points
the time points are ``t_k = k S / K``: the untrained model is evaluated at ``t_0 = 0``, and point
``k`` at the end of the first step whose clock reaches ``t_k`` (the record keeps the exact clock
and step). A step that carries the clock past several time points is evaluated once and that
evaluation is recorded for each of them, so no layout trains past the first step that reaches
``S``, however long its steps are. The run stops at point ``K`` (or at ``train.max_steps``,
recorded as a last point).

The metric is ``csbp compare --metric``: by default the validation loss for diffusion objectives
and, for DFlash drafters, the acceptance length of lossless speculative decoding
(``val_acceptance_length``, the number ``csbp dflash eval`` measures); every record also holds the
validation loss and metrics.

Resume: at every point the loop writes a checkpoint and rank 0 then records the clock, the
points and every step's seconds so far under that step in ``budget_state.json`` (atomic). A resumed layout restores the
clock and points of its latest checkpoint's step and continues.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from csbp.atomic import write_text_atomic
from csbp.devices import backend_device
from csbp.training.checkpoint import checkpoint_step, find_latest_checkpoint

STATE_FILE = "budget_state.json"


@dataclass(frozen=True)
class TimePoint:
    """One evaluation: point ``index`` due at ``target_s``, done at ``clock_s`` after ``step``."""

    index: int
    target_s: float
    clock_s: float
    step: int
    metric: float
    val_loss: float
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class BudgetState:
    """The clock and the points of one layout after ``step``."""

    step: int = 0
    clock_s: float = 0.0
    points: list[TimePoint] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    """Every step's seconds on the clock (slowest rank), in order: the layout's timing noise."""


def load_budget_state(run_dir: Path) -> BudgetState | None:
    """The state saved with the latest checkpoint of ``run_dir``, None when there is none (or it
    does not match that checkpoint: the run was interrupted between the two writes)."""
    latest = find_latest_checkpoint(run_dir)
    path = run_dir / STATE_FILE
    if latest is None or not path.is_file():
        return None
    step = checkpoint_step(latest)
    snapshot = json.loads(path.read_text(encoding="utf-8")).get(str(step))
    if snapshot is None:
        return None
    points = [TimePoint(**point) for point in snapshot["points"]]
    seconds = [float(value) for value in snapshot.get("step_seconds", [])]  # absent before it was recorded
    return BudgetState(step=step, clock_s=float(snapshot["clock_s"]), points=points, step_seconds=seconds)


def _save_budget_state(run_dir: Path, state: BudgetState) -> None:
    path = run_dir / STATE_FILE
    saved = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    saved = {key: value for key, value in saved.items() if int(key) < state.step}
    saved[str(state.step)] = {
        "clock_s": state.clock_s,
        "points": [asdict(p) for p in state.points],
        "step_seconds": state.step_seconds,
    }
    write_text_atomic(path, json.dumps(saved, indent=1) + "\n")


def step_time_summary(seconds: list[float]) -> dict[str, float | int] | None:
    """``{"steps", "median", "p10", "p90"}`` of a layout's step seconds (None without steps): the
    spread is the timing noise the layout ran under."""
    if not seconds:
        return None
    p10, median, p90 = (float(value) for value in np.percentile(np.asarray(seconds, dtype=np.float64), [10, 50, 90]))
    return {"steps": len(seconds), "median": median, "p10": p10, "p90": p90}


def _max_over_ranks(value: float) -> float:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=backend_device())  # NCCL rejects CPU tensors
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


class BudgetHook:
    """A :class:`csbp.training.trainer.StepHook` (module docstring).

    Args:
        budget_s: training seconds of the layout.
        num_points: ``K`` equal intervals (``K + 1`` evaluations with the untrained one).
        metric: ``"val_loss"`` or a validation metric name (``"acceptance_length"``).
        max_steps: the run's ``train.max_steps`` (a last point is taken there if the budget is not
            spent).
        run_dir: the layout's run directory (``budget_state.json``).
        state: the restored state of a resumed layout.
    """

    def __init__(
        self,
        *,
        budget_s: float,
        num_points: int,
        metric: str,
        max_steps: int,
        run_dir: Path,
        state: BudgetState | None = None,
    ) -> None:
        if not (math.isfinite(budget_s) and budget_s > 0) or num_points < 1:
            raise ValueError(f"--budget-s ({budget_s}) must be > 0 and --points ({num_points}) >= 1")
        self.budget_s = budget_s
        self.num_points = num_points
        self.metric = metric
        self.max_steps = max_steps
        self.run_dir = run_dir
        self.state = state or BudgetState()

    def target(self, index: int) -> float:
        return self.budget_s * index / self.num_points

    @property
    def next_index(self) -> int:
        return len(self.state.points)

    @property
    def finished(self) -> bool:
        return self.next_index > self.num_points

    def _evaluate(self, loop: Any, step: int) -> None:
        """Evaluate after ``step`` and record the result for the next time point and for every later
        one the clock has also reached (a step longer than ``S / K`` passes several)."""
        evaluation = loop._evaluate(step)
        metric = evaluation.loss if self.metric == "val_loss" else float(evaluation.metrics[self.metric])
        first = self.next_index
        while True:
            self.state.points.append(
                TimePoint(
                    index=self.next_index,
                    target_s=self.target(min(self.next_index, self.num_points)),
                    clock_s=self.state.clock_s,
                    step=step,
                    metric=metric,
                    val_loss=evaluation.loss,
                    metrics={name: float(value) for name, value in evaluation.metrics.items()},
                )
            )
            if self.finished or self.state.clock_s < self.target(self.next_index):
                break
        self.state.step = step
        last = self.next_index - 1
        which = f"point {first}" if last == first else f"points {first}-{last}"
        loop.writer.message(
            f"t={self.state.clock_s:7.1f} s ({which}/{self.num_points}) step {step}: {self.metric} {metric:.4f}"
        )

    def _record(self, loop: Any, step: int) -> None:
        """Persist the state for the checkpoint of ``step`` (rank 0)."""
        if loop.ctx.coords.rank == 0:
            _save_budget_state(self.run_dir, self.state)
        if dist.is_initialized():
            dist.barrier()

    def on_start(self, loop: Any, start_step: int) -> None:
        """Evaluate the untrained model (point 0) on a fresh start; a layout interrupted before
        point 1 has no checkpoint and starts afresh."""
        if start_step == 0 and not self.state.points:
            self._evaluate(loop, 0)

    def after_step(self, loop: Any, step: int, step_seconds: float) -> bool:
        seconds = _max_over_ranks(step_seconds)
        self.state.clock_s += seconds
        self.state.step_seconds.append(seconds)
        self.state.step = step
        due = self.state.clock_s >= self.target(self.next_index)
        last = step >= self.max_steps
        if not (due or last):
            return False
        self._evaluate(loop, step)
        if self.finished or last:
            self._record(loop, step)
            return True  # the loop writes this step's checkpoint when it stops
        loop._save(step)
        self._record(loop, step)
        return False
