"""One block of block-diffusion sampling for a batch of sequences: the per-sequence state, the
token-shift first token, the denoising steps and their token choices.

:func:`csbp.generation.sampler.generate_batch` calls these once per block for every sequence still
going (see its module docstring for the rules). Every sequence draws from its own generator, in
the same order as when it is sampled alone: its first token (token shift), then per step its
proposals and, for the random order, its unmasked positions. A sequence's choices depend only on
its own rows, so batching changes none of them (up to the rounding of a batched matmul).

Shape legend: ``S`` sequences in the batch, ``B`` block size, ``R`` masked rows being decided,
``V`` vocabulary, ``D`` hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from csbp.generation.token_choice import choose_unmasked, draw_uniforms, propose_tokens

if TYPE_CHECKING:
    from csbp.generation.forward import BlockForward
    from csbp.generation.sampler import GenerationConfig, GenerationResult
    from csbp.models.decoder import Decoder


@dataclass
class SampleState:
    """One completion being drawn.

    Attributes:
        generator: its own CPU generator (seeded with its seed).
        result: what it has produced so far (``GenerationResult``).
        start: absolute start of its current block (a multiple of ``B``).
        carried: prompt tokens at the front of its current block (the first block only).
        budget: tokens it may still generate.
    """

    generator: torch.Generator
    result: GenerationResult
    start: int
    carried: list[int]
    budget: int

    @classmethod
    def start_with(cls, prompt: list[int], seed: int, block_size: int, max_new_tokens: int) -> SampleState:
        from csbp.generation.sampler import GenerationResult

        start = len(prompt) // block_size * block_size
        return cls(
            torch.Generator(device="cpu").manual_seed(seed),
            GenerationResult(prompt_ids=prompt, token_ids=[]),
            start,
            prompt[start:],
            max_new_tokens,
        )

    def block_fill(self, block_size: int) -> int:
        """Positions of the current block to generate: after the carried tokens, within the budget."""
        return min(self.budget, block_size - len(self.carried))

    def finish_block(self, block_ids_B: Tensor, stop_ids: tuple[int, ...], block_size: int) -> bool:
        """Take the current block's new tokens into the completion (cut before a stop token); whether
        the completion goes on past this block."""
        num_fill = self.block_fill(block_size)
        new_tokens = block_ids_B[len(self.carried) : len(self.carried) + num_fill].tolist()
        ends = [offset for offset, token in enumerate(new_tokens) if token in stop_ids]
        if ends:  # every position before the first is filled
            self.result.token_ids.extend(new_tokens[: ends[0]])
            self.result.stopped_at_eos = True
            return False
        self.result.token_ids.extend(new_tokens)
        self.budget -= num_fill
        return self.budget > 0

    def next_block(self, block_size: int) -> None:
        self.start += block_size
        self.carried = []


def commit_first_tokens(
    model: Decoder,
    forward: BlockForward,
    block_ids_SB: Tensor,
    to_fill_SB: Tensor,
    rows: list[int],
    mask_token_id: int,
    config: GenerationConfig,
    samples: list[SampleState],
) -> None:
    """Token shift: fill the first position of each listed sequence's block (in place) from the clean
    row before the block."""
    logits_RV = model.logits(forward.clean_row_before(rows))
    tokens_R, _ = propose(logits_RV, mask_token_id, config, [(samples[row].generator, 1) for row in rows])
    for row, token in zip(rows, tokens_R.tolist(), strict=True):
        block_ids_SB[row, 0] = token
        to_fill_SB[row, 0] = False
        samples[row].result.first_tokens.append((samples[row].start, token))


def eos_settled(block_ids_B: Tensor, to_fill_B: Tensor, stop_ids: tuple[int, ...], first_new: int) -> bool:
    """Whether a generated stop token (at offset ``>= first_new``: a carried prompt token is not one)
    is unmasked with no position before it still to fill: the completion ends there."""
    if not stop_ids:
        return False
    stops = torch.tensor(stop_ids, dtype=block_ids_B.dtype)
    eos_N = torch.nonzero(torch.isin(block_ids_B[first_new:], stops)).squeeze(-1)
    return eos_N.numel() > 0 and not bool(to_fill_B[: first_new + int(eos_N[0])].any())


def sees_only_masks(block_ids_B: Tensor, start: int, mask_token_id: int, window: int | None) -> bool:
    """Whether every row of a block sees nothing but ``[M]``: the block is all masks and no clean row is in
    sight (an empty prefix, or a window of 1). Its rows are then equal in exact arithmetic (equal inputs,
    attention over equal values), so their confidences tie; computed, they differ by rounding, which a
    batch's shapes change, so the sampler gives every row the first row's hidden state and the tie goes
    to the leftmost positions, alone and in a batch alike."""
    return (start == 0 or window == 1) and bool((block_ids_B == mask_token_id).all())


def denoise_block(
    model: Decoder,
    forward: BlockForward,
    block_ids_SB: Tensor,
    to_fill_SB: Tensor,
    mask_token_id: int,
    stop_ids: tuple[int, ...],
    config: GenerationConfig,
    samples: list[SampleState],
) -> None:
    """Unmask every ``to_fill`` position of ``block_ids`` in at most ``steps_per_block`` steps (in place):
    one sub-block after the other (``config.sub_block_size``), each in its share of the steps. A
    sequence is done with a sub-block once its positions there are filled or an EOS ends its
    completion; the step loop ends when every sequence is."""
    block_size = config.block_size
    sub_block = config.sub_block_size or block_size
    steps_each = config.steps_per_block * sub_block // block_size
    offset_B = torch.arange(block_size)
    first_new = [len(sample.carried) for sample in samples]
    starts = [sample.start for sample in samples]
    for first in range(0, block_size, sub_block):
        span_B = (offset_B >= first) & (offset_B < first + sub_block)
        for step in range(steps_each):
            masked = {  # batch row -> block offsets still masked in this sub-block
                row: torch.nonzero(to_fill_SB[row] & span_B).squeeze(-1)
                for row in range(len(samples))
                if not eos_settled(block_ids_SB[row], to_fill_SB[row], stop_ids, first_new[row])
            }
            masked = {row: masked_R for row, masked_R in masked.items() if masked_R.numel() > 0}
            if not masked:
                break
            hidden_SBD = forward.denoise(block_ids_SB, starts)
            for row in masked:
                if sees_only_masks(block_ids_SB[row], starts[row], mask_token_id, config.window):
                    hidden_SBD[row] = hidden_SBD[row, :1].clone()  # equal in exact arithmetic: equal here
            chosen = denoise_step(
                model, hidden_SBD, masked, mask_token_id, config, samples, remaining_steps=steps_each - step
            )
            for row, (chosen_offsets, chosen_tokens) in chosen.items():
                block_ids_SB[row, chosen_offsets] = chosen_tokens
                to_fill_SB[row, chosen_offsets] = False
                samples[row].result.unmask_steps.append(
                    [(starts[row] + int(o), int(t)) for o, t in zip(chosen_offsets.tolist(), chosen_tokens.tolist(), strict=True)]
                )
    for row in range(len(samples)):
        if bool(to_fill_SB[row].any()) and not eos_settled(block_ids_SB[row], to_fill_SB[row], stop_ids, first_new[row]):
            raise RuntimeError("block still has masked positions after steps_per_block steps")


def denoise_step(
    model: Decoder,
    hidden_SBD: Tensor,
    masked: dict[int, Tensor],
    mask_token_id: int,
    config: GenerationConfig,
    samples: list[SampleState],
    *,
    remaining_steps: int,
) -> dict[int, tuple[Tensor, Tensor]]:
    """The choices of one denoising forward: per batch row in ``masked``, the offsets among its masked
    ones to unmask now, and their tokens (one LM-head call over every row's masked positions)."""
    if config.token_shift:
        # Position j is predicted from row j-1. Offset 0 is never masked here: it holds a carried
        # prompt token or the token committed from the clean row before the block.
        assert all(int(masked_R[0]) > 0 for masked_R in masked.values()), "token shift: a block's first position was not committed"
    shift = 1 if config.token_shift else 0
    batch_rows = torch.cat([torch.full_like(masked_R, row) for row, masked_R in masked.items()])
    block_rows = torch.cat(list(masked.values())) - shift
    device = hidden_SBD.device
    logits_RV = model.logits(hidden_SBD[batch_rows.to(device), block_rows.to(device)])
    draws = [(samples[row].generator, int(masked_R.numel())) for row, masked_R in masked.items()]
    all_tokens_R, all_confidence_R = propose(logits_RV, mask_token_id, config, draws)
    chosen: dict[int, tuple[Tensor, Tensor]] = {}
    first = 0
    for row, masked_R in masked.items():
        count = int(masked_R.numel())
        tokens_R, confidence_R = all_tokens_R[first : first + count], all_confidence_R[first : first + count]
        first += count
        picked = choose_unmasked(
            confidence_R, remaining_steps=remaining_steps, threshold=config.threshold, order=config.unmask_order,
            generator=samples[row].generator,
        )
        chosen[row] = (masked_R[picked], tokens_R[picked])
    return chosen


def propose(
    logits_RV: Tensor, mask_token_id: int, config: GenerationConfig, draws: list[tuple[torch.Generator, int]]
) -> tuple[Tensor, Tensor]:
    """``propose_tokens`` with the run's sampling settings over every sequence's rows at once (one call on
    the logits' device); ``draws`` lists, in row order, each sequence's generator and its number of rows.
    At a positive temperature every sequence draws its rows' uniforms from its own generator first, in
    the order it draws them alone (its proposals before its random unmasked positions)."""
    uniforms_R = None
    if config.temperature > 0.0:
        uniforms_R = torch.cat([draw_uniforms(count, generator) for generator, count in draws])
    return propose_tokens(
        logits_RV,
        mask_token_id=mask_token_id,
        temperature=config.temperature,
        top_k=config.top_k,
        top_p=config.top_p,
        uniforms_R=uniforms_R,
    )
