"""Anchor sampling for DFlash training (objectives.md §5.3).

An anchor ``a`` is the last committed token of a draft block ``[x_a, M, …, M]``. It is *valid* when
(Turbo-dLLM rule): ``a`` is supervised, the next token ``a+1`` exists, is supervised and lies in the
same document *segment* (a maximal run of equal ``doc_ids``; a reused id after another document
starts a new segment), and ``doc_ids[a] != -1`` (padding). Anchors never cross document
boundaries, and a block's context starts at its segment start (``segment_starts``).

Sampling draws ``min(max_anchors, #valid)`` distinct anchors, sorted, deterministically from a CPU
``torch.Generator``:

* ``uniform``: without replacement among the valid positions;
* ``locality``: one random cyclic start ``s`` and the stride ``B`` nudged to the nearest value
  coprime with the candidate count ``n`` (ties go to the larger stride): candidates
  ``(s + k·stride) mod n``. Marginals stay uniform and anchors are distinct.

A sequence without a valid anchor is a data error: ``sample_anchors`` raises a one-line
``ValueError``, and ``validate_anchor_coverage`` checks a whole split before training starts.

Shape legend: ``L`` sequence length, ``R`` rows of a split, ``N`` anchors.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np
import torch
from torch import Tensor

AnchorSampling = Literal["uniform", "locality"]


def segment_starts(doc_ids: Tensor) -> Tensor:
    """``[..., L]`` int64: the first position of the document segment holding each position."""
    length = doc_ids.shape[-1]
    positions = torch.arange(length, device=doc_ids.device).expand(doc_ids.shape)
    is_start = torch.ones(doc_ids.shape, dtype=torch.bool, device=doc_ids.device)
    is_start[..., 1:] = doc_ids[..., 1:] != doc_ids[..., :-1]
    return torch.cummax(torch.where(is_start, positions, 0), dim=-1).values


def valid_anchor_mask(loss_mask: Tensor, doc_ids: Tensor) -> Tensor:
    """``[..., L]`` bool: positions that may anchor a block (see the module docstring)."""
    if loss_mask.shape != doc_ids.shape or loss_mask.dim() == 0:
        raise ValueError(
            f"loss_mask {tuple(loss_mask.shape)} and doc_ids {tuple(doc_ids.shape)} "
            "must have one shape [..., L]"
        )
    supervised = loss_mask.bool()
    seg = segment_starts(doc_ids)
    valid = torch.zeros_like(supervised)
    valid[..., :-1] = (
        supervised[..., :-1]
        & supervised[..., 1:]
        & (seg[..., 1:] == seg[..., :-1])
        & (doc_ids[..., :-1] != -1)
    )
    return valid


def coprime_stride(block_size: int, count: int) -> int:
    """The stride nearest ``block_size`` (>= 1) coprime with ``count``; ties go to the larger one."""
    if block_size < 1 or count < 1:
        raise ValueError(f"coprime_stride needs block_size >= 1 and count >= 1, got {block_size}, {count}")
    delta = 0
    while True:
        for candidate in (block_size + delta, block_size - delta):
            if candidate >= 1 and math.gcd(candidate, count) == 1:
                return candidate
        delta += 1


def sample_anchors(
    loss_mask_L: Tensor,
    doc_ids_L: Tensor,
    *,
    max_anchors: int,
    method: AnchorSampling,
    block_size: int,
    generator: torch.Generator,
) -> Tensor:
    """Sorted int64 anchors ``[N]``, ``N = min(max_anchors, #valid)``, drawn with ``generator``."""
    if max_anchors < 1:
        raise ValueError(f"max_anchors must be >= 1, got {max_anchors}")
    candidates = torch.nonzero(valid_anchor_mask(loss_mask_L.cpu(), doc_ids_L.cpu())).flatten()
    count = int(candidates.numel())
    if count == 0:
        raise ValueError(
            "sequence has no valid DFlash anchor (needs a supervised token followed by a supervised token "
            "of the same document); drop such rows or fix loss_mask/doc_ids"
        )
    num_anchors = min(max_anchors, count)
    if method == "uniform":
        picked = torch.randperm(count, generator=generator)[:num_anchors]
    elif method == "locality":
        start = int(torch.randint(count, (1,), generator=generator))
        stride = coprime_stride(block_size, count)
        picked = (start + torch.arange(num_anchors) * stride) % count
    else:
        raise ValueError(f"anchor sampling method must be 'uniform' or 'locality', got {method!r}")
    return torch.sort(candidates[picked]).values


def validate_anchor_coverage(
    loss_mask_RL: np.ndarray | Tensor, doc_ids_RL: np.ndarray | Tensor, *, first_row: int = 0
) -> None:
    """``ValueError`` naming the first row without a valid anchor (run before the first step); the
    rows given are rows ``first_row, first_row + 1, ...`` of their split (for the message). Read-only
    arrays (a memory-mapped split) are copied: torch warns on every run about wrapping them."""
    loss_mask = torch.as_tensor(np.array(loss_mask_RL)).bool()
    doc_ids = torch.as_tensor(np.array(doc_ids_RL)).long()
    if loss_mask.dim() != 2 or loss_mask.shape != doc_ids.shape:
        raise ValueError(
            f"loss_mask {tuple(loss_mask.shape)} and doc_ids {tuple(doc_ids.shape)} must be [R, L]"
        )
    has_anchor = valid_anchor_mask(loss_mask, doc_ids).any(dim=-1)
    if not bool(has_anchor.all()):
        row = first_row + int(torch.nonzero(~has_anchor).flatten()[0])
        raise ValueError(
            f"row {row} has no valid DFlash anchor (no supervised token followed by a supervised token of "
            "the same document)"
        )
