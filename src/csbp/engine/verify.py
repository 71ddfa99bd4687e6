"""``csbp verify``: prove on this machine that a parallel layout equals one process.

For each requested layout, N processes (gloo on the CPU, or NCCL with one GPU each for
``device="cuda"``) run one forward/backward of a small decoder on one fixed corrupted BD3 batch, average gradients with the engine's rules, and rank 0 returns the
global loss and every parameter gradient. The same model, batch and objective run on a single
process on the CPU with dense attention under the closed-form mask predicates (the reference,
``csbp.engine.oracle``: none of the tiled kernels the layouts run). The report gives, per layout, the relative error of the loss and the
largest relative error over all parameter gradients (``max|g - g_ref| / max|g_ref|`` per
parameter, the scale floored at ``GRADIENT_FLOOR`` of the largest gradient), against a
dtype-dependent tolerance.

Beyond the fixed problem of ``csbp verify``, a case can name explicit per-sample document
boundaries (``doc_ids``, padding included), the objective (``bd3``, ``fast_dllm_v2``, ``mdlm``,
each optionally under its unclipped-NELBO validation form), several gradient-accumulation
micro-batches with uneven supervision, RoPE positions restarting at documents, activation
checkpointing, FSDP2 and the trainer's bucketed gradient all-reduce: what :mod:`csbp.engine.fuzz`
draws at random.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from csbp.attention.documents import packed_doc_ids, random_documents
from csbp.config.rules import block_covers_sequence
from csbp.devices import tensors_to
from csbp.engine.block_diffusion import (
    DocumentPlanner,
    RankPlan,
    TransportName,
    build_rank_plan,
    rank_loss,
    sample_rows,
)
from csbp.engine.context import ParallelContext, build_parallel_context, single_process_context
from csbp.engine.grad_buckets import OverlappedGradientSync
from csbp.engine.grads import average_gradients, fill_missing_gradients
from csbp.engine.oracle import OraclePlanner, oracle_plan
from csbp.evaluation.nelbo import nelbo_objective
from csbp.models.config import DecoderConfig
from csbp.models.decoder import Decoder
from csbp.objectives.base import CorruptedBatch, Objective, corruption_generator
from csbp.objectives.bd3 import Bd3Objective
from csbp.objectives.fast_dllm_v2 import FastDllmV2Objective
from csbp.objectives.mdlm import MdlmObjective
from csbp.parallel.groups import release_process_groups
from csbp.parallel.launch import run_local
from csbp.schedules import SchedulePolicy
from csbp.topology import Topology

TOLERANCES = {torch.float64: 1e-9, torch.float32: 1e-4}
VOCAB_SIZE = 64
MASK_TOKEN_ID = 63
OBJECTIVES: tuple[str, ...] = ("bd3", "fast_dllm_v2", "mdlm")
"""Objectives a case may run (mdlm: one bidirectional stream, data-parallel layouts only)."""


@dataclass(frozen=True)
class VerifyCase:
    """One layout to verify and the problem it runs on."""

    topology: Topology
    seq_len: int = 32
    block_size: int = 4
    transport: TransportName = "collective"
    window: int | None = None
    dtype: str = "float64"
    samples: int = 2
    seed: int = 0
    backend: str = "tiles"
    diagonal: str = "auto"  # kernel of the noisy block diagonal (csbp.attention.diagonal)
    clean: str = "generic"  # kernel of the clean-context partials (csbp.attention.backends.CLEAN_KERNELS)
    doc_length: int | None = None  # mean length of random packed documents (document masking on)
    device: str = "cpu"
    schedule: SchedulePolicy = "dual_end"  # block schedule over BP ranks (csbp.schedules)
    objective: str = "bd3"  # one of OBJECTIVES
    nelbo: bool = False  # score the objective's unclipped NELBO (val_nelbo's corruption) instead
    # explicit doc ids of every global row (micro_batches * dp * samples rows of seq_len ids, -1 = padding,
    # never supervised); document masking on. Overrides doc_length.
    doc_ids: tuple[tuple[int, ...], ...] | None = None
    # fraction of supervised tokens of every global row (None: 0.8 each); uneven values give ranks and
    # micro-batches different valid-token counts
    supervision: tuple[float, ...] | None = None
    micro_batches: int = 1  # gradient accumulation: micro-batches summed against one global denominator
    reset_positions: bool = False  # RoPE positions restart at each document (data.reset_positions)
    activation_checkpointing: str = "none"  # train.activation_checkpointing: none | full | selective
    compile: bool = False  # train.compile: layers (regional torch.compile, csbp.training.compile_regions)
    fsdp: bool = False  # train.fsdp: FSDP2 (HSDP when local > 1) over the dp group
    # average gradients as the trainer does, in buckets of at most this many bytes all-reduced during the
    # last micro-batch's backward (csbp.engine.grad_buckets); None: one flat all-reduce after backward
    grad_buckets: int | None = None
    ce_chunk_rows: int = 1024  # rows per chunk of the LM-head loss (csbp.objectives.chunked_ce)

    @property
    def documents(self) -> bool:
        """Whether document masking is on."""
        return self.doc_ids is not None or self.doc_length is not None

    @property
    def block(self) -> int:
        """The engine's block size: ``seq_len`` for mdlm (one block), else ``block_size``."""
        return self.seq_len if self.objective == "mdlm" else self.block_size

    @property
    def label(self) -> str:
        """``csbp     dp1xcp2xbp2  halo``: :attr:`columns` padded to the verify table's minimum widths."""
        name, shape, detail = self.columns
        return f"{name:<8} {shape:<12} {detail}"

    @property
    def columns(self) -> tuple[str, str, str]:
        """The layout's name, its ``dpXxcpYxbpZ`` shape and the detail (transport, window, schedule)."""
        t = self.topology
        parts = [f"dp{t.dp}", f"cp{t.cp}", f"bp{t.bp}"]
        name = {"data": "data", "cp": "cp-only", "bp": "bp-only", "csbp": "csbp"}[t.layout]
        detail = self.transport if t.layout == "csbp" else "-"
        if self.window is not None:
            detail = f"window={self.window}"
        if t.layout == "csbp" and self.documents and self.window is None and self.transport != "streaming":
            detail = "halo"  # CSBP exchanges only the clean rows of the receivers' documents
        if self.transport == "halo" and t.layout == "cp":
            name, detail = "cp-aware", "halo"
        if self.schedule != "dual_end" and t.bp > 1:
            detail += f" {self.schedule}"
        return name, "x".join(parts), detail


