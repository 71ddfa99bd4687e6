"""Weighted cross-entropy through the LM head without materialising ``[R, V]`` logits.

``chunked_weighted_ce`` returns ``Σ_r weight_r · CE(hidden_r @ Wᵀ, label_r)`` (a scalar *sum*; the
caller divides by the global denominator). Rows are processed ``chunk_rows`` at a time; the
forward keeps only the per-row log-sum-exp, and the backward recomputes each chunk's logits, so at
most ``[chunk_rows, V]`` logits exist at once, in forward and in backward. Rows with label
``-100`` or weight 0 are dropped before the head, so unsupervised rows cost nothing.

``keep_logits=True`` skips that recompute when every kept row fits in one chunk: the forward's
logits of the only chunk are held for the backward (the same values, so the same gradients bit
for bit) and released by it. The backward then holds the same two ``[C, V]`` tensors as with the
recompute, so a caller that runs the backward right after the loss keeps the bound; a caller that
runs several losses before one backward (one call per packed-documents sample) must leave it off,
or the held logits of every call add up.

Numerics: the head matmul runs in the promoted dtype of ``hidden`` and ``W`` (bf16 stays bf16
so tensor cores are used); logits, softmax, CE and the weight-gradient accumulator are float32,
or float64 when an input is float64. Optional SUBS exclusion forces one vocabulary logit to
``-inf``; optional soft-capping applies ``c·tanh(z/c)`` before the exclusion.

Shape legend: ``R`` rows, ``C`` rows of one chunk, ``D`` hidden size, ``V`` vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

IGNORE_INDEX = -100


def _compute_dtypes(hidden_RD: Tensor, weight_VD: Tensor) -> tuple[torch.dtype, torch.dtype]:
    """``(matmul dtype, accumulation dtype)`` for a pair of head inputs."""
    matmul_dtype = torch.promote_types(hidden_RD.dtype, weight_VD.dtype)
    accum_dtype = torch.float64 if matmul_dtype == torch.float64 else torch.float32
    return matmul_dtype, accum_dtype


def _chunk_logits(hidden_CD: Tensor, weight_VD: Tensor, accum_dtype: torch.dtype) -> Tensor:
    """Raw logits ``[C, V]`` of one chunk in the accumulation dtype (the only ``[·, V]`` producer)."""
    return (hidden_CD @ weight_VD.t()).to(accum_dtype)


def _finish_logits(raw_CV: Tensor, exclude_token: int | None, logit_softcap: float | None) -> Tensor:
    """Soft-cap, then force the excluded token's logit to ``-inf``.

    Without a soft-cap the exclusion writes into ``raw_CV`` (callers only reuse ``raw_CV`` for the
    soft-cap derivative, in which case the capped logits are a fresh tensor).
    """
    logits_CV = raw_CV if logit_softcap is None else logit_softcap * torch.tanh(raw_CV / logit_softcap)
    if exclude_token is not None:
        logits_CV[:, exclude_token] = float("-inf")
    return logits_CV


class _ChunkedWeightedCE(torch.autograd.Function):
    """Sum of weighted CE over rows that all carry a label; backward recomputes logits per chunk."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden_RD: Tensor,
        weight_VD: Tensor,
        labels_R: Tensor,
        weights_R: Tensor,
        chunk_rows: int,
        exclude_token: int | None,
        logit_softcap: float | None,
        keep_logits: bool = False,
    ) -> Tensor:
        matmul_dtype, accum_dtype = _compute_dtypes(hidden_RD, weight_VD)
        hidden_mm = hidden_RD.to(matmul_dtype)
        weight_mm = weight_VD.to(matmul_dtype)
        row_weights_R = weights_R.to(accum_dtype)
        lse_R = torch.empty(hidden_RD.shape[0], dtype=accum_dtype, device=hidden_RD.device)
        total = torch.zeros((), dtype=accum_dtype, device=hidden_RD.device)
        ctx.raw_logits = None
        for start in range(0, hidden_RD.shape[0], chunk_rows):
            stop = min(start + chunk_rows, hidden_RD.shape[0])
            raw_CV = _chunk_logits(hidden_mm[start:stop], weight_mm, accum_dtype)
            if keep_logits and stop - start == hidden_RD.shape[0]:  # the only chunk: held for the backward
                ctx.raw_logits = raw_CV  # (finished in place below; finishing is idempotent)
            logits_CV = _finish_logits(raw_CV, exclude_token, logit_softcap)
            lse_C = torch.logsumexp(logits_CV, dim=1)
            label_logit_C = logits_CV.gather(1, labels_R[start:stop, None]).squeeze(1)
            total = total + (row_weights_R[start:stop] * (lse_C - label_logit_C)).sum()
            lse_R[start:stop] = lse_C
        ctx.save_for_backward(hidden_RD, weight_VD, labels_R, weights_R, lse_R)
        ctx.chunk_rows = chunk_rows
        ctx.exclude_token = exclude_token
        ctx.logit_softcap = logit_softcap
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: Tensor) -> tuple[Tensor | None, ...]:
        hidden_RD, weight_VD, labels_R, weights_R, lse_R = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        matmul_dtype, accum_dtype = _compute_dtypes(hidden_RD, weight_VD)
        hidden_mm = hidden_RD.to(matmul_dtype)
        weight_mm = weight_VD.to(matmul_dtype)
        row_scale_R = weights_R.to(accum_dtype) * grad_total.to(accum_dtype)
        grad_hidden_RD = torch.empty_like(hidden_RD) if need_hidden else None
        grad_weight_VD = (
            torch.zeros(weight_VD.shape, dtype=accum_dtype, device=weight_VD.device) if need_weight else None
        )
        softcap = ctx.logit_softcap
        held, ctx.raw_logits = ctx.raw_logits, None  # used once: a retained graph's next backward recomputes
        for start in range(0, hidden_RD.shape[0], ctx.chunk_rows):
            stop = min(start + ctx.chunk_rows, hidden_RD.shape[0])
            raw_CV = held if held is not None else _chunk_logits(hidden_mm[start:stop], weight_mm, accum_dtype)
            logits_CV = _finish_logits(raw_CV, ctx.exclude_token, softcap)
            # dCE/dz = softmax(z) - onehot(label); the excluded column has probability exactly 0.
            grad_CV = (logits_CV - lse_R[start:stop, None]).exp_()  # in place: one [C, V] buffer, not two
            rows_C = torch.arange(stop - start, device=grad_CV.device)
            grad_CV[rows_C, labels_R[start:stop]] -= 1.0
            grad_CV *= row_scale_R[start:stop, None]
            if softcap is not None:
                grad_CV *= 1.0 - torch.tanh(raw_CV / softcap) ** 2
            if ctx.exclude_token is not None:
                grad_CV[:, ctx.exclude_token] = 0.0
            grad_mm = grad_CV.to(matmul_dtype)
            if grad_hidden_RD is not None:
                grad_hidden_RD[start:stop] = (grad_mm @ weight_mm).to(hidden_RD.dtype)
            if grad_weight_VD is not None:
                grad_weight_VD += (grad_mm.t() @ hidden_mm[start:stop]).to(accum_dtype)
        if grad_weight_VD is not None:
            grad_weight_VD = grad_weight_VD.to(weight_VD.dtype)
        return grad_hidden_RD, grad_weight_VD, None, None, None, None, None, None


