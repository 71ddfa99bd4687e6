"""Lossless DFlash speculative decoding (objectives.md §7): the target KV cache equals full
forwards, plain greedy with the cache equals greedy by recomputation, speculative output equals
plain greedy token for token (float64 and float32, untrained and briefly trained drafters, a
sliding-window drafter), the acceptance bookkeeping (``τ ∈ [1, B]``, ``1 + Σ τ`` committed tokens,
``1 + rounds`` target forwards) and the evaluation summary.

Sizes follow objectives.md §12 (``csbp.dflash.verify``): a 4-layer target (hidden 32, vocabulary 64),
a 2-layer drafter fusing target layers (0, 2), ``B = 4``, ``[M] = 63``. The trained pair learns a
cycle of 16 tokens: the target with 40 AdamW steps of next-token CE, the drafter with 30 AdamW steps
of ``DFlashStep``; then acceptance must be clearly above 1.
Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_dflash_speculative.py -q``
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from csbp.dflash.attention import UnmaskedDraftAttention
from csbp.dflash.config import DFlashConfig, DFlashObjectiveConfig
from csbp.dflash.drafter import DFlashDrafter, DraftContextCache
from csbp.dflash.evaluate import EvalPrompt, evaluate_drafter, format_report
from csbp.dflash.export import export_dflash, load_dflash
from csbp.dflash.features import capture_target_features
from csbp.dflash.layouts import AnchorPacket, context_rows
from csbp.dflash.rank_plan import build_dflash_rank_plan
from csbp.dflash.reference import EPS as REFERENCE_EPS
from csbp.dflash.reference import reference_dflash_loss
from csbp.dflash.speculative import (
    draft_block,
    greedy_generate,
    inference_draft_attention,
    speculative_generate,
)
from csbp.dflash.step import DFlashBatch, DFlashStep, forward_packet
from csbp.dflash.target_cache import CachedTarget
from csbp.dflash.verify import BLOCK_SIZE, DFlashVerifyCase, build_models
from csbp.engine.context import single_process_context
from csbp.models.attention_fns import CausalAttention
from csbp.models.decoder import Decoder

PROMPTS = ([5], [1, 2, 3], [7, 40, 12, 12, 3, 9, 50], list(range(10, 22)))


def _recompute_greedy(target: Decoder, prompt: list[int], count: int) -> list[int]:
    ids = list(prompt)
    for _ in range(count):
        hidden = target(torch.tensor([ids]), torch.arange(len(ids)), CausalAttention())
        ids.append(int(target.logits(hidden[0, -1]).argmax()))
    return ids[len(prompt) :]


def test_target_cache_chunks_and_crop_equal_full_forwards() -> None:
    target, _ = build_models(DFlashVerifyCase())
    ids = torch.randint(0, 63, (1, 12), generator=torch.Generator().manual_seed(3))
    runner = CachedTarget(target, (0, 2))
    passes = [runner.forward(ids[0, a:b]) for a, b in ((0, 5), (5, 8), (8, 12))]
    full = capture_target_features(target, ids, (0, 2), with_last_hidden=True)
    features = torch.cat([p.features for p in passes])
    torch.testing.assert_close(features, full.features[0], rtol=0, atol=1e-12)
    expected_next = target.logits(full.last_hidden[0]).argmax(-1)
    assert torch.equal(torch.cat([p.next_tokens for p in passes]), expected_next)
    assert runner.length == 12 and runner.forward_passes == 3

    runner.crop(6)  # reject positions 6.. and continue with other tokens
    other = ids.clone()
    other[0, 6:10] = torch.tensor([1, 2, 3, 4])
    again = runner.forward(other[0, 6:10])
    reference = capture_target_features(target, other[:, :10], (0, 2)).features[0, 6:10]
    torch.testing.assert_close(again.features, reference, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="crop length"):
        runner.crop(11)


def test_cached_greedy_equals_recomputed_greedy() -> None:
    target, _ = build_models(DFlashVerifyCase())
    for prompt in PROMPTS[:3]:
        result = greedy_generate(target, prompt, max_new_tokens=10)
        assert result.tokens == _recompute_greedy(target, prompt, 10)
        assert result.target_forwards == 10 and not result.stopped_at_eos


def _check_bookkeeping(result, max_new_tokens: int, block_size: int = BLOCK_SIZE) -> None:  # noqa: ANN001
    assert all(1 <= tau <= block_size for tau in result.acceptance_lengths)
    assert result.committed_tokens == 1 + sum(result.acceptance_lengths)
    assert result.target_forwards == 1 + result.rounds
    assert len(result.tokens) == min(max_new_tokens, result.committed_tokens)
    # the last round was needed: before it fewer than max_new_tokens were committed
    assert result.committed_tokens - result.acceptance_lengths[-1] < max_new_tokens


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_untrained_drafter_is_lossless(dtype: torch.dtype) -> None:
    target, drafter = build_models(DFlashVerifyCase(), dtype=dtype)
    for prompt in PROMPTS:
        result = speculative_generate(target, drafter, prompt, max_new_tokens=17)
        assert result.tokens == greedy_generate(target, prompt, max_new_tokens=17).tokens
        _check_bookkeeping(result, 17)
        assert result.mean_acceptance_length < 1.5  # a random drafter rarely guesses right


def test_eos_stops_both_loops_identically() -> None:
    target, drafter = build_models(DFlashVerifyCase())
    reference = greedy_generate(target, [1, 2, 3], max_new_tokens=12).tokens
    eos = reference[5]
    spec = speculative_generate(target, drafter, [1, 2, 3], max_new_tokens=12, eos_id=eos)
    greedy = greedy_generate(target, [1, 2, 3], max_new_tokens=12, eos_id=eos)
    first = reference.index(eos)
    assert spec.tokens == greedy.tokens == reference[: first + 1]
    assert spec.stopped_at_eos and greedy.stopped_at_eos and greedy.target_forwards == first + 1


@pytest.mark.parametrize("block_size", [1, 2, 7])
def test_dflash2_drafters_of_any_block_size_are_lossless(block_size: int) -> None:
    # the selector's greedy walk stacked an empty list at block_size 1 (no slot to draft; a config
    # csbp dflash export/load accepts) and speculative decoding crashed instead of running one-token rounds
    target, _ = build_models(DFlashVerifyCase())
    config = DFlashConfig.from_target(
        target.config, num_layers=2, block_size=block_size, mask_token_id=63, target_layer_ids=(0, 2),
        conv_kernel_size=2, conv_group_size=8, selector_rank=4, selector_top_k=4,
    )
    drafter = DFlashDrafter(config, target=target, dtype=torch.float64, seed=5)
    with torch.no_grad():  # off the identity/zero initialisation, so the selector takes part
        for param in drafter.selector.parameters():
            param.add_(0.3 * torch.randn(param.shape, generator=torch.Generator().manual_seed(6), dtype=param.dtype))
    for prompt in PROMPTS[:3]:
        result = speculative_generate(target, drafter, prompt, max_new_tokens=9)
        assert result.tokens == greedy_generate(target, prompt, max_new_tokens=9).tokens
        _check_bookkeeping(result, 9, block_size)
    if block_size == 1:
        assert result.acceptance_lengths == [1] * 8 and result.target_forwards == 9


def test_every_listed_stop_id_stops_both_loops() -> None:
    # a chat target stops at its end of turn or its end of text (generation_config.json lists both);
    # eos_id took one id, so a list never stopped (or failed), and csbp dflash eval ran past the turn
    target, drafter = build_models(DFlashVerifyCase())
    reference = greedy_generate(target, [1, 2, 3], max_new_tokens=12).tokens
    first, later = reference[4], reference[5]
    assert first not in reference[:4] and later not in reference[:5]
    for stops in ([later, first], (first,), [first, first]):
        spec = speculative_generate(target, drafter, [1, 2, 3], max_new_tokens=12, eos_id=stops)
        greedy = greedy_generate(target, [1, 2, 3], max_new_tokens=12, eos_id=stops)
        assert spec.tokens == greedy.tokens == reference[:5] and spec.stopped_at_eos and greedy.stopped_at_eos
    with pytest.raises(ValueError, match="eos_id 64"):
        speculative_generate(target, drafter, [1, 2, 3], max_new_tokens=4, eos_id=[first, 64])


@pytest.mark.parametrize("eos_id", [-1, 64, 10**6])
def test_an_eos_id_outside_the_vocabulary_is_refused(eos_id: int) -> None:
    # such an id can never be generated, so it silently meant "never stop at EOS"
    target, drafter = build_models(DFlashVerifyCase())
    with pytest.raises(ValueError, match="eos_id"):
        greedy_generate(target, [1, 2, 3], max_new_tokens=4, eos_id=eos_id)
    with pytest.raises(ValueError, match="eos_id"):
        speculative_generate(target, drafter, [1, 2, 3], max_new_tokens=4, eos_id=eos_id)


def test_sliding_window_draft_equals_training_path() -> None:
    """The inference mask of sliding layers is the training predicate: drafting a block at anchor
    ``a`` with context ``F[:a]`` through the cache equals the training path's block ``a``."""
    case = DFlashVerifyCase(
        drafter_options={"layer_types": ("sliding_attention", "full_attention"), "sliding_window": 3}
    )
    target, drafter = build_models(case)
    tokens = torch.randint(0, 63, (12,), generator=torch.Generator().manual_seed(4))
    features = capture_target_features(target, tokens[None], (0, 2)).features
    anchors = torch.tensor([5, 9])
    packet = AnchorPacket(
        torch.arange(2), anchors, torch.zeros(2, dtype=torch.long), torch.ones(2, dtype=torch.bool)
    )
    positions = torch.arange(12)
    train = forward_packet(drafter, tokens, packet, features, positions, context_rows(positions))[0]
    train_hidden = train.view(2, BLOCK_SIZE, -1)
    cache = DraftContextCache()
    for n, (anchor, new_from) in enumerate(((5, 0), (9, 5))):
        ids = drafter.block_input_ids(tokens[anchor].view(1))[None]
        hidden = drafter(
            drafter.embed(ids),
            anchor + torch.arange(BLOCK_SIZE),
            features[:, new_from:anchor],
            torch.arange(new_from, anchor),
            inference_draft_attention(drafter, anchor),
            cache=cache,
        )[0]
        torch.testing.assert_close(hidden, train_hidden[n], rtol=0, atol=1e-12)
    unmasked = drafter(
        drafter.embed(ids),
        9 + torch.arange(BLOCK_SIZE),
        features[:, :9],
        positions[:9],
        UnmaskedDraftAttention(),
    )[0]
    assert (unmasked - train_hidden[1]).abs().max() > 1e-3  # the window matters at this anchor
    expected = drafter.logits(train_hidden[:, 1:]).argmax(-1)
    cache = DraftContextCache()
    first = draft_block(drafter, int(tokens[5]), 5, features[0, :5], cache)
    second = draft_block(drafter, int(tokens[9]), 9, features[0, 5:9], cache)
    assert [first, second] == expected.tolist() and len(cache) == 9