@dataclass
class VerifyResult:
    case: VerifyCase
    loss: float
    loss_ref: float
    loss_rel_err: float
    grad_rel_err: float
    worst_param: str
    tolerance: float
    attention_bytes_per_rank: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.loss_rel_err <= self.tolerance and self.grad_rel_err <= self.tolerance


def tiny_model_config(num_layers: int = 2) -> DecoderConfig:
    """The small decoder every verification runs (csbp.md §18 sizes: hidden 32, 4/2 heads)."""
    return DecoderConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        intermediate_size=64,
        num_layers=num_layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rope_theta=10000.0,
        qk_norm=True,
    )


def dtype_of(name: str) -> torch.dtype:
    """The torch dtype a case names (``"float64"`` or ``"float32"``)."""
    return {"float64": torch.float64, "float32": torch.float32}[name]


def _batch(case: VerifyCase, num_replicas: int) -> dict[str, torch.Tensor]:
    """The clean rows of every micro-batch: ``micro_batches * num_replicas * samples`` rows."""
    g = torch.Generator().manual_seed(1000 + case.seed)
    shape = (case.micro_batches * case.samples * num_replicas, case.seq_len)
    ids = torch.randint(0, VOCAB_SIZE - 1, shape, generator=g)
    # Supervise unevenly so ranks own different numbers of valid tokens (a rank-local denominator
    # would then fail, csbp.md §18 item 8).
    share = 0.8 if case.supervision is None else torch.tensor(case.supervision, dtype=torch.float32)[:, None]
    loss_mask = torch.rand(shape, generator=g) < share
    loss_mask[:, : case.block_size] = False
    batch = {"input_ids": ids, "loss_mask": loss_mask}
    if case.doc_ids is not None:
        doc_ids = torch.tensor(case.doc_ids, dtype=torch.long)
        if tuple(doc_ids.shape) != shape:
            raise ValueError(f"VerifyCase.doc_ids has shape {tuple(doc_ids.shape)}, expected {shape}")
        batch["doc_ids"] = doc_ids
        loss_mask &= doc_ids >= 0  # padding is never supervised
    elif case.doc_length is not None:
        batch["doc_ids"] = torch.stack(
            [packed_doc_ids(random_documents(case.seq_len, case.doc_length, g)) for _ in range(shape[0])]
        )
    return batch


