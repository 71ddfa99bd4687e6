"""Lossless greedy speculative decoding with a DFlash drafter, and the plain greedy baseline
(objectives.md §7); speculative sampling at a positive temperature (below).

::

    prefill: target on the prompt (KV cache) -> bonus = argmax at the last row;
             F = target features of the prompt positions 0 … P−1;  start = P
    round:   block = [bonus, M, …, M] at positions start … start+B−1
             drafter(block, context = F of every committed position < start, draft cache)
             drafts = greedy (argmax of the target's LM head; DFlash2: the selector's greedy walk)
             verify: ONE target forward over [bonus, drafts] -> y[j] = argmax at slot j
             A = longest prefix with drafts[j] == y[j]          (0 <= A <= B−1)
             commit drafts[:A] and y[A] (the new bonus);  τ = A + 1
             crop the target cache to start + A + 1; F += features of slots 0 … A; start += A + 1

Every committed token is the target's own greedy choice given the committed prefix, so the output
equals :func:`greedy_generate` token for token, whatever the drafter proposes (an untrained drafter
only lowers τ). The draft cache holds context K/V of verified positions only (the block rows are
never cached), so it never holds a rejected position; it is cropped to ``start`` each round to keep
that invariant explicit.

With ``sampling`` (a temperature > 0, optionally ``top_k``/``top_p``) the same loop runs lossless
speculative *sampling* (:mod:`csbp.dflash.sampling`): the prefill's token is drawn from the target's
distribution, each draft ``j`` from the drafter's distribution ``q_j`` of slot ``j``, and the verify
forward's distributions ``p_j`` accept draft ``j`` with probability ``min(1, p_j/q_j)``; the first
rejection commits a token drawn from ``normalize(max(0, p_j − q_j))``, a fully accepted block one
drawn from ``p`` of the last row. The output is then distributed as the target's own sampling, and
``τ`` counts the same way. Without ``sampling`` (temperature 0) nothing of it runs.

Stopping: after the first EOS (kept; ``eos_id`` may list several stop ids, e.g. a chat model's end
of turn and end of text) or ``max_new_tokens`` new tokens; a last round may verify more tokens than
are kept, and its ``τ`` counts them all (as z-lab's benchmark does: ``τ`` measures the drafter, the
truncation is the caller's budget). Counting: the prefill commits one token, round ``r`` commits ``τ_r`` tokens,
so before truncation ``len(tokens) == 1 + Σ τ_r``; the target runs ``1 + rounds`` forwards, plain
greedy one per new token.

Shape legend: ``B`` block size, ``M`` new context rows, ``F`` fused feature width, ``D`` hidden.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from csbp.dflash.attention import DenseDraftAttention, DraftAttentionFn, UnmaskedDraftAttention
from csbp.dflash.drafter import DFlashDrafter, DraftContextCache
from csbp.dflash.sampling import Sampling, accept_drafts, draw_tokens
from csbp.dflash.target_cache import CachedTarget
from csbp.models.decoder import Decoder


@dataclass(frozen=True)
class GreedyResult:
    """Plain greedy decoding: the new ``tokens`` and the target forwards it took."""

    tokens: list[int]
    target_forwards: int
    stopped_at_eos: bool


@dataclass(frozen=True)
class SpeculativeResult:
    """Speculative decoding of one prompt.

    Attributes:
        tokens: new tokens (after the prompt), truncated at EOS / ``max_new_tokens``.
        acceptance_lengths: ``τ_r = A_r + 1`` per verify round, each in ``[1, B]``.
        committed_tokens: tokens committed before truncation (``1 + Σ τ_r``).
        target_forwards: target forward passes (prefill + one per round).
        stopped_at_eos: the output ends with EOS.
    """

    tokens: list[int]
    acceptance_lengths: list[int]
    committed_tokens: int
    target_forwards: int
    stopped_at_eos: bool

    @property
    def rounds(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def mean_acceptance_length(self) -> float:
        """Mean ``τ_r`` over this prompt's rounds (nan without a round)."""
        if not self.acceptance_lengths:
            return float("nan")
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths)


def _prompt_tensor(prompt_ids: Sequence[int] | Tensor, vocab_size: int) -> Tensor:
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten()
    if prompt.numel() == 0:
        raise ValueError("the prompt is empty; speculative decoding needs at least one prompt token")
    if int(prompt.min()) < 0 or int(prompt.max()) >= vocab_size:
        raise ValueError(
            f"prompt token ids must be in [0, {vocab_size}), got [{int(prompt.min())}, {int(prompt.max())}]"
        )
    return prompt


def _check_budget(max_new_tokens: int) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")


StopIds = int | Sequence[int] | None
"""The token id(s) that end an output (kept); None: always ``max_new_tokens`` tokens."""


