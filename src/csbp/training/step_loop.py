"""The step loop of :func:`csbp.training.trainer.train`: steps ``start + 1 .. stop`` of one invocation.

Each step loads ``train.grad_accum`` micro-batches, runs them (:mod:`csbp.training.step` or
:mod:`csbp.training.dflash_step`), waits for the gradient average, clips, and applies the update and
the schedule's step, unless the loss or gradient norm is not finite (``train.nan_policy``,
:mod:`csbp.training.nan_policy`). It logs the step, validates every ``train.eval_every`` steps and
at the invocation's last step, and checkpoints every ``train.save_every`` steps and at the last step.
A :class:`StepHook` may stop the loop after any step (``csbp compare``'s time budget), and so may a
``SIGUSR1`` (:mod:`csbp.training.stop_request`: the loop checkpoints that step and ``stopped_by_signal``
is set).

Everything that decides what a later step does is either a pure function of the step (corruption,
the lr multiplier, the validation and checkpoint schedule) or part of the checkpoint
(:meth:`StepLoop._save`: model, optimizer, scheduler, loader cursor, RNG, the skip streak, the noise
window ``objective.clip_search_widths`` chose, the weight average of ``optim.ema_decay``), so a resumed
loop continues as the uninterrupted one. Validation runs on the weight average when there is one.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

import torch
from torch.optim.lr_scheduler import LRScheduler

from csbp.config.loading import dump_config
from csbp.config.schema import RunConfig
from csbp.data.loader import PackedLoader
from csbp.engine.context import ParallelContext
from csbp.gpu.flops import model_flop_utilisation
from csbp.training.checkpoint import TrainingState, param_shapes, rng_state, save_checkpoint
from csbp.training.clip_search import Window, clip_candidates, search_clip_window
from csbp.training.dflash_layers import resolved_config
from csbp.training.dflash_step import DFlashStepRunner
from csbp.training.input_identity import input_fingerprints
from csbp.training.metrics import MetricsWriter, mfu_peak_tflops, peak_memory_bytes, step_line
from csbp.training.nan_policy import SkipStreak, latest_checkpoint_name
from csbp.training.optim import clip_gradients
from csbp.training.parallelize import gradient_shard_comm, synchronize_gradients
from csbp.training.preflight import RunInputs
from csbp.training.resume_config import flat_config
from csbp.training.step import EvalResult, StepRunner
from csbp.training.stop_request import StopRequest
from csbp.training.weight_average import WeightAverage


class StepHook(Protocol):
    """Called by the step loop (``csbp compare`` uses one to train for a wall-clock budget).

    ``on_start`` runs once before the first step of this invocation; ``after_step`` after every
    step, one ``nan_policy: skip`` skipped included (it ran, so a budget pays for it), with the step's
    seconds on this rank, and returns True to stop the run after that step (a checkpoint is then
    written). Both must return the same decision on every rank.
    """

    def on_start(self, loop: StepLoop, start_step: int) -> None: ...

    def after_step(self, loop: StepLoop, step: int, step_seconds: float) -> bool: ...


@dataclass
class StepLoop:
    """The step loop with its bookkeeping (losses, schedule of evals and saves, the skip streak)."""

    cfg: RunConfig
    inputs: RunInputs
    ctx: ParallelContext
    runner: StepRunner | DFlashStepRunner
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler
    loader: PackedLoader
    writer: MetricsWriter
    run_dir: Path
    device: torch.device
    hook: StepHook | None = None
    streak: SkipStreak = field(default_factory=lambda: SkipStreak("stop"))
    """``train.nan_policy`` and its skip streak (restored from the checkpoint on resume)."""
    average: WeightAverage | None = None
    """``optim.ema_decay``'s weight average: updated after each applied step, validated with, checkpointed."""
    stop_request: StopRequest | None = None
    """A ``SIGUSR1`` stop request, checked by every rank after every step (None: not listened to)."""
    stopped_by_signal: bool = False
    losses: list[float] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    val_nelbos: list[tuple[int, float]] = field(default_factory=list)
    skipped_steps: list[int] = field(default_factory=list)
    """Steps ``train.nan_policy: skip`` skipped (no update) in this invocation."""
    speeds: list[dict[str, float]] = field(default_factory=list)
    """Each updating step's ``tokens_per_s`` and rates (``_rates``), for the run's summary."""
    last_step: int = 0
    _input_fingerprints: dict[str, str] = field(default_factory=dict)
    _peak_tflops: float | None = None
    _clip_candidates: tuple[Window, ...] = ()
    """The noise windows searched at each validation after step 0 (``objective.clip_search_widths``)."""

    def __post_init__(self) -> None:
        self._input_fingerprints = input_fingerprints(flat_config(self.cfg.model_dump(mode="json")))
        self._peak_tflops = mfu_peak_tflops(self.device, self.cfg.train.precision)
        objective = self.cfg.objective
        if objective.clip_search_widths and isinstance(self.runner, StepRunner):
            self._clip_candidates = clip_candidates(
                objective.clip_search_widths, objective.clip_search_delta, (objective.t_min, objective.t_max)
            )

    def run(self, start_step: int, stop_step: int, started: float) -> Path | None:
        train_cfg = self.cfg.train
        tokens_per_step = (
            self.cfg.topology.dp * train_cfg.micro_batch_size * train_cfg.grad_accum * self.cfg.data.seq_len
        )
        evaluating = train_cfg.eval_every > 0 and self.inputs.val_split is not None
        checkpoint: Path | None = None
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.last_step = start_step
        if evaluating and start_step == 0:  # the untrained baseline, so "first -> last" means something
            initial = self._evaluate(0)
            self.writer.log_baseline(
                {"step": 0, "val_loss": initial.loss, **{f"val_{k}": v for k, v in initial.metrics.items()},
                 "elapsed_s": time.perf_counter() - started}
            )
            nelbo = initial.metrics.get("nelbo")
            self.writer.message(f"step 0: val {initial.loss:.4f}" + ("" if nelbo is None else f" nelbo {nelbo:.4f}"))
        if self.hook is not None:
            self.hook.on_start(self, start_step)
        for step in range(start_step + 1, stop_step + 1):
            step_started = time.perf_counter()
            batches = [next(self.loader) for _ in range(train_cfg.grad_accum)]
            result = self.runner.train_step(batches, step)
            if self.runner.grad_sync is not None:
                self.runner.grad_sync.finish()  # overlapped with the last backward; wait and average
            else:
                synchronize_gradients(self.model, self.ctx, fsdp=train_cfg.fsdp)
            grad_norm = clip_gradients(
                params,
                self.cfg.optim.grad_clip,
                shard_comm=gradient_shard_comm(self.ctx, fsdp=train_cfg.fsdp),
            )
            lr = float(self.optimizer.param_groups[0]["lr"])
            finite = math.isfinite(result.loss) and math.isfinite(grad_norm)
            if finite:
                self.streak.finite()
                self.optimizer.step()
                self._zero_grad()
                self.scheduler.step()
                if self.average is not None:
                    self.average.update()
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
            else:  # raises unless train.nan_policy skips; a skipped step still validates and saves on schedule
                self._non_finite(step, result.loss, grad_norm, checkpoint)
            step_seconds = time.perf_counter() - step_started
            rates = {"tokens_per_s": tokens_per_step / max(step_seconds, 1e-9),
                     **self._rates(result.model_flops, step_seconds)}
            if finite:
                self.losses.append(result.loss)
                self.speeds.append(rates)
            else:
                self.skipped_steps.append(step)
            # a skipped step is recorded too ("skipped": true, its non-finite numbers null), with its validation
            record: dict[str, object] = {
                "step": step,
                "loss": result.loss,
                "lr": lr,
                "grad_norm": grad_norm,
                **rates,
                "peak_mem_bytes": peak_memory_bytes(self.device),
                "elapsed_s": time.perf_counter() - started,
                **result.metrics,
                **({} if finite else {"skipped": True}),
            }
            if evaluating and (step % train_cfg.eval_every == 0 or step == stop_step):
                evaluation = self._evaluate(step)
                record["val_loss"] = evaluation.loss
                record.update({f"val_{name}": value for name, value in evaluation.metrics.items()})
                if not finite:
                    self.writer.message(f"step {step}: val {evaluation.loss:.4f} (update skipped)")
            self.writer.log(record)
            if finite and step % train_cfg.log_every == 0:
                self.writer.message(step_line(record))
            self.last_step = step
            stop = self.hook is not None and self.hook.after_step(self, step, step_seconds)
            # agreed() on every rank, every step; a request during the last step stops nothing: the run
            # finishes (final/, exit 0) rather than calling itself unfinished with nothing left to resume
            if self.stop_request is not None and self.stop_request.agreed(self.ctx) and step < stop_step:
                stop = self.stopped_by_signal = True
            if (train_cfg.save_every > 0 and step % train_cfg.save_every == 0) or step == stop_step or stop:
                checkpoint = self._save(step)
            if stop:
                break
        return checkpoint

    def _rates(self, model_flops: float | None, step_seconds: float) -> dict[str, float]:
        """``tflops_per_device`` (the step's model FLOPs over its wall time and the world's devices) and,
        on a GPU of known bf16 peak under ``train.precision: bf16``, ``mfu``; nothing where no FLOPs
        were counted."""
        if model_flops is None:
            return {}
        seconds, device_flops = max(step_seconds, 1e-9), model_flops / self.ctx.world_size
        rates = {"tflops_per_device": device_flops / seconds / 1e12}
        mfu = model_flop_utilisation(device_flops, step_time_s=seconds, peak_tflops=self._peak_tflops)
        if mfu is not None:  # the device check's own MFU arithmetic
            rates["mfu"] = mfu
        return rates

    def _zero_grad(self) -> None:
        if self.runner.grad_sync is not None:
            self.runner.grad_sync.zero_grad()  # .grad stays a view of its bucket
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def _non_finite(self, step: int, loss: float, grad_norm: float, checkpoint: Path | None) -> None:
        """Apply ``train.nan_policy`` to a step whose loss or gradient norm is not finite (the same
        decision on every rank: both numbers are global). The update is never applied."""
        self._zero_grad()
        kept = str(checkpoint) if checkpoint is not None else latest_checkpoint_name(self.run_dir)
        warning = self.streak.non_finite(step, loss, grad_norm, kept=kept)
        self.scheduler.step()
        self.writer.message(warning)

    def _evaluate(self, step: int) -> EvalResult:
        """Validate (and search the noise window) with the weight average when there is one (bd3lms does)."""
        with self.average.swapped_in() if self.average is not None else contextlib.nullcontext():
            return self._evaluate_weights(step)

    def _evaluate_weights(self, step: int) -> EvalResult:
        assert self.inputs.val_split is not None
        evaluation = self.runner.evaluate(
            self.inputs.val_split,
            micro_batch_size=self.cfg.train.micro_batch_size,
            num_batches=self.cfg.train.eval_batches,
        )
        self.val_losses.append((step, evaluation.loss))
        if "nelbo" in evaluation.metrics:
            self.val_nelbos.append((step, evaluation.metrics["nelbo"]))
        if self._clip_candidates and self._scheduled_validation(step):
            return EvalResult(evaluation.loss, {**evaluation.metrics, **self._search_clip_window(step)})
        return evaluation

    def _scheduled_validation(self, step: int) -> bool:
        """Whether ``step`` is one of ``train.eval_every``'s validations after step 0 (the ones the noise-window
        search runs at). Not step 0's baseline (the untrained model: nothing to choose by), nor an invocation's
        extra validation at its last step (``--max-steps``): a search there would move the window a step early,
        and the resumed run would train on a window the uninterrupted run had not chosen."""
        every = self.cfg.train.eval_every
        return step > 0 and every > 0 and step % every == 0

    def _search_clip_window(self, step: int) -> dict[str, float]:
        """Train on the candidate window of least loss variance from the next step on (csbp.training.clip_search)."""
        assert isinstance(self.runner, StepRunner) and self.inputs.val_split is not None
        before = (self.runner.objective.t_min, self.runner.objective.t_max)
        result = search_clip_window(
            self.runner, self.inputs.val_split, micro_batch_size=self.cfg.train.micro_batch_size,
            num_batches=self.cfg.train.eval_batches, candidates=self._clip_candidates,
        )
        if not math.isfinite(result.variance):  # every window's: a non-finite validation loss (train.nan_policy's)
            self.writer.message(f"step {step}: no noise window has a finite loss variance; training stays on "
                                f"[{before[0]:g}, {before[1]:g}]")
            return {"clip_t_min": before[0], "clip_t_max": before[1], "clip_variance": result.variance}
        self.runner.objective = replace(self.runner.objective, t_min=result.window[0], t_max=result.window[1])
        if result.window != before:
            self.writer.message(
                f"step {step}: noise window t in [{result.window[0]:g}, {result.window[1]:g}] from the next step "
                f"(was [{before[0]:g}, {before[1]:g}]): the least loss variance of {len(self._clip_candidates)} "
                f"windows, {result.variance:.4g} against {result.variances.get(before, math.nan):.4g}"
            )
        return {"clip_t_min": result.window[0], "clip_t_max": result.window[1], "clip_variance": result.variance}

    def _save(self, step: int) -> Path:
        state = TrainingState(
            step=step,
            scheduler=self.scheduler.state_dict(),
            loader=self.loader.state_dict(),
            rng=rng_state(),
            data_fingerprint=self.inputs.artifact.fingerprint,
            param_shapes=param_shapes(self.model),
            topology=self.cfg.topology.model_dump(mode="json"),
            config_yaml=dump_config(self.cfg),
            input_fingerprints=self._input_fingerprints,
            nan_skips_in_a_row=self.streak.in_a_row,
            resolved_config=resolved_config(self.inputs.dflash),
            clip_window=[self.runner.objective.t_min, self.runner.objective.t_max] if self._clip_candidates else None,
            ema_updates=None if self.average is None else self.average.updates,
        )
        return save_checkpoint(
            self.run_dir,
            model=self.model,
            optimizer=self.optimizer,
            state=state,
            keep=self.cfg.train.keep_checkpoints,
            average=self.average,
        )
