"""One fused flash-attention call with its log-sum-exp, and its backward from given statistics.

The dense pieces of csbp's attention (the noisy block diagonal, ``csbp.attention.block_diagonal_sdpa``;
the dense and causal pieces of clean context, ``csbp.attention.flash_pieces``) run through ATen's fused
kernels instead of tiles or FlexAttention. This module is the one place that calls them:

* ``cpu-flash``: ``_scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``, in the
  accumulation dtype (fp32 for bf16/fp16/fp32 inputs, fp64 for fp64); GQA native (query head ``h``
  meets KV head ``h // G``, K/V never repeated);
* ``flash`` (CUDA, fp16/bf16, head dim a multiple of 8 up to 256, sm80+): FlashAttention-2 through
  ``_scaled_dot_product_flash_attention`` and ``_backward``; GQA native. Dropout is 0, so the
  backward ignores the philox seed/offset (empty tensors are passed). Its grid holds at most
  65535 batch entries, so larger batches run in chunks;
* ``cudnn`` (CUDA, fp16/bf16, head dim a multiple of 8 up to 128, sm80+; chosen with
  ``cuda_kernel="cudnn"``): cuDNN's fused attention through ``_scaled_dot_product_cudnn_attention``
  (with its lse) and ``_backward``, the kernel SDPA itself may pick on Hopper; GQA passed natively;
  its lse is ``[Z, H, Nq, 1]``, squeezed here and restored for the backward;
* anything else (CUDA fp32/fp64, other head dims): no fused kernel; ``flash_kernel`` returns None and
  callers use their matmul or tiled path.

``is_causal`` is used only on square calls (``Nq == Nk``), where the top-left and bottom-right
conventions of the kernels agree.

**Backward from merged statistics.** Both backwards take ``out`` and ``lse`` as inputs and compute
``P = exp(scale*QK^T - lse)``, ``D = rowsum(dout*out)``: handed the *final* merged ``(out, lse)``
of a row they return exactly this call's share of the gradients (csbp.md §9.2). Rows whose merged
``lse`` is ``-inf`` (they see nothing) are given ``lse = +inf`` so that ``P = 0``: zero gradients,
never NaN.
"""

from __future__ import annotations

import torch
from torch import Tensor

from csbp.attention.merge import accumulation_dtype

_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_FLASH_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention
_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_backward
_CUDNN_FORWARD = torch.ops.aten._scaled_dot_product_cudnn_attention
_CUDNN_BACKWARD = torch.ops.aten._scaled_dot_product_cudnn_attention_backward
_CPU_FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
FLASH_MAX_BATCH = 65535
"""Batch entries per FlashAttention call: its grid puts the batch on CUDA's y dimension."""


CUDA_KERNELS = ("flash", "cudnn")
"""Fused CUDA kernels a caller may ask for (``cuda_kernel``)."""


def flash_kernel(q: Tensor, cuda_kernel: str = "flash") -> str | None:
    """``cpu-flash``, ``flash``, ``cudnn`` or None (no fused kernel for ``q``'s device, dtype and head
    dim); ``cuda_kernel`` is the one wanted on CUDA."""
    if cuda_kernel not in CUDA_KERNELS:
        raise ValueError(f"cuda_kernel must be one of {CUDA_KERNELS}, got {cuda_kernel!r}")
    if q.device.type == "cpu":
        return "cpu-flash"
    if q.device.type == "cuda" and flash_supported(q) and (cuda_kernel == "flash" or q.shape[-1] <= 128):
        return cuda_kernel
    return None


def flash_supported(q: Tensor) -> bool:
    """FlashAttention-2 (the CUDA ``flash`` kernel): fp16/bf16, head dim % 8 == 0 and <= 256, sm80+."""
    dim = q.shape[-1]
    return (
        q.dtype in _FLASH_DTYPES
        and dim % 8 == 0
        and dim <= 256
        and torch.cuda.get_device_capability(q.device) >= (8, 0)
    )


