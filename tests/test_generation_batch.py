"""Drawing several samples of one prompt as a batch (``csbp.generation.generate_batch``).

The oracle is ``generate`` run once per seed: each sample of a batch must make the same choices (tokens,
unmask steps, first tokens, stops) as when it is drawn alone, under every sampling option, with the
KV cache and without it, and when samples end at an EOS in different blocks (they then leave the batch
and the others go on), and in random batches of random options and prompts (a differential check).
The tiny random decoder of ``tests/test_generation.py`` (float64) is the model.
Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_generation_batch.py -q``
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from csbp.generation import (
    CachedBlockForward,
    CachedPrefixAttention,
    GenerationConfig,
    GenerationResult,
    PrefixKVCache,
    RecomputeBlockForward,
    generate,
    generate_batch,
)
from csbp.models.decoder import Decoder
from test_generation import BLOCK, MASK, tiny_model

SEEDS = [0, 1, 2, 3, 4, 5]

OPTIONS: dict[str, dict[str, object]] = {
    "top_k": {"temperature": 1.0, "top_k": 20},
    "top_p": {"temperature": 0.8, "top_p": 0.9},
    "threshold": {"temperature": 1.0, "threshold": 0.2},
    "random_order": {"temperature": 1.0, "unmask_order": "random"},
    "left_to_right": {"temperature": 1.0, "unmask_order": "left_to_right"},
    "sub_blocks": {"temperature": 1.0, "sub_block_size": 2, "steps_per_block": 4},
    "token_shift": {"temperature": 1.0, "token_shift": True},
    "window": {"temperature": 1.0, "window": 3},
    "no_cache": {"temperature": 1.0, "use_cache": False},
    "no_cache_token_shift": {"temperature": 1.0, "use_cache": False, "token_shift": True, "threshold": 0.3},
}


@pytest.fixture(scope="module")
def model() -> Decoder:
    return tiny_model(seed=1)


def config_of(**options: object) -> GenerationConfig:
    return GenerationConfig(**{"block_size": BLOCK, "steps_per_block": 3, "max_new_tokens": 21, **options})  # type: ignore[arg-type]


def singles(model: Decoder, prompt: list[int], config: GenerationConfig, eos_id: int | None) -> list[GenerationResult]:
    return [
        generate(model, prompt, mask_token_id=MASK, eos_id=eos_id, config=replace(config, seed=seed)) for seed in SEEDS
    ]


def choices(result: GenerationResult) -> tuple[object, ...]:
    return (result.token_ids, result.stopped_at_eos, result.block_starts, result.unmask_steps, result.first_tokens)


def eos_ending_in_different_blocks(results: list[GenerationResult], prompt_len: int) -> int | None:
    """A token whose first occurrence ends the samples in at least two different blocks, or ends some
    and not others (so that an EOS makes samples leave the batch at different times)."""
    for token in range(MASK):
        ends = {
            (prompt_len + r.token_ids.index(token)) // BLOCK if token in r.token_ids else None for r in results
        }
        if len(ends) >= 3 or (len(ends) == 2 and None in ends):
            return token
    return None


@pytest.mark.parametrize("prompt_len", [3, 8])
@pytest.mark.parametrize("name", list(OPTIONS))
def test_each_sample_of_a_batch_makes_the_choices_it_makes_alone(model: Decoder, name: str, prompt_len: int) -> None:
    prompt = [(7 * i + 5) % MASK for i in range(prompt_len)]
    config = config_of(**OPTIONS[name])
    free = singles(model, prompt, config, eos_id=None)
    eos = eos_ending_in_different_blocks(free, prompt_len)
    assert eos is not None, "no token ends the samples in different blocks: pick other seeds"
    for eos_id in (None, eos):
        alone = free if eos_id is None else singles(model, prompt, config, eos_id)
        batched = generate_batch(model, [prompt] * len(SEEDS), mask_token_id=MASK, eos_id=eos_id, config=config, seeds=SEEDS)
        assert [choices(r) for r in batched] == [choices(r) for r in alone]
        # a sample in a batch runs at least the rows it runs alone (it waits for the others in a block)
        assert all(b.num_model_rows >= a.num_model_rows for a, b in zip(alone, batched, strict=True))
    lengths = {len(r.token_ids) for r in alone}
    assert len(lengths) >= 2 and any(r.stopped_at_eos for r in alone)  # samples left the batch at different times


#: prompts of every alignment to the block grid of 4: inside the first block, whole blocks, a partial
#: last block, one shared by two samples; the empty prompt only without token shift
PROMPTS = [[5, 9, 2], list(range(1, 9)), list(range(3, 14)), [7], list(range(1, 9))]


@pytest.mark.parametrize("name", list(OPTIONS))
def test_different_prompts_in_one_batch_make_the_choices_they_make_alone(model: Decoder, name: str) -> None:
    """Each sequence runs at its own positions over its own prefix (padded cache slots it never sees)."""
    config = config_of(**OPTIONS[name])
    prompts = PROMPTS if config.token_shift else [*PROMPTS, []]
    seeds = list(range(10, 10 + len(prompts)))
    for eos_id in (None, 11, 30):
        alone = [
            generate(model, prompt, mask_token_id=MASK, eos_id=eos_id, config=replace(config, seed=seed))
            for prompt, seed in zip(prompts, seeds, strict=True)
        ]
        batched = generate_batch(model, prompts, mask_token_id=MASK, eos_id=eos_id, config=config, seeds=seeds)
        assert [choices(r) for r in batched] == [choices(r) for r in alone]
        assert [r.prompt_ids for r in batched] == prompts


def test_a_batch_of_one_is_generate(model: Decoder) -> None:
    prompt = [3, 9, 27, 17, 51]
    config = config_of(temperature=1.0, threshold=0.2, seed=7)
    alone = generate(model, prompt, mask_token_id=MASK, eos_id=None, config=config)
    (batched,) = generate_batch(model, [prompt], mask_token_id=MASK, eos_id=None, config=config, seeds=[7])
    assert choices(batched) == choices(alone) and batched.num_model_rows == alone.num_model_rows


def test_without_early_stops_each_sample_runs_the_rows_it_runs_alone(model: Decoder) -> None:
    """The prompt is prefilled once for the whole batch, and a sample's rows are its share."""
    prompt = list(range(1, 10))
    config = config_of(temperature=1.0)
    alone = singles(model, prompt, config, eos_id=None)
    batched = generate_batch(model, [prompt] * len(SEEDS), mask_token_id=MASK, eos_id=None, config=config, seeds=SEEDS)
    assert [r.num_model_rows for r in batched] == [r.num_model_rows for r in alone]