def _stop_ids(eos_id: StopIds, vocab_size: int) -> frozenset[int]:
    """``eos_id`` as a set, each id checked against the target vocabulary."""
    listed = [] if eos_id is None else [eos_id] if hasattr(eos_id, "__index__") else list(eos_id)  # type: ignore[arg-type]
    ids = []
    for stop in listed:
        if isinstance(stop, bool) or not hasattr(stop, "__index__") or not 0 <= operator.index(stop) < vocab_size:
            raise ValueError(
                f"eos_id {stop!r} is outside the target vocabulary [0, {vocab_size}): it could never be "
                "generated (pass the tokenizer's EOS id, or None to always generate max_new_tokens)"
            )
        ids.append(operator.index(stop))
    return frozenset(ids)


def _finished(tokens: list[int], max_new_tokens: int, stops: frozenset[int]) -> bool:
    return len(tokens) >= max_new_tokens or not stops.isdisjoint(tokens)


def _truncate(tokens: list[int], max_new_tokens: int, stops: frozenset[int]) -> tuple[list[int], bool]:
    kept = tokens[:max_new_tokens]
    for index, token in enumerate(kept):
        if token in stops:
            return kept[: index + 1], True
    return kept, False


@torch.no_grad()
def greedy_generate(
    target: Decoder, prompt_ids: Sequence[int] | Tensor, *, max_new_tokens: int, eos_id: StopIds = None
) -> GreedyResult:
    """The target's own greedy decoding with a KV cache: one target forward per new token."""
    _check_budget(max_new_tokens)
    stops = _stop_ids(eos_id, target.config.vocab_size)
    prompt = _prompt_tensor(prompt_ids, target.config.vocab_size)
    runner = CachedTarget(target)
    tokens = [int(runner.forward(prompt).next_tokens[-1])]
    while not _finished(tokens, max_new_tokens, stops):
        tokens.append(int(runner.forward(torch.tensor([tokens[-1]])).next_tokens[0]))
    kept, at_eos = _truncate(tokens, max_new_tokens, stops)
    return GreedyResult(kept, runner.forward_passes, at_eos)


def inference_draft_attention(drafter: DFlashDrafter, block_start: int) -> DraftAttentionFn:
    """Draft attention of one block at ``block_start`` over context positions ``0 … block_start−1``.

    Full-attention drafters: no mask. Sliding layers: the training predicate (objectives.md §5.5,
    ``allow_DF_SW``): slot ``j`` sees context ``k >= block_start + j − (W−1)`` and, when the layers
    are causal in the block, block slots ``<= j``.
    """
    cfg = drafter.config
    if "sliding_attention" not in (cfg.layer_types or ()):
        return UnmaskedDraftAttention()
    block = cfg.block_size
    device = drafter.fc.weight.device
    slot_B = torch.arange(block, device=device)
    context_M = torch.arange(block_start, device=device)
    full_BK = torch.ones(block, block_start + block, dtype=torch.bool, device=device)
    assert cfg.sliding_window is not None
    window_ctx_BM = context_M[None, :] >= block_start + slot_B[:, None] - (cfg.sliding_window - 1)
    window_blk_BB = torch.ones(block, block, dtype=torch.bool, device=device)
    if cfg.sliding_window_causal:
        window_blk_BB = slot_B[None, :] <= slot_B[:, None]
    sliding_BK = torch.cat((window_ctx_BM, window_blk_BB), dim=1)
    return DenseDraftAttention(
        [sliding_BK if t == "sliding_attention" else full_BK for t in cfg.layer_types or ()]
    )


def _draft_hidden(
    drafter: DFlashDrafter,
    bonus_token: int,
    block_start: int,
    new_context_features_MF: Tensor,
    cache: DraftContextCache,
) -> Tensor:
    """The drafter's last hidden states ``[B, D]`` of the block ``[bonus, M, …, M]`` at ``block_start``."""
    cfg = drafter.config
    device = drafter.fc.weight.device
    cached = len(cache)
    if cached + new_context_features_MF.shape[0] != block_start:
        raise ValueError(
            f"draft context covers positions [0, {cached + new_context_features_MF.shape[0]}) but the block "
            f"starts at {block_start}; pass the features of every committed position before the block"
        )
    ids_1B = drafter.block_input_ids(torch.tensor([bonus_token]))[None].to(device)
    hidden_1BD = drafter(
        drafter.embed(ids_1B),
        block_start + torch.arange(cfg.block_size, device=device),
        new_context_features_MF[None].to(device),
        torch.arange(cached, block_start, device=device),
        inference_draft_attention(drafter, block_start),
        cache=cache,
    )
    cache.crop(block_start)  # only verified context rows are ever cached (module docstring)
    return hidden_1BD[0]


