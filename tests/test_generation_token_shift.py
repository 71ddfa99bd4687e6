"""Block-diffusion sampling against Fast-dLLM v2's released samplers: the block's first token under
token shift, and stopping inside a block at an EOS.

Released behaviour (NVlabs/Fast-dLLM ``v2/generation_functions.py`` ``batch_sample``; the model's
``generate``): once a block is complete it is run as a clean block into the cache and the arg-max of
its *last* logit becomes the next block's first token at once (block-level autoregression); the
block's other positions are then denoised knowing it. That logit comes from a clean row that sees
only the clean prefix, so waiting cannot change it; ranking it with the masked positions (what csbp
did before) only hid it from them. ``generate`` also stops a block once an EOS is unmasked with
everything before it filled.

The tiny random decoder of ``tests/test_generation.py`` (float64) is the model; the oracle for a first
token is a plain forward of the clean sequence under the clean block-causal mask.
Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_generation_token_shift.py -q``
"""

from __future__ import annotations

import pytest
import torch

from csbp.attention.layouts import bd3_rows
from csbp.attention.rows import allow_matrix
from csbp.models.attention_fns import DenseMaskAttention
from csbp.models.decoder import Decoder
from test_generation import BLOCK, MASK, run, tiny_model


@pytest.fixture(scope="module")
def model() -> Decoder:
    return tiny_model(seed=3)


def clean_next_token(model: Decoder, ids: list[int]) -> int:
    """Arg-max (mask excluded) of the last row of a clean block-causal forward over ``ids``."""
    rows = bd3_rows(torch.arange(0), torch.arange(len(ids)), block_size=BLOCK)
    with torch.no_grad():
        hidden_1ND = model(torch.tensor([ids]), rows.pos, DenseMaskAttention(allow_matrix(rows, rows)))
        logits_V = model.logits(hidden_1ND[0, -1]).clone()
    logits_V[MASK] = float("-inf")
    return int(logits_V.argmax())


@pytest.mark.parametrize("prompt_len", [4, 8, 3, 11])
def test_a_block_first_token_is_committed_from_the_clean_row_before_any_denoising(
    model: Decoder, prompt_len: int
) -> None:
    prompt = [(7 * i + 5) % MASK for i in range(prompt_len)]
    for options in ({"temperature": 0.0}, {"temperature": 0.0, "threshold": 0.3}, {"temperature": 1.0, "seed": 4}):
        result = run(model, prompt, token_shift=True, steps_per_block=4, max_new_tokens=18, **options)
        empty_starts = [start for start in result.block_starts if start >= prompt_len]  # no carried prompt
        assert [position for position, _ in result.first_tokens] == empty_starts
        denoised = [position for step in result.unmask_steps for position, _ in step]
        # no denoising step ever decides a block's first position (the old sampler ranked it, often last)
        assert all(position % BLOCK for position in denoised), denoised
        assert sorted(denoised + empty_starts) == list(range(prompt_len, prompt_len + 18))
        if options["temperature"] == 0.0:
            sequence = prompt + result.token_ids
            for position, token in result.first_tokens:
                assert token == sequence[position] == clean_next_token(model, sequence[:position])


def test_cached_and_recomputed_first_tokens_agree_with_a_window(model: Decoder) -> None:
    for use_cache in (True, False):
        result = run(model, [2] * 8, token_shift=True, window=3, use_cache=use_cache, max_new_tokens=12)
        assert [position for position, _ in result.first_tokens] == [8, 12, 16]
    assert run(model, [2] * 8, token_shift=True, window=3, use_cache=False, max_new_tokens=12).token_ids == (
        result.token_ids
    )


def test_an_eos_committed_from_the_clean_row_ends_generation_without_denoising_its_block(model: Decoder) -> None:
    free = run(model, [6] * 8, token_shift=True, steps_per_block=4, max_new_tokens=24)
    sequence = [6] * 8 + free.token_ids
    candidates = [(p, t) for p, t in free.first_tokens[1:] if t not in sequence[8:p]]
    assert candidates, free.first_tokens  # the fixture has a first token not generated before it
    position, eos = candidates[0]
    stopped = run(model, [6] * 8, eos_id=eos, token_shift=True, steps_per_block=4, max_new_tokens=24)
    assert stopped.stopped_at_eos and stopped.token_ids == free.token_ids[: position - 8]
    assert stopped.block_starts[-1] == position and stopped.first_tokens[-1] == (position, eos)
    assert all(p < position for step in stopped.unmask_steps for p, _ in step)  # its block was not denoised


def first_settled_eos(result, prompt_len: int) -> tuple[int, int, int] | None:
    """``(step index, position, token)`` of the first unmasked token that would end the completion
    as an EOS while its block still had steps to run: every position before it filled, and the
    token not generated before it."""
    filled = {position for position, _ in result.first_tokens}
    sequence = result.prompt_ids + result.token_ids
    for index, step in enumerate(result.unmask_steps):
        filled |= {position for position, _ in step}
        block = step[0][0] // BLOCK
        if not any(later[0][0] // BLOCK == block for later in result.unmask_steps[index + 1 :]):
            continue
        for position, token in step:
            before = set(range(max(block * BLOCK, prompt_len), position))
            if before <= filled and token not in sequence[prompt_len:position]:
                return index, position, token
    return None


@pytest.mark.parametrize("token_shift", [False, True])
def test_a_block_stops_denoising_once_an_eos_ends_the_completion(model: Decoder, token_shift: bool) -> None:
    """Stopping early changes nothing before the EOS, only skips the steps that would fill what is cut."""
    options = {"token_shift": token_shift, "steps_per_block": 4, "max_new_tokens": 24}
    checked = 0
    for prompt_len in (5, 8, 10, 13):
        prompt = [(5 * i + 9) % MASK for i in range(prompt_len)]
        free = run(model, prompt, **options)
        chosen = first_settled_eos(free, prompt_len)
        if chosen is None:
            continue
        index, position, eos = chosen
        stopped = run(model, prompt, eos_id=eos, **options)
        assert stopped.stopped_at_eos and stopped.token_ids == free.token_ids[: position - prompt_len]
        assert stopped.unmask_steps == free.unmask_steps[: index + 1]  # the rest of the block was skipped
        assert stopped.num_model_rows < free.num_model_rows
        checked += 1
    assert checked >= 2


def test_an_eos_in_the_carried_prompt_does_not_end_generation(model: Decoder) -> None:
    prompt = [1, 2, 3, 4, 5, 7]  # 7 is carried into the first generated block
    for token_shift in (False, True):
        free = run(model, prompt, token_shift=token_shift, max_new_tokens=6)
        with_eos = run(model, prompt, eos_id=7, token_shift=token_shift, max_new_tokens=6)
        cut = free.token_ids.index(7) if 7 in free.token_ids else len(free.token_ids)
        assert with_eos.token_ids == free.token_ids[:cut] and MASK not in with_eos.token_ids
