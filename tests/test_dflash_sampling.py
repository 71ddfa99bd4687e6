"""Lossless speculative *sampling* (``csbp.dflash.sampling``): its output is distributed as sampling
from the target alone.

* The rule on hand-made distributions (5 tokens): a Markov "target" whose next-token law depends on
  the position and the last token, a "drafter" whose proposals ignore the prefix and differ sharply
  from the target. The exact law of the first two emitted tokens is the product of the target's
  tables; 10000 seeded runs of :func:`accept_drafts` (two rounds where the first, of one draft, rejects it) must
  hit every cell within 4.5 standard errors ``sqrt(π(1−π)/N)`` (plus 1e-3 for cells near 0 or 1). The
  seed is fixed, so the test is deterministic; 4.5σ was chosen so a correct rule would fail with a
  probability below 1e-4 over all cells for *any* seed, while the mutants below miss by > 20σ.
* Mutants must fail that check: resampling a rejection from ``p`` instead of ``max(0, p − q)``, and
  accepting every draft (checked here through ``monkeypatch``; source mutants were also run by hand:
  accept always, accept with ``p/q`` swapped or with ``p`` alone, residual ``max(0, q − p)``, the bonus
  from the last draft's row instead of the bonus row; in the loop, a greedy first token or greedy
  drafts scored with ``q``; each fails).
* The whole loop (:func:`speculative_generate` with a ``Sampling``) on the tiny target and an untrained
  drafter, ``top_k = 2`` so both support two tokens per position (and mostly different ones): the
  first three tokens' law, enumerated with target forwards, against 1500 seeded runs.
* Greedy limits: a temperature so small that every distribution is one-hot makes the sampled path
  reproduce the greedy tokens and acceptance lengths on the trained pair; ``sampling=None`` is the
  greedy path itself.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch

from csbp.dflash import sampling as sampling_module
from csbp.dflash.sampling import Sampling, accept_drafts, draw_tokens, residual
from csbp.dflash.speculative import SELECTOR_SAMPLING_ERROR, greedy_generate, speculative_generate
from csbp.dflash.verify import DFlashVerifyCase, build_models
from csbp.models.attention_fns import CausalAttention
from test_dflash_speculative import trained_pair  # noqa: F401  (the module-scoped fixture)

VOCAB = 5
MAX_DRAFTS = 2  # K = B - 1 after the first round


def _toy_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """Target ``[3, V+1, V]``: law of the next token at prefix length ``n`` (mod 3) after token ``a``
    (``V`` = no token yet); drafter ``[3, V]``: its proposal at prefix length ``n`` (mod 3)."""
    generator = torch.Generator().manual_seed(11)
    target = torch.softmax(1.5 * torch.randn(3, VOCAB + 1, VOCAB, generator=generator, dtype=torch.float64), -1)
    drafter = torch.softmax(1.5 * torch.randn(3, VOCAB, generator=generator, dtype=torch.float64), -1)
    return target, drafter


def _toy_p(target: torch.Tensor, prefix: list[int]) -> torch.Tensor:
    return target[len(prefix) % 3, prefix[-1] if prefix else VOCAB]


def _toy_first_two(target: torch.Tensor, drafter: torch.Tensor, generator: torch.Generator) -> tuple[int, int]:
    """Speculative sampling rounds over the toy models until two tokens are emitted: the second is an
    accepted draft, a correction, or (a first round of one accepted draft) the bonus."""
    prefix: list[int] = []
    while len(prefix) < 2:
        num_drafts = 1 if not prefix else MAX_DRAFTS  # K = 1 first: an accepted draft's bonus is token 2
        q_KV = torch.stack([drafter[(len(prefix) + j) % 3] for j in range(num_drafts)])
        drafts = draw_tokens(q_KV, generator)
        p_BV = torch.stack([_toy_p(target, prefix + drafts[:j]) for j in range(num_drafts + 1)])
        accepted, after = accept_drafts(p_BV, q_KV, drafts, generator)
        prefix += drafts[:accepted] + [after]
    return prefix[0], prefix[1]


def _law_misses(counts: Counter, law: dict[tuple[int, ...], float], runs: int) -> list[str]:
    """The cells whose frequency lies beyond the tolerance of the module docstring."""
    misses = []
    for cell, expected in law.items():
        observed = counts.get(cell, 0) / runs
        tolerance = 4.5 * (expected * (1 - expected) / runs) ** 0.5 + 1e-3
        if abs(observed - expected) > tolerance:
            misses.append(f"{cell}: {observed:.4f} vs {expected:.4f} (±{tolerance:.4f})")
    unexpected = set(counts) - set(law)
    return misses + [f"{cell}: never possible" for cell in sorted(unexpected)]


def _toy_check(runs: int = 10000) -> list[str]:
    target, drafter = _toy_tables()
    law = {(a, b): float(_toy_p(target, [])[a] * _toy_p(target, [a])[b]) for a in range(VOCAB) for b in range(VOCAB)}
    generator = torch.Generator().manual_seed(0)
    counts = Counter(_toy_first_two(target, drafter, generator) for _ in range(runs))
    return _law_misses(counts, law, runs)


def test_toy_drafter_differs_enough_from_the_target_to_exercise_every_branch() -> None:
    target, drafter = _toy_tables()
    for n in range(3):  # total variation of the first-slot proposal from the target, per prefix length
        assert 0.3 < 0.5 * float((drafter[n] - target[n, VOCAB]).abs().sum()) < 0.95


def test_first_two_tokens_follow_the_target_law() -> None:
    assert _toy_check() == []


def test_resampling_from_p_instead_of_the_residual_fails_the_law(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampling_module, "residual", lambda p_V, q_V: p_V)
    assert len(_toy_check()) >= 3


def test_accepting_every_draft_fails_the_law(monkeypatch: pytest.MonkeyPatch) -> None:
    # every round draws the draft uniforms, the acceptance uniforms, then the correction's or bonus's:
    # zeroing the second accepts every draft (the toy target gives every token a positive probability)
    real = sampling_module.draw_uniforms
    calls = itertools.count(1)

    def uniforms(count: int, generator: torch.Generator) -> torch.Tensor:
        drawn = real(count, generator)
        return drawn * 0 if next(calls) % 3 == 2 else drawn

    monkeypatch.setattr(sampling_module, "draw_uniforms", uniforms)
    assert len(_toy_check(4000)) >= 3


def test_residual_is_the_positive_part_and_falls_back_to_p() -> None:
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    assert residual(p, q).tolist() == pytest.approx([0.3, 0.0, 0.0])
    assert torch.equal(residual(p, p), p)


def test_accept_drafts_refuses_mismatched_rows() -> None:
    p, q = torch.full((3, 4), 0.25, dtype=torch.float64), torch.full((3, 4), 0.25, dtype=torch.float64)
    with pytest.raises(ValueError, match="2 drafts need 2 draft rows and 3 target rows"):
        accept_drafts(p, q, [0, 1], torch.Generator())


def test_speculative_sampling_follows_the_target_law_end_to_end() -> None:
    target, drafter = build_models(DFlashVerifyCase())
    sampling = Sampling(temperature=0.05, top_k=2)
    prompt = [7, 40, 12]

    def p_next(prefix: list[int]) -> torch.Tensor:
        ids = torch.tensor([prompt + prefix])
        hidden = target(ids, torch.arange(ids.shape[1]), CausalAttention())
        return sampling.probs(target.logits(hidden[0, -1:]))[0]

    law: dict[tuple[int, ...], float] = {}
    first = p_next([])
    for a in first.nonzero().flatten().tolist():
        second = p_next([a])
        for b in second.nonzero().flatten().tolist():
            third = p_next([a, b])
            for c in third.nonzero().flatten().tolist():
                law[(a, b, c)] = float(first[a] * second[b] * third[c])
    assert len(law) == 8 and min(law.values()) > 0.01, law
    generator = torch.Generator().manual_seed(0)
    runs = 1500
    counts: Counter = Counter()
    taus: Counter = Counter()
    for _ in range(runs):
        result = speculative_generate(
            target, drafter, prompt, max_new_tokens=3, sampling=sampling, generator=generator
        )
        counts[tuple(result.tokens)] += 1
        taus[result.acceptance_lengths[0]] += 1
    assert _law_misses(counts, law, runs) == []
    assert taus[1] > 100 and taus[1] < runs  # rejections and acceptances both happen


def test_a_vanishing_temperature_reproduces_greedy_tokens_and_acceptance(trained_pair) -> None:  # noqa: ANN001, F811
    target, drafter, cycle = trained_pair
    sampling = Sampling(temperature=1e-9)
    for prompt in (cycle[:5].tolist(), [1, 2, 3], cycle[2:4].tolist() + [60, 61]):
        greedy = speculative_generate(target, drafter, prompt, max_new_tokens=20)
        sampled = speculative_generate(
            target, drafter, prompt, max_new_tokens=20, sampling=sampling, generator=torch.Generator().manual_seed(5)
        )
        assert sampled.tokens == greedy.tokens == greedy_generate(target, prompt, max_new_tokens=20).tokens
        assert sampled.acceptance_lengths == greedy.acceptance_lengths
    assert max(greedy.acceptance_lengths) > 1


def test_same_seed_same_output_and_checks() -> None:
    target, drafter = build_models(DFlashVerifyCase())
    sampling = Sampling(temperature=1.0)

    def run(seed: int) -> tuple[list[int], list[int]]:
        result = speculative_generate(
            target, drafter, [5, 6], max_new_tokens=12, sampling=sampling, generator=torch.Generator().manual_seed(seed)
        )
        return result.tokens, result.acceptance_lengths

    assert run(3) == run(3) and run(3) != run(4)
    with pytest.raises(ValueError, match="needs a generator"):
        speculative_generate(target, drafter, [5], max_new_tokens=2, sampling=sampling)
    with pytest.raises(ValueError, match="temperature > 0"):
        Sampling(temperature=0.0)
    _, dflash2 = build_models(DFlashVerifyCase(drafter_options={"selector_rank": 4, "selector_top_k": 4}))
    with pytest.raises(ValueError, match="greedy walk"):
        speculative_generate(
            dflash2.target, dflash2, [5], max_new_tokens=4, sampling=sampling, generator=torch.Generator()
        )
    assert "fix: temperature 0" in SELECTOR_SAMPLING_ERROR


def test_sampling_tables_are_all_possible_cells() -> None:
    # the toy law sums to one over the V^2 cells the check compares (no cell left out)
    target, _ = _toy_tables()
    total = sum(
        float(_toy_p(target, [])[a] * _toy_p(target, [a])[b]) for a, b in itertools.product(range(VOCAB), repeat=2)
    )
    assert total == pytest.approx(1.0, abs=1e-12)
