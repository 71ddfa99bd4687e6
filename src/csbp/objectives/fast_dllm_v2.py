"""Fast-dLLM v2 (objectives.md §4): complementary views, token shift, unit weights.

Per (sample, block) ``t ~ U(0, 1)`` and move chance ``p = (1 − eps)·t + eps``; one Bernoulli per
token ``m_i = [U_i < p_blk(i)]``. With ``eligible = loss_mask``, view 1 masks ``m ∧ eligible`` and
view 2 masks ``¬m ∧ eligible``, so every eligible token is masked in exactly one view. The
corrupted batch has ``2S`` rows: the ``S`` view-1 rows, then the ``S`` view-2 rows, each with the
clean stream ``x_0`` (``[x_t^(v) ; x_0]`` layout, BD3 mask with ``B = bd_size``).

Token shift: noisy row ``i − 1`` predicts token ``i`` when token ``i`` is masked in that view;
position 0 is never a target and the last row never has a label. A target whose previous row
lies in another packed document (``doc_ids`` differ) is dropped, with or without the document
mask: under it that row cannot see the target's document, and without it the target is the first
token of an unrelated document (the released trainer packs rows without document ids and scores
it). A masked token that cannot be a target (position 0, a document start) is still
corrupted but never scored. The mask-token logit is *not* excluded. Denominator: the number of
labelled rows of both views, ``Σ_v Σ_i m^(v)_i`` (``S·(L−1)`` without supervision mask).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from csbp.objectives.base import CorruptedBatch, check_block_size, read_batch
from csbp.objectives.chunked_ce import IGNORE_INDEX
from csbp.objectives.noise import uniform_levels


def shifted_labels(targets_RL: Tensor, scored_RL: Tensor, doc_ids_RL: Tensor) -> Tensor:
    """Token-shift labels ``[R, L]``: row ``i − 1`` carries ``targets[i]`` where ``scored[i]`` and
    rows ``i − 1`` and ``i`` belong to the same document; the last row is unlabelled."""
    labels_RL = torch.full_like(targets_RL, IGNORE_INDEX)
    has_target = scored_RL[:, 1:] & (doc_ids_RL[:, :-1] == doc_ids_RL[:, 1:])
    labels_RL[:, :-1] = torch.where(has_target, targets_RL[:, 1:], labels_RL[:, :-1])
    return labels_RL


def fast_dllm_v2_views(
    input_ids: Tensor,
    eligible: Tensor,
    doc_ids: Tensor,
    bernoulli_SL: Tensor,
    *,
    mask_token_id: int,
    block_size: int,
    move_chance_SN: Tensor | None = None,
) -> CorruptedBatch:
    """Build the doubled batch from a given Bernoulli draw ``m`` (the deterministic half of
    ``corrupt``; also how tests reproduce the supervision map of objectives.md §4).

    ``move_chance_SN`` (``p`` per (sample, block)), when given, is recorded as the noise levels:
    ``p`` for view 1 and ``1 − p`` for view 2.
    """
    num_samples, seq_len = input_ids.shape
    check_block_size(seq_len, block_size)
    device = input_ids.device
    bernoulli_SL = bernoulli_SL.to(device)
    masked_RL = torch.cat([bernoulli_SL & eligible, ~bernoulli_SL & eligible])
    clean_RL = torch.cat([input_ids, input_ids])
    doc_ids_RL = torch.cat([doc_ids, doc_ids])
    noisy_RL = torch.where(masked_RL, torch.full_like(clean_RL, mask_token_id), clean_RL)
    labels_RL = shifted_labels(clean_RL, masked_RL, doc_ids_RL)
    weights_RL = (labels_RL != IGNORE_INDEX).to(torch.float32)
    noise_levels = None
    if move_chance_SN is not None:
        move_chance_SN = move_chance_SN.to(device)
        noise_levels = torch.cat([move_chance_SN, 1.0 - move_chance_SN])
    return CorruptedBatch(
        noisy_ids=noisy_RL,
        clean_ids=clean_RL,
        labels=labels_RL,
        weights=weights_RL,
        doc_ids=doc_ids_RL,
        noise_levels=noise_levels,
        uses_clean_stream=True,
        block_size=block_size,
        exclude_token=None,
        loss_normaliser=float(weights_RL.sum()),
    )


@dataclass(frozen=True)
class FastDllmV2Objective:
    """Fast-dLLM v2 complementary-view block diffusion.

    Attributes:
        mask_token_id: id of ``[M]`` (151665 for the released 7B model); its logit is kept.
        block_size: ``bd_size`` (32 in the release); must divide ``L``.
        eps: floor of the move chance, ``p = (1 − eps)·t + eps``.
    """

    mask_token_id: int
    block_size: int = 32
    eps: float = 1e-3
    name: ClassVar[str] = "fast_dllm_v2"

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"fast_dllm_v2 block_size={self.block_size} must be >= 1")
        if self.mask_token_id < 0:
            raise ValueError(f"fast_dllm_v2 mask_token_id={self.mask_token_id} must be a vocabulary id >= 0")
        if not 0.0 <= self.eps <= 1.0:
            raise ValueError(f"fast_dllm_v2 eps={self.eps} must lie in [0, 1]")

    def corrupt(self, batch: Mapping[str, Tensor], generator: torch.Generator) -> CorruptedBatch:
        return draw_views(
            batch, generator, mask_token_id=self.mask_token_id, block_size=self.block_size, low=self.eps, high=1.0
        )


def draw_views(
    batch: Mapping[str, Tensor],
    generator: torch.Generator,
    *,
    mask_token_id: int,
    block_size: int,
    low: float,
    high: float,
) -> CorruptedBatch:
    """Draw the move chance ``p = low + (high − low)·t``, ``t ~ U(0, 1)`` per (sample, block), and
    one Bernoulli ``[U_i < p]`` per token, then build the complementary views (training:
    ``[eps, 1]``; the NELBO of ``csbp.evaluation.nelbo``: ``[a, 1 − a]``)."""
    input_ids, loss_mask, doc_ids = read_batch(batch)
    num_samples, seq_len = input_ids.shape
    num_blocks = check_block_size(seq_len, block_size)
    levels_SN = uniform_levels(num_samples * num_blocks, generator).view(num_samples, num_blocks)
    move_chance_SN = low + (high - low) * levels_SN
    uniforms_SL = torch.rand(num_samples, seq_len, generator=generator, dtype=torch.float64)
    bernoulli_SL = uniforms_SL < move_chance_SN.repeat_interleave(block_size, dim=1)
    return fast_dllm_v2_views(
        input_ids,
        loss_mask,
        doc_ids,
        bernoulli_SL,
        mask_token_id=mask_token_id,
        block_size=block_size,
        move_chance_SN=move_chance_SN,
    )
