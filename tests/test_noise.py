"""Noise-level samplers: strata coverage, lattice spacing, marginal uniformity, clipping."""

from __future__ import annotations

import pytest
import torch

from csbp.objectives.noise import (
    clip_levels,
    rotated_lattice_levels,
    sample_levels,
    stratified_levels,
    uniform_levels,
)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("num_slots", [1, 2, 7, 64, 1000])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stratified_has_exactly_one_value_per_stratum(num_slots: int, seed: int) -> None:
    levels = stratified_levels(num_slots, _generator(seed))
    assert levels.dtype == torch.float64 and levels.shape == (num_slots,)
    assert bool(((levels >= 0) & (levels < 1)).all())
    counts = torch.bincount(torch.floor(levels * num_slots).long(), minlength=num_slots)
    assert counts.tolist() == [1] * num_slots


@pytest.mark.parametrize("num_slots", [1, 3, 16, 257])
@pytest.mark.parametrize("seed", [0, 5])
def test_rotated_lattice_sorted_spacing_is_one_over_k(num_slots: int, seed: int) -> None:
    levels = rotated_lattice_levels(num_slots, _generator(seed))
    assert bool(((levels >= 0) & (levels < 1)).all())
    spacing = torch.diff(torch.sort(levels).values)
    assert torch.allclose(spacing, torch.full_like(spacing, 1.0 / num_slots), rtol=0, atol=1e-12)
    # Consecutive slots differ by exactly 1/K modulo 1 (slot k = s·N + b keeps its offset).
    step = torch.remainder(torch.diff(levels), 1.0)
    assert torch.allclose(step, torch.full_like(step, 1.0 / num_slots), rtol=0, atol=1e-12)


@pytest.mark.parametrize("sampler", [stratified_levels, rotated_lattice_levels, uniform_levels])
def test_every_slot_is_marginally_uniform(sampler) -> None:
    generator = _generator(11)
    draws = torch.stack([sampler(4, generator) for _ in range(4000)])  # [4000, 4]
    # Standard error of a U(0,1) mean over 4000 draws is 0.0046; quarter-fraction error 0.0068.
    assert torch.allclose(draws.mean(0), torch.full((4,), 0.5, dtype=torch.float64), atol=0.025)
    assert torch.allclose(
        (draws < 0.25).double().mean(0), torch.full((4,), 0.25, dtype=torch.float64), atol=0.035
    )


def test_samplers_are_deterministic_in_the_generator() -> None:
    for scheme in ("stratified", "rotated_lattice", "uniform"):
        first = sample_levels(scheme, 9, _generator(3))
        assert torch.equal(first, sample_levels(scheme, 9, _generator(3)))
        assert not torch.equal(first, sample_levels(scheme, 9, _generator(4)))


def test_clip_levels_is_the_affine_map_and_respects_bounds() -> None:
    tau = torch.tensor([0.0, 0.25, 0.5, 1.0 - 2**-53], dtype=torch.float64)
    clipped = clip_levels(tau, 1e-3, 1.0)
    assert torch.allclose(clipped, 1e-3 + (1.0 - 1e-3) * tau, rtol=0, atol=0)
    clipped = clip_levels(stratified_levels(500, _generator(0)), 0.3, 0.8)
    assert float(clipped.min()) >= 0.3 and float(clipped.max()) < 0.8
    assert float(clip_levels(tau, 0.4, 0.4).max()) == pytest.approx(0.4, abs=1e-15)


@pytest.mark.parametrize("bounds", [(-0.1, 1.0), (0.5, 0.4), (0.0, 1.5)])
def test_clip_levels_rejects_bad_ranges(bounds: tuple[float, float]) -> None:
    with pytest.raises(ValueError, match="t_min"):
        clip_levels(torch.zeros(2, dtype=torch.float64), *bounds)


def test_bad_scheme_and_slot_count_raise() -> None:
    with pytest.raises(ValueError, match="noise scheme"):
        sample_levels("antithetic", 4, _generator(0))
    with pytest.raises(ValueError, match="K=0"):
        stratified_levels(0, _generator(0))


def test_a_stratified_slot_is_not_tied_to_its_stratum() -> None:
    """Slot k = s·N + b is block b of sample s: with one sample per micro-batch, bd3lms' stratum-k-to-
    slot-k rule trains block 0 only at t < 1/N and the last block only at t >= (N-1)/N. Each slot
    must reach every stratum."""
    generator = _generator(2)
    draws = torch.stack([stratified_levels(8, generator) for _ in range(400)])  # [400, 8]
    strata = torch.floor(draws * 8).long()
    for slot in range(8):
        assert set(strata[:, slot].tolist()) == set(range(8)), slot
