"""Input rules of the self-denoising objectives that the formula tests leave untouched: where the
mask token may appear in the data, and the noise levels a ``1/t`` weight can take.

Each case is written from the definitions (objectives.md §2-§3: SUBS gives a supervised ``[M]``
an infinite loss, ``1/t`` is infinite at ``t = 0``), not from the implementation.
"""

from __future__ import annotations

import pytest
import torch

from csbp.objectives import IGNORE_INDEX, Bd3Objective, MdlmObjective
from csbp.objectives.bd3 import same_position_masked_batch

MASK = 63


def _batch_with_unsupervised_mask_token() -> dict[str, torch.Tensor]:
    """A prompt that holds the mask token id but is not supervised (e.g. a chat template's token)."""
    input_ids = torch.tensor([[MASK, 5, 6, 7, 8, 9, 10, 11]])
    loss_mask = torch.tensor([[False, False, True, True, True, True, True, True]])
    return {"input_ids": input_ids, "loss_mask": loss_mask}


@pytest.mark.parametrize(
    "objective",
    [Bd3Objective(mask_token_id=MASK, block_size=4), MdlmObjective(mask_token_id=MASK)],
    ids=["bd3", "mdlm"],
)
def test_an_unsupervised_mask_token_in_the_data_is_accepted_and_never_scored(objective) -> None:  # noqa: ANN001
    # Only a *supervised* [M] has infinite loss under SUBS; one in the prompt only conditions.
    batch = _batch_with_unsupervised_mask_token()
    corrupted = objective.corrupt(batch, torch.Generator().manual_seed(0))
    assert int(corrupted.labels[0, 0]) == IGNORE_INDEX and float(corrupted.weights[0, 0]) == 0.0
    assert int(corrupted.clean_ids[0, 0]) == MASK
    supervised = dict(batch, loss_mask=torch.ones_like(batch["loss_mask"]))
    with pytest.raises(ValueError, match="mask token 63 at supervised positions"):
        objective.corrupt(supervised, torch.Generator().manual_seed(0))


def test_inverse_t_weights_refuse_a_zero_noise_level() -> None:
    # w = 1/t is infinite at t = 0: a zero level must be refused, not turned into an inf weight.
    input_ids = torch.arange(8).view(1, 8)
    loss_mask = torch.ones(1, 8, dtype=torch.bool)
    masked = torch.ones(1, 8, dtype=torch.bool)
    options = {"mask_token_id": MASK, "block_size": 4, "denominator": "supervised_tokens", "uses_clean_stream": True}
    levels = torch.tensor([[0.5, 0.0]], dtype=torch.float64)
    with pytest.raises(ValueError, match="every noise level > 0"):
        same_position_masked_batch(input_ids, loss_mask, torch.zeros_like(input_ids), levels, masked, loss_weight="inv_t", **options)
    unit = same_position_masked_batch(input_ids, loss_mask, torch.zeros_like(input_ids), levels, masked, loss_weight="unit", **options)
    assert unit.weights.tolist() == [[1.0] * 8]


def test_mdlm_refuses_eps_one() -> None:
    # eps is the floor of t in [eps, 1]: eps = 1 masks every token at every draw (no noise range).
    with pytest.raises(ValueError, match=r"eps=1.0 must lie in \[0, 1\)"):
        MdlmObjective(mask_token_id=MASK, eps=1.0)
    MdlmObjective(mask_token_id=MASK, eps=0.0, loss_weight="unit")