def case_objective(case: VerifyCase) -> Objective:
    """The objective ``case`` trains (or, with ``nelbo``, scores as validation does)."""
    objective: Objective
    if case.objective == "bd3":
        objective = Bd3Objective(mask_token_id=MASK_TOKEN_ID, block_size=case.block_size)
    elif case.objective == "fast_dllm_v2":
        objective = FastDllmV2Objective(mask_token_id=MASK_TOKEN_ID, block_size=case.block_size)
    elif case.objective == "mdlm":
        objective = MdlmObjective(mask_token_id=MASK_TOKEN_ID)
    else:
        raise ValueError(f"VerifyCase.objective must be one of {OBJECTIVES}, got {case.objective!r}")
    if case.nelbo:
        scored = nelbo_objective(objective)
        assert scored is not None
        objective = scored
    return objective


def corrupted_batches(case: VerifyCase, num_replicas: int = 1) -> list[CorruptedBatch]:
    """One corrupted batch per micro-batch (every replica's rows corrupted at once, micro-step ``k``
    drawn from its own generator, as a training step draws them)."""
    objective = case_objective(case)
    batch = _batch(case, num_replicas)
    per_micro = case.samples * num_replicas
    return [
        objective.corrupt(
            {name: value[k * per_micro : (k + 1) * per_micro] for name, value in batch.items()},
            corruption_generator(case.seed, 0, 0, micro_step=k),
        )
        for k in range(case.micro_batches)
    ]


def corrupted_batch(case: VerifyCase, num_replicas: int = 1) -> CorruptedBatch:
    """The corrupted batch of a one-micro-batch case."""
    return corrupted_batches(case, num_replicas)[0]


def _model(case: VerifyCase, ctx: ParallelContext) -> Decoder:
    """The case's decoder on this rank: plain, or built on ``meta``, compiled, checkpointed and FSDP-sharded from
    outside and then filled with the same initial weights (as the trainer builds it)."""
    dtype = dtype_of(case.dtype)
    if not (case.activation_checkpointing != "none" or case.fsdp or case.compile):
        return Decoder(tiny_model_config(), dtype=dtype, seed=case.seed, device=ctx.device)
    from csbp.training.activation_checkpointing import checkpoint_layers
    from csbp.training.compile_regions import compile_layers
    from csbp.training.model_factory import load_full_weights
    from csbp.training.parallelize import apply_fsdp

    model = Decoder(tiny_model_config(), dtype=dtype, device="meta")
    compile_layers(model.layers, "layers" if case.compile else "none")
    checkpoint_layers(model.layers, case.activation_checkpointing, ctx.counter)  # type: ignore[arg-type]
    if case.fsdp:
        apply_fsdp(model, ctx, ctx.device)
    model.to_empty(device=ctx.device)
    load_full_weights(model, model.initial_weights(torch.Generator().manual_seed(case.seed)))
    return model


