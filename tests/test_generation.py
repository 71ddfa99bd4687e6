"""Block-diffusion sampling (``csbp.generation``).

A tiny random decoder (hidden 32, 4/2 heads, vocab 64, float64, weights std 0.3 so proposals have
clear confidence gaps) samples with the clean-prefix KV cache and without it (the whole
``[noisy block ; clean prefix]`` layout rebuilt with the BD3 inference mask every step); the two
must agree token for token. The cached denoising rows must also equal the noisy rows of the BD3
*training* layout ``[x_t ; x_0]`` (1e-12), which ties sampling to what the model was trained on.
The command line is tested in ``tests/test_generate_cli.py``.
Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_generation.py -q``
"""

from __future__ import annotations

import pytest
import torch

from csbp.attention.layouts import bd3_rows
from csbp.attention.rows import allow_matrix
from csbp.generation import (
    CachedBlockForward,
    GenerationConfig,
    choose_unmasked,
    generate,
    propose_tokens,
    unmask_count,
)
from csbp.generation.sampler import positions_used
from csbp.models.attention_fns import DenseMaskAttention
from csbp.models.config import DecoderConfig
from csbp.models.decoder import Decoder

VOCAB = 64
MASK = 63
BLOCK = 4


def tiny_model(vocab_size: int = VOCAB, seed: int = 0) -> Decoder:
    config = DecoderConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
    )
    model = Decoder(config, dtype=torch.float64, seed=seed)
    model.init_weights(torch.Generator().manual_seed(seed + 1), std=0.3)
    return model.eval()


@pytest.fixture(scope="module")
def model() -> Decoder:
    return tiny_model()


def run(model: Decoder, prompt: list[int], eos_id: int | None = None, **options: object):
    config = GenerationConfig(**{"block_size": BLOCK, "steps_per_block": 3, "max_new_tokens": 21, **options})
    return generate(model, prompt, mask_token_id=MASK, eos_id=eos_id, config=config)


# ----------------------------------------------------------------------------- cache exactness


@pytest.mark.parametrize(
    ("token_shift", "prompt_len"),
    [
        (False, 0),
        (False, 3),
        (False, 8),
        (False, 11),
        (True, 3),
        (True, 8),
        (True, 11),
    ],  # shift needs a prompt
)
def test_cache_equals_recomputation_token_for_token(
    model: Decoder, token_shift: bool, prompt_len: int
) -> None:
    prompt = [(7 * i + 5) % MASK for i in range(prompt_len)]
    for options in ({"temperature": 0.0}, {"temperature": 1.0, "top_k": 20, "seed": 3}):
        cached = run(model, prompt, token_shift=token_shift, use_cache=True, **options)
        recomputed = run(model, prompt, token_shift=token_shift, use_cache=False, **options)
        assert cached.token_ids == recomputed.token_ids
        assert cached.unmask_steps == recomputed.unmask_steps
        assert cached.first_tokens == recomputed.first_tokens
        assert len(cached.token_ids) == 21