def flash_forward(
    q: Tensor, k: Tensor, v: Tensor, *, causal: bool, scale: float, cuda_kernel: str = "flash",
    kernel_dtype: bool = False,
) -> tuple[Tensor, Tensor]:
    """``q [Z, Hq, Nq, d]`` over ``k, v [Z, Hkv, Nk, d]`` -> ``(out [Z, Hq, Nq, d], lse [Z, Hq, Nq])`` in
    the accumulation dtype (``out`` in the kernel's own with ``kernel_dtype``, for a caller that writes it
    into an accumulation-dtype buffer, casting as it writes). ``causal`` needs ``Nq == Nk``."""
    kernel = _require_kernel(q, k, causal, cuda_kernel)
    dtype = accumulation_dtype(q, k, v)
    if kernel == "cudnn":
        out, lse = _CUDNN_FORWARD(q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
        lse = lse.squeeze(-1)
    elif kernel == "flash":
        parts = [_FLASH_FORWARD(*chunk, 0.0, causal, False, scale=scale)[:2] for chunk in batch_chunks(q, k, v)]
        out, lse = (torch.cat(part) for part in zip(*parts))
    else:
        out, lse = _CPU_FORWARD(q.to(dtype), k.to(dtype), v.to(dtype), 0.0, causal, scale=scale)
    return (out if kernel_dtype else out.to(dtype)), lse.to(dtype)


def flash_backward(
    q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, *, causal: bool, scale: float,
    cuda_kernel: str = "flash", kernel_dtype: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` (accumulation dtype; the kernel's own with ``kernel_dtype``, for a caller that adds
    them into accumulation-dtype buffers, casting as it adds) of one ``flash_forward`` call's key set,
    from the final merged ``out [Z, Hq, Nq, d]`` / ``lse [Z, Hq, Nq]`` of its query rows and ``dout``."""
    kernel = _require_kernel(q, k, causal, cuda_kernel)
    dtype = accumulation_dtype(q, k, v)
    lse = lse.masked_fill(lse == float("-inf"), float("inf"))  # rows that see nothing: P = 0
    if kernel == "cudnn":
        unused = torch.zeros((), dtype=torch.int64, device=q.device)  # the forward's 0-dim philox seed/offset
        dq, dk, dv = _CUDNN_BACKWARD(
            dout.to(q.dtype).contiguous(), q, k, v, out.to(q.dtype).contiguous(),
            lse.to(torch.float32).unsqueeze(-1).contiguous(), unused, unused, None, None, None,
            q.shape[2], k.shape[2], 0.0, causal, scale=scale,
        )
    elif kernel == "flash":
        cast = q.dtype  # flash wants q's dtype for out/dout and a float32 lse
        out, dout, lse = out.to(cast), dout.to(cast), lse.to(torch.float32).contiguous()
        unused = torch.empty(0, dtype=torch.int64, device=q.device)
        parts = [
            _FLASH_BACKWARD(
                dout_c, q_c, k_c, v_c, out_c, lse_c, None, None, q.shape[2], k.shape[2],
                0.0, causal, unused, unused, scale=scale,
            )
            for dout_c, q_c, k_c, v_c, out_c, lse_c in batch_chunks(dout, q, k, v, out, lse)
        ]
        dq, dk, dv = (torch.cat(part) for part in zip(*parts))
    else:
        dq, dk, dv = _CPU_BACKWARD(
            dout.to(dtype), q.to(dtype), k.to(dtype), v.to(dtype), out.to(dtype), lse.to(dtype), 0.0, causal,
            scale=scale,
        )
    if kernel_dtype:
        return dq, dk, dv
    return dq.to(dtype), dk.to(dtype), dv.to(dtype)


def batch_chunks(*tensors: Tensor) -> list[tuple[Tensor, ...]]:
    """``tensors`` split along the batch dim into runs of at most ``FLASH_MAX_BATCH`` entries."""
    size = tensors[0].shape[0]
    if size <= FLASH_MAX_BATCH:
        return [tensors]
    return [tuple(t[start : start + FLASH_MAX_BATCH] for t in tensors) for start in range(0, size, FLASH_MAX_BATCH)]


def _require_kernel(q: Tensor, k: Tensor, causal: bool, cuda_kernel: str) -> str:
    kernel = flash_kernel(q, cuda_kernel)
    if kernel is None:
        raise ValueError(
            f"no fused flash kernel for q on {q.device} in {q.dtype} with head dim {q.shape[-1]}; "
            "check flash_kernel(q) first and use the tiled path"
        )
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(f"a causal flash call must be square, got {q.shape[2]} queries x {k.shape[2]} keys")
    return kernel
