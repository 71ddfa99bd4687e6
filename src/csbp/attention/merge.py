"""Online-softmax merge of attention partials ``(out, lse)`` over disjoint key subsets (csbp.md §9.2).

A partial over key subset ``s`` is the normalised output ``out_s [..., N, d]`` and the natural-log
log-sum-exp ``lse_s [..., N]`` of the scaled scores of the allowed keys of ``s``; a row that sees
no key of ``s`` has ``out_s = 0`` and ``lse_s = -inf``. Merging uses the stable form::

    lse = logaddexp(lse_1, lse_2)
    out = exp(lse_1 - lse) * out_1 + exp(lse_2 - lse) * out_2   # run as lerp(out_1, out_2, exp(lse_2 - lse))

so empty partials contribute nothing and rows that are empty in every partial stay ``out = 0``,
``lse = -inf`` without NaN (also in autograd through the merge). Everything is computed in the
accumulation dtype: float64 when any input is float64, float32 otherwise (bf16 partials would lose
accuracy with every merge).

``partial_grads_from_merged`` is the matching chain rule: the gradient that reaches one partial
from the gradient of the merged output.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch
from torch import Tensor


def accumulation_dtype(*tensors: Tensor) -> torch.dtype:
    """float64 when any tensor is float64, float32 otherwise (also for bf16/fp16 inputs)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def merge_partials(out1: Tensor, lse1: Tensor, out2: Tensor, lse2: Tensor) -> tuple[Tensor, Tensor]:
    """Merge two partials ``(out [..., N, d], lse [..., N])`` into the partial over the union of keys.

    Returns ``(out, lse)`` in the accumulation dtype of the inputs.
    """
    _check_pair("merge_partials", out1, lse1, out2, lse2)
    dtype = accumulation_dtype(out1, lse1, out2, lse2)
    lse1, lse2 = lse1.to(dtype), lse2.to(dtype)
    lse = _logaddexp(lse1, lse2)
    # the two weights sum to one, so out = out1 + w2 * (out2 - out1): one pass over the outputs (lerp)
    # instead of three (two scalings and a sum); exact at w2 = 0 and 1 (rows empty in one partial)
    out = torch.lerp(out1.to(dtype), out2.to(dtype), _merge_weights(lse2, lse).unsqueeze(-1))
    return out, lse


def merge_into(out: Tensor, lse: Tensor, out2: Tensor, lse2: Tensor) -> None:
    """Merge ``(out2, lse2)`` into ``(out, lse)`` in place (views allowed: a slice of rows stays a
    slice, without merging into a copy and copying back); ``out`` and ``lse`` must already be in the
    accumulation dtype, ``out2`` may be in a kernel's (bf16). The same arithmetic as ``merge_partials``;
    on CUDA in fp32 one compiled, fused pass (``out2`` cast as it is read, no cast pass before the
    merge), elsewhere eagerly."""
    dtype = accumulation_dtype(out, lse, out2, lse2)
    if out.dtype != dtype or lse.dtype != dtype:
        raise ValueError(f"merge_into: out ({out.dtype}) and lse ({lse.dtype}) must be in the accumulation dtype {dtype}")
    _check_pair("merge_into", out, lse, out2, lse2)
    _on_cuda_compiled(_merge_in_place, out, dtype)(out, lse, out2, lse2)


def _merge_in_place(out: Tensor, lse: Tensor, out2: Tensor, lse2: Tensor) -> None:
    lse2 = lse2.to(lse.dtype)
    merged = _logaddexp(lse, lse2)
    out.lerp_(out2.to(out.dtype), _merge_weights(lse2, merged).unsqueeze(-1))
    lse.copy_(merged)


def merge_into_rounded(out: Tensor, lse: Tensor, out2: Tensor, lse2: Tensor) -> None:
    """``merge_into`` for an ``out`` in the kernels' dtype (bf16): ``(out2, lse2)`` merged into ``(out,
    lse)`` in place (views allowed), every step in the accumulation dtype (``lse``'s) and the result
    rounded once as it is written. On CUDA one compiled, fused pass (read ``out`` and ``out2``, write
    ``out``) instead of an fp32 buffer's casts and merge; elsewhere the same arithmetic eagerly."""
    if lse.dtype != accumulation_dtype(lse):
        raise ValueError(f"merge_into_rounded: lse ({lse.dtype}) must be in the accumulation dtype")
    _check_pair("merge_into_rounded", out, lse, out2, lse2)
    _on_cuda_compiled(_rounded_merge, out, lse.dtype)(out, lse, out2, lse2)


def _rounded_merge(out: Tensor, lse: Tensor, out2: Tensor, lse2: Tensor) -> None:
    dtype = lse.dtype
    lse2 = lse2.to(dtype)
    merged = _logaddexp(lse, lse2)
    out.copy_(torch.lerp(out.to(dtype), out2.to(dtype), _merge_weights(lse2, merged).unsqueeze(-1)))
    lse.copy_(merged)


