"""MDLM (objectives.md §2): single-stream masked diffusion, the ``B = L`` case of BD3-LM.

One noise level per sequence, ``t ∈ [eps, 1]``, spread over the batch by stratified (antithetic)
sampling; every supervised token is masked with probability ``t``; same-position labels, weight
``1/t``, mask-token logit excluded (SUBS). Attention is fully bidirectional over one stream
(``uses_clean_stream = False``, ``block_size = L``). Denominator: the non-pad (``loss_mask``) token
count by default, or ``S·L`` with ``denominator="all_tokens"``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from csbp.objectives.base import (
    CorruptedBatch,
    check_denominator_rule,
    check_no_mask_token_supervised,
    read_batch,
)
from csbp.objectives.bd3 import check_loss_weight, same_position_masked_batch
from csbp.objectives.noise import NOISE_SCHEMES, clip_levels, sample_levels


@dataclass(frozen=True)
class MdlmObjective:
    """MDLM over one bidirectional stream.

    Attributes:
        mask_token_id: id of ``[M]``; its logit is excluded (SUBS).
        eps: lower end of the noise range, ``t = eps + (1 − eps)·τ``.
        noise_scheme: ``"stratified"`` (default, antithetic across the batch),
            ``"rotated_lattice"`` or ``"uniform"``.
        loss_weight: ``"inv_t"`` (default) or ``"unit"``.
        denominator: ``"supervised_tokens"`` (non-pad tokens) or ``"all_tokens"``.
    """

    mask_token_id: int
    eps: float = 1e-3
    noise_scheme: str = "stratified"
    loss_weight: str = "inv_t"
    denominator: str = "supervised_tokens"
    name: ClassVar[str] = "mdlm"

    def __post_init__(self) -> None:
        if self.mask_token_id < 0:
            raise ValueError(f"mdlm mask_token_id={self.mask_token_id} must be a vocabulary id >= 0")
        if not 0.0 <= self.eps < 1.0:
            raise ValueError(f"mdlm eps={self.eps} must lie in [0, 1)")
        if self.noise_scheme not in NOISE_SCHEMES:
            raise ValueError(f"mdlm noise_scheme={self.noise_scheme!r} is not one of {NOISE_SCHEMES}")
        check_loss_weight(self.loss_weight, self.eps)
        check_denominator_rule(self.denominator)

    def corrupt(self, batch: Mapping[str, Tensor], generator: torch.Generator) -> CorruptedBatch:
        input_ids, loss_mask, doc_ids = read_batch(batch)
        num_samples, seq_len = input_ids.shape
        check_no_mask_token_supervised(input_ids, loss_mask, self.mask_token_id)
        tau_S1 = sample_levels(self.noise_scheme, num_samples, generator).view(num_samples, 1)
        noise_levels_S1 = clip_levels(tau_S1, self.eps, 1.0)
        uniforms_SL = torch.rand(num_samples, seq_len, generator=generator, dtype=torch.float64)
        masked_SL = uniforms_SL <= noise_levels_S1
        return same_position_masked_batch(
            input_ids,
            loss_mask,
            doc_ids,
            noise_levels_S1,
            masked_SL,
            mask_token_id=self.mask_token_id,
            block_size=seq_len,
            loss_weight=self.loss_weight,
            denominator=self.denominator,
            uses_clean_stream=False,
        )
