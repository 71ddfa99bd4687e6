"""Per-step token choice of block-diffusion sampling: candidate tokens, confidences, which to unmask.

``propose_tokens`` turns the logits of the still-masked rows into one candidate token and one
confidence per row:

* the mask-token logit is set to ``-inf`` first (SUBS), so ``[M]`` is never proposed (Fast-dLLM
  v2's release keeps it in the softmax, so its confidences are a little lower);
* ``temperature == 0``: greedy, the arg-max token; its softmax probability is the confidence;
* ``temperature > 0``: logits are divided by the temperature, cut to the ``top_k`` largest and to
  the smallest set whose probability reaches ``top_p`` (nucleus), renormalised, and one token is
  drawn per row by inverting that distribution's cumulative sum at one uniform number ``u`` in
  ``[0, 1)`` (the first token whose cumulative probability exceeds ``u``); the confidence is the drawn
  token's probability under that distribution. Both ends are limits, not errors: a temperature so large that the
  tempered logits round to 0 (``1e300``) draws uniformly among the tokens ``top_k``/``top_p`` keep
  (ranked by the logits, which any temperature leaves in order), and a ``top_p`` below the best
  token's probability (``1e-300``) keeps that token alone.

Where the work runs. Everything over the vocabulary runs on the logits' device, batched over the
rows; only ``[R]`` tokens and confidences come back to the CPU. The randomness is one uniform per
sampled row, drawn from each sequence's own CPU generator (``draw_uniforms``): a seed draws the same
numbers on any device and in any batch, and a GPU does not wait on ``R x V`` random numbers made on
the host (``torch.multinomial`` with a CPU generator, the former draw, needed one exponential per
vocabulary entry, and the logits copied to the host).

Confidence under sampling. Using the tempered, truncated distribution is Fast-dLLM v2's convention
(its released ``sample_with_top_p`` returns the renormalised nucleus of ``softmax(logits / T)`` and
the threshold and arg-max read the drawn token's probability there; Dream's ``sample_tokens`` does
the same). LLaDA's ``generate`` instead ranks by the *untempered* ``softmax(logits)`` of the token
its Gumbel noise drew. The consequence here: as ``T -> 0+`` every confidence tends to 1, the ties
resolve to the leftmost positions, and sampling becomes greedy *left to right*, not the ``T == 0``
greedy most-confident-first order; ``T == 0`` is its own mode, not the limit of small temperatures.

``choose_unmasked`` picks which candidates are committed in this step: the ``k`` most confident
with ``k = ceil(remaining / remaining_steps)`` (so a block always finishes within its step budget),
or, with a ``threshold``, every candidate whose confidence exceeds it if those are more than ``k``.
The comparison is strict, as Fast-dLLM v2's released sampler (``x1_p > threshold``, plus the most
confident one): ``threshold = 1`` adds nothing to the schedule, even where a float32 softmax rounds a
confident proposal to exactly 1. A threshold picks by confidence, so it needs the confidence order.

Shape legend: ``R`` masked rows being decided, ``V`` vocabulary.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


class NonFiniteLogits(ValueError):
    """The model gave NaN or +inf logits: its weights diverged, and no token can be chosen from them."""


def check_sampling_options(
    temperature: float, top_k: int | None, top_p: float, threshold: float | None
) -> None:
    """``ValueError`` naming the bad option."""
    if not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 (or unset), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must lie in (0, 1], got {top_p}")
    if threshold is not None and not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must lie in [0, 1] (a probability), got {threshold}")


def draw_uniforms(count: int, generator: torch.Generator) -> Tensor:
    """``count`` uniforms in ``[0, 1)`` (float64, CPU) from ``generator``: one sampled row's randomness each."""
    return torch.rand(count, generator=generator, dtype=torch.float64)