def row_delta(dout: Tensor, out: Tensor, dtype: torch.dtype) -> Tensor:
    """``delta = rowsum(dout * out)`` (``[..., N]``) in ``dtype`` (the accumulation dtype), the row term of
    every partial's backward. ``dout`` (bf16 in training) is promoted inside the product as it is read,
    instead of a separate cast pass over it: the same values as casting first. On CUDA in fp32 one
    compiled pass (read ``dout`` and ``out``, write ``delta``) instead of a cast, a product and a sum."""
    return _on_cuda_compiled(_row_delta, out, dtype)(dout, out, dtype)


def _row_delta(dout: Tensor, out: Tensor, dtype: torch.dtype) -> Tensor:
    return (dout * out.to(dtype)).sum(-1, dtype=dtype)


def _on_cuda_compiled(fn: Callable[..., object], tensor: Tensor, dtype: torch.dtype) -> Callable[..., object]:
    """``fn`` compiled (``compiled``) for fp32 work on CUDA, where each eager op is a launch and a pass
    through memory; ``fn`` itself elsewhere (the CPU, and float64 exactness checks on CUDA)."""
    return compiled(fn) if tensor.device.type == "cuda" and dtype == torch.float32 else fn


@functools.cache
def compiled(fn: Callable[..., object]) -> Callable[..., object]:
    """``fn`` compiled once, whole (``fullgraph``), with dynamic shapes: the row counts of pieces and
    shards change with packed documents from step to step, and one graph serves them all."""
    return torch.compile(fn, dynamic=True, fullgraph=True)


def merge_many(partials: Sequence[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Merge any number (at least one) of partials ``(out, lse)`` over disjoint key subsets."""
    if len(partials) == 0:
        raise ValueError("merge_many needs at least one partial (out, lse)")
    out, lse = partials[0]
    dtype = accumulation_dtype(out, lse)
    out, lse = out.to(dtype), lse.to(dtype)
    for out_next, lse_next in partials[1:]:
        out, lse = merge_partials(out, lse, out_next, lse_next)
    return out, lse


def partial_grads_from_merged(
    out_part: Tensor, lse_part: Tensor, out: Tensor, lse: Tensor, dout: Tensor
) -> tuple[Tensor, Tensor]:
    """Gradients reaching one partial ``(out_part, lse_part)`` from ``dout`` of the merged ``(out, lse)``.

    With ``w = exp(lse_part - lse)`` (0 for rows empty in the partial): ``dout_part = w * dout`` and
    ``dlse_part = w * <dout, out_part - out>`` (csbp.md §9.2). The merged lse is treated as having no
    gradient of its own (attention outputs only ``out``).
    """
    dtype = accumulation_dtype(out_part, lse_part, out, lse, dout)
    weight = _merge_weights(lse_part.to(dtype), lse.to(dtype))
    dout = dout.to(dtype)
    dout_part = weight.unsqueeze(-1) * dout
    dlse_part = weight * (dout * (out_part.to(dtype) - out.to(dtype))).sum(-1)
    return dout_part, dlse_part


def _check_pair(caller: str, out1: Tensor, lse1: Tensor, out2: Tensor, lse2: Tensor) -> None:
    """One clear ``ValueError`` unless both partials are ``out [..., N, d]`` and ``lse [..., N]`` alike."""
    if out1.shape != out2.shape or lse1.shape != lse2.shape or out1.shape[:-1] != lse1.shape:
        raise ValueError(
            f"{caller}: shapes out1 {tuple(out1.shape)}, lse1 {tuple(lse1.shape)}, out2 "
            f"{tuple(out2.shape)}, lse2 {tuple(lse2.shape)} must be out [..., N, d] and lse [..., N] alike"
        )


def _logaddexp(lse1: Tensor, lse2: Tensor) -> Tensor:
    """``log(exp(lse1) + exp(lse2))`` whose autograd stays NaN-free when both are ``-inf``."""
    shift = torch.maximum(lse1, lse2).detach()  # lse does not depend on the shift: no gradient needed
    shift = shift.masked_fill(shift == float("-inf"), 0.0)
    total = (lse1 - shift).exp() + (lse2 - shift).exp()
    empty = total == 0
    return (shift + total.masked_fill(empty, 1.0).log()).masked_fill(empty, float("-inf"))


def _merge_weights(lse_part: Tensor, lse: Tensor) -> Tensor:
    """``exp(lse_part - lse)``; 0 where the merged row is empty (``lse = -inf``), never NaN."""
    lse_finite = lse.masked_fill(lse == float("-inf"), 0.0)
    return (lse_part - lse_finite).exp()
