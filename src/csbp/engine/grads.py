"""Gradient averaging over every rank that holds a model replica (csbp.md §13 rule 3).

All ``dp * local`` ranks are averaged at once: with ``bp > cp`` the replicated rings must be
averaged too, so the world group (the optimizer-DP group of the reference) is the right one.
Gradients are flattened into one buffer per dtype for a single all-reduce; parameters that
received no gradient on this rank (a rank owning no supervised row) contribute zeros, so every
rank issues identical collectives.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from csbp.parallel.comm import Comm


def fill_missing_gradients(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    """Give every trainable parameter a gradient tensor (zeros where backward produced none)."""
    out = []
    for p in params:
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        out.append(p)
    return out


def average_gradients(params: Iterable[nn.Parameter], comm: Comm | None) -> None:
    """Average gradients over ``comm``'s group (no-op for a single process)."""
    trainable = fill_missing_gradients(params)
    if comm is None or comm.size == 1:
        return
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in trainable:
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    for group in by_dtype.values():
        flat = torch.cat([p.grad.reshape(-1) for p in group])
        flat = comm.all_reduce(flat)
        flat.div_(comm.size)
        offset = 0
        for p in group:
            n = p.grad.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n
