"""Plain causal language modelling (used to train small DFlash targets).

No corruption: the noisy stream is ``x_0`` itself and row ``i`` predicts ``x_0[i+1]`` when that
token is supervised (``loss_mask``) and in the same packed document. Unit weights, no clean stream,
``block_size = 1`` (the engine applies a causal mask), no excluded token. Denominator: the number
of targets.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from csbp.objectives.base import CorruptedBatch, read_batch
from csbp.objectives.chunked_ce import IGNORE_INDEX
from csbp.objectives.fast_dllm_v2 import shifted_labels


@dataclass(frozen=True)
class ArObjective:
    """Next-token prediction; ``corrupt`` ignores the generator (it draws nothing)."""

    name: ClassVar[str] = "ar"

    def corrupt(self, batch: Mapping[str, Tensor], generator: torch.Generator) -> CorruptedBatch:
        input_ids, loss_mask, doc_ids = read_batch(batch)
        labels_SL = shifted_labels(input_ids, loss_mask, doc_ids)
        weights_SL = (labels_SL != IGNORE_INDEX).to(torch.float32)
        return CorruptedBatch(
            noisy_ids=input_ids,
            clean_ids=input_ids,
            labels=labels_SL,
            weights=weights_SL,
            doc_ids=doc_ids,
            noise_levels=None,
            uses_clean_stream=False,
            block_size=1,
            exclude_token=None,
            loss_normaliser=float(weights_SL.sum()),
        )
