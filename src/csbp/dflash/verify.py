"""Prove that a parallel DFlash layout equals one process (csbp.md §14, objectives.md §12 test 11).

A tiny float64 problem (objectives.md §12 sizes: a 4-layer target with hidden 32, 4/2 heads, head
dim 8, vocabulary 64; a 2-layer drafter fusing target layers (0, 2), ``B = 4``, ``[M] = 63``; two
samples per replica, one packing two documents and ending in padding; with ``doc_length`` every
sample packs random documents of that mean length, as ``csbp verify --doc-length`` does for bd3) runs one DFlash step on
``topology.world_size`` gloo processes: online target features, the rank's anchors and context
shard, ``loss.backward()`` and gradient averaging over all ranks. Rank 0's sample-group loss and
averaged gradients are compared with ``reference_dflash_loss`` (dense masks, full logits) on the
same anchors: relative error of the loss and the largest per-parameter
``max|g − g_ref| / max|g_ref|``. ``transport`` is ``topology.transport``: with documents CSBP
exchanges only the visible context rows, CP-only too with ``halo`` (``csbp.dflash.exchange``).

Usage::

    result = verify_dflash(DFlashVerifyCase(Topology(cp=2, bp=2)))
    assert result.ok, result
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from csbp.attention.documents import packed_doc_ids, random_documents
from csbp.dflash.anchors import valid_anchor_mask
from csbp.dflash.config import DFlashConfig, DFlashObjectiveConfig
from csbp.dflash.drafter import DFlashDrafter
from csbp.dflash.features import capture_target_features
from csbp.dflash.rank_plan import build_dflash_rank_plan
from csbp.dflash.reference import reference_dflash_loss
from csbp.dflash.step import DFlashBatch, DFlashStep, sample_batch_anchors
from csbp.dflash.target_shard import TARGET_CATEGORY
from csbp.dflash.teacher_rows import TEACHER_CATEGORY
from csbp.engine.context import build_parallel_context
from csbp.engine.grads import average_gradients
from csbp.engine.verify import TOLERANCES, dtype_of, gradient_error, loss_error
from csbp.models.config import DecoderConfig
from csbp.models.decoder import Decoder
from csbp.parallel.groups import release_process_groups
from csbp.parallel.launch import run_local
from csbp.topology import Topology

VOCAB_SIZE, MASK_TOKEN_ID, BLOCK_SIZE = 64, 63, 4
# a rank's (loss, rank 0's gradients, attention / dflash.target / dflash.teacher bytes sent)
WorkerResult = tuple[float, dict[str, torch.Tensor] | None, int, int, int]
TARGET_CONFIG = DecoderConfig(
    vocab_size=VOCAB_SIZE,
    hidden_size=32,
    intermediate_size=64,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
)


@dataclass(frozen=True)
class DFlashVerifyCase:
    """One layout and the drafter/objective options it runs with.

    ``perturb_extras`` moves the DFlash2 convolutions and selector off their identity/zero
    initialisation so that they matter. ``samples`` is per data-parallel replica.
    """

    topology: Topology = field(default_factory=Topology)
    drafter_options: dict = field(default_factory=dict)
    objective: DFlashObjectiveConfig = field(
        default_factory=lambda: DFlashObjectiveConfig(max_anchors=6, gamma=7.0)
    )
    selector_scale: float = 0.0
    perturb_extras: bool = False
    seq_len: int = 32
    samples: int = 2
    seed: int = 0
    device: str = "cpu"  # where the layouts run (the reference always runs on the CPU)
    backend: str = "tiles"  # attention backend of the layouts' draft layers (csbp.attention.backends)
    diagonal: str = "auto"  # block-diagonal kernel of the layouts' draft blocks (csbp.attention.diagonal)
    clean: str = "generic"  # kernel of the draft blocks over the context (csbp.attention.backends.CLEAN_KERNELS)
    transport: str = "collective"  # topology.transport: "halo" exchanges the visible context rows in CP-only too
    doc_length: int | None = None  # mean length of random packed documents in every sample (None: make_batch's two)
    # explicit doc ids of every global row (dp * samples rows of seq_len ids, -1 = padding); overrides doc_length
    doc_ids: tuple[tuple[int, ...], ...] | None = None
    dtype: str = "float64"  # of the target and drafter, in the layouts and the reference alike


@dataclass(frozen=True)
class DFlashVerifyResult:
    case: DFlashVerifyCase
    loss: float
    loss_ref: float
    loss_rel_err: float
    grad_rel_err: float
    worst_param: str
    attention_bytes_per_rank: list[int]
    tolerance: float = 1e-9
    # bytes each rank sent in the online target pass (dflash.target: per-layer K/V all-gathers of the
    # sharded pass) and in the KL teacher rows' exchange (dflash.teacher)
    target_bytes_per_rank: list[int] = field(default_factory=list)
    teacher_bytes_per_rank: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.loss_rel_err <= self.tolerance and self.grad_rel_err <= self.tolerance


def build_models(
    case: DFlashVerifyCase, dtype: torch.dtype = torch.float64, device: torch.device | str | None = None
) -> tuple[Decoder, DFlashDrafter]:
    """The frozen target and the drafter of ``case`` (deterministic, the same on every device)."""
    target = Decoder(TARGET_CONFIG, dtype=dtype, seed=case.seed + 1, device=device)
    config = DFlashConfig.from_target(
        TARGET_CONFIG,
        num_layers=2,
        block_size=BLOCK_SIZE,
        mask_token_id=MASK_TOKEN_ID,
        target_layer_ids=(0, 2),
        **case.drafter_options,
    )
    drafter = DFlashDrafter(config, target=target, dtype=dtype, device=device, seed=case.seed + 2)
    if case.perturb_extras:
        generator = torch.Generator().manual_seed(case.seed + 9)
        with torch.no_grad():
            for name, param in drafter.named_parameters():
                if "conv" in name or "selector" in name:
                    param.add_(
                        0.3 * torch.randn(param.shape, generator=generator, dtype=torch.float64).to(param)
                    )
    return target, drafter


def make_batch(
    num_samples: int, seq_len: int, *, seed: int = 0, doc_length: int | None = None,
    doc_ids: tuple[tuple[int, ...], ...] | None = None,
) -> DFlashBatch:
    """Random tokens, ~80% supervision; odd samples pack two documents (with ``doc_length``: every
    sample packs random documents of that mean length) and end in 4 padding tokens. ``doc_ids``
    gives every row's documents explicitly (``-1``: padding, never supervised) instead."""
    generator = torch.Generator().manual_seed(seed + 5)
    ids = torch.randint(0, MASK_TOKEN_ID, (num_samples, seq_len), generator=generator)
    loss_mask = torch.rand(num_samples, seq_len, generator=generator) < 0.8
    doc_ids_SL = torch.zeros(num_samples, seq_len, dtype=torch.long)
    doc_ids_SL[1::2, seq_len * 3 // 8 :] = 1
    if doc_length is not None:
        doc_ids_SL = torch.stack(
            [packed_doc_ids(random_documents(seq_len, doc_length, generator)) for _ in range(num_samples)]
        )
    if doc_ids is not None:
        explicit = torch.tensor(doc_ids, dtype=torch.long)
        if tuple(explicit.shape) != (num_samples, seq_len):
            raise ValueError(f"doc_ids has shape {tuple(explicit.shape)}, expected {(num_samples, seq_len)}")
        return DFlashBatch(ids, loss_mask & (explicit >= 0), explicit)
    doc_ids_SL[1::2, seq_len - 4 :] = -1
    loss_mask[1::2, seq_len - 4 :] = False
    return DFlashBatch(ids, loss_mask, doc_ids_SL)


def anchorless_rows(case: DFlashVerifyCase) -> list[int]:
    """Rows of ``case``'s whole batch (every replica's samples) with no valid DFlash anchor (no supervised
    token followed by a supervised token of its document): training refuses such data before its first
    step (``validate_anchor_coverage``), so a case holding one is invalid."""
    batch = make_batch(case.samples * case.topology.dp, case.seq_len, seed=case.seed, doc_length=case.doc_length,
                       doc_ids=case.doc_ids)
    has_anchor = valid_anchor_mask(batch.loss_mask, batch.doc_ids).any(dim=-1)
    return [row for row, ok in enumerate(has_anchor.tolist()) if not ok]


def replica_batch(batch: DFlashBatch, replica: int, samples: int) -> DFlashBatch:
    rows = slice(replica * samples, (replica + 1) * samples)
    return DFlashBatch(batch.input_ids[rows], batch.loss_mask[rows], batch.doc_ids[rows])


def anchor_generator(case: DFlashVerifyCase, replica: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 * case.seed + 17 + replica)


def _worker(
    rank: int, world: int, case: DFlashVerifyCase
) -> WorkerResult:
    ctx = build_parallel_context(case.topology)
    _, drafter = build_models(case, dtype_of(case.dtype), device=ctx.device)
    full = make_batch(case.samples * case.topology.dp, case.seq_len, seed=case.seed, doc_length=case.doc_length,
                      doc_ids=case.doc_ids)
    batch = replica_batch(full, ctx.coords.dp_rank, case.samples)
    plan = build_dflash_rank_plan(
        ctx, case.objective, backend=case.backend, diagonal=case.diagonal, clean=case.clean,
        transport=case.transport,
    )
    step = DFlashStep(drafter, case.objective, plan)
    out = step(batch, anchor_generator(case, ctx.coords.dp_rank), selector_scale=case.selector_scale)
    out.loss.backward()
    average_gradients(drafter.parameters(), ctx.world_comm("gradients"))
    loss = torch.tensor([out.loss_value], dtype=torch.float64, device=ctx.device)
    loss = ctx.world_comm("logging").all_reduce(loss) / world  # replicas' group losses, averaged over dp
    moved = [ctx.counter.bytes(category) for category in ("attention", TARGET_CATEGORY, TEACHER_CATEGORY)]
    dist.barrier()
    if ctx.groups is not None:  # a worker runs a batch of cases, each with its own groups
        release_process_groups(ctx.groups)
    grads = {name: p.grad.detach().cpu() for name, p in drafter.named_parameters()} if rank == 0 else None
    return float(loss[0]), grads, moved[0], moved[1], moved[2]


def reference(case: DFlashVerifyCase) -> tuple[float, dict[str, torch.Tensor]]:
    """Single-process loss and gradients of ``case`` (all replicas' samples, same anchors)."""
    target, drafter = build_models(case, dtype_of(case.dtype))
    full = make_batch(case.samples * case.topology.dp, case.seq_len, seed=case.seed, doc_length=case.doc_length,
                      doc_ids=case.doc_ids)
    anchors = []
    for replica in range(case.topology.dp):
        part = replica_batch(full, replica, case.samples)
        anchors += sample_batch_anchors(part, case.objective, BLOCK_SIZE, anchor_generator(case, replica))
    features = capture_target_features(
        target, full.input_ids, (0, 2), doc_ids_SL=full.doc_ids, with_last_hidden=case.objective.loss == "kl"
    )
    out = reference_dflash_loss(
        drafter,
        full.input_ids,
        full.loss_mask,
        full.doc_ids,
        anchors,
        features,
        case.objective,
        selector_scale=case.selector_scale,
    )
    out.loss.backward()
    return float(out.loss.detach()), {name: p.grad.detach().clone() for name, p in drafter.named_parameters()}


def verify_dflash(case: DFlashVerifyCase, *, timeout_s: float = 300.0) -> DFlashVerifyResult:
    """Run ``case`` on ``topology.world_size`` processes and compare with the reference."""
    loss_ref, grads_ref = reference(case)
    results = run_local(_worker, case.topology.world_size, (case,), timeout_s=timeout_s, device=case.device)
    return compare_dflash(case, results, loss_ref, grads_ref)


def compare_dflash(
    case: DFlashVerifyCase,
    results: list[WorkerResult],
    loss_ref: float,
    grads_ref: dict[str, torch.Tensor],
) -> DFlashVerifyResult:
    """The result of ``case`` from its ranks' ``_worker`` results (rank 0 holds the gradients)."""
    loss, grads = results[0][:2]
    assert grads is not None
    worst_name, worst = gradient_error(grads, grads_ref)
    return DFlashVerifyResult(
        case=case,
        loss=loss,
        loss_ref=loss_ref,
        loss_rel_err=loss_error(loss, loss_ref),
        grad_rel_err=worst,
        worst_param=worst_name,
        attention_bytes_per_rank=[r[2] for r in results],
        tolerance=TOLERANCES[dtype_of(case.dtype)],
        target_bytes_per_rank=[r[3] for r in results],
        teacher_bytes_per_rank=[r[4] for r in results],
    )