def _validate(
    hidden_RD: Tensor, weight_VD: Tensor, labels_R: Tensor, weights_R: Tensor, chunk_rows: int
) -> None:
    if hidden_RD.dim() != 2 or weight_VD.dim() != 2 or hidden_RD.shape[1] != weight_VD.shape[1]:
        raise ValueError(
            f"hidden {tuple(hidden_RD.shape)} and lm_head_weight {tuple(weight_VD.shape)} must be [R, D] and [V, D]"
        )
    rows = hidden_RD.shape[0]
    if tuple(labels_R.shape) != (rows,) or tuple(weights_R.shape) != (rows,):
        raise ValueError(
            f"labels {tuple(labels_R.shape)} and weights {tuple(weights_R.shape)} must both be [R]=[{rows}]"
        )
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows={chunk_rows} must be >= 1")


def chunked_weighted_ce(
    hidden: Tensor,
    lm_head_weight: Tensor,
    labels: Tensor,
    weights: Tensor,
    *,
    chunk_rows: int = 1024,
    exclude_token: int | None = None,
    logit_softcap: float | None = None,
    keep_logits: bool = False,
) -> Tensor:
    """``Σ_r weights[r] · CE(softcap(hidden[r] @ Wᵀ) with W[exclude] = -inf, labels[r])``.

    Args:
        hidden: ``[R, D]`` final hidden states of the rows that produce logits.
        lm_head_weight: ``[V, D]`` output embedding.
        labels: ``[R]`` int64 targets; ``-100`` rows are dropped.
        weights: ``[R]`` per-row weights (no gradient); weight-0 rows are dropped.
        chunk_rows: rows per chunk; at most ``[chunk_rows, V]`` logits exist at a time.
        exclude_token: vocabulary id whose logit is ``-inf`` (SUBS); a row labelled with it has
            infinite loss, so objectives must never produce such a label.
        logit_softcap: ``c`` of the final-logit soft-cap ``c·tanh(z/c)``, or ``None``.
        keep_logits: when the kept rows fit in one chunk, hold the forward's logits for the
            backward instead of recomputing them (module docstring: only for a backward that
            follows this one loss).

    Returns:
        A scalar (float32, or float64 for float64 inputs). If no row is kept it is an exact zero
        that still back-propagates zero gradients to ``hidden`` and ``lm_head_weight``.
    """
    _validate(hidden, lm_head_weight, labels, weights, chunk_rows)
    keep_R = (labels != IGNORE_INDEX) & (weights != 0)
    kept_index = keep_R.nonzero().squeeze(1)
    return _ChunkedWeightedCE.apply(
        hidden.index_select(0, kept_index),
        lm_head_weight,
        labels.index_select(0, kept_index).long(),
        weights.index_select(0, kept_index),
        chunk_rows,
        exclude_token,
        logit_softcap,
        keep_logits,
    )


