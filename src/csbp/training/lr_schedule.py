"""Learning-rate schedule: linear warm-up, then cosine decay to ``min_lr_ratio`` (or constant).

The multiplier is a pure function of the optimizer step, so the schedule of a resumed run is the
schedule of an uninterrupted one. It always spans ``train.max_steps``: stopping early with
``csbp train --max-steps N`` does not compress it.

Step ``k`` (0-based: the ``k``-th optimizer update) uses ``lr * lr_multiplier(k)``:

* warm-up, ``k < W``: ``(k + 1) / W`` (the first update already has a non-zero rate);
* cosine, ``k >= W``: ``r + (1 - r) * (1 + cos(pi * p)) / 2`` with ``p = (k - W) / max(1, T - W)``,
  clamped to ``[0, 1]``, so the last update (``k = T - 1``) lands just above ``r * lr``;
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


def lr_multiplier(
    step: int, *, warmup_steps: int, max_steps: int, schedule: str, min_lr_ratio: float
) -> float:
    """Factor applied to the peak learning rate at 0-based optimizer step ``step``."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule != "cosine":
        raise ValueError(f"optim.schedule={schedule!r} is not one of ('cosine', 'constant')")
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
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
    )
    return LambdaLR(optimizer, lr_lambda=multiplier)