def propose_tokens(
    logits_RV: Tensor,
    *,
    mask_token_id: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    uniforms_R: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """``(tokens [R] int64, confidence [R])`` on the CPU (see the module docstring). A positive
    temperature draws with ``uniforms_R`` (one per row, from :func:`draw_uniforms`) or, without them,
    ``R`` uniforms from ``generator``."""
    num_rows, vocab = logits_RV.shape
    if not 0 <= mask_token_id < vocab:
        raise ValueError(f"mask_token_id {mask_token_id} is outside the model vocabulary of {vocab}")
    if temperature > 0.0:
        if uniforms_R is None:
            if generator is None:
                raise ValueError("sampling at a positive temperature needs a generator (or uniforms_R)")
            uniforms_R = draw_uniforms(num_rows, generator)
        if tuple(uniforms_R.shape) != (num_rows,):
            raise ValueError(f"uniforms_R has shape {tuple(uniforms_R.shape)}, expected ({num_rows},): one per row")
    compute_dtype = torch.float64 if logits_RV.dtype == torch.float64 else torch.float32
    logits_RV = logits_RV.detach().to(dtype=compute_dtype, copy=True)
    logits_RV[:, mask_token_id] = float("-inf")
    if bool((torch.isnan(logits_RV) | torch.isposinf(logits_RV)).any()):  # -inf is a token ruled out
        # torch.multinomial raised a RuntimeError traceback on them, and the greedy arg-max chose a NaN silently
        raise NonFiniteLogits(
            "the model's logits are not finite (NaN or inf): its weights diverged, so no token can be chosen "
            "(fix: sample a checkpoint trained without a non-finite loss; lower optim.lr and train it again)"
        )
    if temperature == 0.0:
        probs_RV = torch.softmax(logits_RV, dim=-1)
        confidence_R, tokens_R = probs_RV.max(dim=-1)
        return tokens_R.cpu(), confidence_R.cpu()
    probs_RV = tempered_probs(logits_RV, temperature=temperature, top_k=top_k, top_p=top_p)
    tokens_R = invert_cdf(probs_RV, uniforms_R.to(device=probs_RV.device, dtype=torch.float64))
    confidence_R = probs_RV.gather(-1, tokens_R[:, None]).squeeze(-1)
    return tokens_R.cpu(), confidence_R.cpu()


def tempered_probs(logits_RV: Tensor, *, temperature: float, top_k: int | None = None, top_p: float = 1.0) -> Tensor:
    """The distribution a positive ``temperature`` samples from (module docstring): ``softmax(logits / T)``
    cut to the ``top_k`` largest logits and to the ``top_p`` nucleus, renormalised; ``[R, V]`` in the
    logits' dtype. Logits of ``-inf`` (tokens ruled out) keep probability 0."""
    # Shift by the row maximum first (softmax is shift-invariant): the best tokens are 0 and stay 0,
    # the rest are < 0, so a tiny temperature (even one that underflows to 0 in the logits' dtype)
    # sends them to -inf instead of giving inf - inf = nan in the softmax: the arg-max limit.
    shifted_RV = logits_RV - logits_RV.max(dim=-1, keepdim=True).values
    if top_k is not None and top_k < logits_RV.shape[-1]:
        # ranked by the logits: a temperature keeps their order, but one past the dtype's range makes
        # every tempered value 0, a tie that would keep every token
        kth_largest_R1 = torch.topk(shifted_RV, top_k, dim=-1).values[:, -1:]
        shifted_RV = shifted_RV.masked_fill(shifted_RV < kth_largest_R1, float("-inf"))
    # -inf (the mask, tokens cut above) stays -inf: a temperature past the dtype's range (1e300 in
    # float32) is inf there, and -inf / inf was nan; finite logits / inf = 0, the uniform limit
    tempered_RV = torch.isfinite(shifted_RV) & (shifted_RV != 0)
    scaled_RV = torch.where(tempered_RV, shifted_RV / temperature, shifted_RV)
    if top_p < 1.0:
        scaled_RV = _nucleus(scaled_RV, top_p, ranking_RV=shifted_RV)
    return torch.softmax(scaled_RV, dim=-1)


def invert_cdf(probs_RV: Tensor, uniforms_R: Tensor) -> Tensor:
    """Per row, the first token whose cumulative probability (float64) exceeds ``u`` times the row's
    total: a draw from ``probs_RV``. A token of probability 0 is never the first to exceed a value, so
    only where ``u * total`` rounds up to the total would the search run past the last possible token;
    it is held at that token."""
    cdf_RV = torch.cumsum(probs_RV, dim=-1, dtype=torch.float64)
    targets_R1 = uniforms_R[:, None] * cdf_RV[:, -1:]
    tokens_R = torch.searchsorted(cdf_RV, targets_R1, right=True).squeeze(-1)
    vocab = probs_RV.shape[-1]
    last_possible_R = (vocab - 1) - torch.argmax((probs_RV.flip(-1) > 0).to(torch.int8), dim=-1)
    return torch.minimum(tokens_R, last_possible_R)


def _nucleus(scaled_RV: Tensor, top_p: float, *, ranking_RV: Tensor | None = None) -> Tensor:
    """Keep the most probable tokens whose cumulative probability first reaches ``top_p``, ranked by
    ``ranking_RV`` (the untempered logits: the same order, kept where a huge temperature made every
    tempered value 0) or else by ``scaled_RV``; the most probable token is always kept."""
    _, order_RV = torch.sort(scaled_RV if ranking_RV is None else ranking_RV, dim=-1, descending=True, stable=True)
    probs_RV = torch.softmax(scaled_RV.gather(-1, order_RV), dim=-1)
    mass_before_RV = probs_RV.cumsum(dim=-1) - probs_RV  # probability of strictly better tokens
    drop_sorted_RV = mass_before_RV >= top_p
    drop_sorted_RV[:, 0] = False  # a top_p below the dtype's smallest number (1e-300 in float32) is 0 there
    drop_RV = torch.zeros_like(drop_sorted_RV).scatter(-1, order_RV, drop_sorted_RV)
    return scaled_RV.masked_fill(drop_RV, float("-inf"))


def unmask_count(remaining: int, remaining_steps: int) -> int:
    """``ceil(remaining / remaining_steps)``: the schedule that finishes exactly on the last step."""
    if remaining_steps < 1:
        raise ValueError(f"remaining_steps must be >= 1, got {remaining_steps}")
    return -(-remaining // remaining_steps)


UNMASK_ORDERS = ("confidence", "left_to_right", "random")

#: a threshold unmasks the proposals above it; another order would unmask as many other positions instead
THRESHOLD_ORDER_ERROR = (
    "threshold unmasks the proposals more confident than it, so it needs unmask_order 'confidence' "
    "(with 'left_to_right' or 'random' as many other positions were unmasked instead, confident or not)"
)


def choose_unmasked(
    confidence_R: Tensor,
    *,
    remaining_steps: int,
    threshold: float | None = None,
    order: str = "confidence",
    generator: torch.Generator | None = None,
) -> Tensor:
    """Indices (into the ``R`` candidates) to unmask now: the most confident, most confident first and
    ties leftmost (``order="confidence"``), or the leftmost, in position order (``"left_to_right"``: each
    token then sees every token before it, which keeps a briefly trained model from joining word pieces
    chosen in parallel), or a uniformly random set drawn from ``generator`` (``"random"``: the masked
    diffusion models' own reverse process, whose unmasked positions do not depend on the model; with
    one step per position it is bd3lms' first-hitting sampler, one random position per step)."""
    remaining = int(confidence_R.shape[0])
    count = unmask_count(remaining, remaining_steps)
    if threshold is not None:
        if order != "confidence":
            raise ValueError(THRESHOLD_ORDER_ERROR)
        count = max(count, int((confidence_R > threshold).sum()))
    if order == "left_to_right":
        return torch.arange(min(count, remaining), device=confidence_R.device)
    if order == "random":
        if generator is None:
            raise ValueError("unmask order 'random' needs a generator")
        return torch.randperm(remaining, generator=generator)[: min(count, remaining)].to(confidence_R.device)
    if order != "confidence":
        raise ValueError(f"unmask order {order!r} is not one of {UNMASK_ORDERS}")
    order_R = torch.argsort(confidence_R, descending=True, stable=True)
    return order_R[: min(count, remaining)]
