"""Materialise a mask predicate: a dense boolean matrix (the test oracle and the CPU reference path)
or a FlexAttention ``BlockMask`` (the GPU kernel path). Both come from the same ``mask_mod``, so the
kernel and the oracle can never disagree about who attends to whom (style.md, "habits" 2).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from csbp.masks.predicates import MaskMod

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask


def dense_mask(mask_mod: MaskMod, q_len: int, kv_len: int, device: torch.device | str = "cpu") -> Tensor:
    """``BoolTensor [q_len, kv_len]``: ``mask_mod`` evaluated at every (query, key) pair.

    The predicate is called once on broadcast index grids ``q_idx [q_len, 1]``, ``kv_idx [1, kv_len]``
    with ``b = h = 0``.
    """
    if q_len < 0 or kv_len < 0:
        raise ValueError(f"q_len and kv_len must be >= 0, got {q_len} and {kv_len}")
    q_idx = torch.arange(q_len, device=device)[:, None]
    kv_idx = torch.arange(kv_len, device=device)[None, :]
    zero = torch.zeros((), dtype=torch.long, device=device)
    allowed = mask_mod(zero, zero, q_idx, kv_idx)
    if allowed.dtype != torch.bool:
        raise ValueError(f"mask_mod must return a bool tensor, got {allowed.dtype}")
    return allowed.expand(q_len, kv_len).contiguous()


def flex_block_mask(
    mask_mod: MaskMod,
    q_len: int,
    kv_len: int,
    block: int = 128,
    device: torch.device | str = "cpu",
) -> BlockMask:
    """FlexAttention ``BlockMask`` of ``mask_mod`` shared by every sample and head (``B = H = None``).

    ``block`` is the square tile size (``BLOCK_SIZE``); tiles where the predicate is all False are
    skipped by the kernel, all-True tiles are marked full (no per-element mask evaluation). Tensors
    captured by ``mask_mod`` must live on ``device``. Construction works on CPU.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    return create_block_mask(mask_mod, None, None, q_len, kv_len, device=device, BLOCK_SIZE=block)
