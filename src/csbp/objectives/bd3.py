"""BD3-LM block diffusion (objectives.md §3): per-block noise, same-position labels, ``1/t`` weights.

One noise level per (sample, block) from ``K = S·N`` evenly spread slots (``k = s·N + b``), clipped
to ``[t_min, t_max]``. Every supervised token is masked with its block's probability
(``m_i = [U_i <= t_blk(i)]`` AND ``loss_mask``); the noisy row ``i`` predicts ``x_0[i]`` with weight
``1/t`` (``loss_weight="inv_t"``) or 1 (``"unit"``), and the mask-token logit is excluded (SUBS).
With ``resample``, a block whose realised masked fraction falls outside the window is redrawn from
the conditioned law (bd3lms' ``training.resample``, :mod:`csbp.objectives.window_resample`).

Denominator (``denominator=``):

* ``"supervised_tokens"`` (default): the micro-batch's ``loss_mask`` count; without a supervision
  mask this is every token, ``S·L`` (bd3lms' per-token NELBO over non-pad tokens);
* ``"all_tokens"``: always ``S·L`` (LLaDA-style pretraining normaliser, padding included).

The same builder serves MDLM (``block_size = L``, single stream), see ``mdlm.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from csbp.objectives.base import (
    CorruptedBatch,
    check_block_size,
    check_denominator_rule,
    check_no_mask_token_supervised,
    read_batch,
    token_count_denominator,
)
from csbp.objectives.chunked_ce import IGNORE_INDEX
from csbp.objectives.noise import NOISE_SCHEMES, check_clip_range, clip_levels, sample_levels
from csbp.objectives.window_resample import resample_into_window, window_count_problem

LOSS_WEIGHTS: tuple[str, ...] = ("inv_t", "unit")


def check_loss_weight(loss_weight: str, t_min: float) -> None:
    if loss_weight not in LOSS_WEIGHTS:
        raise ValueError(f"loss_weight={loss_weight!r} is not one of {LOSS_WEIGHTS}")
    if loss_weight == "inv_t" and t_min <= 0.0:
        raise ValueError(f"loss_weight='inv_t' needs t_min > 0 (got {t_min}); raise t_min or use 'unit'")


def same_position_masked_batch(
    input_ids: Tensor,
    loss_mask: Tensor,
    doc_ids: Tensor,
    noise_levels_SN: Tensor,
    masked_SL: Tensor,
    *,
    mask_token_id: int,
    block_size: int,
    loss_weight: str,
    denominator: str,
    uses_clean_stream: bool,
) -> CorruptedBatch:
    """Build the corrupted batch from explicit draws (the deterministic half of ``corrupt``).

    ``noise_levels_SN`` is the masking probability ``t`` of each (sample, block) and ``masked_SL``
    the tokens to mask; it is intersected with ``loss_mask``. Row ``i`` is labelled ``x_0[i]``
    exactly where it is masked, with weight ``1/t_blk(i)`` or 1.
    """
    num_samples, seq_len = input_ids.shape
    num_blocks = check_block_size(seq_len, block_size)
    if tuple(noise_levels_SN.shape) != (num_samples, num_blocks):
        raise ValueError(
            f"noise levels have shape {tuple(noise_levels_SN.shape)}, expected {(num_samples, num_blocks)}"
        )
    check_loss_weight(loss_weight, 1.0)
    if loss_weight == "inv_t" and noise_levels_SN.numel() > 0 and float(noise_levels_SN.min()) <= 0.0:
        raise ValueError("loss_weight='inv_t' needs every noise level > 0; clip the levels with t_min > 0")
    check_denominator_rule(denominator)
    device = input_ids.device
    masked_SL = masked_SL.to(device) & loss_mask
    level_per_token_SL = noise_levels_SN.to(device).repeat_interleave(block_size, dim=1)
    noisy_ids = torch.where(masked_SL, torch.full_like(input_ids, mask_token_id), input_ids)
    labels = torch.where(masked_SL, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
    token_weight_SL = (
        1.0 / level_per_token_SL if loss_weight == "inv_t" else torch.ones_like(level_per_token_SL)
    )
    weights = torch.where(masked_SL, token_weight_SL, torch.zeros_like(token_weight_SL)).to(torch.float32)
    return CorruptedBatch(
        noisy_ids=noisy_ids,
        clean_ids=input_ids,
        labels=labels,
        weights=weights,
        doc_ids=doc_ids,
        noise_levels=noise_levels_SN.to(device),
        uses_clean_stream=uses_clean_stream,
        block_size=block_size,
        exclude_token=mask_token_id,
        loss_normaliser=token_count_denominator(denominator, loss_mask),
    )


@dataclass(frozen=True)
class Bd3Objective:
    """BD3-LM: ``[x_t ; x_0]`` layout, one noise level per (sample, block).

    Attributes:
        mask_token_id: id of ``[M]``; its logit is excluded from the softmax (SUBS).
        block_size: diffusion block size ``B`` (must divide ``L``).
        t_min, t_max: clip range ``[β, ω]`` of the noise level, ``t = β + (ω − β)·τ``.
        noise_scheme: ``"rotated_lattice"`` (default), ``"stratified"`` or ``"uniform"``.
        loss_weight: ``"inv_t"`` (NELBO weight of the linear schedule) or ``"unit"``.
        denominator: ``"supervised_tokens"`` or ``"all_tokens"`` (module docstring).
        resample: redraw a block whose realised masked fraction falls outside ``[t_min, t_max]``
            (bd3lms' ``training.resample``; :mod:`csbp.objectives.window_resample`).
    """

    mask_token_id: int
    block_size: int
    t_min: float = 1e-3
    t_max: float = 1.0
    noise_scheme: str = "rotated_lattice"
    loss_weight: str = "inv_t"
    denominator: str = "supervised_tokens"
    resample: bool = False
    name: ClassVar[str] = "bd3"

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"bd3 block_size={self.block_size} must be >= 1")
        if self.mask_token_id < 0:
            raise ValueError(f"bd3 mask_token_id={self.mask_token_id} must be a vocabulary id >= 0")
        check_clip_range(self.t_min, self.t_max)
        if self.noise_scheme not in NOISE_SCHEMES:
            raise ValueError(f"bd3 noise_scheme={self.noise_scheme!r} is not one of {NOISE_SCHEMES}")
        check_loss_weight(self.loss_weight, self.t_min)
        check_denominator_rule(self.denominator)
        if self.resample and (problem := window_count_problem(self.block_size, self.t_min, self.t_max)):
            raise ValueError(f"bd3 resample: {problem}")

    def corrupt(self, batch: Mapping[str, Tensor], generator: torch.Generator) -> CorruptedBatch:
        input_ids, loss_mask, doc_ids = read_batch(batch)
        num_samples, seq_len = input_ids.shape
        num_blocks = check_block_size(seq_len, self.block_size)
        check_no_mask_token_supervised(input_ids, loss_mask, self.mask_token_id)
        # Slot k = s·N + b, so a row-major view gives [S, N].
        tau_SN = sample_levels(self.noise_scheme, num_samples * num_blocks, generator).view(
            num_samples, num_blocks
        )
        noise_levels_SN = clip_levels(tau_SN, self.t_min, self.t_max)
        uniforms_SL = torch.rand(num_samples, seq_len, generator=generator, dtype=torch.float64)
        masked_SL = uniforms_SL <= noise_levels_SN.repeat_interleave(self.block_size, dim=1)
        if self.resample:
            masked_SL = resample_into_window(
                masked_SL, uniforms_SL, loss_mask, noise_levels_SN,
                block_size=self.block_size, t_min=self.t_min, t_max=self.t_max, generator=generator,
            )
        return same_position_masked_batch(
            input_ids,
            loss_mask,
            doc_ids,
            noise_levels_SN,
            masked_SL,
            mask_token_id=self.mask_token_id,
            block_size=self.block_size,
            loss_weight=self.loss_weight,
            denominator=self.denominator,
            uses_clean_stream=True,
        )
