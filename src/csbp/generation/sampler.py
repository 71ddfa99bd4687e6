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

Batches. :func:`generate_batch` draws one completion per (prompt, seed) pair together: each
sequence's prompt blocks are prefilled (once per distinct prompt) into one KV cache, and every
denoising and commit forward runs the sequences still going as one batch of ``[S, B]`` rows, each at
its own positions (its own block grid). Each sequence has its own generator, consumed in the same
order as when it is drawn alone, so it makes the same choices (the same tokens, up to the rounding
of a batched matmul: float32 on CPU gave identical samples; a block whose rows see nothing but ``[M]``,
equal in exact arithmetic, gives them all its first row's state, so their tie goes leftmost, not to the rounding). A sequence leaves the batch at the end
of its last block (an EOS, or its ``max_new_tokens``, which end sooner for a prompt whose last block
carries more tokens); inside a block, sequences that finish early (threshold, EOS) wait for the
others. The per-block steps are :mod:`csbp.generation.block_denoising`. :func:`generate` is a batch
of one.

Usage::

    result = generate(model, prompt_ids, mask_token_id=tok.mask_token_id, eos_id=tok.eos_id,
                      config=GenerationConfig(max_new_tokens=64, block_size=16, steps_per_block=8))
    print(tok.decode(result.token_ids))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from csbp.generation.block_denoising import SampleState, commit_first_tokens, denoise_block
from csbp.generation.forward import BlockForward, CachedBlockForward, RecomputeBlockForward
from csbp.generation.token_choice import THRESHOLD_ORDER_ERROR, UNMASK_ORDERS, check_sampling_options
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
        model, [prompt_ids], mask_token_id=mask_token_id, eos_id=eos_id, config=config, seeds=[config.seed]
    )[0]


@torch.no_grad()
def generate_batch(
    model: Decoder,
    prompts: Sequence[Sequence[int]],
    *,
    mask_token_id: int,
    eos_id: int | Sequence[int] | None,
    config: GenerationConfig,
    seeds: Sequence[int],
) -> list[GenerationResult]:
    """One completion of ``prompts[i]`` drawn with ``seeds[i]`` for every ``i``, drawn together (module
    docstring, "Batches"): ``config.seed`` is not used, and completion ``i`` makes the same choices as
    :func:`generate` of ``prompts[i]`` with seed ``seeds[i]``, up to the rounding of a batched matmul.
    Inside a block every sequence still going runs at each step until the last of them has filled
    its block (a threshold or an EOS may finish one early); those extra rows count in its
    ``num_model_rows``."""
    if not seeds or len(prompts) != len(seeds):
        raise ValueError(f"generate_batch needs one seed per prompt, at least one: got {len(prompts)} prompts, {len(seeds)} seeds")
    bad_seeds = [s for s in seeds if isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < 2**64]
    if bad_seeds:
        raise ValueError(f"seeds must be integers in [0, 2^64) (a CPU generator's seed), got {bad_seeds[0]!r}")
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
    block_size = config.block_size
    samples = [
        SampleState.start_with(prompt, seed, block_size, config.max_new_tokens)
        for prompt, seed in zip(_checked_prompts(prompts, vocab_size, mask_token_id, config.token_shift), seeds, strict=True)
    ]
    results = [sample.result for sample in samples]
    forward = _forward_for(model, config)
    forward.prefill([sample.result.prompt_ids[: sample.start] for sample in samples])
    while samples:
        block_ids_SB = torch.full((len(samples), block_size), mask_token_id, dtype=torch.long)
        to_fill_SB = torch.zeros(len(samples), block_size, dtype=torch.bool)
        for row, sample in enumerate(samples):
            carried = len(sample.carried)
            block_ids_SB[row, :carried] = torch.tensor(sample.carried, dtype=torch.long)
            to_fill_SB[row, carried : carried + sample.block_fill(block_size)] = True
            sample.result.block_starts.append(sample.start)
        first_token_rows = [row for row, sample in enumerate(samples) if config.token_shift and not sample.carried]
        if first_token_rows:
            commit_first_tokens(model, forward, block_ids_SB, to_fill_SB, first_token_rows, mask_token_id, config, samples)
        denoise_block(model, forward, block_ids_SB, to_fill_SB, mask_token_id, stop_ids, config, samples)
        going = [row for row, sample in enumerate(samples) if sample.finish_block(block_ids_SB[row], stop_ids, block_size)]
        for row, sample in enumerate(samples):
            if row not in going:
                sample.result.num_model_rows = forward.rows_processed[row]
        if going:
            if len(going) < len(samples):
                forward.keep(going)
            forward.commit(block_ids_SB[going], [samples[row].start for row in going])
            for row in going:
                samples[row].next_block(block_size)
        samples = [samples[row] for row in going]
    return results


def _checked_prompts(
    prompts: Sequence[Sequence[int]], vocab_size: int, mask_token_id: int, token_shift: bool
) -> list[list[int]]:
    """The prompts as int lists; a token outside the vocabulary or the mask token is refused, and an
    empty prompt under token shift (nothing to predict the first token from)."""
    checked = []
    for prompt_ids in prompts:
        prompt = [int(t) for t in prompt_ids]
        bad = [t for t in prompt if not 0 <= t < vocab_size or t == mask_token_id]
        if bad:
            raise ValueError(
                f"prompt token {bad[0]} is the mask token or outside the vocabulary [0, {vocab_size})"
            )
        if token_shift and not prompt:
            raise ValueError(
                "token_shift=True predicts each token from the one before it: give a non-empty prompt"
            )
        checked.append(prompt)
    return checked
