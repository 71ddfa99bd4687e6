"""The FlexAttention ``BlockMask`` of two sets of interval rows, built from per-block summaries
(csbp.md §9.1): never from a dense mask.

Per block of ``block`` query rows and ``block`` key rows a few summaries (range of noisy block ids,
union and intersection of the clean-context intervals, range of clean key positions, liveness) decide
whether the block pair is empty, full (every pair allowed: no ``mask_mod`` evaluated) or partial. The
work is ``O((Nq/block) * (Nk/block))`` small integer ops, so a 256K x 256K BlockMask costs
milliseconds instead of a 64 GiB boolean matrix. "Partial" is always safe (the kernel then applies
``mask_mod``, ``csbp.masks.rows_mask``: the predicate the tiles and the reference evaluate); "full"
only when proven.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from csbp.attention.rows import Rows
from csbp.masks import rows_mask

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

DEFAULT_FLEX_BLOCK = 128
"""Sparse block edge (query and key rows): FlexAttention's kernel tile on Ampere/Hopper GPUs."""

_BIG = torch.iinfo(torch.int64).max
_SMALL = torch.iinfo(torch.int64).min


def rows_block_mask(
    q_rows: Rows, k_rows: Rows, *, causal_in_block: bool = False, block: int = DEFAULT_FLEX_BLOCK
) -> BlockMask | None:
    """FlexAttention ``BlockMask`` of ``rows_mask(q_rows, k_rows)`` from per-block interval summaries
    (no dense mask); None when no block pair can hold an allowed pair."""
    from torch.nn.attention.flex_attention import BlockMask

    if block < 1:
        raise ValueError(f"flex block must be >= 1, got {block}")
    if k_rows.pos.device != q_rows.pos.device:
        raise ValueError(f"q_rows are on {q_rows.pos.device} but k_rows on {k_rows.pos.device}; use Rows.to")
    num_queries, num_keys = len(q_rows), len(k_rows)
    if num_queries == 0 or num_keys == 0:
        return None
    qs, ks = _QuerySummary.of(q_rows, block), _KeySummary.of(k_rows, block)
    noisy = (
        (ks.block_lo[None, :] <= qs.block_hi[:, None])
        & (ks.block_hi[None, :] >= qs.block_lo[:, None])
        & qs.has_noisy[:, None]
        & ks.has_noisy[None, :]
    )
    context = (
        (ks.pos_lo[None, :] < qs.ctx_hi[:, None])
        & (ks.pos_hi[None, :] >= qs.ctx_lo[:, None])
        & qs.has_context[:, None]
        & ks.has_clean[None, :]
    )
    full = (  # every key clean and inside every row's interval
        qs.complete_live[:, None]
        & ks.complete_clean[None, :]
        & (ks.pos_lo[None, :] >= qs.shared_lo[:, None])
        & (ks.pos_hi[None, :] < qs.shared_hi[:, None])
    )
    if not causal_in_block:  # one noisy block on both sides, bidirectional
        full |= (
            qs.complete_one_block[:, None]
            & ks.complete_one_block[None, :]
            & (qs.block_lo[:, None] == ks.block_lo[None, :])
        )
    partial = (noisy | context) & ~full
    if not bool((partial | full).any()):
        return None
    kv_num, kv_index = _block_lists(partial)
    full_num, full_index = _block_lists(full)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_index,
        full_num,
        full_index,
        BLOCK_SIZE=(block, block),
        mask_mod=rows_mask(q_rows, k_rows, causal_in_block=causal_in_block),
        seq_lengths=(num_queries, num_keys),
    )


# ----------------------------------------------------------------------------- block summaries