def test_sliding_window_training_loss_equals_the_served_draft_logits(tmp_path) -> None:  # noqa: ANN001
    """Served as trained: the training objective of one block (the reference loss every training
    layout equals) is the cross-entropy of the draft logits ``csbp dflash eval`` computes for the same
    context, through an export and reload (the exported config carries the window)."""
    case = DFlashVerifyCase(
        drafter_options={"layer_types": ("sliding_attention", "full_attention"), "sliding_window": 3}
    )
    target, drafter = build_models(case)
    served = load_dflash(export_dflash(drafter, tmp_path / "drafter"), target)
    assert served.config.sliding_window == 3 and served.config.layer_types == drafter.config.layer_types
    tokens = torch.randint(0, 63, (16,), generator=torch.Generator().manual_seed(4))
    features = capture_target_features(target, tokens[None], (0, 2))
    objective = DFlashObjectiveConfig(max_anchors=8)  # CE, no position decay: a plain mean over slots
    for anchor in (5, 9):
        trained = reference_dflash_loss(
            drafter,
            tokens[None],
            torch.ones(1, 16, dtype=torch.bool),
            torch.zeros(1, 16, dtype=torch.long),
            [torch.tensor([anchor])],
            features,
            objective,
        ).main
        ids = served.block_input_ids(tokens[anchor].view(1))[None]
        positions = anchor + torch.arange(BLOCK_SIZE)
        context = features.features[:, :anchor]
        hidden = served(
            served.embed(ids), positions, context, torch.arange(anchor), inference_draft_attention(served, anchor)
        )[0]
        labels = tokens[anchor + 1 : anchor + BLOCK_SIZE]
        served_ce = F.cross_entropy(served.logits(hidden[1:]), labels).detach()
        slots = BLOCK_SIZE - 1
        assert float(trained) == pytest.approx(float(served_ce) * slots / (slots + REFERENCE_EPS), rel=1e-12)
        unwindowed = served(served.embed(ids), positions, context, torch.arange(anchor), UnmaskedDraftAttention())[0]
        unwindowed_ce = F.cross_entropy(served.logits(unwindowed[1:]), labels).detach()
        assert abs(float(unwindowed_ce) - float(served_ce)) > 1e-6


