"""How a training step normalises its loss over micro-steps, replicas and rows (docs/training.md,
"Loss normalisation").

One global batch of 4 rows whose supervised token counts are very unequal (16, 3, 0 and 7 tokens;
one row packs two documents and ends in padding) is trained as one micro-batch, as 2 and 4
accumulated micro-batches, and (``multiprocess``) on 2 gloo ranks as ``dp=2 x grad_accum 2``,
``bp=2`` and ``cp=2 x grad_accum 2``. Loss and averaged gradients must agree in float64, and equal
the estimator ``Σ_rows w·CE / Σ_rows supervised`` (not a mean of per-micro-batch means, which the
counts here move by far more than the tolerance). Corruption is keyed by the row (not by
``(dp_rank, micro_step)`` as in training), so every split draws the same masks.

DFlash is a per-sample mean (each sample's weighted sum over its own supervised slots, then the mean
over samples); with ``max_anchors`` above every row's valid count its anchors are every valid one, so
the same comparison applies, against ``reference_dflash_loss``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import ClassVar

import pytest
import torch
from torch import Tensor

from csbp.dflash.config import DFlashObjectiveConfig
from csbp.dflash.features import capture_target_features
from csbp.dflash.reference import reference_dflash_loss
from csbp.dflash.step import DFlashBatch
from csbp.dflash.verify import BLOCK_SIZE, DFlashVerifyCase, build_models
from csbp.engine.block_diffusion import DocumentPlanner, rank_loss
from csbp.engine.context import ParallelContext, build_parallel_context, single_process_context
from csbp.engine.grads import average_gradients
from csbp.engine.verify import MASK_TOKEN_ID, tiny_model_config
from csbp.models.decoder import Decoder
from csbp.objectives import build_objective
from csbp.objectives.base import CorruptedBatch, Objective
from csbp.parallel.groups import release_process_groups
from csbp.parallel.launch import run_local
from csbp.topology import Topology
from csbp.training.dflash_step import DFlashStepRunner
from csbp.training.step import StepRunner

SEQ_LEN, BLOCK, ROWS = 16, 4, 4
OBJECTIVES = ("bd3", "fast_dllm_v2", "mdlm", "ar")
TIGHT = {"rel": 1e-12, "abs": 1e-15}
Grads = dict[str, Tensor]


def global_batch(supervised: tuple[int, ...] = (16, 3, 0, 7)) -> dict[str, Tensor]:
    """4 rows; row ``i`` supervises ``supervised[i]`` tokens (row 3: two documents, then padding)."""
    generator = torch.Generator().manual_seed(7)
    ids = torch.randint(0, MASK_TOKEN_ID, (ROWS, SEQ_LEN), generator=generator)
    doc_ids = torch.zeros(ROWS, SEQ_LEN, dtype=torch.long)
    doc_ids[3, 6:12], doc_ids[3, 12:] = 1, -1
    loss_mask = torch.zeros(ROWS, SEQ_LEN, dtype=torch.bool)
    for row, count in enumerate(supervised):
        live = torch.nonzero(doc_ids[row] >= 0).flatten()
        loss_mask[row, live[len(live) - count :]] = True  # the last tokens: a prompt/response split
    return {"input_ids": ids, "loss_mask": loss_mask, "doc_ids": doc_ids, "row_ids": torch.arange(ROWS)}


def micro_batches(batch: dict[str, Tensor], *, dp: int, dp_rank: int, rows: int, accum: int) -> list[dict]:
    """The loader's split: micro-step ``k`` of replica ``r`` holds rows ``k·dp·rows + r·rows ...``."""
    assert dp * rows * accum == ROWS
    starts = [k * dp * rows + dp_rank * rows for k in range(accum)]
    return [{name: value[s : s + rows] for name, value in batch.items()} for s in starts]


def concat(parts: list[CorruptedBatch]) -> CorruptedBatch:
    """The rows of ``parts`` as one corrupted batch, normalisers summed (the loss is a sum over rows,
    so their order does not matter)."""
    tensors = {name: torch.cat([getattr(p, name) for p in parts]) for name in
               ("noisy_ids", "clean_ids", "labels", "weights", "doc_ids")}
    levels = [p.noise_levels for p in parts if p.noise_levels is not None]
    return replace(parts[0], **tensors, noise_levels=torch.cat(levels) if levels else None,
                   loss_normaliser=sum(p.loss_normaliser for p in parts))