@pytest.mark.parametrize("forward_class", [CachedBlockForward, RecomputeBlockForward])
def test_dropping_sequences_keeps_the_others_prefixes(model: Decoder, forward_class: type) -> None:
    """``keep`` leaves each remaining sequence's denoising rows as they were (its own clean prefix)."""
    forward = forward_class(model, BLOCK)
    forward.prefill([[5, 6, 7, 8], [], [5, 6, 7, 8, 1, 2, 3, 4]])
    forward.commit(torch.tensor([[1, 2, 3, 4], [9, 10, 11, 12], [13, 14, 15, 16]]), [4, 0, 8])
    noisy_SB = torch.tensor([[MASK, 2, MASK, 4], [MASK, 20, MASK, 21], [MASK, MASK, 30, 31]])
    with torch.no_grad():
        before_SBD = forward.denoise(noisy_SB, [8, 4, 12])
        alone = forward_class(model, BLOCK)
        alone.prefill([[5, 6, 7, 8, 1, 2, 3, 4, 13, 14, 15, 16]])
        torch.testing.assert_close(alone.denoise(noisy_SB[2:], [12]), before_SBD[2:], rtol=0, atol=1e-12)
        clean_before_SD = forward.clean_row_before([0, 1, 2])
        forward.keep([2, 0])
        after_SBD = forward.denoise(noisy_SB[[2, 0]], [12, 8])
        clean_after_SD = forward.clean_row_before([0, 1])
    torch.testing.assert_close(after_SBD, before_SBD[[2, 0]], rtol=0, atol=1e-12)
    torch.testing.assert_close(clean_after_SD, clean_before_SD[[2, 0]], rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match=r"must be a \[2, N\]"):
        forward.denoise(noisy_SB, [12, 8, 4])
    with pytest.raises(RuntimeError, match="starts at 8"):
        forward.denoise(noisy_SB[:2], [8, 8])
    for bad in ([], [0, 0], [2]):
        with pytest.raises(ValueError, match="distinct sequence indices"):
            forward.keep(bad)


