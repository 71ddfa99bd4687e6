"""Block-diffusion sampling against a model whose predictions are known in closed form.

``PositionEcho`` ignores its inputs: the row at position ``p`` predicts token ``p mod 8`` with one
clear winner (every other logit 0, the mask and the EOS ids included). So the token each position
receives tells which row predicted it: position ``i`` gets ``i mod 8`` without token shift and
``(i − 1) mod 8`` with it (objectives.md §1, label alignment). All confidences are equal, so the
confidence order resolves its ties to the leftmost position (``csbp.generation.token_choice``).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import Tensor

from csbp.generation import GenerationConfig, choose_unmasked, generate

VOCAB, MASK, EOS = 16, 15, 12


class PositionEcho:
    """A stand-in decoder: hidden state of a row = its position; logits favour ``position mod 8``."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(vocab_size=VOCAB, num_layers=1)
        self.embed_tokens = SimpleNamespace(weight=torch.zeros(1))

    def __call__(self, ids_1N: Tensor, positions_N: Tensor, attention: object) -> Tensor:
        return positions_N.to(torch.float64).view(1, -1, 1)

    def logits(self, hidden_RD: Tensor) -> Tensor:
        positions = hidden_RD[..., 0].long()
        return 10.0 * torch.nn.functional.one_hot(positions % 8, VOCAB).to(torch.float64)


def _generate(prompt: list[int], **options: object):
    config = GenerationConfig(**{"block_size": 4, "steps_per_block": 4, "max_new_tokens": 8, "use_cache": False, **options})
    return generate(PositionEcho(), prompt, mask_token_id=MASK, eos_id=EOS, config=config)  # type: ignore[arg-type]


@pytest.mark.parametrize("prompt_len", [4, 5, 6])
@pytest.mark.parametrize("token_shift", [False, True])
def test_each_position_is_predicted_from_its_own_row_or_the_row_before(prompt_len: int, token_shift: bool) -> None:
    result = _generate(list(range(prompt_len)), token_shift=token_shift)
    shift = 1 if token_shift else 0
    positions = range(prompt_len, prompt_len + 8)
    assert result.token_ids == [(p - shift) % 8 for p in positions]


def test_an_eos_in_the_prompt_does_not_end_the_completion() -> None:
    # The prompt's last partial block carries an EOS (a chat turn's end); it conditions, it is not
    # generated, so the block is still filled (was: denoising stopped at once, leaving [M] tokens).
    result = _generate([0, 1, 2, 3, EOS])
    assert result.token_ids == [5, 6, 7, 0, 1, 2, 3, 4]
    assert not result.stopped_at_eos and MASK not in result.token_ids


def test_a_block_stops_denoising_once_a_generated_eos_ends_the_completion() -> None:
    # Position 5 receives 5 = eos here; positions 4 and 5 are unmasked first (ties go left), so after
    # the second step the completion [4] is settled and no third step runs.
    config = GenerationConfig(block_size=4, steps_per_block=4, max_new_tokens=8, use_cache=False)
    result = generate(PositionEcho(), [0, 1, 2, 3], mask_token_id=MASK, eos_id=5, config=config)  # type: ignore[arg-type]
    assert result.token_ids == [4] and result.stopped_at_eos
    assert result.unmask_steps == [[(4, 4)], [(5, 5)]]


def test_confidence_ties_go_to_the_leftmost_positions_in_a_long_block() -> None:
    # 64 equal confidences (a greedy block of 64, or T -> 0+): the 4 unmasked are the leftmost 4.
    assert choose_unmasked(torch.ones(64), remaining_steps=16).tolist() == [0, 1, 2, 3]
    confidence = torch.ones(64)
    confidence[40] = 2.0
    assert sorted(choose_unmasked(confidence, remaining_steps=16).tolist()) == [0, 1, 2, 40]
