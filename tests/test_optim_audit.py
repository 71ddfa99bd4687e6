"""The learning-rate schedule and the optimizer, against hand-computed values and float64 references.

Each test here kills a mutant of :mod:`csbp.training.lr_schedule` or :mod:`csbp.training.optim` that
the other tests let live (a mutation audit): a warm-up as long as the run, the ``constant`` schedule
through ``build_lr_scheduler``, an unknown schedule name, the config's epsilon and betas at
construction, frozen parameters left out of the optimizer, and the float64 sum of squares of the
clipping norm.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from csbp.config.schema import OptimSection
from csbp.training.lr_schedule import build_lr_scheduler, lr_multiplier
from csbp.training.optim import build_optimizer, clip_gradients, parameter_groups


def two_layers() -> nn.Module:
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model[0].weight.requires_grad_(False)  # frozen, like the DFlash drafter's target model
    return model


def learning_rates(optim: OptimSection, max_steps: int) -> list[float]:
    """The rate of each of the ``max_steps`` updates, stepping the scheduler once more after the last
    (as the training loop does)."""
    optimizer = build_optimizer(two_layers(), optim)
    scheduler = build_lr_scheduler(optimizer, optim, max_steps=max_steps)
    seen = []
    for _ in range(max_steps):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return seen


def test_a_warmup_as_long_as_the_run_ramps_to_the_peak_and_steps_past_the_end() -> None:
    """``warmup_steps == max_steps`` passes the config rules (warmup <= max_steps); the scheduler's step
    after the last update asks for multiplier(max_steps), whose cosine span is then 0 steps (a mutant
    dividing by ``max_steps - warmup_steps`` without the floor of 1 raised ZeroDivisionError there)."""
    optim = OptimSection(lr=0.3, warmup_steps=3, min_lr_ratio=0.1)
    assert learning_rates(optim, 3) == pytest.approx([0.1, 0.2, 0.3], abs=1e-15)
    assert lr_multiplier(3, warmup_steps=3, max_steps=3, schedule="cosine", min_lr_ratio=0.1) == 1.0


def test_the_constant_schedule_holds_the_peak_after_warmup() -> None:
    """``optim.schedule: constant`` must reach the scheduler (a mutant building every schedule as cosine
    passed: the scheduler tests all used cosine)."""
    optim = OptimSection(lr=0.2, warmup_steps=2, min_lr_ratio=0.1, schedule="constant")
    assert learning_rates(optim, 6) == pytest.approx([0.1, 0.2, 0.2, 0.2, 0.2, 0.2], abs=1e-15)
    cosine = OptimSection(lr=0.2, warmup_steps=0, min_lr_ratio=0.1)
    reference = torch.optim.lr_scheduler.CosineAnnealingLR(
        torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.2), T_max=6, eta_min=0.02
    )
    expected = []
    for _ in range(6):
        expected.append(reference.get_last_lr()[0])
        reference.optimizer.step()
        reference.step()
    assert learning_rates(cosine, 6) == pytest.approx(expected, rel=1e-12)


def test_an_unknown_schedule_is_refused() -> None:
    with pytest.raises(ValueError, match="optim.schedule='step'"):
        lr_multiplier(5, warmup_steps=2, max_steps=10, schedule="step", min_lr_ratio=0.1)


def test_the_optimizer_takes_the_configs_hyperparameters_and_no_frozen_parameter() -> None:
    """A fresh run's AdamW holds the config's epsilon and betas (a mutant using AdamW's default epsilon
    passed: the config default is the same 1e-8), and only trainable parameters."""
    model = two_layers()
    optim = OptimSection(lr=0.01, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.05)
    optimizer = build_optimizer(model, optim)
    decayed, plain = optimizer.param_groups
    for group in (decayed, plain):
        assert (group["lr"], group["betas"], group["eps"]) == (0.01, (0.8, 0.9), 1e-6)
    assert (decayed["weight_decay"], plain["weight_decay"]) == (0.05, 0.0)
    held = {id(p) for group in parameter_groups(model, 0.05) for p in group["params"]}
    assert held == {id(model[0].bias), id(model[1].weight), id(model[1].bias)}


def test_the_clipping_norm_of_float32_gradients_is_summed_in_float64() -> None:
    """The docstring's float64 accumulation, inside each tensor too: 4096**2 is 2**24, where float32
    steps by 2, so a float32 sum of the squares drops the seven 1s (a mutant squaring and summing in
    float32 reported 4096.0 or 4096.00098)."""
    grad = torch.tensor([4096.0] + [1.0] * 7, dtype=torch.float32)
    param = nn.Parameter(torch.zeros(8))
    param.grad = grad.clone()
    exact = math.sqrt(4096.0**2 + 7)
    assert clip_gradients([param], None) == pytest.approx(exact, rel=1e-12)
    reference = float(torch.linalg.vector_norm(grad.to(torch.float64)))
    assert clip_gradients([param], None) == pytest.approx(reference, rel=1e-12)


def test_lr_multiplier_linear_and_warmup_stable_decay() -> None:
    """``linear`` falls in equal steps to ``min_lr_ratio``; ``wsd`` holds the peak rate until the last
    ``decay_fraction`` of the post-warm-up steps, then falls linearly to the same end."""
    kwargs = {"warmup_steps": 2, "max_steps": 12, "min_lr_ratio": 0.1}
    linear = [lr_multiplier(k, schedule="linear", **kwargs) for k in range(2, 13)]
    assert linear == pytest.approx([1.0 - 0.09 * i for i in range(11)], abs=1e-12)
    wsd = [lr_multiplier(k, schedule="wsd", decay_fraction=0.3, **kwargs) for k in range(13)]
    # progress p = (k - 2) / 10: stable while 1 - p >= 0.3 (k <= 9), then 0.1 + 0.9 * (1 - p) / 0.3
    assert wsd[:2] == [0.5, 1.0] and wsd[2:10] == [1.0] * 8
    assert wsd[10:] == pytest.approx([0.1 + 0.9 * (0.2 / 0.3), 0.1 + 0.9 * (0.1 / 0.3), 0.1], abs=1e-12)
    assert lr_multiplier(100, schedule="wsd", decay_fraction=0.3, **kwargs) == pytest.approx(0.1, abs=1e-12)
    assert lr_multiplier(2, schedule="wsd", decay_fraction=1.0, **kwargs) == 1.0  # all decay: linear
    assert lr_multiplier(7, schedule="wsd", decay_fraction=1.0, **kwargs) == pytest.approx(
        lr_multiplier(7, schedule="linear", **kwargs), abs=1e-12)
    with pytest.raises(ValueError, match="decay_fraction"):
        lr_multiplier(5, schedule="wsd", decay_fraction=0.0, **kwargs)
    with pytest.raises(ValueError, match="optim.schedule='step'"):
        lr_multiplier(5, schedule="step", **kwargs)


def test_the_config_carries_the_wsd_decay_fraction_to_the_scheduler() -> None:
    optim = OptimSection(lr=1.0, warmup_steps=0, min_lr_ratio=0.0, schedule="wsd", decay_fraction=0.5)
    # p = 0, 1/4, 1/2, 3/4: decays over the last half
    assert learning_rates(optim, max_steps=4) == pytest.approx([1.0, 1.0, 1.0, 0.5])


def test_a_schedule_setting_the_schedule_never_reads_is_refused() -> None:
    """``optim.decay_fraction`` without ``wsd`` (or ``min_lr_ratio`` with ``constant``) trained on a schedule
    that ignores it, silently; csbp refuses such settings (``objective.clip_search_delta`` without widths)."""
    from csbp.config import ConfigError, config_from_dict

    with pytest.raises((ConfigError, ValueError), match="decay_fraction: has no effect with schedule cosine"):
        config_from_dict({"model": {}, "optim": {"lr": 1e-3, "decay_fraction": 0.5}, "train": {"max_steps": 4}})
    with pytest.raises((ConfigError, ValueError), match="min_lr_ratio: has no effect with schedule constant"):
        config_from_dict({"model": {}, "optim": {"lr": 1e-3, "schedule": "constant", "min_lr_ratio": 0.0},
                          "train": {"max_steps": 4}})
    assert OptimSection(lr=1e-3, schedule="wsd", decay_fraction=0.5).decay_fraction == 0.5
    assert OptimSection(lr=1e-3, schedule="linear", min_lr_ratio=0.0).min_lr_ratio == 0.0
