"""Attention masks as pure predicates over logical indices, and their dense / FlexAttention builders.

Usage::

    from csbp.masks import bd3_mask, dense_mask, flex_block_mask

    mask_mod = bd3_mask(seq_len=L, block_size=B)
    allowed_QK = dense_mask(mask_mod, 2 * L, 2 * L)            # CPU oracle
    block_mask = flex_block_mask(mask_mod, 2 * L, 2 * L)        # FlexAttention kernel
"""

from csbp.masks.builders import dense_mask, flex_block_mask
from csbp.masks.predicates import (
    MaskMod,
    ar_mask,
    bd3_mask,
    dflash_mask,
    fast_dllm_v2_mask,
    mdlm_mask,
    rows_mask,
)

__all__ = [
    "ar_mask",
    "MaskMod",
    "bd3_mask",
    "dense_mask",
    "dflash_mask",
    "fast_dllm_v2_mask",
    "flex_block_mask",
    "mdlm_mask",
    "rows_mask",
]