def test_cached_denoise_equals_training_layout_rows(model: Decoder) -> None:
    """Row ``i`` of block ``b`` in the ``[x_t ; x_0]`` training forward equals the cached denoising
    forward of block ``b`` over the clean prefix ``x_0[: b*B]`` (objectives.md §3.4 test oracle)."""
    seq_len, block = 16, 2
    generator = torch.Generator().manual_seed(5)
    clean_1L = torch.randint(0, MASK, (1, seq_len), generator=generator)
    noisy_1L = torch.where(torch.rand(1, seq_len, generator=generator) < 0.5, MASK, clean_1L)
    rows = bd3_rows(torch.arange(seq_len), torch.arange(seq_len), block_size=BLOCK)
    with torch.no_grad():
        training_1RD = model(
            torch.cat((noisy_1L, clean_1L), dim=1), rows.pos, DenseMaskAttention(allow_matrix(rows, rows))
        )
        forward = CachedBlockForward(model, BLOCK)
        forward.prefill([clean_1L[0, : block * BLOCK].tolist()])
        span = slice(block * BLOCK, (block + 1) * BLOCK)
        denoised_1BD = forward.denoise(noisy_1L[:, span], [block * BLOCK])
        before_1D = forward.clean_row_before([0])
    torch.testing.assert_close(denoised_1BD, training_1RD[:, span], rtol=0, atol=1e-12)
    # the clean row before the block (token-shift source) is the training clean row at b*B - 1
    torch.testing.assert_close(before_1D, training_1RD[:, seq_len + block * BLOCK - 1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("window", [3, 6])
def test_windowed_sampling_uses_the_training_window(model: Decoder, window: int) -> None:
    """A model trained with ``topology.window`` is sampled with the windowed BD3 mask: every cached
    denoising and commit row equals the windowed *training* layout's row, the cache equals
    recomputation token for token, and the window changes the samples."""
    seq_len = 16
    generator = torch.Generator().manual_seed(7)
    clean_1L = torch.randint(0, MASK, (1, seq_len), generator=generator)
    noisy_1L = torch.where(torch.rand(1, seq_len, generator=generator) < 0.5, MASK, clean_1L)
    rows = bd3_rows(torch.arange(seq_len), torch.arange(seq_len), block_size=BLOCK, window=window)
    with torch.no_grad():
        training_1RD = model(
            torch.cat((noisy_1L, clean_1L), dim=1), rows.pos, DenseMaskAttention(allow_matrix(rows, rows))
        )
        forward = CachedBlockForward(model, BLOCK, window)
        forward.prefill([clean_1L[0, : 2 * BLOCK].tolist()])  # two clean blocks at once: token-causal in the window
        for block in (2, 3):
            span = slice(block * BLOCK, (block + 1) * BLOCK)
            denoised_1BD = forward.denoise(noisy_1L[:, span], [block * BLOCK])
            torch.testing.assert_close(denoised_1BD, training_1RD[:, span], rtol=0, atol=1e-12)
            torch.testing.assert_close(
                forward.clean_row_before([0]), training_1RD[:, seq_len + block * BLOCK - 1], rtol=0, atol=1e-12
            )
            forward.commit(clean_1L[:, span], [block * BLOCK])
    prompt = [(5 * i + 2) % MASK for i in range(9)]
    for options in ({"temperature": 0.0}, {"temperature": 1.0, "top_k": 20, "seed": 3}):
        cached = run(model, prompt, window=window, use_cache=True, **options)
        recomputed = run(model, prompt, window=window, use_cache=False, **options)
        assert cached.token_ids == recomputed.token_ids
    unwindowed = run(model, prompt, max_new_tokens=40, temperature=0.0)
    assert run(model, prompt, max_new_tokens=40, temperature=0.0, window=window).token_ids != unwindowed.token_ids
    with pytest.raises(ValueError, match="window"):
        GenerationConfig(window=0)


def test_left_to_right_order_fills_each_block_from_the_left(model: Decoder) -> None:
    prompt = [(3 * i + 1) % MASK for i in range(6)]
    result = run(model, prompt, steps_per_block=2, unmask_order="left_to_right", temperature=0.0)
    filled = [position for step in result.unmask_steps for position, _ in step]
    assert filled == sorted(filled) and filled == list(range(6, 6 + 21))  # leftmost first, in order
    assert run(model, prompt, steps_per_block=2, unmask_order="left_to_right", use_cache=False).token_ids == (
        result.token_ids
    )
    assert result.token_ids != run(model, prompt, steps_per_block=2, temperature=0.0).token_ids
    with pytest.raises(ValueError, match="unmask_order"):
        GenerationConfig(unmask_order="rightmost")


def test_random_order_unmasks_one_random_position_per_step_whatever_the_model(model: Decoder) -> None:
    """With one step per position it is bd3lms' first-hitting sampler: each step unmasks one masked position
    drawn uniformly from the seed's generator, so the order of a block is a permutation that does not depend
    on the model's confidences."""
    prompt = [(3 * i + 1) % MASK for i in range(BLOCK)]
    orders = {}
    for seed in range(40):
        result = run(model, prompt, steps_per_block=BLOCK, max_new_tokens=BLOCK, unmask_order="random",
                     temperature=0.0, seed=seed)
        assert [len(step) for step in result.unmask_steps] == [1] * BLOCK
        order = tuple(position for step in result.unmask_steps for position, _ in step)
        assert sorted(order) == list(range(BLOCK, 2 * BLOCK))
        orders[seed] = order
        again = run(model, prompt, steps_per_block=BLOCK, max_new_tokens=BLOCK, unmask_order="random",
                    temperature=0.0, seed=seed, use_cache=False)
        assert again.token_ids == result.token_ids and again.unmask_steps == result.unmask_steps
    firsts = [order[0] - BLOCK for order in orders.values()]
    assert len(set(orders.values())) >= 12 and set(firsts) == set(range(BLOCK))  # 17 of the 24 orders: not one order
    with pytest.raises(ValueError, match="threshold"):
        GenerationConfig(unmask_order="random", threshold=0.5)


def test_cache_never_recomputes_the_prefix(model: Decoder) -> None:
    prompt = list(range(1, 10))  # 2 whole blocks prefilled, 1 prompt token carried into block 2
    result = run(model, prompt, steps_per_block=2, max_new_tokens=11)
    num_blocks = len(result.block_starts)
    denoise_rows = BLOCK * len(result.unmask_steps)
    commit_rows = BLOCK * (num_blocks - 1)  # the last block is never committed
    assert result.num_model_rows == 8 + denoise_rows + commit_rows
    assert run(model, prompt, steps_per_block=2, max_new_tokens=11, use_cache=False).num_model_rows > 2 * (
        result.num_model_rows
    )


# ----------------------------------------------------------------------------- loop semantics


@pytest.mark.parametrize("prompt_len", [0, 3, 8, 11])
def test_block_structure_and_positions(model: Decoder, prompt_len: int) -> None:
    prompt = [(3 * i + 1) % MASK for i in range(prompt_len)]
    steps, max_new = 3, 18
    result = run(model, prompt, steps_per_block=steps, max_new_tokens=max_new)
    first = prompt_len // BLOCK * BLOCK
    assert result.block_starts == list(range(first, first + BLOCK * len(result.block_starts), BLOCK))
    unmasked = [pair for step in result.unmask_steps for pair in step]
    positions = sorted(pos for pos, _ in unmasked)
    # every generated position exactly once, the carried prompt tokens never
    assert positions == list(range(prompt_len, prompt_len + max_new))
    by_position = dict(unmasked)
    assert result.token_ids == [by_position[p] for p in positions]
    # each step only touches its own block; blocks take at most `steps` steps
    step_blocks = [{pos // BLOCK for pos, _ in step} for step in result.unmask_steps]
    assert all(len(blocks) == 1 for blocks in step_blocks)
    per_block = [
        sum(1 for blocks in step_blocks if blocks == {start // BLOCK}) for start in result.block_starts
    ]
    assert max(per_block) <= steps
    # k = ceil(remaining / remaining_steps): a full block of 4 in 3 steps unmasks 2, 1, 1
    full = [len(step) for step in result.unmask_steps[-steps:]]
    if (prompt_len + max_new) % BLOCK == 0:
        assert full == [2, 1, 1]


def test_mask_token_is_never_generated(model: Decoder) -> None:
    boosted = tiny_model()
    plain_logits = boosted.logits
    bonus = torch.zeros(VOCAB, dtype=torch.float64)
    bonus[MASK] = 50.0  # the mask would win every proposal if it were not excluded
    boosted.logits = lambda hidden: plain_logits(hidden) + bonus  # type: ignore[method-assign]
    for options in ({"temperature": 0.0}, {"temperature": 2.0, "seed": 1}):
        result = run(boosted, [1, 2, 3], max_new_tokens=40, **options)
        assert MASK not in result.token_ids and len(result.token_ids) == 40


def test_eos_stops_generation_after_its_block(model: Decoder) -> None:
    free = run(model, [4, 5], max_new_tokens=24)
    eos = free.token_ids[9]
    cut = free.token_ids.index(eos)
    stopped = run(model, [4, 5], eos_id=eos, max_new_tokens=24)
    assert stopped.stopped_at_eos and stopped.token_ids == free.token_ids[:cut]
    eos_block = (2 + cut) // BLOCK
    assert len(stopped.block_starts) == eos_block + 1


def test_any_of_several_stop_ids_ends_the_completion(model: Decoder) -> None:
    """A chat model stops at its end of turn as well as the data's EOS (generation_config's list)."""
    free = run(model, [4, 5], max_new_tokens=24)
    turn_end = free.token_ids[9]
    never = next(t for t in range(VOCAB) if t not in free.token_ids and t != MASK)
    cut = free.token_ids.index(turn_end)
    stopped = run(model, [4, 5], eos_id=[never, turn_end], max_new_tokens=24)
    assert stopped.stopped_at_eos and stopped.token_ids == free.token_ids[:cut]
    assert run(model, [4, 5], eos_id=(never,), max_new_tokens=24).token_ids == free.token_ids
    with pytest.raises(ValueError, match=r"^eos_id 9999 is the mask token or outside"):
        run(model, [4, 5], eos_id=[turn_end, 9999])


def test_seeded_sampling_is_deterministic(model: Decoder) -> None:
    options = {"temperature": 1.0, "top_k": 16, "top_p": 0.9}
    first = run(model, [1, 2, 3], seed=11, **options)
    again = run(model, [1, 2, 3], seed=11, **options)
    other = run(model, [1, 2, 3], seed=12, **options)
    assert first.token_ids == again.token_ids
    assert first.token_ids != other.token_ids


def test_threshold_zero_unmasks_a_block_in_one_step(model: Decoder) -> None:
    result = run(model, [1, 2, 3, 4], steps_per_block=4, max_new_tokens=12, threshold=0.0)
    assert [len(step) for step in result.unmask_steps] == [BLOCK, BLOCK, BLOCK]


def test_invalid_options_are_rejected(model: Decoder) -> None:
    for options, field in (
        ({"block_size": 0}, "block_size"),
        ({"steps_per_block": 0}, "steps_per_block"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": 0}, "top_k"),
    ):
        with pytest.raises(ValueError, match=field):
            GenerationConfig(**options)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^steps_per_block 5 exceeds block_size 4: .* \(use 1 to 4\)$"):
        GenerationConfig(block_size=4, steps_per_block=5)  # never silently fewer steps than asked
    with pytest.raises(ValueError, match="non-empty prompt"):
        run(model, [], token_shift=True)
    with pytest.raises(ValueError, match="mask token"):
        run(model, [1, MASK])
    # an EOS the sampler can never produce (outside the vocabulary, or the never-proposed mask)
    # silently meant "never stop at EOS"
    for eos_id in (-1, 64, 10**6, MASK):
        with pytest.raises(ValueError, match="eos_id"):
            run(model, [1, 2], eos_id=eos_id)


# ----------------------------------------------------------------------------- token choice


def test_proposals_respect_top_k_top_p_and_exclude_the_mask() -> None:
    logits_RV = torch.tensor([[0.0, 3.0, 2.0, 1.0, 9.0]]).repeat(400, 1)  # id 4 plays the mask
    generator = torch.Generator().manual_seed(0)
    tokens, _ = propose_tokens(logits_RV, mask_token_id=4, temperature=1.0, top_k=2, generator=generator)
    assert set(tokens.tolist()) == {1, 2}
    # p(1) = 0.644, p(2) = 0.237: the nucleus of mass 0.7 is {1, 2}; of mass 0.5 only {1}
    tokens, confidence = propose_tokens(
        logits_RV, mask_token_id=4, temperature=1.0, top_p=0.5, generator=generator
    )
    assert set(tokens.tolist()) == {1} and torch.allclose(confidence, torch.ones(400))
    tokens, _ = propose_tokens(logits_RV, mask_token_id=4, temperature=1.0, top_p=0.7, generator=generator)
    assert set(tokens.tolist()) == {1, 2}
    tokens, confidence = propose_tokens(logits_RV[:1], mask_token_id=4)
    expected = torch.softmax(torch.tensor([0.0, 3.0, 2.0, 1.0]), dim=0)[1]
    assert tokens.tolist() == [1] and abs(float(confidence[0]) - float(expected)) < 1e-6


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_non_finite_logits_are_named_not_sampled(bad: float, temperature: float) -> None:
    """A diverged model (train.nan_policy: skip lets a run end with one): torch.multinomial raised a
    RuntimeError traceback from the sample after training, and the greedy arg-max chose a NaN silently."""
    from csbp.generation.token_choice import NonFiniteLogits

    logits_RV = torch.tensor([[0.0, 3.0, bad, 1.0, 9.0]])
    with pytest.raises(NonFiniteLogits, match=r"logits are not finite .* \(fix: "):
        propose_tokens(logits_RV, mask_token_id=4, temperature=temperature, generator=torch.Generator())
    ruled_out = torch.tensor([[0.0, 3.0, float("-inf"), 1.0, float("nan")]])  # -inf, and NaN on the mask: fine
    drawn = propose_tokens(ruled_out, mask_token_id=4, temperature=temperature, generator=torch.Generator().manual_seed(0))
    assert drawn[0].tolist() == [1] if temperature == 0 else drawn[0].item() in (0, 1, 3)  # not the global RNG's draw


def test_positions_used_end_at_the_block_after_the_last_new_token(model: Decoder) -> None:
    assert [positions_used(p, n, BLOCK) for p, n in ((5, 3), (5, 4), (0, 1), (3, 18))] == [8, 12, 4, 24]
    for prompt_len in (0, 3, 8):
        result = run(model, list(range(1, prompt_len + 1)), max_new_tokens=9)
        assert result.block_starts[-1] + BLOCK == positions_used(prompt_len, 9, BLOCK)


def test_unmask_schedule() -> None:
    assert [unmask_count(r, s) for r, s in ((16, 16), (16, 3), (5, 2), (1, 4))] == [1, 6, 3, 1]
    confidence = torch.tensor([0.1, 0.9, 0.5, 0.95, 0.2])
    assert choose_unmasked(confidence, remaining_steps=3).tolist() == [3, 1]
    assert choose_unmasked(confidence, remaining_steps=5, threshold=0.4).tolist() == [3, 1, 2]
    assert choose_unmasked(confidence, remaining_steps=1).tolist() == [3, 1, 2, 4, 0]


@pytest.mark.parametrize("temperature", [1e-40, 1e-320])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_tiny_positive_temperature_samples_the_argmax_instead_of_crashing(
    temperature: float, dtype: torch.dtype
) -> None:
    # logits / 1e-40 overflow float32 (1e-320 overflows float64): inf - inf in the softmax was nan
    # and torch.multinomial raised; the limit temperature -> 0 is the arg-max.
    logits_RV = torch.tensor([[0.5, 3.0, -2.0, 1.0, 9.0], [-1.0, -3.0, -0.5, -4.0, 0.0]], dtype=dtype)
    generator = torch.Generator().manual_seed(0)
    for top_k, top_p in ((None, 1.0), (2, 1.0), (None, 0.9)):
        tokens, confidence = propose_tokens(
            logits_RV, mask_token_id=4, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator
        )
        assert tokens.tolist() == [1, 2]
        assert torch.equal(confidence, torch.ones(2, dtype=confidence.dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_huge_temperature_or_a_tiny_top_p_is_its_limit_instead_of_crashing(dtype: torch.dtype) -> None:
    """``csbp generate --temperature 1e300`` and ``--top-p 1e-300`` ended in torch.multinomial's
    RuntimeError (inf/nan probabilities): 1e300 is inf in float32 and the mask's -inf / inf was nan;
    1e-300 is 0 there and the nucleus dropped even the best token. Their limits: a uniform draw among
    the kept tokens (still ranked by the logits), and the most likely token alone."""
    logits_RV = torch.tensor([[0.5, 3.0, -2.0, 1.0, 9.0]], dtype=dtype).repeat(2000, 1)  # id 4 plays the mask
    generator = torch.Generator().manual_seed(0)
    for top_k, top_p, kept in ((None, 1.0, {0, 1, 2, 3}), (2, 1.0, {1, 3}), (None, 0.5, {1, 3}), (3, 1e-300, {1})):
        tokens, confidence = propose_tokens(
            logits_RV, mask_token_id=4, temperature=1e300, top_k=top_k, top_p=top_p, generator=generator
        )
        assert set(tokens.tolist()) == kept, (top_k, top_p)
        assert torch.allclose(confidence, torch.full_like(confidence, 1 / len(kept)))
    tokens, confidence = propose_tokens(logits_RV, mask_token_id=4, temperature=1.0, top_p=1e-300, generator=generator)
    assert set(tokens.tolist()) == {1} and torch.equal(confidence, torch.ones_like(confidence))


def test_a_vanishing_temperature_is_greedy_left_to_right_not_the_greedy_order(model: Decoder) -> None:
    """The documented limit of the tempered confidence (Fast-dLLM v2's convention, see
    ``csbp.generation.token_choice``): as ``T -> 0+`` every confidence is 1, so the arg-max tokens
    are unmasked leftmost first; ``T = 0`` ranks by the untempered probability instead."""
    prompt = [(3 * i + 1) % MASK for i in range(6)]
    vanishing = run(model, prompt, steps_per_block=2, temperature=1e-300, seed=4)
    left_to_right = run(model, prompt, steps_per_block=2, temperature=0.0, unmask_order="left_to_right")
    assert vanishing.unmask_steps == left_to_right.unmask_steps
    greedy = run(model, prompt, steps_per_block=2, temperature=0.0)
    assert greedy.unmask_steps != vanishing.unmask_steps  # a different order (and so other tokens)


def test_threshold_is_strict_as_in_fast_dllm_v2() -> None:
    """Fast-dLLM v2 unmasks ``x1_p > threshold`` (plus the most confident). With ``>=`` a threshold of 1
    unmasked every float32 proposal whose softmax rounds to exactly 1 (a logit gap above ~17, common
    in a trained model) in parallel, where the reference unmasks one."""
    saturated = torch.softmax(torch.tensor([[0.0, -20.0], [0.0, -25.0], [0.0, -1.0]]), dim=-1).max(dim=-1).values
    assert saturated[:2].tolist() == [1.0, 1.0]
    assert choose_unmasked(saturated, remaining_steps=3, threshold=1.0).tolist() == [0]
    assert choose_unmasked(torch.tensor([0.5, 0.9, 0.7]), remaining_steps=3, threshold=0.7).tolist() == [1]


def test_threshold_needs_the_confidence_order(model: Decoder) -> None:
    """With ``left_to_right`` the count of confident proposals unmasked as many *leftmost* positions,
    confident or not: ``[0.1, 0.95, 0.95]`` at threshold 0.9 unmasked offsets 0 and 1."""
    with pytest.raises(ValueError, match="needs unmask_order 'confidence'"):
        GenerationConfig(threshold=0.9, unmask_order="left_to_right")
    with pytest.raises(ValueError, match="needs unmask_order 'confidence'"):
        choose_unmasked(torch.tensor([0.1, 0.95, 0.95]), remaining_steps=3, threshold=0.9, order="left_to_right")


# ----------------------------------------------------------------------------- Fast-dLLM v2 sub-blocks


@pytest.mark.parametrize(("token_shift", "prompt"), [(False, []), (False, [5, 6, 7]), (True, [5, 6, 7]), (True, [1] * 8)])
def test_sub_blocks_fill_left_to_right_and_the_cache_equals_recomputation(
    model: Decoder, token_shift: bool, prompt: list[int]
) -> None:
    """Fast-dLLM v2 decodes a block in sub-blocks: only the leftmost unfinished sub-block's masked
    positions are candidates (confidence threshold, at least one per step); the forward still runs
    the whole block."""
    options = {"block_size": 8, "steps_per_block": 8, "sub_block_size": 4, "max_new_tokens": 21, "threshold": 0.2}
    for sampling in ({"temperature": 0.0}, {"temperature": 1.0, "seed": 2}):
        cached = run(model, prompt, token_shift=token_shift, **options, **sampling)
        recomputed = run(model, prompt, token_shift=token_shift, use_cache=False, **options, **sampling)
        assert cached.token_ids == recomputed.token_ids and cached.unmask_steps == recomputed.unmask_steps
        assert len(cached.token_ids) == 21 and all(cached.unmask_steps)
        assert cached.first_tokens == recomputed.first_tokens
        done = {position for position, _ in cached.first_tokens}  # committed before their block's steps
        for step in cached.unmask_steps:
            positions = {position for position, _ in step}
            assert len({position // 4 for position in positions}) == 1  # one sub-block per step
            sub_start = min(positions) // 4 * 4
            # every generated position of the earlier sub-blocks of this block is already filled
            block_start = sub_start // 8 * 8
            earlier = {p for p in range(max(block_start, len(prompt)), sub_start)}
            assert earlier <= done, (earlier - done, step)
            done |= positions


def test_one_position_sub_blocks_are_left_to_right_decoding(model: Decoder) -> None:
    for token_shift in (False, True):
        sub = run(model, [3, 4, 5], token_shift=token_shift, steps_per_block=BLOCK, sub_block_size=1)
        ltr = run(model, [3, 4, 5], token_shift=token_shift, steps_per_block=BLOCK, unmask_order="left_to_right")
        assert sub.token_ids == ltr.token_ids and sub.unmask_steps == ltr.unmask_steps
    whole = run(model, [3, 4, 5], steps_per_block=2, sub_block_size=BLOCK)
    assert whole.unmask_steps == run(model, [3, 4, 5], steps_per_block=2).unmask_steps


def test_sub_blocks_share_the_block_s_steps(model: Decoder) -> None:
    """``steps_per_block`` is the block's budget, split evenly over its sub-blocks: 2 steps over two
    sub-blocks of 4 is one step each, filling its 4 positions at once. Each sub-block given the whole
    budget (twice the forwards, other outputs) passed every test."""
    result = run(model, [], steps_per_block=2, sub_block_size=4, block_size=8, max_new_tokens=16)
    assert len(result.block_starts) == 2 and len(result.unmask_steps) == 4
    assert [len(step) for step in result.unmask_steps] == [4, 4, 4, 4]


def test_sub_block_options_are_checked() -> None:
    with pytest.raises(ValueError, match="sub_block_size must be a divisor of block_size 8, got 3"):
        GenerationConfig(block_size=8, steps_per_block=8, sub_block_size=3)
    with pytest.raises(ValueError, match=r"steps_per_block 3 does not split evenly over the 2 sub-blocks of 4"):
        GenerationConfig(block_size=8, steps_per_block=3, sub_block_size=4)
    GenerationConfig(block_size=8, steps_per_block=2, sub_block_size=4)


def test_the_nucleus_stops_at_the_token_that_reaches_top_p() -> None:
    """top-p keeps the most probable tokens until their mass first reaches ``top_p``: with probabilities
    (0.5, 0.25, 0.125, 0.125) and ``top_p = 0.5`` the first alone, 0.75 the first two. A strict comparison
    (one token more when the mass lands exactly on ``top_p``) passed every test. Powers of two: exact sums."""
    from csbp.generation.token_choice import _nucleus

    logits = torch.tensor([[0.125, 0.5, 0.125, 0.25]], dtype=torch.float64).log()
    for top_p, count in ((0.5, 1), (0.75, 2), (0.8, 3), (0.875, 3)):  # past 0.75 one of the tied 0.125 joins
        survivors = set(torch.isfinite(_nucleus(logits, top_p))[0].nonzero().flatten().tolist())
        assert len(survivors) == count and survivors >= {1, 3} & set([1, 3][:count]), (top_p, survivors)
