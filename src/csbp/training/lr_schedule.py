"""Learning-rate schedule: linear warm-up, then a decay to ``min_lr_ratio`` (cosine, linear or
warm-up-stable-decay) or a constant rate.

The multiplier is a pure function of the optimizer step, so the schedule of a resumed run is the
schedule of an uninterrupted one. It always spans ``train.max_steps``: stopping early with
``csbp train --max-steps N`` does not compress it.

Step ``k`` (0-based: the ``k``-th optimizer update) uses ``lr * lr_multiplier(k)``:

* warm-up, ``k < W``: ``(k + 1) / W`` (the first update already has a non-zero rate);
* cosine, ``k >= W``: ``r + (1 - r) * (1 + cos(pi * p)) / 2`` with ``p = (k - W) / max(1, T - W)``,
  clamped to ``[0, 1]``, so the last update (``k = T - 1``) lands just above ``r * lr``;
* linear, ``k >= W``: ``r + (1 - r) * (1 - p)``;
* wsd (warm-up-stable-decay, as MiniCPM and torchtitan's ``decay_ratio``), ``k >= W``: 1 while
  ``p <= 1 - f`` (``f = decay_fraction``), then linear to ``r`` over the last ``f`` of the steps:
  ``r + (1 - r) * (1 - p) / f``; a run stopped in the stable phase can be continued, or branched into
  a decay, without a schedule that already decayed;
* constant: 1 after warm-up.

Usage::

    scheduler = build_lr_scheduler(optimizer, cfg.optim, max_steps=cfg.train.max_steps)
    optimizer.step(); scheduler.step()
"""

from __future__ import annotations

import math
from functools import partial

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from csbp.config.schema import OptimSection

SCHEDULES = ("cosine", "constant", "linear", "wsd")


def lr_multiplier(
    step: int, *, warmup_steps: int, max_steps: int, schedule: str, min_lr_ratio: float,
    decay_fraction: float = 0.2,
) -> float:
    """Factor applied to the peak learning rate at 0-based optimizer step ``step``."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule not in SCHEDULES:
        raise ValueError(f"optim.schedule={schedule!r} is not one of {SCHEDULES}")
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    if schedule == "linear":
        return min_lr_ratio + (1.0 - min_lr_ratio) * (1.0 - progress)
    if schedule == "wsd":
        if not 0.0 < decay_fraction <= 1.0:
            raise ValueError(f"optim.decay_fraction={decay_fraction} must lie in (0, 1]")
        left = 1.0 - progress  # the share of the post-warm-up steps still ahead
        return 1.0 if left >= decay_fraction else min_lr_ratio + (1.0 - min_lr_ratio) * left / decay_fraction
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(optimizer: Optimizer, optim: OptimSection, *, max_steps: int) -> LambdaLR:
    """A ``LambdaLR`` applying :func:`lr_multiplier` to every parameter group.

    Its ``state_dict()`` holds plain numbers (the lambda itself is not stored), so checkpoints keep
    it as JSON.
    """
    multiplier = partial(
        lr_multiplier,
        warmup_steps=optim.warmup_steps,
        max_steps=max_steps,
        schedule=optim.schedule,
        min_lr_ratio=optim.min_lr_ratio,
        decay_fraction=optim.decay_fraction,
    )
    return LambdaLR(optimizer, lr_lambda=multiplier)