def _forward_backward(
    case: VerifyCase, ctx: ParallelContext, *, num_replicas: int, oracle: bool = False
) -> tuple[float, dict[str, torch.Tensor]]:
    """One step on this rank. Each micro-batch holds ``samples * num_replicas`` rows corrupted at
    once; data-parallel replica ``d`` takes rows ``[d*samples, (d+1)*samples)`` of each, so the
    single-process reference (one replica holding every row) sees exactly the same corruption.
    ``oracle``: every layer's attention is the dense predicate oracle (``csbp.engine.oracle``)."""
    model = _model(case, ctx)
    micro = [tensors_to(c, ctx.device) for c in corrupted_batches(case, num_replicas)]
    denominator = max(sum(c.denominator() for c in micro), 1.0)  # global: every replica and micro-batch
    per_rank = case.samples * num_replicas // ctx.topology.dp
    dp_rank = ctx.coords.dp_rank
    plan: RankPlan | DocumentPlanner
    common = {
        "uses_clean_stream": case.objective != "mdlm", "transport": case.transport, "window": case.window,
        "backend": case.backend, "diagonal": case.diagonal, "clean": case.clean, "schedule": case.schedule,
    }
    if not case.documents:
        plan = build_rank_plan(ctx, case.seq_len, case.block, **common)  # type: ignore[arg-type]
        if oracle:
            plan = oracle_plan(plan, seq_len=case.seq_len, block_size=case.block, window=case.window, doc_ids=None,
                               single_stream=case.objective == "mdlm")
    else:
        planner = OraclePlanner if oracle else DocumentPlanner
        plan = planner(
            ctx, case.seq_len, case.block, reset_positions=case.reset_positions, **common  # type: ignore[arg-type]
        )
    total = torch.zeros(1, dtype=torch.float64, device=ctx.device)
    sync = None
    if case.grad_buckets is not None and not case.fsdp:
        sync = OverlappedGradientSync(model.parameters(), ctx.world_comm("gradients"), bucket_bytes=case.grad_buckets)
        sync.zero_grad()
    for k, full in enumerate(micro):
        corrupted = sample_rows(full, slice(dp_rank * per_rank, (dp_rank + 1) * per_rank))
        loss, ce_sum = rank_loss(
            model, corrupted, plan, global_denominator=denominator, world_size=ctx.world_size,
            ce_chunk_rows=case.ce_chunk_rows,
        )
        if sync is not None and k == len(micro) - 1:
            sync.arm()  # the last backward launches the buckets, as in training
        loss.backward()
        total += ce_sum.to(torch.float64)
    if case.fsdp:  # FSDP2 averaged the gradients over every rank inside backward
        fill_missing_gradients(model.parameters())
    elif sync is not None:
        sync.finish()
    else:
        average_gradients(model.parameters(), ctx.world_comm("gradients"))
    if ctx.is_distributed:
        total = ctx.world_comm("logging").all_reduce(total)
    grads = {name: _full(p.grad).detach().cpu() for name, p in model.named_parameters()}
    return float(total[0] / denominator), grads


def _full(grad: torch.Tensor | None) -> torch.Tensor:
    """A gradient as one full tensor (an FSDP2 ``DTensor`` shard is gathered: call on every rank)."""
    assert grad is not None
    from torch.distributed.tensor import DTensor

    return grad.full_tensor() if isinstance(grad, DTensor) else grad


def _worker(rank: int, world: int, case: VerifyCase) -> tuple[float, dict[str, torch.Tensor] | None, int]:
    ctx = build_parallel_context(case.topology)
    loss, grads = _forward_backward(case, ctx, num_replicas=case.topology.dp)
    attention_bytes = ctx.counter.bytes("attention")
    dist.barrier()
    if ctx.groups is not None:  # a worker runs a batch of cases (the fuzz sweep), each with its own groups
        release_process_groups(ctx.groups)
    return loss, (grads if rank == 0 else None), attention_bytes


def reference(case: VerifyCase) -> tuple[float, dict[str, torch.Tensor]]:
    """Single-process loss and gradients for ``case``'s model and batch, every layer's attention the
    dense oracle of the mask predicates (``csbp.engine.oracle``): independent of the tiled kernels,
    transports and row intervals the layouts run, so even the one-process layout of ``csbp verify
    --nproc 1`` is checked against something other than itself."""
    # the CPU reference: the plan only orders the rows (its kernels are replaced by the oracle)
    ref_case = replace(
        case, topology=Topology(), device="cpu", backend="tiles", diagonal="matmul", clean="generic",
        activation_checkpointing="none", fsdp=False, compile=False, grad_buckets=None,
    )
    return _forward_backward(ref_case, single_process_context(), num_replicas=case.topology.dp, oracle=True)


def check_case(case: VerifyCase) -> None:
    """Fail closed, before any process starts, on a case the engine cannot run (one line)."""
    if case.objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {case.objective!r}")
    if case.objective == "mdlm" and case.topology.local != 1:
        raise ValueError(
            f"mdlm is a single stream with no clean context to shard, got cp={case.topology.cp}, "
            f"bp={case.topology.bp}: use cp=1, bp=1 and scale with dp"
        )
    if case.objective == "mdlm" and case.window is not None:  # was: refused only once the reference planned it
        raise ValueError(
            f"window={case.window} has no effect on mdlm, which trains full attention: drop the window "
            "or use bd3/fast_dllm_v2"
        )
    if case.micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, got {case.micro_batches}")
    if case.reset_positions and not case.documents:
        raise ValueError("reset_positions needs documents: give doc_ids or doc_length")
    if case.transport != "collective" and case.topology.cp == 1:  # as the train config (topology.transport)
        raise ValueError(
            f"transport={case.transport!r} needs a CP ring (cp > 1), got cp=1 ({case.topology.layout} layout): "
            "use cp > 1 or transport='collective'"
        )
    if case.fsdp and case.topology.dp < 2:
        raise ValueError(f"fsdp shards over the dp group: use dp >= 2, got dp={case.topology.dp}")
    if case.compile:
        from csbp.training.compile_regions import check_compile_runs_on

        check_compile_runs_on("layers", case.device, where="compile")
    if block_covers_sequence(case.objective, case.block_size, case.seq_len):  # the train config's rule
        raise ValueError(
            f"block_size={case.block_size} must be below seq_len={case.seq_len} for {case.objective} "
            "(fix: a smaller block size; one block per sequence is mdlm)"
        )
    case.topology.validate_sequence(case.seq_len, case.block)