@dataclass(frozen=True)
class RowKeyed:
    """``inner``'s corruption of each row with a generator seeded by its ``row_ids`` entry, so any
    split of the rows into micro-batches and replicas draws the same masks."""

    inner: Objective
    name: ClassVar[str] = "row_keyed"

    def corrupt(self, batch: Mapping[str, Tensor], generator: torch.Generator) -> CorruptedBatch:
        return concat([
            self.inner.corrupt({k: v[i : i + 1] for k, v in batch.items()},
                               torch.Generator().manual_seed(1000 + int(batch["row_ids"][i])))
            for i in range(int(batch["input_ids"].shape[0]))
        ])


def inner_objective(name: str) -> Objective:
    if name in ("bd3", "fast_dllm_v2"):
        return build_objective(name, mask_token_id=MASK_TOKEN_ID, block_size=BLOCK)
    return build_objective(name, mask_token_id=MASK_TOKEN_ID) if name == "mdlm" else build_objective(name)


def planner(name: str, ctx: ParallelContext) -> DocumentPlanner:
    """The trainer's plan with the document mask (``rank_plan_for``)."""
    block = SEQ_LEN if name == "mdlm" else 1 if name == "ar" else BLOCK
    return DocumentPlanner(ctx, SEQ_LEN, block, uses_clean_stream=name not in ("mdlm", "ar"), causal=name == "ar")


def grads_of(params: list[tuple[str, torch.nn.Parameter]]) -> Grads:
    return {name: p.grad.detach().clone() for name, p in params}  # type: ignore[union-attr]


def train_step(
    name: str, ctx: ParallelContext, *, rows: int, accum: int, batch: dict[str, Tensor] | None = None
) -> tuple[float, Grads]:
    """One ``StepRunner.train_step`` of this rank's share of the global batch, gradients averaged
    over every rank as the trainer averages them."""
    model = Decoder(tiny_model_config(), dtype=torch.float64, seed=0, device=ctx.device)
    inner = inner_objective(name)
    runner = StepRunner(model, inner, planner(name, ctx), ctx, device=ctx.device, precision="fp64", seed=0,
                        ce_chunk_rows=7)
    runner.objective = RowKeyed(inner)
    micro = micro_batches(batch or global_batch(), dp=ctx.topology.dp, dp_rank=ctx.coords.dp_rank,
                          rows=rows, accum=accum)
    result = runner.train_step(micro, step=1)
    average_gradients(model.parameters(), ctx.world_comm("gradients"))
    return result.loss, grads_of(list(model.named_parameters()))


def estimator(name: str) -> tuple[float, Grads, float]:
    """``Σ_rows w·CE / Σ_rows supervised`` of the global batch, its gradient, and the mean over
    four one-row micro-batches of their own means (the estimator this must not be)."""
    ctx = single_process_context()
    model = Decoder(tiny_model_config(), dtype=torch.float64, seed=0)
    objective, plan, batch = RowKeyed(inner_objective(name)), planner(name, ctx), global_batch()
    sums, counts, labelled = [], [], 0
    for row in range(ROWS):
        corrupted = objective.corrupt({k: v[row : row + 1] for k, v in batch.items()}, torch.Generator())
        ce_sum, _ = rank_loss(model, corrupted, plan, global_denominator=1.0, world_size=1, ce_chunk_rows=7)
        sums.append(ce_sum)
        counts.append(corrupted.denominator())
        labelled += corrupted.num_labelled()
    # the documented normaliser: supervised tokens (bd3lms: non-pad tokens), or the scored targets
    assert sum(counts) == (int(batch["loss_mask"].sum()) if name in ("bd3", "mdlm") else labelled)
    loss = torch.stack(sums).sum() / sum(counts)
    loss.backward()
    mean_of_means = sum(float(s.detach()) / max(c, 1.0) for s, c in zip(sums, counts, strict=True)) / ROWS
    return float(loss.detach()), grads_of(list(model.named_parameters())), mean_of_means


