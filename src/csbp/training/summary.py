"""``TrainSummary``: what one ``train`` invocation did, and the end-of-run text ``csbp train`` prints
(its last line, ``val_loss: <first> -> <last>``, is the demo's contract)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from csbp.evaluation.nelbo import perplexity_bound
from csbp.wording import counted

MAX_SKIPPED_SHOWN = 5
"""Skipped steps the summary names before ``...`` (``metrics.jsonl`` marks every one)."""


@dataclass(frozen=True)
class RunHistory:
    """A resumed run's records up to the step it resumed from (``metrics.jsonl``, read by rank 0), so the
    summary's first losses are the run's, not this invocation's."""

    losses: list[float] = field(default_factory=list)
    val_losses: list[tuple[int, float]] = field(default_factory=list)
    val_nelbos: list[tuple[int, float]] = field(default_factory=list)
    skipped_steps: list[int] = field(default_factory=list)

    @classmethod
    def from_records(cls, records: list[dict[str, Any]], *, up_to_step: int) -> RunHistory:
        """The history in ``records`` (``csbp.training.metrics.read_metrics``) at steps ``<= up_to_step``."""
        earlier = [r for r in records if r["step"] <= up_to_step]

        def numbers(key: str) -> list[tuple[int, float]]:
            return [(r["step"], float(r[key])) for r in earlier if isinstance(r.get(key), (int, float))]

        skipped = [r["step"] for r in earlier if r.get("skipped") is True]
        return cls([value for _, value in numbers("loss")], numbers("val_loss"), numbers("val_nelbo"), skipped)


@dataclass(frozen=True)
class TrainSummary:
    """What one ``train`` invocation did (identical on every rank, but for ``earlier``: rank 0's)."""

    run_dir: Path
    start_step: int
    end_step: int
    total_steps: int
    elapsed_s: float
    losses: list[float] = field(repr=False)
    val_losses: list[tuple[int, float]]
    checkpoint: Path | None
    final_dir: Path | None
    sample: str | None = None
    val_nelbos: list[tuple[int, float]] = field(default_factory=list)
    """Unclipped NELBO per token at each validation (diffusion objectives; empty for ar/dflash)."""
    skipped_steps: list[int] = field(default_factory=list)
    """Steps ``train.nan_policy: skip`` skipped (no update): the train loss lines leave them out."""
    earlier: RunHistory = field(default_factory=RunHistory)
    """A resumed run's losses before ``start_step``: the summary's first numbers are the run's."""
    ema_decay: float | None = None
    """``optim.ema_decay``: validation and ``final/`` used the weight average (None: the trained weights)."""
    speeds: list[dict[str, float]] = field(default_factory=list)
    """Each updating step's ``tokens_per_s`` and, where counted, ``tflops_per_device`` and ``mfu``."""
    stopped_by_signal: bool = False
    """Stopped after ``end_step`` on ``SIGUSR1`` (checkpointed there, no ``final/``: not finished)."""

    @property
    def first_loss(self) -> float | None:
        losses = self.earlier.losses + self.losses
        return losses[0] if losses else None

    @property
    def last_loss(self) -> float | None:
        losses = self.earlier.losses + self.losses
        return losses[-1] if losses else None

    def speed_line(self) -> str | None:
        """``speed       11,741 tokens/s, 139.2 TFLOP/s per device, MFU 14.1% (medians over 599 steps, the
        first one left out)``: over this invocation's updating steps, its first left out when there are
        others (it compiles on CUDA, and warms the allocator); None without steps."""
        speeds = self.speeds[1:] if len(self.speeds) > 1 else self.speeds
        if not speeds:
            return None
        parts = [f"{statistics.median(s['tokens_per_s'] for s in speeds):,.0f} tokens/s"]
        if all("tflops_per_device" in s for s in speeds):
            rate = statistics.median(s["tflops_per_device"] for s in speeds)
            parts.append(f"{rate:.1f} TFLOP/s per device" if rate >= 10 else f"{rate:.3g} TFLOP/s per device")
        if all("mfu" in s for s in speeds):
            parts.append(f"MFU {100 * statistics.median(s['mfu'] for s in speeds):.1f}%")
        over = f"medians over {counted(len(speeds), 'step')}" if len(speeds) > 1 else "one step"
        left_out = ", the first one left out" if len(self.speeds) > 1 else ""
        return f"speed       {', '.join(parts)} ({over}{left_out})"

    def format(self) -> str:
        """The human-readable end-of-run summary ``csbp train`` prints."""

        def number(value: float | None) -> str:
            return "-" if value is None else f"{value:.4f}"

        averaged = "" if self.ema_decay is None else f"  (weight average, optim.ema_decay {self.ema_decay:g})"
        val_losses = self.earlier.val_losses + self.val_losses
        val_nelbos = self.earlier.val_nelbos + self.val_nelbos
        val_first = val_losses[0][1] if val_losses else None
        val_last = val_losses[-1][1] if val_losses else None
        lines = [
            f"run dir     {self.run_dir}",
            f"steps       {self.start_step} -> {self.end_step} of {self.total_steps} "
            f"in {self.elapsed_s:.1f} s",
        ]
        if self.first_loss is not None:
            lines.append(f"train loss  first {number(self.first_loss)}  last {number(self.last_loss)}")
        skipped = self.earlier.skipped_steps + self.skipped_steps
        if skipped:  # else a run whose updates were all skipped reads as a run that trained
            shown = ", ".join(str(step) for step in skipped[:MAX_SKIPPED_SHOWN])
            shown += ", ..." if len(skipped) > MAX_SKIPPED_SHOWN else ""
            lines.append(f"skipped     {counted(len(skipped), 'step')} with no update ({shown}; train.nan_policy: skip)")
        speed = self.speed_line()
        if speed is not None:
            lines.append(speed)
        if val_first is not None:
            lines.append(f"val loss    first {number(val_first)} (step {val_losses[0][0]})  "
                         f"last {number(val_last)} (step {val_losses[-1][0]})" + averaged)
        if val_nelbos:
            nelbo_last = val_nelbos[-1][1]
            lines.append(
                f"val nelbo   first {number(val_nelbos[0][1])}  last {number(nelbo_last)}  "
                f"(unclipped, nats/token; perplexity <= {perplexity_bound(nelbo_last):.2f})"
            )
        if self.checkpoint is not None:
            lines.append(f"checkpoint  {self.checkpoint}")
        if self.stopped_by_signal:
            lines.append(f"stopped     after step {self.end_step} on SIGUSR1, not finished (--resume continues it)")
        if self.final_dir is not None:
            lines.append(f"export      {self.final_dir}" + averaged)
        if self.sample is not None:
            lines.append(f"sample      {self.sample}")
        if val_first is not None:  # the demo's contract: this is the last line
            lines.append(f"val_loss: {number(val_first)} -> {number(val_last)}")
        return "\n".join(lines)
