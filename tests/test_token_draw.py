"""The sampled proposal's draw (``csbp.generation.token_choice``): one uniform per row, inverted through
the row's cumulative probability, on the logits' device.

The oracle is the definition: a uniform ``u`` picks the first token whose cumulative probability
exceeds ``u`` times the row's total, so a grid of uniforms lands on each token in proportion to its
probability, exactly; a token of probability 0 is never drawn, also where ``u * total`` rounds up to
the total. Draws from a seeded generator follow the softmax (a fixed seed, within 5 standard errors).
Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_token_draw.py -q``
"""

from __future__ import annotations

import math

import pytest
import torch

from csbp.generation.token_choice import draw_uniforms, invert_cdf, propose_tokens

U_BELOW_ONE = 1.0 - 2.0**-53  # the largest float64 uniform torch.rand can return


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_grid_of_uniforms_lands_on_each_token_in_proportion_to_its_probability(dtype: torch.dtype) -> None:
    probs_V = torch.tensor([0.0, 0.125, 0.0, 0.5, 0.375, 0.0], dtype=dtype)
    grid = 1024
    uniforms_R = (torch.arange(grid, dtype=torch.float64) + 0.5) / grid
    tokens_R = invert_cdf(probs_V.repeat(grid, 1), uniforms_R)
    counts = torch.bincount(tokens_R, minlength=6).tolist()
    assert counts == [0, 128, 0, 512, 384, 0]
    # an unnormalised row (a float32 softmax sums to 1 only up to rounding) is scaled, not cut short
    scaled = invert_cdf((probs_V * 0.75).repeat(grid, 1), uniforms_R)
    assert torch.equal(scaled, tokens_R)


def test_the_ends_of_the_unit_interval_draw_the_first_and_last_possible_tokens() -> None:
    probs_RV = torch.tensor([[0.0, 0.25, 0.75, 0.0, 0.0]] * 3, dtype=torch.float64)
    tokens_R = invert_cdf(probs_RV, torch.tensor([0.0, U_BELOW_ONE, 1.0], dtype=torch.float64))
    assert tokens_R.tolist() == [1, 2, 2]  # 1.0 cannot be drawn; it stands for a u * total rounded up
    one_token = torch.zeros(2, 7, dtype=torch.float32)
    one_token[:, 6] = 1.0
    assert invert_cdf(one_token, torch.tensor([0.0, U_BELOW_ONE], dtype=torch.float64)).tolist() == [6, 6]


def test_seeded_draws_follow_the_tempered_truncated_softmax() -> None:
    logits_V = torch.tensor([2.0, 0.5, -1.0, 1.5, 9.0, 0.0, 1.0])  # id 4 plays the mask
    rows = 40_000
    tokens_R, confidence_R = propose_tokens(
        logits_V.repeat(rows, 1), mask_token_id=4, temperature=0.7, top_k=4, generator=torch.Generator().manual_seed(3)
    )
    kept = torch.tensor([0, 3, 6, 1])  # the four largest logits but the mask's
    expected_V = torch.zeros(7, dtype=torch.float64)
    expected_V[kept] = torch.softmax(logits_V[kept].double() / 0.7, dim=0)
    observed_V = torch.bincount(tokens_R, minlength=7).double() / rows
    standard_error_V = (expected_V * (1 - expected_V) / rows).sqrt()
    assert torch.all((observed_V - expected_V).abs() <= 5 * standard_error_V + 1e-12), (observed_V, expected_V)
    assert torch.allclose(confidence_R.double(), expected_V[tokens_R], atol=1e-6)


def test_a_generator_and_the_uniforms_it_draws_give_the_same_tokens() -> None:
    logits_RV = torch.randn(64, 50, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 2
    options = {"mask_token_id": 7, "temperature": 0.9, "top_p": 0.8}
    from_generator = propose_tokens(logits_RV, generator=torch.Generator().manual_seed(11), **options)
    uniforms_R = draw_uniforms(64, torch.Generator().manual_seed(11))
    from_uniforms = propose_tokens(logits_RV, uniforms_R=uniforms_R, **options)
    assert torch.equal(from_generator[0], from_uniforms[0]) and torch.equal(from_generator[1], from_uniforms[1])
    # row by row, the same: a row's draw depends on its own uniform alone
    row_by_row = [propose_tokens(logits_RV[r : r + 1], uniforms_R=uniforms_R[r : r + 1], **options)[0] for r in range(64)]
    assert torch.equal(torch.cat(row_by_row), from_uniforms[0])
    assert from_uniforms[0].device.type == "cpu" and from_uniforms[0].dtype == torch.int64


def test_the_draw_refuses_missing_or_misshapen_randomness() -> None:
    logits_RV = torch.zeros(3, 5)
    with pytest.raises(ValueError, match="needs a generator"):
        propose_tokens(logits_RV, mask_token_id=0, temperature=1.0)
    with pytest.raises(ValueError, match=r"uniforms_R has shape \(2,\), expected \(3,\)"):
        propose_tokens(logits_RV, mask_token_id=0, temperature=1.0, uniforms_R=torch.rand(2, dtype=torch.float64))
    tokens_R, _ = propose_tokens(logits_RV, mask_token_id=0)  # greedy needs no randomness
    assert tokens_R.tolist() == [1, 1, 1]


def test_one_uniform_per_row_is_drawn() -> None:
    """The randomness a sampled step consumes is one number per row (the former multinomial draw took one
    per vocabulary entry on the host), so a generator's stream position after a step is known."""
    generator = torch.Generator().manual_seed(5)
    propose_tokens(torch.randn(6, 1000), mask_token_id=0, temperature=1.0, generator=generator)
    reference = torch.Generator().manual_seed(5)
    draw_uniforms(6, reference)
    assert math.isclose(float(torch.rand(1, generator=generator)), float(torch.rand(1, generator=reference)))


def test_the_cumulative_sum_and_the_uniforms_resolve_below_float32s_rounding() -> None:
    """The draw is exact where float32 is not: a token of probability 2**-30 next to one of 1/2 is lost in
    a float32 cumulative sum (0.5 + 2**-30 rounds to 0.5), and a float32 uniform (24 bits) cannot land in
    its interval; the float64 sum and uniforms keep it drawable."""
    probs_RV = torch.tensor([[0.5, 2.0**-30, 0.25, 0.25]], dtype=torch.float32)
    assert invert_cdf(probs_RV, torch.tensor([0.5], dtype=torch.float64)).tolist() == [1]
    uniforms_R = draw_uniforms(64, torch.Generator().manual_seed(0))
    assert uniforms_R.dtype == torch.float64
    assert not torch.equal(uniforms_R, uniforms_R.float().double())  # finer than float32's grid
    # through propose_tokens too: token 1's interval of uniforms holds no float32 number
    probs_V = torch.tensor([0.5 + 2.0**-27, 2.0**-30, 0.5 - 2.0**-27 - 2.0**-30, 0.5], dtype=torch.float64)
    u_R = torch.tensor([0.5 + 2.0**-27 + 2.0**-31], dtype=torch.float64)
    tokens_R, _ = propose_tokens(probs_V.log()[None], mask_token_id=3, temperature=1.0, uniforms_R=u_R)
    assert tokens_R.tolist() == [1]