@torch.no_grad()
def token_accuracy(
    hidden: Tensor,
    lm_head_weight: Tensor,
    labels: Tensor,
    *,
    chunk_rows: int = 1024,
    exclude_token: int | None = None,
) -> tuple[Tensor, Tensor]:
    """``(num_correct, num_labelled)`` int64 scalars: argmax hits over rows with a label.

    Soft-capping is monotone and cannot change the argmax, so it is not a parameter.
    """
    weights = torch.ones(labels.shape, dtype=torch.float32, device=labels.device)
    _validate(hidden, lm_head_weight, labels, weights, chunk_rows)
    kept_index = (labels != IGNORE_INDEX).nonzero().squeeze(1)
    hidden_RD = hidden.index_select(0, kept_index)
    labels_R = labels.index_select(0, kept_index)
    matmul_dtype, accum_dtype = _compute_dtypes(hidden_RD, lm_head_weight)
    weight_mm = lm_head_weight.to(matmul_dtype)
    correct = torch.zeros((), dtype=torch.long, device=hidden.device)
    for start in range(0, hidden_RD.shape[0], chunk_rows):
        stop = min(start + chunk_rows, hidden_RD.shape[0])
        logits_CV = _finish_logits(
            _chunk_logits(hidden_RD[start:stop].to(matmul_dtype), weight_mm, accum_dtype), exclude_token, None
        )
        correct += (logits_CV.argmax(dim=1) == labels_R[start:stop]).sum()
    return correct, torch.tensor(int(kept_index.numel()), dtype=torch.long, device=hidden.device)


@torch.no_grad()
def weighted_ce_per_row(
    hidden: Tensor,
    lm_head_weight: Tensor,
    labels: Tensor,
    weights: Tensor,
    *,
    chunk_rows: int = 1024,
    exclude_token: int | None = None,
) -> Tensor:
    """``[R]`` per-row ``weights[r] · CE(hidden[r] @ Wᵀ, labels[r])`` (no gradient), 0 on rows with label
    ``-100`` or weight 0; the terms :func:`chunked_weighted_ce` sums, with its numerics and chunking."""
    _validate(hidden, lm_head_weight, labels, weights, chunk_rows)
    matmul_dtype, accum_dtype = _compute_dtypes(hidden, lm_head_weight)
    weight_mm = lm_head_weight.to(matmul_dtype)
    per_row = torch.zeros(hidden.shape[0], dtype=accum_dtype, device=hidden.device)
    kept_index = ((labels != IGNORE_INDEX) & (weights != 0)).nonzero().squeeze(1)
    for start in range(0, kept_index.numel(), chunk_rows):
        rows = kept_index[start : start + chunk_rows]
        logits_CV = _finish_logits(
            _chunk_logits(hidden.index_select(0, rows).to(matmul_dtype), weight_mm, accum_dtype), exclude_token, None
        )
        label_logit_C = logits_CV.gather(1, labels.index_select(0, rows).long()[:, None]).squeeze(1)
        per_row[rows] = weights.index_select(0, rows).to(accum_dtype) * (torch.logsumexp(logits_CV, dim=1) - label_logit_C)
    return per_row