@torch.no_grad()
def draft_block(
    drafter: DFlashDrafter,
    bonus_token: int,
    block_start: int,
    new_context_features_MF: Tensor,
    cache: DraftContextCache,
) -> list[int]:
    """The ``B−1`` greedy drafts after ``bonus_token`` at ``block_start``.

    ``new_context_features_MF`` are the target features of positions ``len(cache) … block_start−1``
    (appended to ``cache``), so the drafter sees every committed position strictly before the block.
    """
    hidden_BD = _draft_hidden(drafter, bonus_token, block_start, new_context_features_MF, cache)
    if drafter.selector is not None:
        drafts = drafter.selector.greedy_decode(hidden_BD, drafter.lm_head_weight, bonus_token)
    else:
        drafts = drafter.logits(hidden_BD[1:]).argmax(dim=-1)
    return [int(t) for t in drafts]


@torch.no_grad()
def draft_distributions(
    drafter: DFlashDrafter,
    bonus_token: int,
    block_start: int,
    new_context_features_MF: Tensor,
    cache: DraftContextCache,
    sampling: Sampling,
) -> Tensor:
    """``q [B−1, V]`` (float64): the drafter's distribution of each draft slot under ``sampling``, as
    :func:`draft_block` reads its arguments. DFlash2's selector re-scores slot ``j`` given draft
    ``j−1`` (a greedy walk), which has no per-slot distribution here: refused."""
    if drafter.selector is not None:
        raise ValueError(SELECTOR_SAMPLING_ERROR)
    hidden_BD = _draft_hidden(drafter, bonus_token, block_start, new_context_features_MF, cache)
    return sampling.probs(drafter.logits(hidden_BD[1:]))


SELECTOR_SAMPLING_ERROR = (
    "speculative sampling (temperature > 0) drafts each slot from the drafter's own logits, but a DFlash2 "
    "drafter with a candidate selector drafts by a greedy walk (fix: temperature 0)"
)


@torch.no_grad()
def speculative_generate(
    target: Decoder,
    drafter: DFlashDrafter,
    prompt_ids: Sequence[int] | Tensor,
    *,
    max_new_tokens: int,
    eos_id: StopIds = None,
    sampling: Sampling | None = None,
    generator: torch.Generator | None = None,
) -> SpeculativeResult:
    """DFlash speculative decoding of one prompt; lossless. Greedy (module docstring) without
    ``sampling``; with it, speculative sampling (:mod:`csbp.dflash.sampling`) drawing from ``generator``."""
    _check_budget(max_new_tokens)
    if drafter.target is not target:
        raise ValueError("the drafter is attached to another target: call drafter.attach_target(target)")
    if sampling is not None and generator is None:
        raise ValueError("speculative sampling needs a generator (torch.Generator().manual_seed(seed))")
    if sampling is not None and drafter.selector is not None:
        raise ValueError(SELECTOR_SAMPLING_ERROR)
    stops = _stop_ids(eos_id, target.config.vocab_size)
    prompt = _prompt_tensor(prompt_ids, target.config.vocab_size)
    cfg = drafter.config
    runner = CachedTarget(target, cfg.target_layer_ids or ())
    draft_cache = DraftContextCache()
    prefill = runner.forward(prompt)
    assert prefill.features is not None
    if sampling is None:
        tokens = [int(prefill.next_tokens[-1])]
    else:
        assert generator is not None
        tokens = draw_tokens(sampling.probs(prefill.logits[-1:]), generator)
    pending_features_MF = prefill.features  # committed positions not yet in the draft cache
    del prefill  # its [P, V] logits: not held through the whole generation
    start = int(prompt.shape[0])  # position of the bonus token tokens[-1]
    acceptance: list[int] = []
    while not _finished(tokens, max_new_tokens, stops):
        bonus = tokens[-1]
        if sampling is None:
            drafts = draft_block(drafter, bonus, start, pending_features_MF, draft_cache)
            verified = runner.forward(torch.tensor([bonus, *drafts]))
            target_choice = [int(t) for t in verified.next_tokens]
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == target_choice[accepted]:
                accepted += 1
            after = target_choice[accepted]
        else:
            assert generator is not None
            q_KV = draft_distributions(drafter, bonus, start, pending_features_MF, draft_cache, sampling)
            drafts = draw_tokens(q_KV, generator)
            verified = runner.forward(torch.tensor([bonus, *drafts]))
            accepted, after = accept_drafts(sampling.probs(verified.logits), q_KV, drafts, generator)
        assert verified.features is not None
        tokens += drafts[:accepted] + [after]
        acceptance.append(accepted + 1)
        runner.crop(start + accepted + 1)
        pending_features_MF = verified.features[: accepted + 1]
        start += accepted + 1
    kept, at_eos = _truncate(tokens, max_new_tokens, stops)
    return SpeculativeResult(kept, acceptance, len(tokens), runner.forward_passes, at_eos)
