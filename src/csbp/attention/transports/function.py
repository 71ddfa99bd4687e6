"""The one autograd Function every attention transport runs through.

A transport is a pair of plain functions over a prebuilt plan::

    forward(q, k, v, plan) -> (out, lse, *saved)              # saved: e.g. the received K/V
    backward(q, k, v, out, lse, *saved, dout, plan) -> (dq, dk, dv)

``TransportFunction`` saves ``q, k, v, out, lse`` and the extras (under selective activation
checkpointing a layer's recompute takes ``out, lse`` and the extras from its first forward instead
of running the transport again, :mod:`csbp.attention.kept_forwards`), calls the backward with the
final merged ``(out, lse)`` (csbp.md §9.2) and casts results back to the input dtypes; the
backward runs the transport's mirror collective. ``out`` is kept as returned, in q's dtype (bf16
in training), as FlashAttention keeps it: the merge ran in fp32, and the backward needs ``out`` only
for the row term ``delta = rowsum(dout * out)``, which the fused kernels form from the bf16
``out`` anyway; keeping the fp32 copy would double the saved attention output of every layer.

Precision: forward and backward run with autocast *disabled* (``exact_attention_precision``), so
the kernels compute scores, softmax statistics and gradients in their accumulation dtype (fp32
for bf16 inputs) whether or not the caller trains under ``torch.autocast``. Otherwise autocast
would run the forward's matmuls in bf16 while the backward (outside autocast) recomputes the
scores in fp32: a lower-precision forward that disagrees with its own backward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from csbp.attention.kept_forwards import kept_or_computed

TransportForward = Callable[..., tuple[Tensor, ...]]
TransportBackward = Callable[..., tuple[Tensor, Tensor, Tensor]]


def exact_attention_precision(device: torch.device) -> contextlib.AbstractContextManager:
    """Autocast off on ``device`` (the kernels choose their own accumulation dtype), a no-op on
    device types without autocast (``meta``)."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


class TransportFunction(torch.autograd.Function):
    """``TransportFunction.apply(q, k, v, plan, forward_fn, backward_fn) -> out``."""

    @staticmethod
    def forward(
        ctx: Any,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        plan: object,
        forward_fn: TransportForward,
        backward_fn: TransportBackward,
    ) -> Tensor:
        def compute() -> tuple[Tensor, ...]:
            with exact_attention_precision(q.device):
                out, lse, *saved = forward_fn(q, k, v, plan)
            return out.to(q.dtype), lse, *saved  # out: the same tensor when q is in the accumulation dtype

        # under train.activation_checkpointing: selective, a recompute replays the first forward's results
        out, lse, *saved = kept_or_computed(compute)
        ctx.save_for_backward(q, k, v, out, lse, *saved)
        ctx.plan, ctx.backward_fn = plan, backward_fn
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse, *saved = ctx.saved_tensors
        with exact_attention_precision(q.device):
            dq, dk, dv = ctx.backward_fn(q, k, v, out, lse, *saved, dout, ctx.plan)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None
