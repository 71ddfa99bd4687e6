"""The contract between a self-denoising objective and the distributed engine.

An objective turns a clean batch into a :class:`CorruptedBatch`: the noisy and clean token
streams plus, for every *noisy row* (a row that produces logits), the label it predicts and the
weight of its cross-entropy. Labels and weights are aligned with the rows that produce the logits,
so the engine can score whichever noisy rows a rank owns without knowing which objective made them
(same-position labels for BD3/MDLM, token shift for Fast-dLLM v2 and AR are all just label maps).

Corruption is a deterministic function of ``(batch, generator state)``. Every rank that shares a
sample must draw the same corruption, so the generator is seeded by ``(seed, step, dp_rank)`` only,
never by the CP/BP rank (csbp.md §13 rule 5); see :func:`corruption_generator`. All random draws
happen on the CPU generator and are moved to the batch device afterwards, so the result does not
depend on the device either.

Shape legend: ``S`` samples of the clean batch, ``S'`` rows of the corrupted batch (``S`` or
``2S``), ``L`` sequence length, ``N = L // block_size`` blocks, ``D`` hidden size, ``V`` vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal, Protocol, get_args, runtime_checkable

import torch
from torch import Tensor

from csbp.objectives.chunked_ce import IGNORE_INDEX, chunked_weighted_ce

DenominatorRule = Literal["supervised_tokens", "all_tokens"]
DENOMINATOR_RULES: tuple[str, ...] = get_args(DenominatorRule)


@dataclass(frozen=True)
class CorruptedBatch:
    """A corrupted micro-batch, independent of the parallel layout.

    Attributes:
        noisy_ids: ``[S', L]`` int64, the noisy stream ``x_t`` (the rows that produce logits).
        clean_ids: ``[S', L]`` int64, the clean stream ``x_0`` (the inference-time KV cache
            stand-in; for single-stream objectives the same tokens as the input).
        labels: ``[S', L]`` int64, the token predicted FROM noisy row ``i``; ``-100`` = no label.
        weights: ``[S', L]`` float32, per-row loss weight; exactly 0 where ``labels == -100``.
        doc_ids: ``[S', L]`` int64, packed-document id of every position (rows follow the noisy
            rows, so Fast-dLLM v2's second view repeats the first).
        noise_levels: ``[S', N]`` float64 masking probability of each (row, block), or ``None``
            for objectives without noise (AR). For logging and per-level loss statistics.
        uses_clean_stream: True for the ``[x_t ; x_0]`` layout (BD3, Fast-dLLM v2); False for a
            single stream (MDLM: full bidirectional; AR: causal).
        block_size: diffusion block size ``B`` (``L`` for MDLM, 1 for AR).
        exclude_token: vocabulary id whose logit is forced to ``-inf`` (SUBS), or ``None``.
        loss_normaliser: this micro-batch's contribution to the global denominator, see
            :meth:`denominator`.
    """

    noisy_ids: Tensor
    clean_ids: Tensor
    labels: Tensor
    weights: Tensor
    doc_ids: Tensor
    noise_levels: Tensor | None
    uses_clean_stream: bool
    block_size: int
    exclude_token: int | None
    loss_normaliser: float

    def __post_init__(self) -> None:
        shape = tuple(self.noisy_ids.shape)
        if len(shape) != 2:
            raise ValueError(f"CorruptedBatch.noisy_ids has shape {shape}, expected [rows, L]")
        for name in ("clean_ids", "labels", "weights", "doc_ids"):
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise ValueError(f"CorruptedBatch.{name} has shape {got}, expected {shape}")

    @property
    def num_rows(self) -> int:
        """``S'``: rows of the corrupted batch."""
        return int(self.noisy_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.noisy_ids.shape[1])

    def denominator(self) -> float:
        """This micro-batch's normaliser under the objective's rule (a count, never rank-local).

        The distributed engine sums it over the step's micro-batches and data-parallel replicas
        and divides by the factor its gradient reduction divides by (csbp.md §13 rule 1); the
        single-process oracle :func:`objective_loss` divides by it directly.
        """
        return self.loss_normaliser

    def num_labelled(self) -> int:
        """Rows carrying a label (the active targets of this micro-batch)."""
        return int((self.labels != IGNORE_INDEX).sum())


@runtime_checkable
class Objective(Protocol):
    """A self-denoising objective: ``corrupt`` must be deterministic in (batch, generator state)."""

    @property
    def name(self) -> str: ...

    def corrupt(self, batch: Mapping[str, Tensor], generator: torch.Generator) -> CorruptedBatch: ...


def corruption_generator(seed: int, step: int, dp_rank: int, *, micro_step: int = 0) -> torch.Generator:
    """A CPU generator seeded by ``(seed, step, dp_rank, micro_step)`` only.

    Never pass a CP/BP/TP coordinate: every rank that cooperates on a sample must draw the same
    corruption. Re-seeding every step makes resumption exact without saving generator state.
    """
    for name, value in (("seed", seed), ("step", step), ("dp_rank", dp_rank), ("micro_step", micro_step)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"corruption_generator: {name} must be a non-negative int, got {value!r}")
    mixed = 0
    for value in (seed, step, dp_rank, micro_step):
        mixed = _splitmix64(mixed ^ _splitmix64(value))
    generator = torch.Generator(device="cpu")
    generator.manual_seed(mixed & 0x7FFF_FFFF_FFFF_FFFF)
    return generator


def _splitmix64(value: int) -> int:
    """One round of the splitmix64 finaliser: a bijective 64-bit mix, so distinct tuples spread."""
    mask = (1 << 64) - 1
    z = (value + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


def read_batch(batch: Mapping[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """Validate a clean batch and return ``(input_ids [S, L] int64, loss_mask [S, L] bool,
    doc_ids [S, L] int64)``; a missing ``loss_mask`` supervises everything, missing ``doc_ids``
    means one document per row."""
    if "input_ids" not in batch:
        raise ValueError("batch is missing 'input_ids' ([S, L] int64 token ids)")
    input_ids = batch["input_ids"]
    if input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise ValueError(
            f"batch['input_ids'] must be a [S, L] int64 tensor, got {tuple(input_ids.shape)} {input_ids.dtype}"
        )
    loss_mask = batch.get("loss_mask")
    if loss_mask is None:
        loss_mask = torch.ones_like(input_ids, dtype=torch.bool)
    elif loss_mask.shape != input_ids.shape or loss_mask.dtype != torch.bool:
        raise ValueError(
            f"batch['loss_mask'] must be a bool tensor shaped like input_ids {tuple(input_ids.shape)}, "
            f"got {tuple(loss_mask.shape)} {loss_mask.dtype}"
        )
    doc_ids = batch.get("doc_ids")
    if doc_ids is None:
        doc_ids = torch.zeros_like(input_ids)
    elif doc_ids.shape != input_ids.shape:
        raise ValueError(
            f"batch['doc_ids'] must be shaped like input_ids {tuple(input_ids.shape)}, got {tuple(doc_ids.shape)}"
        )
    return input_ids, loss_mask, doc_ids.long()


def check_block_size(seq_len: int, block_size: int) -> int:
    """Number of blocks ``N = L // B``; raise if ``B`` does not divide ``L``."""
    if block_size < 1 or seq_len % block_size != 0:
        raise ValueError(f"block_size={block_size} must be >= 1 and divide the sequence length L={seq_len}")
    return seq_len // block_size


def check_no_mask_token_supervised(input_ids: Tensor, loss_mask: Tensor, mask_token_id: int) -> None:
    """Under SUBS the mask-token logit is ``-inf``, so a supervised ``[M]`` in the data has infinite loss."""
    if bool(((input_ids == mask_token_id) & loss_mask).any()):
        raise ValueError(
            f"input_ids contain the mask token {mask_token_id} at supervised positions; "
            "choose an unused mask_token_id or exclude those positions from loss_mask"
        )


def check_denominator_rule(rule: str) -> None:
    if rule not in DENOMINATOR_RULES:
        raise ValueError(f"denominator={rule!r} is not one of {DENOMINATOR_RULES}")


def token_count_denominator(rule: str, loss_mask: Tensor) -> float:
    """``supervised_tokens``: loss-mask tokens (all tokens without a mask); ``all_tokens``: ``S·L``."""
    if rule == "supervised_tokens":
        return float(loss_mask.sum())
    return float(loss_mask.numel())


def objective_loss(
    hidden_noisy_rows: Tensor,
    lm_head_weight: Tensor,
    corrupted: CorruptedBatch,
    *,
    chunk_rows: int = 1024,
    logit_softcap: float | None = None,
) -> Tensor:
    """Single-process oracle: ``Σ weight·CE(hidden @ Wᵀ, label) / denominator``.

    ``hidden_noisy_rows`` is ``[S', L, D]``, the final hidden states of the noisy rows (already
    final-normed). A micro-batch with a zero denominator supervises nothing and returns 0.
    """
    rows, seq_len = corrupted.num_rows, corrupted.seq_len
    if hidden_noisy_rows.dim() != 3 or tuple(hidden_noisy_rows.shape[:2]) != (rows, seq_len):
        raise ValueError(
            f"hidden_noisy_rows has shape {tuple(hidden_noisy_rows.shape)}, expected [{rows}, {seq_len}, D]"
        )
    hidden_RD = hidden_noisy_rows.reshape(rows * seq_len, -1)
    total = chunked_weighted_ce(
        hidden_RD,
        lm_head_weight,
        corrupted.labels.reshape(-1).to(hidden_RD.device),
        corrupted.weights.reshape(-1).to(hidden_RD.device),
        chunk_rows=chunk_rows,
        exclude_token=corrupted.exclude_token,
        logit_softcap=logit_softcap,
    )
    return total / max(corrupted.denominator(), 1.0)