def _cycle_batch(cycle: torch.Tensor, generator: torch.Generator, samples: int, length: int) -> torch.Tensor:
    offsets = torch.randint(0, cycle.numel(), (samples, 1), generator=generator)
    return cycle[(offsets + torch.arange(length)) % cycle.numel()]


@pytest.fixture(scope="module")
def trained_pair() -> tuple[Decoder, DFlashDrafter, torch.Tensor]:
    """A target and drafter briefly trained on a 16-token cycle (float32)."""
    target, drafter = build_models(DFlashVerifyCase(), dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    cycle = torch.randperm(63, generator=generator)[:16]
    target.requires_grad_(True)
    optimizer = torch.optim.AdamW(target.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(40):
        ids = _cycle_batch(cycle, generator, 4, 24)
        hidden = target(ids[:, :-1], torch.arange(23), CausalAttention())
        loss = F.cross_entropy(target.logits(hidden).flatten(0, 1), ids[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    drafter.attach_target(target)  # freezes the target again
    objective = DFlashObjectiveConfig(max_anchors=8)
    step = DFlashStep(drafter, objective, build_dflash_rank_plan(single_process_context(), objective))
    optimizer = torch.optim.AdamW(drafter.parameters(), lr=1e-2, weight_decay=0.0)
    for index in range(30):
        ids = _cycle_batch(cycle, generator, 4, 24)
        batch = DFlashBatch(ids, torch.ones_like(ids, dtype=torch.bool), torch.zeros_like(ids))
        out = step(batch, torch.Generator().manual_seed(index))
        optimizer.zero_grad()
        out.loss.backward()
        optimizer.step()
    return target, drafter, cycle


def test_trained_drafter_accepts_more_and_stays_lossless(trained_pair) -> None:  # noqa: ANN001
    target, drafter, cycle = trained_pair
    prompts = [cycle[:5].tolist(), cycle[7:13].tolist(), [1, 2, 3], cycle[2:4].tolist() + [60, 61]]
    taus = []
    for prompt in prompts:
        result = speculative_generate(target, drafter, prompt, max_new_tokens=24)
        assert result.tokens == greedy_generate(target, prompt, max_new_tokens=24).tokens
        _check_bookkeeping(result, 24)
        taus.append(result.mean_acceptance_length)
    assert sum(taus) / len(taus) > 2.0, taus
    assert result.target_forwards < len(result.tokens)  # fewer target passes than plain greedy


def test_evaluation_summary_and_report(trained_pair) -> None:  # noqa: ANN001
    target, drafter, cycle = trained_pair
    prompts = [
        EvalPrompt("a", "cycle", tuple(cycle[:5].tolist())),
        EvalPrompt("b", "cycle", tuple(cycle[4:9].tolist())),
        EvalPrompt("c", "random", (1, 2, 3)),
    ]
    summary = evaluate_drafter(target, drafter, prompts, max_new_tokens=20)
    assert not summary.mismatches and all(p.lossless for p in summary.prompts)
    means = [p.mean_acceptance_length for p in summary.prompts]
    assert summary.acceptance_length == pytest.approx(sum(means) / 3, rel=1e-12)
    assert sum(summary.histogram) == sum(p.rounds for p in summary.prompts)
    assert len(summary.histogram) == BLOCK_SIZE
    assert summary.greedy_forwards == 60 and summary.target_forwards == sum(
        1 + p.rounds for p in summary.prompts
    )
    assert summary.reduction == pytest.approx(60 / summary.target_forwards) and summary.reduction > 1.5
    rates = summary.position_acceptance
    rounds = sum(summary.histogram)
    assert rates == [sum(summary.histogram[k:]) / rounds for k in range(1, BLOCK_SIZE)]
    assert rates == sorted(rates, reverse=True) and rates[0] > 0.5
    taus = [tau for p in summary.prompts for tau in p.acceptance_lengths]
    assert 1 + sum(rates) == pytest.approx(sum(taus) / len(taus), rel=1e-12)  # round-weighted mean tau
    assert summary.metrics()["accept_rate_2"] == rates[1]
    report = format_report(summary)
    assert "acceptance rate per draft position" in report and f"k=1: {rates[0]:.3f}" in report
    assert "[cycle]" in report and "[random]" in report and "lossless check passed: 3/3" in report
    assert report.splitlines()[-1] == f"acceptance_length: {summary.acceptance_length:.3f}"


def test_artifact_prompts_name_the_longest_prompt_length_that_fits() -> None:
    """A --prompt-len past the rows said "lower it" without the bound (the help's "seq_len - 1" is the
    default's cap, not the limit: a whole row is a valid prompt)."""
    from csbp.dflash.evaluate import artifact_prompts

    tokens_RL, doc_ids_RL = np.arange(8).reshape(2, 4), np.zeros((2, 4), dtype=np.int64)
    assert [p.token_ids for p in artifact_prompts(tokens_RL, doc_ids_RL, num_prompts=1, prompt_len=4)] == [(0, 1, 2, 3)]
    with pytest.raises(ValueError) as caught:
        artifact_prompts(tokens_RL, doc_ids_RL, num_prompts=1, prompt_len=5)
    assert str(caught.value) == "--prompt-len 5 exceeds the artifact's seq_len 4 (fix: --prompt-len 4 or less)"


def test_the_lossless_check_compares_whole_outputs() -> None:
    """Speculative decoding is lossless when it writes exactly plain greedy's tokens: a strict prefix of them
    (a stop too early) or a longer run is a mismatch at the shorter length. A check of the prefix only passed
    every test."""
    from csbp.dflash.evaluate import PromptEval

    prompt = EvalPrompt("p", "g", (1, 2))

    def evaluated(tokens: list[int], greedy: list[int] | None) -> PromptEval:
        return PromptEval(prompt, tokens, [len(tokens)], 1, 0.1, greedy, 0.1 if greedy is not None else None)

    assert evaluated([5, 6, 7], [5, 6, 7]).lossless is True and evaluated([5, 6, 7], [5, 6, 7]).first_mismatch() is None
    for tokens, greedy, first in (([5, 6], [5, 6, 7], 2), ([5, 6, 7, 8], [5, 6, 7], 3), ([5, 9, 7], [5, 6, 7], 1)):
        result = evaluated(tokens, greedy)
        assert result.lossless is False and result.first_mismatch() == first, (tokens, greedy)
    assert evaluated([5], None).lossless is None and evaluated([5], None).first_mismatch() is None
