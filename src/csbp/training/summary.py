"""``TrainSummary``: what one ``train`` invocation did, and the end-of-run text ``csbp train`` prints
(its last line, ``val_loss: <first> -> <last>``, is the demo's contract)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from csbp.evaluation.nelbo import perplexity_bound


@dataclass(frozen=True)
class TrainSummary:
    """What one ``train`` invocation did (identical on every rank)."""

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

    @property
    def first_loss(self) -> float | None:
        return self.losses[0] if self.losses else None

    @property
    def last_loss(self) -> float | None:
        return self.losses[-1] if self.losses else None

    def format(self) -> str:
        """The human-readable end-of-run summary ``csbp train`` prints."""

        def number(value: float | None) -> str:
            return "-" if value is None else f"{value:.4f}"

        val_first = self.val_losses[0][1] if self.val_losses else None
        val_last = self.val_losses[-1][1] if self.val_losses else None
        lines = [
            f"run dir     {self.run_dir}",
            f"steps       {self.start_step} -> {self.end_step} of {self.total_steps} "
            f"in {self.elapsed_s:.1f} s",
            f"train loss  first {number(self.first_loss)}  last {number(self.last_loss)}",
            f"val loss    first {number(val_first)}  last {number(val_last)}",
        ]
        if self.val_nelbos:
            nelbo_last = self.val_nelbos[-1][1]
            lines.append(
                f"val nelbo   first {number(self.val_nelbos[0][1])}  last {number(nelbo_last)}  "
                f"(unclipped, nats/token; perplexity <= {perplexity_bound(nelbo_last):.2f})"
            )
        if self.checkpoint is not None:
            lines.append(f"checkpoint  {self.checkpoint}")
        if self.final_dir is not None:
            lines.append(f"export      {self.final_dir}")
        if self.sample is not None:
            lines.append(f"sample      {self.sample}")
        if val_first is not None:  # the demo's contract: this is the last line
            lines.append(f"val_loss: {number(val_first)} -> {number(val_last)}")
        return "\n".join(lines)
