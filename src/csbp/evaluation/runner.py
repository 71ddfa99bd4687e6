"""Evaluate a trained block-diffusion model on a data split: NELBO (K noise draws) and exact LTR NLL.

Every row of the split is scored once (``--max-batches`` caps it), in order, on one process:

* **NELBO**: ``K`` independent corruptions of every batch under the unclipped-NELBO objective
  (:mod:`csbp.evaluation.nelbo`), draw ``k`` of batch ``n`` seeded by
  ``corruption_generator(seed, n, 0, micro_step=k)``. Draw ``k`` gives a whole-split estimate
  ``NELBO_k = Σ_n CE_{n,k} / Σ_n Z_n``; the report gives their mean and its standard error
  ``std_k(NELBO_k) / sqrt(K)`` (the estimator's noise-draw uncertainty for this data; ``K >= 2``);
* **LTR NLL**: the exact ``−log p(x)`` of left-to-right sampling (:mod:`csbp.evaluation.left_to_right`),
  ``B`` forwards per batch, per scored token.

Both run through the training engine's ``rank_loss`` with a one-process plan of the model's layout
(``[x_t ; x_0]`` for bd3/fast_dllm_v2, one bidirectional stream for mdlm, the run's window and
document mask), so the numbers are those of the training objective's code path. All nats/token.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import numpy as np
import torch
from torch import Tensor

from csbp.data.artifact import ArtifactSplit
from csbp.data.loader import PackedLoader
from csbp.devices import tensors_to
from csbp.engine.block_diffusion import DocumentPlanner, RankPlan, build_rank_plan, rank_loss
from csbp.engine.context import ParallelContext, single_process_context
from csbp.evaluation.left_to_right import left_to_right_batches
from csbp.evaluation.nelbo import EVAL_T_MIN, nelbo_objective, perplexity_bound
from csbp.evaluation.settings import EvalSettings
from csbp.models.decoder import Decoder
from csbp.objectives.base import CorruptedBatch, corruption_generator
from csbp.wording import counted


@dataclass(frozen=True)
class EvalReport:
    """What ``csbp eval`` prints and writes (``units``: nats per token; bits are nats / ln 2).

    ``t_min``/``t_max`` is the NELBO's noise range: of ``t`` (``p = t``) for bd3/mdlm, of the move
    chance ``p`` of Fast-dLLM v2's first view (``[a, 1 − a]``, the second view's is ``1 − p``).
    """

    objective: str
    block_size: int
    split: str
    rows: int
    batches: int
    samples: int
    t_min: float
    nelbo: float
    nelbo_stderr: float | None
    ppl_bound: float
    nelbo_tokens: int
    ltr_nll: float | None
    ltr_ppl: float | None
    ltr_tokens: int
    seconds: float
    t_max: float = 1.0
    units: str = "nats/token"
    document_mask: bool = False
    window: int | None = None

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    def format(self) -> str:
        stderr = "n/a (--samples 1)" if self.nelbo_stderr is None else f"{self.nelbo_stderr:.4f}"
        lines = [
            f"data        {self.split}: {counted(self.rows, 'row')} in {counted(self.batches, 'batch', 'batches')}, "
            f"{self.objective} B={self.block_size}, {'document mask' if self.document_mask else 'no document mask'}, "
            f"{'full attention' if self.window is None else f'window {self.window}'}",
            f"nelbo       {self.nelbo:.4f} nats/token  stderr {stderr}  over {counted(self.samples, 'noise draw')}, "
            f"{'p' if self.objective == 'fast_dllm_v2' else 't'} in [{self.t_min:g}, {self.t_max:g}], "
            f"{self.nelbo_tokens} tokens",
            f"ppl bound   {self.ppl_bound:.2f}  (exp nelbo)",
        ]
        if self.ltr_nll is not None:
            lines.append(
                f"ltr nll     {self.ltr_nll:.4f} nats/token  (exact, left-to-right unmasking, {self.ltr_tokens} tokens)"
            )
            lines.append(f"ltr ppl     {self.ltr_ppl:.2f}")
        lines.append(f"time        {self.seconds:.1f} s")
        return "\n".join(lines)


def eval_plan(settings: EvalSettings, seq_len: int, ctx: ParallelContext) -> RankPlan | DocumentPlanner:
    """This rank's plan of the model's training layout (one process: ``single_process_context()``)."""
    common = {"uses_clean_stream": settings.uses_clean_stream, "window": settings.window}
    if settings.document_mask:
        return DocumentPlanner(ctx, seq_len, settings.block_size, reset_positions=settings.reset_positions, **common)
    return build_rank_plan(ctx, seq_len, settings.block_size, **common)  # type: ignore[arg-type]


def batch_count(split: ArtifactSplit, micro_batch_size: int, max_batches: int | None) -> int:
    """How many batches :func:`split_batches` yields."""
    count = -(-split.num_rows // micro_batch_size)
    return count if max_batches is None else min(count, max_batches)


def split_batches(split: ArtifactSplit, micro_batch_size: int, max_batches: int | None) -> Iterator[dict[str, Tensor]]:
    """Every row of ``split`` once, in order, in batches of ``micro_batch_size`` (the last may be
    short), read from the memory map one batch at a time."""
    loader = PackedLoader(split, batch_size=micro_batch_size, seed=0, drop_last=False, shuffle=False)
    for index in range(batch_count(split, micro_batch_size, max_batches)):
        batch = next(loader)
        keep = min(micro_batch_size, split.num_rows - index * micro_batch_size)
        yield {name: value[:keep] for name, value in batch.items()}


def _ce_sum(model: Decoder, corrupted: CorruptedBatch, plan: RankPlan | DocumentPlanner, chunk: int) -> float:
    _, ce_sum = rank_loss(model, corrupted, plan, global_denominator=1.0, world_size=1, ce_chunk_rows=chunk)
    return float(ce_sum.to(torch.float64))


@dataclass(frozen=True)
class EvalOptions:
    """How to score a split (``csbp eval``'s flags)."""

    samples: int = 4
    micro_batch_size: int = 8
    max_batches: int | None = None
    seed: int = 0
    left_to_right: bool = True
    ce_chunk_rows: int = 1024

    def __post_init__(self) -> None:
        if self.samples < 1:
            raise ValueError(f"--samples must be >= 1, got {self.samples}")


@dataclass
class EvalSums:
    """One rank's shares: per-draw NELBO CE sums and token counts, the LTR CE sum and token count.
    CE sums add over every rank; counts and rows over the ranks of one model replica, once."""

    nelbo: list[float]
    nelbo_tokens: list[float]
    ltr: float = 0.0
    ltr_tokens: float = 0.0
    rows: int = 0


SCAN_TOKENS = 1 << 24
"""Positions of the loss mask, tokens and document ids :func:`check_scored_tokens` reads at a time
(at least one row): a bound in rows held ``rows x seq_len`` of each, some GiB for long rows."""


def check_scored_tokens(split: ArtifactSplit, settings: EvalSettings, options: EvalOptions, *, vocab_size: int) -> None:
    """``ValueError`` (one line) unless the rows :func:`split_batches` yields hold a token to score,
    every token of them is an embedding row of the model (``[0, vocab_size)``), and none of the
    scored tokens is the mask token.

    The ids are read, not taken from the manifest's ``max_token_id``: no fingerprint covers that record,
    and a token file changed since ``csbp data prepare`` (same size) fed an id past the embedding to the
    forward, an ``IndexError`` traceback on CPU and a device-side assert on CUDA.

    Without a scored token the NELBO and the LTR NLL would be ``0 / 0``, reported as a perfect ``0.0``.
    A scored ``[M]`` can never be predicted: its logit is excluded (as the sampler does), so its CE
    is infinite, and the report was ``inf`` for ``fast_dllm_v2`` (bd3/mdlm refused it only at the first
    batch holding one, after forwards). Reads the loss mask and tokens (and, under token shift, the
    document ids: position 0 and document starts are never targets) of those rows a chunk at a time.
    """
    rows = min(batch_count(split, options.micro_batch_size, options.max_batches) * options.micro_batch_size, split.num_rows)
    if rows == 0:
        raise ValueError(f"--split {split.name} has no rows (fix: evaluate a split with data)")
    scored_any = False
    chunk = max(1, SCAN_TOKENS // max(1, split.seq_len))
    for start in range(0, rows, chunk):
        end = min(start + chunk, rows)
        supervised = np.asarray(split.loss_mask[start:end]) != 0
        tokens = np.asarray(split.tokens[start:end])
        outside = np.argwhere(tokens >= vocab_size)  # every token is an input, scored or not
        if outside.size:
            row, column = (int(v) for v in outside[0])
            raise ValueError(
                f"--split {split.name}: row {start + row} holds token id {int(tokens[row, column])} at position "
                f"{column}, outside the model vocabulary [0, {vocab_size}) (fix: evaluate data prepared with the "
                "model's tokenizer; if it was, its token files changed since: check with csbp data inspect --verify)"
            )
        first = 0
        if settings.token_shift:
            doc_ids = np.asarray(split.doc_ids[start:end])
            supervised = supervised[:, 1:] & (doc_ids[:, 1:] == doc_ids[:, :-1])
            tokens, first = tokens[:, 1:], 1
        masked = np.argwhere(supervised & (tokens == settings.mask_token_id))
        if masked.size:
            row, column = (int(v) for v in masked[0])
            raise ValueError(
                f"--split {split.name}: row {start + row} holds the mask token id {settings.mask_token_id} at scored "
                f"position {column + first}; the model never predicts [M] (its logit is excluded), so the NELBO would "
                "be inf (fix: evaluate data prepared with the model's tokenizer and mask token, where no supervised "
                "token is [M])"
            )
        scored_any = scored_any or bool(supervised.any())
    if scored_any:
        return
    which = "supervised token that token shift can target (never position 0 or a document start)" if settings.token_shift else "supervised token"
    raise ValueError(
        f"--split {split.name}: the {counted(rows, 'row')} scored hold no {which}: its NELBO would be 0/0 "
        "(fix: evaluate a split with supervised tokens, or raise --max-batches)"
    )


@torch.no_grad()
def score_split(
    model: Decoder,
    split: ArtifactSplit,
    settings: EvalSettings,
    plan: RankPlan | DocumentPlanner,
    options: EvalOptions,
    *,
    replica: int = 0,
    replicas: int = 1,
    progress: bool = True,
) -> EvalSums:
    """This rank's sums over the batches of data-parallel ``replica`` (batch ``n`` belongs to replica
    ``n % replicas``); batch ``n`` is corrupted the same way whatever the layout."""
    from tqdm.auto import tqdm

    device = model.embed_tokens.weight.device
    model.eval()
    objective = nelbo_objective(settings.build_objective())
    assert objective is not None
    samples = options.samples
    sums = EvalSums([0.0] * samples, [0.0] * samples)
    num_batches = batch_count(split, options.micro_batch_size, options.max_batches)
    forwards = samples + (settings.block_size if options.left_to_right else 0)
    mine = len(range(replica, num_batches, replicas))
    bar = tqdm(total=mine * forwards, desc="eval", unit="fwd", dynamic_ncols=True, disable=None if progress else True)
    for index, batch in enumerate(split_batches(split, options.micro_batch_size, options.max_batches)):
        if index % replicas != replica:
            continue
        batch = {name: value.to(device) for name, value in batch.items()}
        sums.rows += int(batch["input_ids"].shape[0])
        for draw in range(samples):
            generator = corruption_generator(options.seed, index, 0, micro_step=draw)
            corrupted = tensors_to(objective.corrupt(batch, generator), device)
            sums.nelbo[draw] += _ce_sum(model, corrupted, plan, options.ce_chunk_rows)
            sums.nelbo_tokens[draw] += corrupted.denominator()
            bar.update(1)
        if options.left_to_right:
            for corrupted in left_to_right_batches(
                batch,
                mask_token_id=settings.mask_token_id,
                block_size=settings.block_size,
                token_shift=settings.token_shift,
                uses_clean_stream=settings.uses_clean_stream,
            ):
                sums.ltr += _ce_sum(model, corrupted, plan, options.ce_chunk_rows)
                sums.ltr_tokens += corrupted.denominator()
                bar.update(1)
    bar.close()
    return sums


def evaluate_model(
    model: Decoder,
    split: ArtifactSplit,
    settings: EvalSettings,
    options: EvalOptions | None = None,
    *,
    progress: bool = True,
) -> EvalReport:
    """Score ``split`` on this one process (see the module docstring)."""
    options = options or EvalOptions()
    check_scored_tokens(split, settings, options, vocab_size=model.config.vocab_size)
    started = time.perf_counter()
    ctx = single_process_context(model.embed_tokens.weight.device)
    sums = score_split(model, split, settings, eval_plan(settings, split.seq_len, ctx), options, progress=progress)
    return build_report(sums, sums, split, settings, options, time.perf_counter() - started)


def build_report(
    ce: EvalSums,
    counts: EvalSums,
    split: ArtifactSplit,
    settings: EvalSettings,
    options: EvalOptions,
    seconds: float,
) -> EvalReport:
    """The report from the CE sums (``ce``) and token/row counts (``counts``) of all ranks."""
    samples = options.samples
    nelbo_sums, nelbo_tokens = ce.nelbo, counts.nelbo_tokens
    estimates = torch.tensor([s / max(z, 1.0) for s, z in zip(nelbo_sums, nelbo_tokens, strict=True)], dtype=torch.float64)
    nelbo = float(estimates.mean())
    stderr = float(estimates.std(unbiased=True)) / math.sqrt(samples) if samples > 1 else None
    ltr_nll = ce.ltr / max(counts.ltr_tokens, 1.0) if options.left_to_right else None
    return EvalReport(
        objective=settings.objective,
        block_size=settings.block_size,
        split=split.name,
        rows=counts.rows,
        batches=batch_count(split, options.micro_batch_size, options.max_batches),
        samples=samples,
        t_min=EVAL_T_MIN,
        t_max=1.0 - EVAL_T_MIN if settings.objective == "fast_dllm_v2" else 1.0,
        nelbo=nelbo,
        nelbo_stderr=stderr,
        ppl_bound=perplexity_bound(nelbo),
        nelbo_tokens=int(nelbo_tokens[0]),
        ltr_nll=ltr_nll,
        ltr_ppl=None if ltr_nll is None else perplexity_bound(ltr_nll),
        ltr_tokens=int(counts.ltr_tokens),
        seconds=seconds,
        document_mask=settings.document_mask,
        window=settings.window,
    )
