"""``csbp verify``: prove on this machine that a parallel layout equals one process.

For each requested layout, N processes (gloo on the CPU, or NCCL with one GPU each for
``device="cuda"``) run one forward/backward of a small decoder on one fixed corrupted BD3 batch, average gradients with the engine's rules, and rank 0 returns the
global loss and every parameter gradient. The same model, batch and objective run on a single
process on the CPU (the reference). The report gives, per layout, the relative error of the loss and the
largest relative error over all parameter gradients (``max|g - g_ref| / max|g_ref|`` per
parameter), against a dtype-dependent tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from csbp.attention.documents import packed_doc_ids, random_documents
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
from csbp.engine.grads import average_gradients
from csbp.models.config import DecoderConfig
from csbp.models.decoder import Decoder
from csbp.objectives.base import CorruptedBatch, corruption_generator
from csbp.objectives.bd3 import Bd3Objective
from csbp.parallel.launch import run_local
from csbp.schedules import SchedulePolicy
from csbp.topology import Topology

TOLERANCES = {torch.float64: 1e-9, torch.float32: 1e-4}
VOCAB_SIZE = 64
MASK_TOKEN_ID = 63


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

    @property
    def label(self) -> str:
        t = self.topology
        parts = [f"dp{t.dp}", f"cp{t.cp}", f"bp{t.bp}"]
        name = {"data": "data", "cp": "cp-only", "bp": "bp-only", "csbp": "csbp"}[t.layout]
        detail = self.transport if t.layout == "csbp" else "-"
        if self.window is not None:
            detail = f"window={self.window}"
        if t.layout == "csbp" and self.doc_length is not None and self.window is None and self.transport != "streaming":
            detail = "halo"  # CSBP exchanges only the clean rows of the receivers' documents
        if self.transport == "halo" and t.layout == "cp":
            name, detail = "cp-aware", "halo"
        if self.schedule != "dual_end" and t.bp > 1:
            detail += f" {self.schedule}"
        return f"{name:<8} {'x'.join(parts):<12} {detail}"


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


def _dtype(name: str) -> torch.dtype:
    return {"float64": torch.float64, "float32": torch.float32}[name]


def _batch(case: VerifyCase, num_replicas: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + case.seed)
    shape = (case.samples * num_replicas, case.seq_len)
    ids = torch.randint(0, VOCAB_SIZE - 1, shape, generator=g)
    # Supervise unevenly so ranks own different numbers of valid tokens (a rank-local denominator
    # would then fail, csbp.md §18 item 8).
    loss_mask = torch.rand(shape, generator=g) < 0.8
    loss_mask[:, : case.block_size] = False
    batch = {"input_ids": ids, "loss_mask": loss_mask}
    if case.doc_length is not None:
        batch["doc_ids"] = torch.stack(
            [packed_doc_ids(random_documents(case.seq_len, case.doc_length, g)) for _ in range(shape[0])]
        )
    return batch


def corrupted_batch(case: VerifyCase, num_replicas: int = 1) -> CorruptedBatch:
    objective = Bd3Objective(mask_token_id=MASK_TOKEN_ID, block_size=case.block_size)
    return objective.corrupt(_batch(case, num_replicas), corruption_generator(case.seed, 0, 0))


def _forward_backward(
    case: VerifyCase, ctx: ParallelContext, *, num_replicas: int
) -> tuple[float, dict[str, torch.Tensor]]:
    """One step on this rank. The batch holds ``samples * num_replicas`` rows corrupted at once;
    data-parallel replica ``d`` takes rows ``[d*samples, (d+1)*samples)``, so the single-process
    reference (one replica holding every row) sees exactly the same corruption."""
    model = Decoder(tiny_model_config(), dtype=_dtype(case.dtype), seed=case.seed, device=ctx.device)
    full = tensors_to(corrupted_batch(case, num_replicas), ctx.device)
    denominator = full.denominator()  # global: every replica's rows
    per_rank = case.samples * num_replicas // ctx.topology.dp
    dp_rank = ctx.coords.dp_rank
    corrupted = sample_rows(full, slice(dp_rank * per_rank, (dp_rank + 1) * per_rank))
    plan: RankPlan | DocumentPlanner
    if case.doc_length is None:
        plan = build_rank_plan(
            ctx, case.seq_len, case.block_size, transport=case.transport, window=case.window,
            backend=case.backend, diagonal=case.diagonal, clean=case.clean, schedule=case.schedule,
        )
    else:
        plan = DocumentPlanner(
            ctx, case.seq_len, case.block_size, transport=case.transport, window=case.window,
            backend=case.backend, diagonal=case.diagonal, clean=case.clean, schedule=case.schedule,
        )
    loss, ce_sum = rank_loss(model, corrupted, plan, global_denominator=denominator, world_size=ctx.world_size)
    loss.backward()
    average_gradients(model.parameters(), ctx.world_comm("gradients"))
    total = ce_sum.clone().reshape(1)
    if ctx.is_distributed:
        total = ctx.world_comm("logging").all_reduce(total)
    grads = {name: p.grad.detach().cpu() for name, p in model.named_parameters()}
    return float(total[0] / denominator), grads


def _worker(rank: int, world: int, case: VerifyCase) -> tuple[float, dict[str, torch.Tensor] | None, int]:
    ctx = build_parallel_context(case.topology)
    loss, grads = _forward_backward(case, ctx, num_replicas=case.topology.dp)
    attention_bytes = ctx.counter.bytes("attention")
    dist.barrier()
    return loss, (grads if rank == 0 else None), attention_bytes


def reference(case: VerifyCase) -> tuple[float, dict[str, torch.Tensor]]:
    """Single-process loss and gradients for ``case``'s model and batch."""
    # the CPU reference: tiles with the batched-matmul block diagonal, whatever kernels the case runs
    ref_case = replace(case, topology=Topology(), device="cpu", backend="tiles", diagonal="matmul", clean="generic")
    return _forward_backward(ref_case, single_process_context(), num_replicas=case.topology.dp)


def _relative_error(value: torch.Tensor, ref: torch.Tensor) -> float:
    scale = ref.abs().max().item()
    diff = (value - ref).abs().max().item()
    return diff / scale if scale > 0 else diff


def verify(case: VerifyCase, *, timeout_s: float = 300.0) -> VerifyResult:
    """Run ``case`` on ``topology.world_size`` processes and compare with one process."""
    case.topology.validate_sequence(case.seq_len, case.block_size)
    loss_ref, grads_ref = reference(case)
    results = run_local(_worker, case.topology.world_size, (case,), timeout_s=timeout_s, device=case.device)
    loss, grads, _ = results[0]
    assert grads is not None
    worst_name, worst = "", 0.0
    for name, ref in grads_ref.items():
        err = _relative_error(grads[name], ref)
        if err >= worst:
            worst_name, worst = name, err
    return VerifyResult(
        case=case,
        loss=loss,
        loss_ref=loss_ref,
        loss_rel_err=abs(loss - loss_ref) / abs(loss_ref),
        grad_rel_err=worst,
        worst_param=worst_name,
        tolerance=TOLERANCES[_dtype(case.dtype)],
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
