"""``objective.resample`` (csbp.objectives.window_resample): bd3lms' redraw loop, drawn in one pass.

The law is checked against the closed form (``Binomial(n, t)`` restricted to the window's counts, a
uniform subset given the count) and against bd3lms' own loop written out here (redraw every
out-of-window block's tokens with the same ``t`` until none is out). Counts of 40,000 blocks from
fixed seeds: a frequency's standard error is at most 0.0025, the tolerance 0.012 (about 5 of them).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from csbp.config import config_from_dict
from csbp.evaluation.nelbo import nelbo_objective
from csbp.objectives import build_objective
from csbp.objectives.window_resample import resample_into_window, window_count_problem
from csbp.training.resume_config import ADDED_FIELDS
from test_config import error_lines, with_changes

TOLERANCE = 0.012


def _draw(levels_SN: torch.Tensor, block: int, seed: int, loss_mask: torch.Tensor | None = None):
    generator = torch.Generator().manual_seed(seed)
    samples, blocks = levels_SN.shape
    uniforms = torch.rand(samples, blocks * block, generator=generator, dtype=torch.float64)
    masked = uniforms <= levels_SN.repeat_interleave(block, dim=1)
    mask = torch.ones_like(masked) if loss_mask is None else loss_mask
    return masked & mask, uniforms, mask, generator


def _resampled(levels_SN, block, window, seed=0, loss_mask=None):
    masked, uniforms, mask, generator = _draw(levels_SN, block, seed, loss_mask)
    out = resample_into_window(
        masked, uniforms, mask, levels_SN, block_size=block, t_min=window[0], t_max=window[1], generator=generator
    )
    return masked, out


def _restricted_binomial(n: int, t: float, window: tuple[float, float]) -> torch.Tensor:
    pmf = torch.tensor([
        math.comb(n, c) * t**c * (1 - t) ** (n - c)
        if (window[0] <= 1e-3 or c / n >= window[0]) and (window[1] >= 1 or c / n <= window[1]) else 0.0
        for c in range(n + 1)
    ], dtype=torch.float64)
    return pmf / pmf.sum()


def _bd3lms_loop(t: float, block: int, window: tuple[float, float], blocks: int, seed: int) -> torch.Tensor:
    """bd3lms' ``_resample_q_xt``: redraw each out-of-window block, same ``t``, until every block is in."""
    generator = torch.Generator().manual_seed(seed)
    masked = torch.rand(blocks, block, generator=generator, dtype=torch.float64) <= t
    while True:
        fraction = masked.double().mean(-1)
        out = (fraction < window[0]) | (fraction > window[1])
        if not bool(out.any()):
            return masked
        redraw = torch.rand(blocks, block, generator=generator, dtype=torch.float64) <= t
        masked = torch.where(out[:, None], redraw, masked)


@pytest.mark.parametrize(("block", "t", "window"), [(8, 0.5, (0.3, 0.6)), (16, 0.35, (0.3, 0.4)), (4, 0.31, (0.3, 0.8))])
def test_the_count_follows_the_restricted_binomial_as_bd3lms_loop_does(block: int, t: float, window: tuple) -> None:
    blocks = 40_000
    _, out = _resampled(torch.full((1, blocks), t, dtype=torch.float64), block, window)
    expected = _restricted_binomial(block, t, window)
    got = torch.bincount(out.view(blocks, block).sum(-1), minlength=block + 1).double() / blocks
    loop = torch.bincount(_bd3lms_loop(t, block, window, blocks, 1).sum(-1), minlength=block + 1).double() / blocks
    assert torch.allclose(got, expected, atol=TOLERANCE)
    assert torch.allclose(loop, expected, atol=TOLERANCE)
    assert float(got[expected == 0].sum()) == 0.0  # no block outside the window at all


def test_given_its_count_a_blocks_masked_set_is_a_uniform_subset() -> None:
    blocks, block = 40_000, 4
    _, out = _resampled(torch.full((1, blocks), 0.2, dtype=torch.float64), block, (0.3, 0.8))
    two = out.view(blocks, block)[out.view(blocks, block).sum(-1) == 2]
    codes = (two.long() * torch.tensor([1, 2, 4, 8])).sum(-1)
    subsets = torch.bincount(codes, minlength=16).double()[[3, 5, 6, 9, 10, 12]] / len(two)
    assert torch.allclose(subsets, torch.full_like(subsets, 1 / 6), atol=TOLERANCE)


