"""Noise-level samplers shared by the self-denoising objectives (objectives.md §2, §3.3).

A micro-batch has ``K`` noise slots (one per sequence for MDLM, one per (sample, block) for BD3,
``k = s·N + b``). The samplers return ``K`` levels in ``[0, 1)`` that cover the interval evenly,
which lowers the variance of the NELBO estimate:

* ``stratified``: ``(U_j + j) / K`` with an independent ``U_j`` per stratum, so exactly one value
  lands in each ``[j/K, (j+1)/K)`` (MDLM/BD3-LM "antithetic" sampling), the strata dealt to the
  slots in a random order. bd3lms gives slot ``k`` stratum ``k``: a block's level is then tied to its
  position (with one sample per micro-batch, block 0 only ever sees ``t < 1/N``, the last block only
  ``t >= (N-1)/N``); the shuffle keeps the stratification and makes every slot marginally uniform;
* ``rotated_lattice``: one ``u`` and ``(u + k/K) mod 1``; the sorted values are exactly ``1/K``
  apart and every slot is marginally uniform, so the level is not tied to the block position;
* ``uniform``: independent ``U(0, 1)`` per slot (Fast-dLLM v2).

All levels are float64 and drawn from the given CPU generator, so they are reproducible.
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from torch import Tensor

NoiseScheme = Literal["rotated_lattice", "stratified", "uniform"]
NOISE_SCHEMES: tuple[str, ...] = get_args(NoiseScheme)


def _check_count(num_slots: int) -> None:
    if num_slots < 1:
        raise ValueError(f"number of noise slots K={num_slots} must be >= 1")


def stratified_levels(num_slots: int, generator: torch.Generator) -> Tensor:
    """``[K]`` float64 levels, one uniform in each stratum ``[j/K, (j+1)/K)``, the strata in a random
    order over the slots (so no slot's level is tied to its position)."""
    _check_count(num_slots)
    jitter_K = torch.rand(num_slots, generator=generator, dtype=torch.float64)
    slot_K = torch.arange(num_slots, dtype=torch.float64)
    levels_K = (slot_K + jitter_K) / num_slots
    # (k + U)/K can round up onto the next stratum's edge when U is within an ulp of 1.
    upper_K = torch.nextafter((slot_K + 1) / num_slots, torch.zeros_like(slot_K))
    levels_K = torch.minimum(torch.maximum(levels_K, slot_K / num_slots), upper_K)
    return levels_K[torch.randperm(num_slots, generator=generator)]


def rotated_lattice_levels(num_slots: int, generator: torch.Generator) -> Tensor:
    """``[K]`` float64 levels ``(u + k/K) mod 1`` from a single ``u ~ U(0, 1)``."""
    _check_count(num_slots)
    offset = torch.rand(1, generator=generator, dtype=torch.float64)
    slot_K = torch.arange(num_slots, dtype=torch.float64)
    return torch.remainder(offset + slot_K / num_slots, 1.0)


def uniform_levels(num_slots: int, generator: torch.Generator) -> Tensor:
    """``[K]`` independent float64 ``U(0, 1)`` levels."""
    _check_count(num_slots)
    return torch.rand(num_slots, generator=generator, dtype=torch.float64)


def sample_levels(scheme: str, num_slots: int, generator: torch.Generator) -> Tensor:
    """Dispatch on ``scheme`` (one of :data:`NOISE_SCHEMES`)."""
    if scheme == "rotated_lattice":
        return rotated_lattice_levels(num_slots, generator)
    if scheme == "stratified":
        return stratified_levels(num_slots, generator)
    if scheme == "uniform":
        return uniform_levels(num_slots, generator)
    raise ValueError(f"noise scheme {scheme!r} is not one of {NOISE_SCHEMES}")


def check_clip_range(t_min: float, t_max: float) -> None:
    if not 0.0 <= t_min <= t_max <= 1.0:
        raise ValueError(
            f"noise clip range t_min={t_min}, t_max={t_max} must satisfy 0 <= t_min <= t_max <= 1"
        )


def clip_levels(tau: Tensor, t_min: float, t_max: float) -> Tensor:
    """Map levels in ``[0, 1)`` affinely onto ``[t_min, t_max)``: ``t_min + (t_max - t_min)·tau``."""
    check_clip_range(t_min, t_max)
    return t_min + (t_max - t_min) * tau
