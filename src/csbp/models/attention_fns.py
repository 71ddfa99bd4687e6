"""Single-process attention callables for the decoder (``csbp.models.decoder.AttentionFn``).

These run outside the parallel engine: HF parity tests, autoregressive training of small targets,
generation, and dense references. They use ``torch.nn.functional.scaled_dot_product_attention``
(scale ``1/sqrt(d)``, grouped-query heads via ``enable_gqa``).

* ``CausalAttention()``: autoregressive attention, ``k_pos <= q_pos``; by default the row order is
  the position order (SDPA ``is_causal``), or the mask is built from explicit positions.
* ``DenseMaskAttention(mask)``: any boolean mask (``True`` = may attend).

Rows that see no key return zeros, never NaN (the csbp convention for dead rows).

Shape legend: ``S`` samples, ``Hq``/``Hkv`` heads, ``N`` query rows, ``Nk`` key rows, ``d`` head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def masked_attention(q_SHNd: Tensor, k_SHKd: Tensor, v_SHKd: Tensor, allow: Tensor) -> Tensor:
    """Softmax attention under a boolean mask ``allow`` of shape ``[N, Nk]`` or ``[S, N, Nk]``.

    Returns ``[S, Hq, N, d]``; rows whose mask row is all False are exactly 0.
    """
    _check_qkv(q_SHNd, k_SHKd, v_SHKd)
    num_samples, num_rows, num_keys = q_SHNd.shape[0], q_SHNd.shape[2], k_SHKd.shape[2]
    if allow.dtype != torch.bool:
        raise ValueError(f"attention mask must be a bool tensor, got dtype {allow.dtype}")
    if allow.shape not in ((num_rows, num_keys), (num_samples, num_rows, num_keys)):
        raise ValueError(
            f"attention mask has shape {tuple(allow.shape)}, expected [{num_rows}, {num_keys}] "
            f"or [{num_samples}, {num_rows}, {num_keys}]"
        )
    allow = allow.to(q_SHNd.device)
    has_key = allow.any(dim=-1, keepdim=True)  # [..., N, 1]
    # A fully masked row makes the softmax 0/0; let it see every key, then zero its output.
    safe_allow = allow | ~has_key
    if safe_allow.dim() == 3:
        safe_allow, has_key = safe_allow[:, None], has_key[:, None]  # broadcast over heads
    out_SHNd = F.scaled_dot_product_attention(
        q_SHNd, k_SHKd, v_SHKd, attn_mask=safe_allow, enable_gqa=_is_gqa(q_SHNd, k_SHKd)
    )
    return out_SHNd.masked_fill(~has_key, 0.0)


class CausalAttention:
    """Causal (autoregressive) attention.

    Without positions, query row ``i`` sees key rows ``0 … i`` (requires ``N == Nk``; fastest path,
    SDPA ``is_causal``). With ``query_positions [N]`` (and optionally ``key_positions [Nk]``,
    defaulting to the query positions), a query sees every key whose position is ``<=`` its own,
    whatever the row order.
    """

    def __init__(self, query_positions: Tensor | None = None, key_positions: Tensor | None = None) -> None:
        if query_positions is None and key_positions is not None:
            raise ValueError("CausalAttention: key_positions needs query_positions as well")
        for name, pos in (("query_positions", query_positions), ("key_positions", key_positions)):
            if pos is not None and (pos.dim() != 1 or pos.is_floating_point()):
                raise ValueError(
                    f"CausalAttention.{name} must be a 1-D integer tensor, got {pos.dtype} "
                    f"of shape {tuple(pos.shape)}"
                )
        self.allow: Tensor | None = None
        if query_positions is not None:
            keys = query_positions if key_positions is None else key_positions
            self.allow = keys[None, :] <= query_positions[:, None]  # [N, Nk]

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, layer_index: int) -> Tensor:
        if self.allow is not None:
            return masked_attention(q, k, v, self.allow)
        _check_qkv(q, k, v)
        if q.shape[2] != k.shape[2]:
            raise ValueError(
                f"CausalAttention without positions needs as many keys as queries (got {k.shape[2]} keys, "
                f"{q.shape[2]} queries); pass query_positions/key_positions"
            )
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=_is_gqa(q, k))


class DenseMaskAttention:
    """Attention under a fixed boolean mask ``[N, Nk]`` or ``[S, N, Nk]`` (``True`` = may attend),
    the same for every layer. Rows with no visible key give 0."""

    def __init__(self, mask: Tensor) -> None:
        if mask.dtype != torch.bool or mask.dim() not in (2, 3):
            raise ValueError(
                f"DenseMaskAttention.mask must be a bool tensor [N, Nk] or [S, N, Nk], got {mask.dtype} "
                f"of shape {tuple(mask.shape)}"
            )
        self.mask = mask

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, layer_index: int) -> Tensor:
        return masked_attention(q, k, v, self.mask)


def _is_gqa(q_SHNd: Tensor, k_SHKd: Tensor) -> bool:
    return q_SHNd.shape[1] != k_SHKd.shape[1]


def _check_qkv(q_SHNd: Tensor, k_SHKd: Tensor, v_SHKd: Tensor) -> None:
    if q_SHNd.dim() != 4 or k_SHKd.dim() != 4 or k_SHKd.shape != v_SHKd.shape:
        raise ValueError(
            f"attention expects q [S, Hq, N, d] and k, v [S, Hkv, Nk, d], got {tuple(q_SHNd.shape)}, "
            f"{tuple(k_SHKd.shape)}, {tuple(v_SHKd.shape)}"
        )
    if q_SHNd.shape[0] != k_SHKd.shape[0] or q_SHNd.shape[-1] != k_SHKd.shape[-1]:
        raise ValueError(f"q {tuple(q_SHNd.shape)} and k {tuple(k_SHKd.shape)} disagree on S or d")
    if q_SHNd.shape[1] % k_SHKd.shape[1] != 0:
        raise ValueError(
            f"query heads ({q_SHNd.shape[1]}) must be a multiple of KV heads ({k_SHKd.shape[1]})"
        )