def assert_same(got: tuple[float, Grads], want: tuple[float, Grads], what: str) -> None:
    assert got[0] == pytest.approx(want[0], **TIGHT), what
    for param, grad in want[1].items():
        scale = float(grad.abs().max())
        err = float((got[1][param] - grad).abs().max())
        assert err <= 1e-12 * max(scale, 1e-30) or err == 0.0, (what, param, err, scale)


@pytest.mark.parametrize("name", OBJECTIVES)
def test_accumulated_micro_batches_equal_one_micro_batch_and_the_token_mean(name: str) -> None:
    """Splits of 1, 2 and 4 micro-batches (4 one-row micro-batches supervise 16, 3, 0 and 7
    tokens) give the loss and gradient of ``Σ w·CE / Σ supervised`` over the whole batch; the
    logged loss is the estimator whose gradient is applied."""
    ctx = single_process_context()
    want_loss, want_grads, mean_of_means = estimator(name)
    assert abs(mean_of_means - want_loss) > 0.05 * want_loss  # the counts make the bug visible
    for rows, accum in ((4, 1), (2, 2), (1, 4)):
        assert_same(train_step(name, ctx, rows=rows, accum=accum), (want_loss, want_grads), f"{name} {rows}x{accum}")


@pytest.mark.parametrize("name", OBJECTIVES)
def test_a_step_supervising_nothing_has_zero_loss_and_gradient(name: str) -> None:
    """No NaN, no division by zero: a step whose every micro-batch supervises nothing logs 0."""
    ctx = single_process_context()
    nothing = global_batch((0, 0, 0, 0))
    for rows, accum in ((4, 1), (1, 4)):
        loss, grads = train_step(name, ctx, rows=rows, accum=accum, batch=nothing)
        assert loss == 0.0
        assert all(bool(torch.all(g == 0)) for g in grads.values()), name


DFLASH_SUPERVISED = (16, 3, 2, 7)
"""Every row needs a valid anchor (a supervised token followed by one of its document)."""
DFLASH = DFlashObjectiveConfig(max_anchors=SEQ_LEN, gamma=4.0)
"""``max_anchors`` above every row's valid count: every valid anchor is drawn, whatever the generator."""


def dflash_step(
    ctx: ParallelContext, *, rows: int, accum: int, objective: DFlashObjectiveConfig = DFLASH
) -> tuple[float, Grads]:
    """One ``DFlashStepRunner.train_step`` of this rank's share, gradients averaged over every rank."""
    _, drafter = build_models(DFlashVerifyCase(), torch.float64, device=ctx.device)
    runner = DFlashStepRunner(drafter, objective, ctx, device=ctx.device, precision="fp64", seed=0, total_steps=1)
    batch = global_batch(DFLASH_SUPERVISED)
    micro = micro_batches(batch, dp=ctx.topology.dp, dp_rank=ctx.coords.dp_rank, rows=rows, accum=accum)
    result = runner.train_step(micro, step=1)
    average_gradients(drafter.parameters(), ctx.world_comm("gradients"))
    return result.loss, grads_of([(n, p) for n, p in drafter.named_parameters() if p.requires_grad])


def dflash_reference(objective: DFlashObjectiveConfig = DFLASH) -> tuple[float, Grads]:
    """``reference_dflash_loss`` of the whole batch in one micro-batch, every valid anchor drawn."""
    from csbp.dflash.anchors import valid_anchor_mask

    target, drafter = build_models(DFlashVerifyCase(), torch.float64)
    batch = global_batch(DFLASH_SUPERVISED)
    full = DFlashBatch(batch["input_ids"], batch["loss_mask"], batch["doc_ids"])
    anchors = [torch.nonzero(row).flatten() for row in valid_anchor_mask(full.loss_mask, full.doc_ids)]
    features = capture_target_features(target, full.input_ids, (0, 2), doc_ids_SL=full.doc_ids)
    out = reference_dflash_loss(drafter, full.input_ids, full.loss_mask, full.doc_ids, anchors, features, objective)
    out.loss.backward()
    return float(out.loss.detach()), grads_of([(n, p) for n, p in drafter.named_parameters() if p.requires_grad])


