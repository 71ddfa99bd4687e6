"""The dense attention oracle of ``csbp verify``'s single-process reference.

The reference must not run the code it checks: with the tiled kernels on both sides, ``csbp verify
--nproc 1`` (one process, the reference's own kernels) compared a computation with itself and could
not fail. Here every layer's attention is plain ``softmax(q kᵀ / sqrt(d) + mask) v`` over all of the
rank's rows, its mask evaluated from the closed-form predicates of :mod:`csbp.masks.predicates`
(``bd3_mask`` over the ``[x_t ; x_0]`` layout, ``mdlm_mask`` for one stream) at each row's logical
index, with the window and the sample's document ids: neither the tile plans, the merge of partials,
nor the interval form of :mod:`csbp.attention.rows` takes part. Only the plan's row order (which row
holds which token) is shared with the code under test.

Usage::

    plan = oracle_plan(plan, seq_len=32, block_size=4, window=None, doc_ids=None, single_stream=False)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from csbp.engine.block_diffusion import DocumentPlanner, RankPlan
from csbp.masks import bd3_mask, dense_mask, mdlm_mask


def oracle_allow(
    plan: RankPlan, *, seq_len: int, block_size: int, window: int | None, doc_ids: Tensor | None, single_stream: bool
) -> Tensor:
    """``[rows, rows]`` boolean mask of ``plan``'s rows from the closed-form predicate of the objective."""
    rows = plan.rows
    docs = None if doc_ids is None else doc_ids.detach().cpu().long()
    if single_stream:
        logical, size = rows.pos.cpu(), seq_len
        mask_mod = mdlm_mask(seq_len, docs)
    else:
        logical, size = rows.pos.cpu() + rows.clean.cpu().long() * seq_len, 2 * seq_len
        mask_mod = bd3_mask(seq_len, block_size, window, docs)
    full = dense_mask(mask_mod, size, size)
    return full[logical][:, logical]


@dataclass(frozen=True)
class DenseAttention:
    """An ``AttentionFn``: dense softmax attention under ``allow`` (a query row that may see no key
    returns zeros), grouped-query heads repeated, computed in the dtype of ``q``. One sample at a
    time, each recomputed in backward (``torch.utils.checkpoint``), so the reference holds one
    sample's ``[H, rows, rows]`` scores at a time rather than every sample's of every layer."""

    allow: Tensor

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, layer_index: int = 0) -> Tensor:
        n = self.allow.shape[0]
        if q.shape[2] != n or k.shape[2] != n:
            raise ValueError(f"the oracle holds {n} rows, got {q.shape[2]} queries and {k.shape[2]} keys")
        return torch.cat([
            checkpoint(self._sample, q[i : i + 1], k[i : i + 1], v[i : i + 1], use_reentrant=False)
            for i in range(q.shape[0])
        ])

    def _sample(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        allow = self.allow.to(q.device)
        sees = allow.any(dim=1, keepdim=True)
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        scores = scores.masked_fill(~allow, float("-inf")).masked_fill(~sees, 0.0)
        return (torch.softmax(scores, dim=-1) * sees) @ v


def oracle_plan(
    plan: RankPlan, *, seq_len: int, block_size: int, window: int | None, doc_ids: Tensor | None, single_stream: bool
) -> RankPlan:
    """``plan`` with its attention replaced by the dense oracle (same rows, positions and loss rows)."""
    allow = oracle_allow(
        plan, seq_len=seq_len, block_size=block_size, window=window, doc_ids=doc_ids, single_stream=single_stream
    )
    return replace(plan, attention=DenseAttention(allow))


@dataclass(frozen=True, eq=False)
class OraclePlanner(DocumentPlanner):
    """A ``DocumentPlanner`` whose per-sample plans run the dense oracle under that sample's documents
    (its window; one stream without ``uses_clean_stream``)."""

    def plans_for(self, doc_ids: Tensor) -> list[RankPlan]:
        if self.causal:
            raise ValueError("the dense oracle has no causal (AR) predicate here: verify bd3, fast_dllm_v2 or mdlm")
        return [
            oracle_plan(
                plan, seq_len=self.seq_len, block_size=self.block_size, window=self.window, doc_ids=row,
                single_stream=not self.uses_clean_stream,
            )
            for plan, row in zip(super().plans_for(doc_ids), doc_ids, strict=True)
        ]
