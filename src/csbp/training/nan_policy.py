"""``train.nan_policy``: what a step whose loss or gradient norm is not finite does.

``stop`` (the default) raises :class:`NonFiniteTraining` at that step, naming the last good
checkpoint. ``skip`` drops the step's update (the schedule still moves on) with a warning line, at
most :data:`MAX_SKIPPED_STEPS` steps in a row; the next one stops the run as ``stop`` would. The
count of skipped steps in a row is part of every checkpoint (``nan_skips_in_a_row`` in
``trainer_state.json``), so a run resumed inside such a streak stops at the step the uninterrupted
run stops at.

Usage::

    streak = SkipStreak("skip", in_a_row=state.nan_skips_in_a_row)
    streak.finite()                                            # after a step that was applied
    line = streak.non_finite(step, loss, grad_norm, kept=...)  # raises unless the step is skipped
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

MAX_SKIPPED_STEPS = 10
"""``train.nan_policy: skip`` stops the run after this many non-finite steps in a row."""


class NonFiniteTraining(ValueError):
    """The loss or gradient norm of a step is not finite and ``train.nan_policy`` says stop."""


def latest_checkpoint_name(run_dir: Path) -> str | None:
    """The name ``checkpoints/latest`` holds, if any."""
    pointer = Path(run_dir) / "checkpoints" / "latest"
    return pointer.read_text(encoding="utf-8").strip() if pointer.is_file() else None


@dataclass
class SkipStreak:
    """``train.nan_policy`` and the number of steps skipped in a row up to now (checkpointed)."""

    policy: str
    in_a_row: int = 0

    def finite(self) -> None:
        """A step's update was applied: the streak ends."""
        self.in_a_row = 0

    def non_finite(self, step: int, loss: float, grad_norm: float, *, kept: str | None) -> str:
        """The warning line of skipped step ``step``, or :class:`NonFiniteTraining` when the policy is
        ``stop`` or the streak is full (``kept``: the last good checkpoint, for the message)."""
        what = f"step {step}: loss {loss} and grad_norm {grad_norm}: not finite"
        if self.policy == "skip" and self.in_a_row < MAX_SKIPPED_STEPS:
            self.in_a_row += 1
            return f"warning: {what}, update skipped (train.nan_policy: skip)"
        streak = self.policy == "skip"  # skipping is on: this step is one too many in a row
        if streak:
            what += f" after {self.in_a_row} skipped steps in a row (the most train.nan_policy: skip allows)"
        raise NonFiniteTraining(
            f"{what}; the run stopped without writing a checkpoint or final/ (last good checkpoint: "
            f"{kept or 'none'}) (fix: lower optim.lr or set optim.grad_clip, check the data, then --resume"
            + (")" if streak else "; or set train.nan_policy: skip)")
        )