GRADIENT_FLOOR = 1e-3
"""A parameter's gradient error is measured against at least this fraction of the model's largest
reference gradient: a gradient that is mathematically zero (a query that sees one key has no
gradient through its softmax, e.g. ``window=1`` with ``block_size=1``) is round-off on both sides,
and dividing by its own round-off-sized scale reported a false failure of order 1."""


def loss_error(loss: float, loss_ref: float) -> float:
    """``|loss - loss_ref| / |loss_ref|``, the absolute difference where the reference is zero."""
    return abs(loss - loss_ref) / abs(loss_ref) if loss_ref else abs(loss - loss_ref)


def gradient_error(grads: dict[str, torch.Tensor], grads_ref: dict[str, torch.Tensor]) -> tuple[str, float]:
    """``(worst parameter, its error)`` with error ``max|g - g_ref| / max(max|g_ref|, GRADIENT_FLOOR * G)``,
    ``G`` the largest ``|g_ref|`` of any parameter; a non-finite gradient on either side is an infinite error."""
    largest = max((float(ref.abs().max()) for ref in grads_ref.values() if ref.numel()), default=0.0)
    floor = GRADIENT_FLOOR * largest
    worst_name, worst = "", 0.0
    for name, ref in grads_ref.items():
        scale = max(float(ref.abs().max()), floor) if ref.numel() else floor
        diff = float((grads[name] - ref).abs().max()) if ref.numel() else 0.0
        err = diff / scale if scale > 0 else diff
        if not math.isfinite(err):  # a NaN compares false with everything: it would pass as no error at all
            err = math.inf
        if err >= worst:
            worst_name, worst = name, err
    return worst_name, worst


def verify(case: VerifyCase, *, timeout_s: float = 300.0) -> VerifyResult:
    """Run ``case`` on ``topology.world_size`` processes and compare with one process."""
    check_case(case)
    loss_ref, grads_ref = reference(case)
    results = run_local(_worker, case.topology.world_size, (case,), timeout_s=timeout_s, device=case.device)
    return compare(case, results, loss_ref, grads_ref)


def compare(
    case: VerifyCase,
    results: list[tuple[float, dict[str, torch.Tensor] | None, int]],
    loss_ref: float,
    grads_ref: dict[str, torch.Tensor],
) -> VerifyResult:
    """The result of ``case`` from its ranks' ``_worker`` results (rank 0 holds the gradients)."""
    loss, grads, _ = results[0]
    assert grads is not None
    worst_name, worst = gradient_error(grads, grads_ref)
    return VerifyResult(
        case=case,
        loss=loss,
        loss_ref=loss_ref,
        loss_rel_err=loss_error(loss, loss_ref),
        grad_rel_err=worst,
        worst_param=worst_name,
        tolerance=TOLERANCES[dtype_of(case.dtype)],
        attention_bytes_per_rank=[r[2] for r in results],
    )


def layouts_for(nproc: int) -> list[Topology]:
    """Every valid single-sample topology on ``nproc`` processes, plus pure data parallelism."""
    found: list[Topology] = [Topology(dp=nproc)] if nproc > 1 else [Topology()]
    for local in range(2, nproc + 1):
        if nproc % local:
            continue
        dp = nproc // local
        found.append(Topology(dp=dp, cp=local))
        found.append(Topology(dp=dp, bp=local, replicate_clean_prefix=True))
        for cp in range(2, local + 1):
            if local % cp == 0:
                found.append(Topology(dp=dp, cp=cp, bp=local))
    return found
