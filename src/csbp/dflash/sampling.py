"""Lossless speculative *sampling* (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"; Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling") for a
DFlash drafter: the rule :func:`csbp.dflash.speculative.speculative_generate` applies at a positive
temperature.

Both models' logits are turned into distributions the same way (:class:`Sampling`: ``softmax(logits / T)``
cut to ``top_k`` / the ``top_p`` nucleus, :func:`csbp.generation.token_choice.tempered_probs`): ``q_j``
from the drafter's logits at block slot ``j`` (DFlash drafts the whole block in one forward, so slot
``j``'s proposal does not depend on the drafts before it), ``p_j`` from the target's verify row that
predicts draft ``j``. Per round, with ``K = B − 1`` drafts:

::

    x_j ~ q_j                          for j = 1 … K   (K uniforms, one per slot)
    accept x_j  iff  u_j · q_j(x_j) < p_j(x_j)        (probability min(1, p_j(x_j) / q_j(x_j)))
    first rejection at j: commit x_1 … x_{j−1} and y ~ normalize(max(0, p_j − q_j))
    all K accepted:       commit x_1 … x_K    and y ~ p_{K+1}  (the bonus row)

Every committed token is then distributed exactly as the target's own sampling (with the same
temperature, ``top_k`` and ``top_p``) given the committed prefix, whatever the drafter proposes
(``tests/test_dflash_sampling.py`` checks it by frequencies over seeded runs). All randomness comes
from one ``torch.Generator`` (CPU, float64 uniforms, drawn in a fixed order: the ``K`` draft
uniforms, the ``K`` acceptance uniforms, one for the correction or bonus token), so a seed
reproduces a run on any device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from csbp.generation.token_choice import check_sampling_options, draw_uniforms, invert_cdf, tempered_probs


@dataclass(frozen=True)
class Sampling:
    """How logits become the distribution both models sample from: ``temperature > 0`` (0 is greedy
    decoding, which takes no :class:`Sampling`), ``top_k`` largest logits, ``top_p`` nucleus."""

    temperature: float
    top_k: int | None = None
    top_p: float = 1.0

    def __post_init__(self) -> None:
        check_sampling_options(self.temperature, self.top_k, self.top_p, None)
        if self.temperature == 0:
            raise ValueError("Sampling needs temperature > 0; temperature 0 is greedy decoding (pass no Sampling)")

    def probs(self, logits_NV: Tensor) -> Tensor:
        """``[N, V]`` float64 distributions of ``N`` rows of logits (on their device)."""
        return tempered_probs(
            logits_NV.detach().to(torch.float64), temperature=self.temperature, top_k=self.top_k, top_p=self.top_p
        )


def draw_tokens(probs_NV: Tensor, generator: torch.Generator) -> list[int]:
    """One token per row of ``probs_NV``, from ``N`` uniforms of ``generator``."""
    uniforms_N = draw_uniforms(int(probs_NV.shape[0]), generator).to(probs_NV.device)
    return [int(t) for t in invert_cdf(probs_NV, uniforms_N)]


def residual(p_V: Tensor, q_V: Tensor) -> Tensor:
    """``max(0, p − q)`` (unnormalised: :func:`draw_tokens` normalises). Only where ``p == q`` is it
    all zero, and then a rejection has probability 0; rounding can still reject there, so ``p`` is
    returned instead of a zero distribution."""
    surplus_V = (p_V - q_V).clamp_min(0.0)
    return surplus_V if bool(surplus_V.sum() > 0) else p_V


def accept_drafts(
    p_BV: Tensor, q_KV: Tensor, drafts: list[int], generator: torch.Generator
) -> tuple[int, int]:
    """``(A, y)``: the accepted drafts ``0 <= A <= K`` and the token committed after them (module docstring).

    ``p_BV`` holds the target's distributions of the verify rows ``0 … K`` (row ``j`` predicts draft
    ``j``, 0-based; row ``K`` the bonus), ``q_KV`` the drafter's of the ``K`` drafts."""
    num_drafts = len(drafts)
    if tuple(q_KV.shape[:1]) != (num_drafts,) or tuple(p_BV.shape[:1]) != (num_drafts + 1,):
        raise ValueError(
            f"{num_drafts} drafts need {num_drafts} draft rows and {num_drafts + 1} target rows, got "
            f"{q_KV.shape[0]} and {p_BV.shape[0]}"
        )
    index_K1 = torch.tensor(drafts, dtype=torch.long, device=q_KV.device).view(-1, 1)
    p_at_K = p_BV[:num_drafts].gather(1, index_K1).squeeze(1).cpu()
    q_at_K = q_KV.gather(1, index_K1).squeeze(1).cpu()
    uniforms_K = draw_uniforms(num_drafts, generator)
    for slot in range(num_drafts):
        if not uniforms_K[slot] * q_at_K[slot] < p_at_K[slot]:
            corrected = residual(p_BV[slot], q_KV[slot])
            return slot, draw_tokens(corrected[None], generator)[0]
    return num_drafts, draw_tokens(p_BV[num_drafts:], generator)[0]
