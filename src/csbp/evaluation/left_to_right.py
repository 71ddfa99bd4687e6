"""The exact likelihood of left-to-right block-diffusion sampling, in ``B`` forward passes.

``csbp generate --unmask-order left_to_right`` (one token per step, temperature 1, mask logit
excluded) fills block ``b`` position by position; each token is drawn from the model's prediction
with the clean prefix (blocks ``< b``) in the cache, the block's earlier positions filled and the
rest still ``[M]``. The probability it assigns to ``x`` is therefore exactly

    log p(x) = Σ_b Σ_j log p(x_{b,j} | x_{<b}, x_{b,<j}, [M] at offsets >= j)

(a chain rule, not a bound). In the training layout ``[x_t ; x_0]`` every noisy block sees exactly
its own tokens and the clean earlier blocks, so one forward scores offset ``j`` of *every* block at
once: forward ``j`` masks offsets ``>= j`` of every noisy block and labels offset ``j``. ``B``
forwards cover the sequence (``L`` for MDLM, whose single block is the whole row).

Token shift (Fast-dLLM v2): position ``i`` is predicted from row ``i − 1``. Forward ``j`` for
``j = 1 … B`` masks offsets ``>= j`` and labels row ``(b, j − 1)`` with ``x_{bB+j}``; ``j = B`` masks
nothing, and its last row of block ``b`` (which then equals the clean row the sampler uses) predicts
the first token of block ``b + 1``. Position 0 and document starts are never targets.

Unsupervised tokens (``loss_mask`` false, e.g. padding) are never masked or scored: they condition.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch import Tensor

from csbp.objectives.base import CorruptedBatch, check_block_size, read_batch
from csbp.objectives.chunked_ce import IGNORE_INDEX
from csbp.objectives.fast_dllm_v2 import shifted_labels


def left_to_right_batches(
    batch: Mapping[str, Tensor],
    *,
    mask_token_id: int,
    block_size: int,
    token_shift: bool = False,
    uses_clean_stream: bool = True,
) -> Iterator[CorruptedBatch]:
    """The ``B`` corrupted batches whose unit-weight CE sums add up to ``−log p(x)`` (module docstring).

    Every batch has unit weights on its labelled rows, the mask-token logit excluded (as the
    sampler does) and as normaliser its number of labelled rows, so the sum of normalisers over the
    ``B`` batches is the number of scored tokens.
    """
    input_ids, loss_mask, doc_ids = read_batch(batch)
    num_samples, seq_len = input_ids.shape
    check_block_size(seq_len, block_size)
    offset_SL = (torch.arange(seq_len, device=input_ids.device) % block_size).expand(num_samples, seq_len)
    mask_fill = torch.full_like(input_ids, mask_token_id)
    ignore = torch.full_like(input_ids, IGNORE_INDEX)
    offsets = range(1, block_size + 1) if token_shift else range(block_size)
    for j in offsets:
        masked_SL = (offset_SL >= j) & loss_mask
        noisy_ids = torch.where(masked_SL, mask_fill, input_ids)
        if token_shift:
            # j = B labels offset 0: the first token of the next block, from this block's last row.
            labels = shifted_labels(input_ids, (offset_SL == j % block_size) & loss_mask, doc_ids)
        else:
            labels = torch.where((offset_SL == j) & loss_mask, input_ids, ignore)
        weights = (labels != IGNORE_INDEX).to(torch.float32)
        yield CorruptedBatch(
            noisy_ids=noisy_ids,
            clean_ids=input_ids,
            labels=labels,
            weights=weights,
            doc_ids=doc_ids,
            noise_levels=None,
            uses_clean_stream=uses_clean_stream,
            block_size=block_size,
            exclude_token=mask_token_id,
            loss_normaliser=float(weights.sum()),
        )