def test_a_block_already_in_the_window_keeps_its_draw_and_every_other_moves_into_it() -> None:
    generator = torch.Generator().manual_seed(3)
    levels = 0.3 + 0.5 * torch.rand(6, 50, generator=generator, dtype=torch.float64)
    before, after = _resampled(levels, 8, (0.3, 0.8), seed=4)
    fraction_before = before.view(6, 50, 8).double().mean(-1)
    fraction_after = after.view(6, 50, 8).double().mean(-1)
    kept = (fraction_before >= 0.3) & (fraction_before <= 0.8)
    assert 0 < int(kept.sum()) < kept.numel()
    assert torch.equal(after.view(6, 50, 8)[kept], before.view(6, 50, 8)[kept])
    assert bool(((fraction_after >= 0.3) & (fraction_after <= 0.8)).all())


@pytest.mark.parametrize(("window", "may_be_clean", "may_be_full"), [((1e-3, 0.5), True, False), ((0.5, 1.0), False, True)])
def test_an_unclipped_end_bounds_nothing_as_in_bd3lms(window: tuple, may_be_clean: bool, may_be_full: bool) -> None:
    levels = torch.cat([torch.full((1, 2000), 0.01), torch.full((1, 2000), 0.99)], dim=1).double()
    _, out = _resampled(levels, 4, window)
    counts = out.view(-1, 4).sum(-1)
    assert bool((counts == 0).any()) == may_be_clean
    assert bool((counts == 4).any()) == may_be_full


def test_only_supervised_tokens_count_and_a_block_that_cannot_fit_keeps_its_draw() -> None:
    block, blocks = 8, 3000
    loss_mask = torch.zeros(1, blocks * block, dtype=torch.bool).view(1, blocks, block)
    loss_mask[0, 0::3, :4] = True  # four supervised: counts 2..3 fit [0.3, 0.8]
    loss_mask[0, 1::3, :1] = True  # one supervised: 0 or 1 of 1, neither in the window
    loss_mask = loss_mask.view(1, -1)
    levels = torch.full((1, blocks), 0.5, dtype=torch.float64)
    before, after = _resampled(levels, block, (0.3, 0.8), seed=2, loss_mask=loss_mask)
    assert not bool((after & ~loss_mask).any())
    four = after.view(blocks, block)[0::3].sum(-1)
    assert bool(((four >= 2) & (four <= 3)).all())
    one = slice(1, None, 3)
    assert torch.equal(after.view(blocks, block)[one], before.view(blocks, block)[one])
    assert bool(after.view(blocks, block)[one].any()) and not bool(after.view(blocks, block)[one].all())
    assert not bool(after.view(blocks, block)[2::3].any())  # nothing supervised: nothing masked


def test_a_partly_supervised_blocks_count_follows_the_binomial_of_its_supervised_tokens() -> None:
    block, blocks = 8, 40_000
    loss_mask = torch.zeros(1, blocks, block, dtype=torch.bool)
    loss_mask[..., :2] = True  # counts 1 or 2 of 2 lie in [0.5, 1]: C(2, k) / 4 restricted, 2/3 and 1/3
    _, after = _resampled(torch.full((1, blocks), 0.5, dtype=torch.float64), block, (0.5, 1.0),
                          loss_mask=loss_mask.view(1, -1))
    got = torch.bincount(after.view(blocks, block).sum(-1), minlength=block + 1).double() / blocks
    assert torch.allclose(got[:3], _restricted_binomial(2, 0.5, (0.5, 1.0)), atol=TOLERANCE)


def test_the_generator_advances_the_same_whatever_the_data() -> None:
    states = []
    for level in (0.05, 0.5):
        masked, uniforms, mask, generator = _draw(torch.full((2, 10), level, dtype=torch.float64), 4, 0)
        resample_into_window(masked, uniforms, mask, torch.full((2, 10), level, dtype=torch.float64),
                             block_size=4, t_min=0.3, t_max=0.8, generator=generator)
        states.append(generator.get_state())
    assert torch.equal(states[0], states[1])


def test_the_objective_resamples_only_when_asked_and_the_nelbo_never() -> None:
    batch = {"input_ids": torch.randint(0, 60, (4, 64), generator=torch.Generator().manual_seed(0))}
    plain = build_objective("bd3", mask_token_id=63, block_size=8, t_min=0.3, t_max=0.8)
    resampled = build_objective("bd3", mask_token_id=63, block_size=8, t_min=0.3, t_max=0.8, resample=True)
    fractions = []
    for objective in (plain, resampled):
        corrupted = objective.corrupt(batch, torch.Generator().manual_seed(1))
        fractions.append((corrupted.noisy_ids == 63).view(4, 8, 8).double().mean(-1))
    assert not bool(((fractions[0] >= 0.3) & (fractions[0] <= 0.8)).all())
    assert bool(((fractions[1] >= 0.3) & (fractions[1] <= 0.8)).all())
    assert nelbo_objective(resampled).resample is False


