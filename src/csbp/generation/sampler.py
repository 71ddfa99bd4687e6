"""Block-diffusion sampling: fill the continuation of a prompt block by block, most confident first.

Block grid. Blocks are aligned to absolute positions exactly as in training (block ``b`` covers
positions ``b*B .. b*B+B-1``). The prompt's whole blocks are prefilled as clean blocks. A partial
last prompt block is *not* padded: its prompt tokens sit, already unmasked, at the front of the
first generated block and the rest of that block starts as mask tokens (in training, unmasked
tokens of a noisy block are exactly such clean tokens). No pad token is ever shown to the model.

Per block at positions ``p .. p+B-1`` (``p`` a multiple of ``B``): the block starts as ``[M]`` on
every position still to generate. Each of ``steps_per_block`` denoising steps runs the block's rows,
bidirectional inside the block and seeing the whole clean prefix (through the KV cache, or by
recomputation), proposes a token for every still-masked position
(:func:`~csbp.generation.token_choice.propose_tokens`, mask logit excluded) and unmasks the most
confident ones, or the leftmost with ``unmask_order="left_to_right"``, or random ones with ``"random"``
(:func:`~csbp.generation.token_choice.choose_unmasked`). A finished block is run once
more as a clean block and joins the cache. With ``sub_block_size`` (Fast-dLLM v2's sub-blocks) only the
still-masked positions of the leftmost unfinished sub-block are candidates, each sub-block in its
share of the steps, while every forward still runs the whole block (later sub-blocks as ``[M]``).

Stopping. Generation stops at the first EOS (the completion is cut before it) or after
``max_new_tokens`` tokens; in the last block only the positions inside the budget are filled. A
block stops denoising as soon as an EOS is unmasked with every position before it filled (what
follows would be cut; Fast-dLLM v2's released ``generate`` stops there too), so the completion is
the same as filling the whole block, for fewer forwards.

Label alignment. ``token_shift=False`` (BD3-LM, MDLM): row ``i`` predicts position ``i``.
``token_shift=True`` (Fast-dLLM v2): position ``i`` is predicted from row ``i-1``, so a shifted model
needs a non-empty prompt. The first position of a block that starts empty (no carried prompt
tokens) is predicted from the clean row just before it, the last row of the completed previous
block (or of the prompt), which sees only the clean prefix: its proposal cannot change while the
block is denoised. So it is committed at once, before the block's first denoising step, from the
forward that committed the previous block, as Fast-dLLM v2's released samplers do (the next token
from the last logit of the finished block, block-level autoregression); every position of the
block is then denoised knowing it. These tokens are listed in ``GenerationResult.first_tokens``,
not in ``unmask_steps``. The proposal is the usual one (``propose_tokens``): greedy at temperature
0, as in the release, and sampled at a positive temperature, where the release takes the arg-max.

Batches. :func:`generate_batch` draws one completion per seed of the same prompt together: the
prompt's whole blocks are prefilled once and shared, and every denoising and commit forward runs
the samples still going as one batch (``[S, B]`` rows over per-sample KV caches). Each sample has its
own generator, consumed in the same order as when it is drawn alone, so it makes the same choices
(the same tokens, up to the rounding of a batched matmul: float32 on CPU gave identical samples). A
sample that ends at an EOS leaves the batch at its block's end; inside a block, samples that finish
early (threshold, EOS) wait for the others. :func:`generate` is a batch of one.

Usage::

    result = generate(model, prompt_ids, mask_token_id=tok.mask_token_id, eos_id=tok.eos_id,
                      config=GenerationConfig(max_new_tokens=64, block_size=16, steps_per_block=8))
    print(tok.decode(result.token_ids))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from csbp.generation.forward import BlockForward, CachedBlockForward, RecomputeBlockForward
from csbp.generation.token_choice import (
    THRESHOLD_ORDER_ERROR,
    UNMASK_ORDERS,
    check_sampling_options,
    choose_unmasked,
    propose_tokens,
)
from csbp.models.decoder import Decoder


@dataclass(frozen=True)
class GenerationConfig:
    """Sampling options.

    Attributes:
        max_new_tokens: most tokens to generate after the prompt.
        block_size: diffusion block size ``B`` (the one the model was trained with).
        steps_per_block: denoising steps per block, 1 to ``block_size`` (at most; a threshold may finish
            a block early).
        temperature: 0 for greedy, else the softmax temperature of the sampled proposals.
        top_k: keep only the ``k`` most likely tokens when sampling (None: all).
        top_p: nucleus mass kept when sampling (1: all).
        threshold: also unmask every proposal more confident than this (None: schedule only); needs
            ``unmask_order="confidence"``.
        seed: seed of the CPU generator that draws sampled tokens.
        token_shift: position ``i`` is predicted from row ``i-1`` (Fast-dLLM v2 models).
        use_cache: use the clean-prefix KV cache (False recomputes the prefix every step).
        window: the sliding window the model was trained with (``topology.window``), None: full.
        unmask_order: ``confidence`` (most confident positions first), ``left_to_right`` or ``random``
            (drawn from the seed's generator: the masked diffusion models' own reverse process).
        sub_block_size: Fast-dLLM v2's sub-blocks: a divisor ``S`` of ``block_size``; each block is
            filled one sub-block after the other, left to right, each in ``steps_per_block · S / B``
            steps (a whole number), while every forward still runs the whole block (None: one
            sub-block, the whole block).
    """

    max_new_tokens: int = 128
    block_size: int = 16
    steps_per_block: int = 16
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    threshold: float | None = None
    seed: int = 0
    token_shift: bool = False
    use_cache: bool = True
    window: int | None = None
    unmask_order: str = "confidence"
    sub_block_size: int | None = None

    def __post_init__(self) -> None:
        if self.unmask_order not in UNMASK_ORDERS:
            raise ValueError(f"unmask_order must be one of {UNMASK_ORDERS}, got {self.unmask_order!r}")
        if self.window is not None and (isinstance(self.window, bool) or self.window < 1):
            raise ValueError(f"window must be None or a positive integer, got {self.window!r}")
        for name in ("max_new_tokens", "block_size", "steps_per_block"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.steps_per_block > self.block_size:
            raise ValueError(
                f"steps_per_block {self.steps_per_block} exceeds block_size {self.block_size}: every step "
                f"unmasks at least one position (use 1 to {self.block_size})"
            )
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")
        check_sampling_options(self.temperature, self.top_k, self.top_p, self.threshold)
        if self.threshold is not None and self.unmask_order != "confidence":
            raise ValueError(THRESHOLD_ORDER_ERROR)
        sub = self.sub_block_size
        if sub is not None:
            if isinstance(sub, bool) or not isinstance(sub, int) or sub < 1 or self.block_size % sub:
                raise ValueError(f"sub_block_size must be a divisor of block_size {self.block_size}, got {sub!r}")
            if self.steps_per_block % (self.block_size // sub):
                raise ValueError(
                    f"steps_per_block {self.steps_per_block} does not split evenly over the "
                    f"{self.block_size // sub} sub-blocks of {sub} (use a multiple of {self.block_size // sub})"
                )


@dataclass
class GenerationResult:
    """What ``generate`` produced.

    Attributes:
        prompt_ids: the prompt tokens.
        token_ids: the completion (after the prompt; cut before the first EOS).
        stopped_at_eos: whether an EOS ended the completion.
        block_starts: absolute start position of every generated block (multiples of ``B``).
        unmask_steps: per denoising step, the ``(position, token)`` pairs unmasked in that step.
        first_tokens: ``token_shift`` only: the ``(position, token)`` of every block's first position
            committed from the clean row before the block, before its denoising steps.
        num_model_rows: rows fed to the model in total (prefill + denoising + commits).
    """

    prompt_ids: list[int]
    token_ids: list[int]
    stopped_at_eos: bool = False
    block_starts: list[int] = field(default_factory=list)
    unmask_steps: list[list[tuple[int, int]]] = field(default_factory=list)
    first_tokens: list[tuple[int, int]] = field(default_factory=list)
    num_model_rows: int = 0


def positions_used(prompt_len: int, max_new_tokens: int, block_size: int) -> int:
    """Positions a generation of up to ``max_new_tokens`` after ``prompt_len`` tokens runs rows at
    (``0 .. n-1``): the last block is run whole, so ``n`` is the block boundary at or after the last
    new token."""
    return -(-(prompt_len + max_new_tokens) // block_size) * block_size


def _forward_for(model: Decoder, config: GenerationConfig) -> BlockForward:
    if config.use_cache:
        return CachedBlockForward(model, config.block_size, config.window)
    return RecomputeBlockForward(model, config.block_size, config.window)


@torch.no_grad()
def generate(
    model: Decoder,
    prompt_ids: Sequence[int],
    *,
    mask_token_id: int,
    eos_id: int | Sequence[int] | None,
    config: GenerationConfig,
) -> GenerationResult:
    """Block-diffusion sampling of a continuation of ``prompt_ids`` (see the module docstring).

    ``eos_id``: the token id(s) that end the completion (the data's EOS, and a chat model's end of
    turn, as ``generation_config.json``'s ``eos_token_id`` list); None fills ``max_new_tokens``."""
    return generate_batch(
        model, prompt_ids, mask_token_id=mask_token_id, eos_id=eos_id, config=config, seeds=[config.seed]
    )[0]


@torch.no_grad()
def generate_batch(
    model: Decoder,
    prompt_ids: Sequence[int],
    *,
    mask_token_id: int,
    eos_id: int | Sequence[int] | None,
    config: GenerationConfig,
    seeds: Sequence[int],
) -> list[GenerationResult]:
    """One completion of ``prompt_ids`` per seed, drawn together: every model call runs the samples
    still going as one batch (the prompt is prefilled once for all). Sample ``i`` draws from its own
    generator seeded ``seeds[i]`` (``config.seed`` is not used) and makes the same choices as
    :func:`generate` with that seed: the same tokens, up to the rounding of a batched matmul.

    A sample that ends (EOS) leaves the batch at its block's end. Inside a block every sample still
    going is run at each step until the last of them has filled its block (a threshold or an EOS may
    finish one early); those extra rows are counted in its ``num_model_rows``."""
    if not seeds:
        raise ValueError("generate_batch needs at least one seed")
    bad_seeds = [s for s in seeds if isinstance(s, bool) or not isinstance(s, int) or s < 0]
    if bad_seeds:
        raise ValueError(f"seeds must be integers >= 0, got {bad_seeds[0]!r}")
    vocab_size = model.config.vocab_size
    if not 0 <= mask_token_id < vocab_size:
        raise ValueError(f"mask_token_id {mask_token_id} is outside the model vocabulary [0, {vocab_size})")
    stop_ids = () if eos_id is None else (int(eos_id),) if isinstance(eos_id, int) else tuple(int(t) for t in eos_id)
    for stop in stop_ids:
        if not 0 <= stop < vocab_size or stop == mask_token_id:
            raise ValueError(
                f"eos_id {stop} is the mask token or outside the model vocabulary [0, {vocab_size}): it could "
                "never be generated (pass the tokenizer's EOS id, or None to always fill max_new_tokens)"
            )
    prompt = [int(t) for t in prompt_ids]
    bad = [t for t in prompt if not 0 <= t < vocab_size or t == mask_token_id]
    if bad:
        raise ValueError(
            f"prompt token {bad[0]} is the mask token or outside the vocabulary [0, {vocab_size})"
        )
    if config.token_shift and not prompt:
        raise ValueError(
            "token_shift=True predicts each token from the one before it: give a non-empty prompt"
        )
    block_size = config.block_size
    forward = _forward_for(model, config)
    results = [GenerationResult(prompt_ids=list(prompt), token_ids=[]) for _ in seeds]
    samples = [_Sample(torch.Generator(device="cpu").manual_seed(seed), result) for seed, result in zip(seeds, results, strict=True)]

    start = len(prompt) // block_size * block_size
    forward.prefill(torch.tensor([prompt[:start]], dtype=torch.long).reshape(1, -1), samples=len(samples))
    carried = prompt[start:]  # prompt tokens inside the first generated block, already unmasked
    budget = config.max_new_tokens
    while budget > 0 and samples:
        block_ids_SB = torch.full((len(samples), block_size), mask_token_id, dtype=torch.long)
        block_ids_SB[:, : len(carried)] = torch.tensor(carried, dtype=torch.long)
        num_fill = min(budget, block_size - len(carried))
        to_fill_SB = torch.zeros(len(samples), block_size, dtype=torch.bool)
        to_fill_SB[:, len(carried) : len(carried) + num_fill] = True
        for sample in samples:
            sample.result.block_starts.append(start)
        if config.token_shift and not carried:
            _commit_first_tokens(model, forward, block_ids_SB, to_fill_SB, start, mask_token_id, config, samples)
        _denoise_block(
            model, forward, block_ids_SB, to_fill_SB, start, mask_token_id, stop_ids, len(carried), config, samples
        )
        going = []  # batch rows whose completion goes on past this block
        for row, sample in enumerate(samples):
            new_tokens = block_ids_SB[row, len(carried) : len(carried) + num_fill].tolist()
            ends = [offset for offset, token in enumerate(new_tokens) if token in stop_ids]
            if ends:  # every position before the first is filled
                sample.result.token_ids.extend(new_tokens[: ends[0]])
                sample.result.stopped_at_eos = True
                sample.result.num_model_rows = forward.rows_processed
            else:
                sample.result.token_ids.extend(new_tokens)
                going.append(row)
        budget -= num_fill
        if budget > 0 and going:
            if len(going) < len(samples):
                forward.keep(going)
            forward.commit(block_ids_SB[going], start)
            start += block_size
            carried = []
        samples = [samples[row] for row in going]
    for sample in samples:
        sample.result.num_model_rows = forward.rows_processed
    return results


@dataclass
class _Sample:
    """One completion being drawn: its own generator and result."""

    generator: torch.Generator
    result: GenerationResult


def _commit_first_tokens(
    model: Decoder,
    forward: BlockForward,
    block_ids_SB: Tensor,
    to_fill_SB: Tensor,
    start: int,
    mask_token_id: int,
    config: GenerationConfig,
    samples: list[_Sample],
) -> None:
    """Token shift: fill each block's first position (in place) from the clean row before the block."""
    logits_SV = model.logits(forward.clean_row_before(start))
    for row, sample in enumerate(samples):
        tokens_1, _ = _propose(logits_SV[row : row + 1], mask_token_id, config, sample.generator)
        block_ids_SB[row, 0] = tokens_1[0]
        to_fill_SB[row, 0] = False
        sample.result.first_tokens.append((start, int(tokens_1[0])))


def _eos_settled(block_ids_B: Tensor, to_fill_B: Tensor, stop_ids: tuple[int, ...], first_new: int) -> bool:
    """Whether a generated stop token (at offset ``>= first_new``: a carried prompt token is not one)
    is unmasked with no position before it still to fill: the completion ends there."""
    if not stop_ids:
        return False
    stops = torch.tensor(stop_ids, dtype=block_ids_B.dtype)
    eos_N = torch.nonzero(torch.isin(block_ids_B[first_new:], stops)).squeeze(-1)
    return eos_N.numel() > 0 and not bool(to_fill_B[: first_new + int(eos_N[0])].any())


def _denoise_block(
    model: Decoder,
    forward: BlockForward,
    block_ids_SB: Tensor,
    to_fill_SB: Tensor,
    start: int,
    mask_token_id: int,
    stop_ids: tuple[int, ...],
    first_new: int,
    config: GenerationConfig,
    samples: list[_Sample],
) -> None:
    """Unmask every ``to_fill`` position of ``block_ids`` in at most ``steps_per_block`` steps (in place):
    one sub-block after the other (``config.sub_block_size``), each in its share of the steps. A sample
    is done with a sub-block once its positions there are filled or an EOS ends its completion (module
    docstring); the step loop ends when every sample is."""
    block_size = config.block_size
    sub_block = config.sub_block_size or block_size
    steps_each = config.steps_per_block * sub_block // block_size
    offset_B = torch.arange(block_size)
    for first in range(0, block_size, sub_block):
        span_B = (offset_B >= first) & (offset_B < first + sub_block)
        for step in range(steps_each):
            masked = {  # batch row -> block offsets still masked in this sub-block
                row: torch.nonzero(to_fill_SB[row] & span_B).squeeze(-1)
                for row in range(len(samples))
                if not _eos_settled(block_ids_SB[row], to_fill_SB[row], stop_ids, first_new)
            }
            masked = {row: masked_R for row, masked_R in masked.items() if masked_R.numel() > 0}
            if not masked:
                break
            chosen = _denoise_step(
                model, forward, block_ids_SB, masked, start, mask_token_id, config, samples,
                remaining_steps=steps_each - step,
            )  # fmt: skip
            for row, (chosen_offsets, chosen_tokens) in chosen.items():
                block_ids_SB[row, chosen_offsets] = chosen_tokens
                to_fill_SB[row, chosen_offsets] = False
                samples[row].result.unmask_steps.append(
                    [(start + int(o), int(t)) for o, t in zip(chosen_offsets.tolist(), chosen_tokens.tolist(), strict=True)]
                )
    for row in range(len(samples)):
        if bool(to_fill_SB[row].any()) and not _eos_settled(block_ids_SB[row], to_fill_SB[row], stop_ids, first_new):
            raise RuntimeError("block still has masked positions after steps_per_block steps")


def _denoise_step(
    model: Decoder,
    forward: BlockForward,
    block_ids_SB: Tensor,
    masked: dict[int, Tensor],
    start: int,
    mask_token_id: int,
    config: GenerationConfig,
    samples: list[_Sample],
    *,
    remaining_steps: int,
) -> dict[int, tuple[Tensor, Tensor]]:
    """One denoising forward of the blocks: per batch row in ``masked``, the offsets among its masked
    ones to unmask now, and their tokens (one LM-head call over every row's masked positions)."""
    hidden_SBD, _ = forward.denoise(block_ids_SB, start)
    if config.token_shift:
        # Position j is predicted from row j-1. Offset 0 is never masked here: it holds a carried
        # prompt token or the token committed from the clean row before the block.
        assert all(int(masked_R[0]) > 0 for masked_R in masked.values()), "token shift: a block's first position was not committed"
    shift = 1 if config.token_shift else 0
    batch_rows = torch.cat([torch.full_like(masked_R, row) for row, masked_R in masked.items()])
    block_rows = torch.cat(list(masked.values())) - shift
    device = hidden_SBD.device
    logits_RV = model.logits(hidden_SBD[batch_rows.to(device), block_rows.to(device)])
    chosen: dict[int, tuple[Tensor, Tensor]] = {}
    first = 0
    for row, masked_R in masked.items():
        count = int(masked_R.numel())
        tokens_R, confidence_R = _propose(logits_RV[first : first + count], mask_token_id, config, samples[row].generator)
        first += count
        picked = choose_unmasked(
            confidence_R, remaining_steps=remaining_steps, threshold=config.threshold, order=config.unmask_order,
            generator=samples[row].generator,
        )
        chosen[row] = (masked_R[picked], tokens_R[picked])
    return chosen


def _propose(logits_RV: Tensor, mask_token_id: int, config: GenerationConfig, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """``propose_tokens`` with the run's sampling settings."""
    return propose_tokens(
        logits_RV,
        mask_token_id=mask_token_id,
        temperature=config.temperature,
        top_k=config.top_k,
        top_p=config.top_p,
        generator=generator,
    )