def test_bad_seed_lists_are_refused(model: Decoder) -> None:
    for prompts, seeds, match in (([], [], "at least one"), ([[1, 2]] * 2, [0, -1], r"seeds must be integers in \[0, 2\^64\)"),
                                  ([[1, 2]], [2**64], r"got 18446744073709551616"),
                                  ([[1, 2]], [0, 1], "one seed per prompt")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            generate_batch(model, prompts, mask_token_id=MASK, eos_id=None, config=config_of(), seeds=seeds)


def test_per_sequence_positions_follow_the_cache_s_device() -> None:
    """``positions [S, N]`` on another device than the cache (the CPU, a cache on the model's GPU) build the
    mask on the cache's device, as ``[N]`` positions do (they raised 'not on the expected device')."""
    cache = PrefixKVCache(2, sequences=2, device="meta")  # a device other than the positions'
    for positions in (torch.tensor([[4, 5], [8, 9]]), torch.tensor([4, 5])):
        for append in (False, True):
            attention = CachedPrefixAttention(cache, positions, block_size=4, append=append, window=3)
            assert attention.allow_SNK.device.type == "meta" and tuple(attention.allow_SNK.shape) == (2, 2, 2)


def random_case(rng: random.Random) -> tuple[GenerationConfig, list[list[int]], list[int]]:
    """Random options, prompts (some shared, empty ones without token shift) and seeds."""
    block = rng.choice([1, 2, 3, 4, 6])
    sub = rng.choice([None, None, *[d for d in range(1, block + 1) if block % d == 0]])
    sub_blocks = block // (sub or block)
    order = rng.choice(["confidence", "confidence", "left_to_right", "random"])
    temperature = rng.choice([0.0, 0.7, 1.0, 2.0])
    token_shift = rng.random() < 0.4
    window = rng.choice([None, None, 1, 2, 3, block, block + 1, 2 * block + 1])
    config = GenerationConfig(
        max_new_tokens=rng.choice([1, 2, block, block + 1, 7, 13]),
        block_size=block,
        steps_per_block=rng.choice([s for s in range(1, block + 1) if s % sub_blocks == 0]),
        temperature=temperature,
        top_k=rng.choice([None, 1, 3, 20]) if temperature else None,
        top_p=rng.choice([1.0, 0.5, 0.9]) if temperature else 1.0,
        threshold=rng.choice([None, 0.1, 0.3, 0.9]) if order == "confidence" else None,
        token_shift=token_shift,
        window=window,
        unmask_order=order,
        sub_block_size=sub,
    )
    lengths = [rng.choice([1, max(block - 1, 1), block, block + 1, 2 * block + rng.randrange(block), rng.randrange(1, 14)])
               for _ in range(rng.choice([1, 2, 3]))]  # fmt: skip
    lengths += [] if token_shift or rng.random() < 0.5 else [0]
    prompts = [[rng.randrange(MASK) for _ in range(n)] for n in lengths for _ in range(rng.choice([1, 2]))]
    rng.shuffle(prompts)
    return config, prompts, [rng.randrange(1000) for _ in prompts]


@pytest.mark.parametrize("first", [0, 20])
def test_random_batches_make_the_choices_each_sequence_makes_alone(model: Decoder, first: int) -> None:
    """A randomized differential check (fixed seeds): random options, block sizes (1 included), windows
    smaller and larger than the block, prompts of every alignment (empty ones too) in one batch, EOS ids drawn among the
    tokens the batch generates (so sequences end in different blocks); the batch with the cache and
    without it, and each sequence alone, must make the same choices."""
    for case in range(first, first + 20):
        rng = random.Random(case)
        config, prompts, seeds = random_case(rng)
        free = generate_batch(model, prompts, mask_token_id=MASK, eos_id=None, config=config, seeds=seeds)
        generated = [t for r in free for t in r.token_ids]
        eos_id = rng.choice([None, rng.choice(generated), [rng.choice(generated), rng.choice(generated)]])
        batched = generate_batch(model, prompts, mask_token_id=MASK, eos_id=eos_id, config=config, seeds=seeds)
        recomputed = generate_batch(
            model, prompts, mask_token_id=MASK, eos_id=eos_id, config=replace(config, use_cache=False), seeds=seeds
        )
        alone = [
            generate(model, prompt, mask_token_id=MASK, eos_id=eos_id, config=replace(config, seed=seed))
            for prompt, seed in zip(prompts, seeds, strict=True)
        ]
        expected = [choices(r) for r in alone]
        assert [choices(r) for r in batched] == expected, (case, config, prompts, seeds, eos_id)
        assert [choices(r) for r in recomputed] == expected, (case, config, prompts, seeds, eos_id)


def test_blocks_that_see_only_masks_tie_to_the_left_alone_and_in_a_batch(model: Decoder) -> None:
    """An empty prompt's first block (or any block under a window of 1) sees nothing but ``[M]``: its rows
    are equal in exact arithmetic, so the first step unmasks the leftmost positions, whatever the batch
    (rounding decided, and a batch of empty prompts drew other samples than one at a time in 1 case of 6)."""
    for window, others in ((None, []), (None, [[5, 6, 7, 8, 9], [1, 2]]), (1, [[5, 6, 7, 8, 9], [1, 2]])):
        prompts = [[]] * 4 + others
        for block, steps, temperature in ((4, 2, 0.0), (8, 4, 1.0), (8, 1, 0.0), (2, 1, 1.0)):
            config = GenerationConfig(max_new_tokens=2 * block, block_size=block, steps_per_block=steps,
                                      temperature=temperature, window=window)  # fmt: skip
            seeds = list(range(len(prompts)))
            batched = generate_batch(model, prompts, mask_token_id=MASK, eos_id=None, config=config, seeds=seeds)
            for prompt, seed, result in zip(prompts, seeds, batched, strict=True):
                for use_cache in (True, False):
                    alone = generate(model, prompt, mask_token_id=MASK, eos_id=None,
                                     config=replace(config, seed=seed, use_cache=use_cache))  # fmt: skip
                    assert choices(result) == choices(alone), (window, prompt, block, steps, temperature, use_cache)
                if not prompt and temperature == 0:  # greedy: one token, one confidence
                    count = -(-block // steps)
                    assert [p for p, _ in result.unmask_steps[0]] == list(range(count))