@dataclass(frozen=True)
class _QuerySummary:
    """Per query block (``[nqb]``): noisy block-id range, clean-context union and intersection."""

    has_noisy: Tensor
    block_lo: Tensor
    block_hi: Tensor
    has_context: Tensor
    ctx_lo: Tensor
    ctx_hi: Tensor
    complete_live: Tensor  # a whole block of live rows (the intersection below is meaningful)
    shared_lo: Tensor
    shared_hi: Tensor
    complete_one_block: Tensor  # a whole block of live noisy rows of one block id

    @staticmethod
    def of(rows: Rows, block: int) -> _QuerySummary:
        noisy = rows.live & ~rows.clean
        context = rows.live & (rows.ctx_start < rows.ctx_stop)
        every = torch.ones_like(rows.live)
        block_lo = _reduce(rows.block, noisy, block, _BIG, "amin")
        block_hi = _reduce(rows.block, noisy, block, _SMALL, "amax")
        ctx_lo = _reduce(rows.ctx_start, context, block, _BIG, "amin")
        ctx_hi = _reduce(rows.ctx_stop, context, block, _SMALL, "amax")
        complete_live = _reduce(rows.live.long(), every, block, 0, "amin") == 1
        all_noisy = _reduce(noisy.long(), every, block, 0, "amin") == 1
        return _QuerySummary(
            has_noisy=block_lo <= block_hi,
            block_lo=block_lo,
            block_hi=block_hi,
            has_context=ctx_lo < ctx_hi,
            ctx_lo=ctx_lo,
            ctx_hi=ctx_hi,
            complete_live=complete_live,
            shared_lo=_reduce(rows.ctx_start, every, block, _BIG, "amax"),
            shared_hi=_reduce(rows.ctx_stop, every, block, _SMALL, "amin"),
            complete_one_block=all_noisy & (block_lo == block_hi),
        )


@dataclass(frozen=True)
class _KeySummary:
    """Per key block (``[nkb]``): live noisy block-id range and live clean position range."""

    has_noisy: Tensor
    block_lo: Tensor
    block_hi: Tensor
    has_clean: Tensor
    pos_lo: Tensor
    pos_hi: Tensor
    complete_clean: Tensor  # a whole block of live clean keys
    complete_one_block: Tensor  # a whole block of live noisy keys of one block id

    @staticmethod
    def of(rows: Rows, block: int) -> _KeySummary:
        noisy = rows.live & ~rows.clean
        clean = rows.live & rows.clean
        every = torch.ones_like(rows.live)
        block_lo = _reduce(rows.block, noisy, block, _BIG, "amin")
        block_hi = _reduce(rows.block, noisy, block, _SMALL, "amax")
        pos_lo = _reduce(rows.pos, clean, block, _BIG, "amin")
        all_noisy = _reduce(noisy.long(), every, block, 0, "amin") == 1
        return _KeySummary(
            has_noisy=block_lo <= block_hi,
            block_lo=block_lo,
            block_hi=block_hi,
            has_clean=pos_lo < _BIG,
            pos_lo=pos_lo,
            pos_hi=_reduce(rows.pos, clean, block, _SMALL, "amax"),
            complete_clean=_reduce(clean.long(), every, block, 0, "amin") == 1,
            complete_one_block=all_noisy & (block_lo == block_hi),
        )


def _reduce(values: Tensor, valid: Tensor, block: int, fill: int, how: str) -> Tensor:
    """Per block of ``block`` rows: ``how`` ("amin"/"amax") of ``values`` where ``valid``; ``fill`` for
    invalid rows and the padded tail (so a partial last block is never "complete")."""
    num_blocks = -(-values.shape[0] // block)
    padded = values.new_full((num_blocks * block,), fill)
    padded[: values.shape[0]] = torch.where(valid, values, fill)
    return getattr(padded.view(num_blocks, block), how)(1)


def _block_lists(selected: Tensor) -> tuple[Tensor, Tensor]:
    """``[nqb, nkb]`` bool -> ``(num [1, 1, nqb], indices [1, 1, nqb, nkb])`` int32, selected first."""
    num = selected.sum(1, dtype=torch.int32)
    order = torch.argsort((~selected).to(torch.int8), dim=1, stable=True).to(torch.int32)
    return num[None, None], order[None, None]
