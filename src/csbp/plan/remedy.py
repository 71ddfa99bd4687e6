"""What to change when no layout fits in memory: ``csbp plan`` and ``topology: auto`` then fail with
one line naming the smallest layout, the memory term that breaks it and the changes the cost model
predicts would fit. Each change (activation checkpointing, FSDP2 sharding, a target pass that holds
less, a smaller micro-batch with more accumulation, more devices, a shorter sequence) is retried with the same search, so a fix the line names is
one the planner has checked, and a change that cannot help (more devices when the weights are
replicated) is not proposed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from csbp.plan.artifact_documents import DocumentSample
from csbp.plan.calibration import Calibration
from csbp.plan.hardware import hardware
from csbp.plan.layout import MAX_DEVICES, Checkpointing, Placement, Sharding
from csbp.plan.model import Prediction
from csbp.plan.search import Plan, candidate_layouts, describe, rank
from csbp.plan.workload import Workload

MAX_DOUBLINGS = 6
"""Device counts tried: up to 2^6 = 64x the job's."""

MAX_HALVINGS = 12
"""Sequence lengths tried: down to 1/4096 of the job's."""

PLAN_FLAGS: Mapping[str, str] = {
    "checkpointing": "--checkpointing full",
    "sharding": "--sharding fsdp2",
    "target sharded": "--target-pass sharded",
    "target offline": "--target-pass offline",
    "micro_batch": "--set train.micro_batch_size={mb} --set train.grad_accum={accum}",
    "gpus": "--gpus {gpus}",
    "seq_len": "--seq-len {}",
}
"""How ``csbp plan`` names each change (``gpus``: formatted with ``gpus`` and ``nodes``)."""

AUTO_SETTINGS: Mapping[str, str] = {
    "sharding": "--set train.fsdp=true",
    "target sharded": "--set objective.dflash.target_capture=sharded",
    "target offline": "objective.dflash.features (captured ahead of time)",
    "micro_batch": "--set train.micro_batch_size={mb} --set train.grad_accum={accum}",
    "gpus": "--nnodes {nodes}",
    "seq_len": "--set data.seq_len={}",
}
"""How ``topology: auto`` names them (it searches both checkpointing settings already)."""


@dataclass(frozen=True)
class Search:
    """A search that found no layout that fits, retried with one setting changed."""

    workload: Workload
    gpus: int
    seq_len: int
    gpu: str
    cal: Calibration
    gpus_per_node: int | None = None
    checkpointing: tuple[Checkpointing, ...] = ("full", "none")
    sharding: Sharding = "fsdp2"
    placement: Placement = "packed"
    micro_batches: tuple[int, ...] = (1, 2, 4)
    global_batch: int | None = None
    grad_accum: int = 1
    names: Mapping[str, str] = field(default_factory=lambda: PLAN_FLAGS)

    def best(self, **changes: object) -> Prediction | None:
        """The fastest layout that fits with ``changes`` applied, or None (no layout, or an invalid job)."""
        s = replace(self, **changes)  # type: ignore[arg-type]
        try:
            hw = hardware(s.gpu, gpus=s.gpus, gpus_per_node=s.gpus_per_node)
        except ValueError:
            return None
        layouts = candidate_layouts(
            s.workload, s.gpus, s.seq_len, global_batch=s.global_batch, checkpointing=s.checkpointing,
            placement=s.placement, sharding=s.sharding, micro_batches=s.micro_batches,
        )
        if not layouts:
            return None
        plan = rank(s.workload, layouts, s.seq_len, hw, s.cal, global_batch=s.global_batch, grad_accum=s.grad_accum)
        return plan.best


def remedies(search: Search) -> list[str]:
    """The single changes that make some layout fit, each named as ``search.names`` says (a change
    with no name there is not tried)."""
    names, found = search.names, []
    obj = search.workload.objective
    if "checkpointing" in names and "full" not in search.checkpointing and not obj.is_drafter:
        if search.best(checkpointing=("full",)) is not None:
            found.append(names["checkpointing"])
    if "sharding" in names and search.sharding != "fsdp2" and search.best(sharding="fsdp2") is not None:
        found.append(names["sharding"])
    tp = search.workload.target_pass
    if tp is not None and tp.mode != "offline":
        for mode in ("sharded", "offline") if tp.mode == "replicated" else ("offline",):
            if f"target {mode}" in names and search.best(workload=search.workload.with_target_pass(mode)) is not None:
                found.append(names[f"target {mode}"])
                break
    mb = min(search.micro_batches)
    if "micro_batch" in names and mb > 1 and search.global_batch is None:  # the same sequences per step
        for smaller in (d for d in range(mb - 1, 0, -1) if mb % d == 0):
            accum = search.grad_accum * mb // smaller
            if search.best(micro_batches=(smaller,), grad_accum=accum) is not None:
                found.append(names["micro_batch"].format(mb=smaller, accum=accum))
                break
    if "gpus" in names:
        per_node = search.gpus_per_node or search.gpus
        for k in range(1, MAX_DOUBLINGS + 1):
            more = search.gpus << k
            if more > MAX_DEVICES:  # no job has more (torch.distributed's ranks are a C int)
                break
            if search.best(gpus=more) is not None:
                found.append(names["gpus"].format(gpus=more, nodes=max(1, more // per_node)))
                break
    # a row sample of real documents is tied to its length: no other length is planned for it
    if "seq_len" in names and not isinstance(search.workload.doc_length, DocumentSample):
        for k in range(1, MAX_HALVINGS + 1):
            shorter = search.seq_len >> k
            if shorter < max(obj.block, 1):
                break
            if search.best(seq_len=shorter) is not None:
                found.append(names["seq_len"].format(shorter))
                break
    return found


def nothing_fits(plan: Plan, search: Search, *, hardware_name: str, given: Sequence[str] = ()) -> str:
    """One line for a plan none of whose layouts fits: the smallest one, the term that breaks it and
    the fixes :func:`remedies` checked. ``given``: the ``--topology`` layouts evaluated instead of the
    search (then the search's best fitting layout, if any, is the first fix)."""
    smallest = plan.infeasible[0]
    fixes = []
    if given:
        best = search.best()
        if best is not None:
            fixes.append(f"--topology {best.layout.name}, the fastest layout the search finds that fits")
    if not fixes:
        fixes = remedies(search)
    tried = (
        f"none found: no layout fits with up to {search.gpus << MAX_DOUBLINGS} devices"
        + ("" if isinstance(search.workload.doc_length, DocumentSample) else " or a shorter sequence")
        + "; use devices with more memory or a smaller model"
    )
    scope = f"of --topology {' '.join(given)} " if given else ""
    return (
        f"no layout {scope}fits in memory on {search.gpus}x{hardware_name}: the smallest, {describe(smallest.layout)}, "
        f"{smallest.oom_reason()} (fix: {' or '.join(fixes) if fixes else tried})"
    )
