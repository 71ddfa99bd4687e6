"""Forward KL through a shared LM head without materialising ``[R, V]`` logits, plus the no-grad
per-row scan the DFlash loss needs (label log-probability, argmax, top-K candidates).

``chunked_forward_kl(hidden, teacher, W, weights)`` returns
``Σ_r w_r · KL(softmax(W t_r) ‖ softmax(W h_r))``: the draft rows ``h`` and the teacher rows ``t``
(the target's final-normed hidden state one position earlier) share the target's LM head ``W``.
Forward keeps nothing of size ``V``; backward recomputes each chunk's logits
(``∂/∂z_draft = w·(softmax(z_draft) − p_teacher)``). Accumulation is float32, or float64 for
float64 inputs.

Shape legend: ``R`` rows, ``C`` rows of a chunk, ``D`` hidden, ``V`` vocabulary, ``K`` candidates.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from csbp.attention.merge import accumulation_dtype


class _ChunkedForwardKL(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden_RD: Tensor,
        teacher_RD: Tensor,
        weight_VD: Tensor,
        row_weights_R: Tensor,
        chunk_rows: int,
    ) -> Tensor:
        accum = accumulation_dtype(hidden_RD, weight_VD)
        total = torch.zeros((), dtype=accum, device=hidden_RD.device)
        for start in range(0, hidden_RD.shape[0], chunk_rows):
            stop = min(start + chunk_rows, hidden_RD.shape[0])
            log_draft = torch.log_softmax((hidden_RD[start:stop] @ weight_VD.t()).to(accum), dim=-1)
            log_teacher = torch.log_softmax(
                (teacher_RD[start:stop].to(weight_VD.dtype) @ weight_VD.t()).to(accum), -1
            )
            kl_C = (log_teacher.exp() * (log_teacher - log_draft)).sum(-1)
            total = total + (row_weights_R[start:stop].to(accum) * kl_C).sum()
        ctx.save_for_backward(hidden_RD, teacher_RD, weight_VD, row_weights_R)
        ctx.chunk_rows = chunk_rows
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: Tensor) -> tuple[Tensor | None, ...]:
        hidden_RD, teacher_RD, weight_VD, row_weights_R = ctx.saved_tensors
        accum = accumulation_dtype(hidden_RD, weight_VD)
        grad_hidden = torch.zeros_like(hidden_RD) if ctx.needs_input_grad[0] else None
        grad_weight = (
            torch.zeros(weight_VD.shape, dtype=accum, device=weight_VD.device)
            if ctx.needs_input_grad[2]
            else None
        )
        scale_R = row_weights_R.to(accum) * grad_total.to(accum)
        for start in range(0, hidden_RD.shape[0], ctx.chunk_rows):
            stop = min(start + ctx.chunk_rows, hidden_RD.shape[0])
            draft = torch.softmax((hidden_RD[start:stop] @ weight_VD.t()).to(accum), dim=-1)
            teacher = torch.softmax(
                (teacher_RD[start:stop].to(weight_VD.dtype) @ weight_VD.t()).to(accum), dim=-1
            )
            grad_CV = (draft - teacher) * scale_R[start:stop, None]
            if grad_hidden is not None:
                grad_hidden[start:stop] = (grad_CV.to(weight_VD.dtype) @ weight_VD).to(hidden_RD.dtype)
            if grad_weight is not None:
                grad_weight += grad_CV.t() @ hidden_RD[start:stop].to(accum)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight_VD.dtype)
        return grad_hidden, None, grad_weight, None, None


def chunked_forward_kl(
    hidden_RD: Tensor, teacher_RD: Tensor, weight_VD: Tensor, row_weights_R: Tensor, *, chunk_rows: int = 1024
) -> Tensor:
    """``Σ_r w_r · KL(p_teacher,r ‖ p_draft,r)`` (module docstring); the teacher rows, and W through
    the teacher logits, get no gradient (the teacher is a constant)."""
    if (
        hidden_RD.shape != teacher_RD.shape
        or hidden_RD.dim() != 2
        or row_weights_R.shape != hidden_RD.shape[:1]
    ):
        raise ValueError(
            f"hidden {tuple(hidden_RD.shape)}, teacher {tuple(teacher_RD.shape)} and weights "
            f"{tuple(row_weights_R.shape)} must be [R, D], [R, D] and [R]"
        )
    return _ChunkedForwardKL.apply(
        hidden_RD, teacher_RD.detach(), weight_VD, row_weights_R.detach(), chunk_rows
    )


@torch.no_grad()
def scan_rows(
    hidden_RD: Tensor, weight_VD: Tensor, labels_R: Tensor, *, chunk_rows: int = 1024, top_k: int = 0
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Per row: ``log p(label)`` (accumulation dtype), the argmax token and, if ``top_k > 0``, the
    top-K token ids ``[R, K]`` of ``softmax(W h)``."""
    accum = accumulation_dtype(hidden_RD, weight_VD)
    rows = hidden_RD.shape[0]
    log_prob = torch.empty(rows, dtype=accum, device=hidden_RD.device)
    argmax = torch.empty(rows, dtype=torch.long, device=hidden_RD.device)
    top = torch.empty(rows, top_k, dtype=torch.long, device=hidden_RD.device) if top_k > 0 else None
    for start in range(0, rows, chunk_rows):
        stop = min(start + chunk_rows, rows)
        logits_CV = (hidden_RD[start:stop] @ weight_VD.t()).to(accum)
        lse_C = torch.logsumexp(logits_CV, dim=-1)
        log_prob[start:stop] = logits_CV.gather(1, labels_R[start:stop, None]).squeeze(1) - lse_C
        argmax[start:stop] = logits_CV.argmax(dim=-1)
        if top is not None:
            top[start:stop] = logits_CV.topk(top_k, dim=-1).indices
    return log_prob, argmax, top