@pytest.mark.parametrize("objective", [DFLASH, DFlashObjectiveConfig(max_anchors=SEQ_LEN, weighting="dpace")],
                         ids=["decay", "dpace"])
def test_dflash_accumulation_equals_one_micro_batch_and_the_per_sample_mean(objective: DFlashObjectiveConfig) -> None:
    """Per-sample normalisation (by the sample's supervised slots, or by its D-PACE weight sum):
    samples of very different supervision weigh equally whichever micro-batch holds them, so splits
    of 1, 2 and 4 micro-batches agree with the single-process reference."""
    ctx = single_process_context()
    want = dflash_reference(objective)
    assert BLOCK_SIZE == BLOCK
    for rows, accum in ((4, 1), (2, 2), (1, 4)):
        assert_same(dflash_step(ctx, rows=rows, accum=accum, objective=objective), want, f"dflash {rows}x{accum}")


LAMBDA = DFlashObjectiveConfig(max_anchors=SEQ_LEN, gamma=4.0, lk_loss_type="lambda", kl_decay=3.0)


def test_the_lambda_mix_is_a_statistic_of_the_micro_batch() -> None:
    """Why ``lk_loss_type: lambda`` refuses ``train.grad_accum > 1`` (config rule): its CE/TV mix
    ``c = kl_scale·exp(−kl_decay·acceptance)`` takes the acceptance of the micro-batch it scores, so
    splitting the batch into micro-steps changes the loss and gradient (data parallelism does not:
    the acceptance is all-reduced over the replicas, see the multiprocess test)."""
    ctx = single_process_context()
    whole = dflash_step(ctx, rows=4, accum=1, objective=LAMBDA)
    assert_same(whole, dflash_reference(LAMBDA), "lambda 4x1")
    split = dflash_step(ctx, rows=2, accum=2, objective=LAMBDA)
    assert abs(split[0] - whole[0]) > 1e-5 * whole[0]


LAYOUTS = {
    "dp2": Topology(dp=2),
    "bp2": Topology(bp=2, replicate_clean_prefix=True),
    "cp2": Topology(cp=2),
    "csbp": Topology(cp=2, bp=2),
}


def _layouts_worker(rank: int, world: int) -> dict[str, tuple[float, Grads]] | None:
    """Every 2-process layout: dp2 x grad_accum 2 (one row per micro-batch) for every objective;
    bp2, cp2 and CSBP (cp2 x bp2) x grad_accum 2 (two rows per micro-batch) for bd3, fast_dllm_v2
    and dflash; the lambda mix on dp2 without accumulation."""
    out: dict[str, tuple[float, Grads]] = {}
    for layout, topology in LAYOUTS.items():
        ctx = build_parallel_context(topology)
        rows = ROWS // (2 * topology.dp)
        names = OBJECTIVES if layout == "dp2" else ("bd3", "fast_dllm_v2")
        for name in names:
            out[f"{name} {layout}"] = train_step(name, ctx, rows=rows, accum=2)
        out[f"dflash {layout}"] = dflash_step(ctx, rows=rows, accum=2)
        if layout == "dp2":
            out["lambda dp2"] = dflash_step(ctx, rows=2, accum=1, objective=LAMBDA)
        if ctx.groups is not None:
            release_process_groups(ctx.groups)
    return out if rank == 0 else None


@pytest.mark.multiprocess
def test_every_layout_with_accumulation_equals_one_micro_batch() -> None:
    """2 gloo ranks: the global batch of unequal rows split over replicas, BP/CP ranks and micro-steps
    gives the single-process loss and gradients (float64, 1e-12)."""
    got = run_local(_layouts_worker, 2, timeout_s=240)[0]
    ctx = single_process_context()
    want = {name: train_step(name, ctx, rows=ROWS, accum=1) for name in OBJECTIVES}
    want["dflash"] = dflash_reference()
    want["lambda"] = dflash_reference(LAMBDA)
    assert len(got) == 4 + 2 * 3 + 4 + 1
    for label, result in got.items():
        assert_same(result, want[label.split()[0]], label)