def test_a_window_no_block_can_land_in_is_refused() -> None:
    assert window_count_problem(4, 0.3, 0.45) is not None
    assert window_count_problem(4, 0.3, 0.5) is None
    with pytest.raises(ValueError, match="no count of masked tokens out of a block of 4"):
        build_objective("bd3", mask_token_id=63, block_size=4, t_min=0.3, t_max=0.45, resample=True)


RESAMPLED = {"objective.block_size": 4, "objective.t_min": 0.3, "objective.t_max": 0.8, "objective.resample": True}


@pytest.mark.parametrize(("changes", "line"), [
    ({"objective.name": "mdlm"}, "objective.resample: redraws bd3's blocks into its noise window; mdlm has none"),
    ({"objective.t_min": 0.001, "objective.t_max": 1.0}, "objective.resample: the window [0.001, 1] bounds no"),
    ({"objective.t_max": 0.45}, "objective.t_min: with resample, no count of masked tokens out of a block of 4 "
     "lies in the noise window [0.3, 0.45]"),
    ({"objective.clip_search_widths": [0.1], "train.eval_every": 10},
     "objective.clip_search_widths: with resample, no count of masked tokens out of a block of 4 lies in the "
     "noise window [0.05, 0.15], [0.1, 0.2], [0.3, 0.4] ..."),
])
def test_resample_settings_that_cannot_work_are_refused_naming_the_field(changes: dict, line: str) -> None:
    lines = error_lines(with_changes({**RESAMPLED, **changes}))
    assert any(line in got for got in lines), lines


def test_an_inverted_window_is_named_once_not_also_as_a_window_resample_cannot_fill() -> None:
    """``t_min >= t_max`` has its own rule (lower ``t_min``); with resample the window also admits no count,
    and a second line on the same field told the user to widen a window whose ends are only swapped."""
    lines = error_lines(with_changes({**RESAMPLED, "objective.t_min": 0.8, "objective.t_max": 0.3}))
    assert lines == ["config.yaml: objective.t_min: t_min=0.8 must be below t_max=0.3 (fix: lower t_min)"]


def test_resample_on_an_unclipped_window_is_allowed_while_a_search_may_clip_it() -> None:
    changes = {**RESAMPLED, "objective.t_min": 0.001, "objective.t_max": 1.0,
               "objective.clip_search_widths": [0.5], "train.eval_every": 10}
    assert config_from_dict(with_changes(changes), source="config.yaml").objective.resample is True
    assert ADDED_FIELDS["objective.resample"] is False  # a run recorded before the field trained without it


def test_training_and_the_window_search_draw_resampled_blocks_and_the_nelbo_does_not(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from csbp.training import step as step_module
    from csbp.training import train
    from csbp.training.step import NELBO_MICRO_STEP
    from test_training_run import make_artifact, tiny_config

    seen: list[tuple[int, tuple[float, float], bool, torch.Tensor]] = []
    real = step_module.StepRunner._corrupt_on_host

    def recording(self, batch, step, micro_step, objective=None):  # type: ignore[no-untyped-def]
        used = objective or self.objective
        corrupted = real(self, batch, step, micro_step, objective)
        masked = (corrupted.labels != -100).view(corrupted.num_rows, -1, 4).sum(-1)
        supervised = batch.get("loss_mask", torch.ones_like(batch["input_ids"], dtype=torch.bool))
        supervised = supervised.view(corrupted.num_rows, -1, 4).sum(-1)
        fractions = masked[supervised > 0] / supervised[supervised > 0]  # a block with none is left alone
        seen.append((micro_step, (used.t_min, used.t_max), used.resample, fractions.double()))
        return corrupted

    monkeypatch.setattr(step_module.StepRunner, "_corrupt_on_host", recording)
    changes = {"objective.t_min": 0.3, "objective.t_max": 0.8, "objective.resample": True,
               "objective.clip_search_widths": [0.5], "objective.clip_search_delta": 0.25}
    train(tiny_config(make_artifact(tmp_path / "art"), **changes), run_dir=tmp_path / "run")
    windows = {window for micro_step, window, resample, _ in seen if resample}
    assert len(windows) > 2  # the configured window and the searched ones
    for micro_step, (low, high), resample, fractions in seen:
        inside = (fractions >= (low if low > 1e-3 else 0.0)) & (fractions <= high)
        assert resample == (micro_step != NELBO_MICRO_STEP)
        assert bool(inside.all()) or not resample
    nelbo = torch.cat([fractions.flatten() for micro_step, _, _, fractions in seen if micro_step == NELBO_MICRO_STEP])
    assert bool(((nelbo < 0.3) | (nelbo > 0.8)).any())  # the NELBO's draws are the independent ones
