"""Enumerate the layouts csbp can run for a job, predict each, rank them, and say why the best wins.

The search covers every ``dp x local`` split of the devices and, per local size, the data layout,
CP-only, BP-only and every fused CSBP ``cp | bp``; per layout the transports (rings only),
activation checkpointing and micro-batches that divide the global batch. Layouts csbp would reject
for the sequence (``Topology.validate_sequence``) are never proposed.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from csbp.plan.calibration import Calibration
from csbp.plan.hardware import Hardware
from csbp.plan.layout import Checkpointing, Layout, Placement, Sharding, Transport, divisors
from csbp.plan.model import Prediction, predict
from csbp.plan.workload import Workload
from csbp.topology import sequence_error_in_flags
from csbp.wording import size


@dataclass(frozen=True)
class Plan:
    """Ranked predictions: ``feasible`` fastest first, ``infeasible`` (out of memory) apart."""

    feasible: tuple[Prediction, ...]
    infeasible: tuple[Prediction, ...]
    why: str

    @property
    def best(self) -> Prediction | None:
        return self.feasible[0] if self.feasible else None


def largest_ring(workload: Workload, seq_len: int) -> int:
    """The most devices one sample can be split over (``max(cp, bp)``): 1 for a single stream, else
    the sequence's rows (each ring member holds one at least) or a drafter's anchors (its BP ranks
    own one each). More devices only add replicas: the search looks at no larger ring."""
    obj = workload.objective
    if obj.single_stream:
        return 1
    return max(seq_len, obj.anchors) if obj.is_drafter else seq_len


def candidate_layouts(
    workload: Workload,
    gpus: int,
    seq_len: int,
    *,
    global_batch: int | None = None,
    checkpointing: Sequence[Checkpointing] = ("full", "none"),
    placement: Placement = "packed",
    sharding: Sharding = "fsdp2",
    micro_batches: Sequence[int] = (1, 2, 4),
) -> list[Layout]:
    """Every layout csbp accepts for ``gpus`` devices and this workload (see module docstring).
    Without ``global_batch`` (one optimizer step = ``dp`` micro-batches) only the first of
    ``micro_batches`` is used."""
    obj = workload.objective
    out: list[Layout] = []
    for local in divisors(gpus, at_most=largest_ring(workload, seq_len)):
        dp = gpus // local
        degrees: list[tuple[int, int]] = [(1, 1)] if local == 1 else [(local, 1), (1, local)]
        degrees += [(cp, local) for cp in divisors(local) if 1 < cp < local]
        if local > 1:
            degrees.append((local, local))
        for cp, bp in degrees:
            if obj.single_stream and local > 1:
                continue
            base = Layout(dp, cp, bp, placement=placement, sharding=sharding)
            if not _accepts(workload, base, seq_len):
                continue
            transports = transports_for(workload, base)
            ckpts = ("none",) if obj.is_drafter else tuple(checkpointing)
            for mb in micro_batches:
                if global_batch is None and mb != micro_batches[0]:
                    continue
                if global_batch is not None and global_batch % (dp * mb):
                    continue
                for transport in transports:
                    for ckpt in ckpts:
                        for schedule in schedules_for(workload, base):
                            out.append(
                                replace(
                                    base, transport=transport, checkpointing=ckpt, micro_batch=mb, schedule=schedule
                                )
                            )
    return out


def transports_for(workload: Workload, layout: Layout) -> tuple[Transport, ...]:
    """The K/V transports that differ for this layout: none without a ring, none for drafters (their
    context all-gather) or for CSBP when every layer is windowed (the halo all-to-all ignores it).
    With packed documents CP-only adds ``halo``, the mask-aware baseline ``cp-aware``."""
    all_windowed = all(g.window for g in workload.model.groups)
    aware: tuple[Transport, ...] = ("halo",) if workload.doc_length and layout.kind == "cp" else ()
    if layout.cp == 1 or (layout.kind == "csbp" and all_windowed):
        return ("collective",)
    if workload.objective.is_drafter:
        return ("collective", *aware)
    return ("collective", "streaming", *aware)


def schedules_for(workload: Workload, layout: Layout) -> tuple[str, ...]:
    """The block schedules that differ for this layout: with packed documents a BP layout (BD3
    family) adds ``balanced``, which deals blocks by their document cost (``counts.document_schedule``)."""
    if workload.doc_length and layout.bp > 1 and not workload.objective.is_drafter:
        return ("dual_end", "balanced")
    return ("dual_end",)


def _accepts(workload: Workload, layout: Layout, seq_len: int) -> bool:
    return sequence_problem(workload, layout, seq_len) is None


def sequence_problem(workload: Workload, layout: Layout, seq_len: int) -> tuple[str, str] | None:
    """``(why, fix)`` when csbp would reject ``seq_len`` on ``layout`` (``Topology.validate_sequence``;
    a drafter: ``2 x cp`` zigzag chunks and at least ``bp`` anchors), else None. ``fix`` names the
    ``csbp plan`` flags."""
    obj = workload.objective
    if obj.single_stream:  # one block per sequence (mdlm) or none (ar): no block rule, data parallel only
        return None
    if obj.block >= seq_len:  # csbp.config.rules.block_covers_sequence (not imported: it loads torch)
        return (
            f"block_size={obj.block} must be below seq_len={seq_len} for {obj.name} (one block per sequence is "
            "mdlm's)",
            f"--seq-len {2 * obj.block} or more, or --block-size below {seq_len}",
        )
    if obj.is_drafter:
        unit = 2 * layout.cp
        if seq_len % unit:
            lower = seq_len // unit * unit
            lengths = " or ".join(str(n) for n in (lower, lower + unit) if n > 0)
            return f"seq_len={seq_len} must be a multiple of 2*cp = {unit} (the drafter's zigzag chunks)", f"--seq-len {lengths}"
        if obj.anchors < layout.bp:
            return f"{obj.anchors} anchors per sample are fewer than bp={layout.bp}", f"--anchors {layout.bp} or more, or a smaller bp"
        return None
    try:
        layout.topology.validate_sequence(seq_len, obj.block)
    except ValueError as exc:
        why, _, fix = str(exc).partition(" (fix: ")
        return why, sequence_error_in_flags(fix.removesuffix(")")) or "change --seq-len or --block-size"
    return None


def no_layout_reason(
    workload: Workload,
    gpus: int,
    seq_len: int,
    *,
    global_batch: int | None = None,
    micro_batches: Sequence[int] = (1, 2, 4),
) -> str:
    """One line (with the fix) saying why :func:`candidate_layouts` found nothing: the sequence
    fits no layout (the data-parallel layout asks least: whole blocks, or a drafter's even length),
    or ``global_batch`` is a multiple of no accepted layout's ``dp x micro-batch``."""
    problem = sequence_problem(workload, Layout(gpus), seq_len)  # dp only: no CP/BP rule on top
    if problem is not None:
        why, fix = problem
        return f"--seq-len {seq_len}: no layout of {gpus} devices accepts it, not even data parallel: {why} (fix: {fix})"
    dps = sorted({lay.dp for lay in candidate_layouts(workload, gpus, seq_len, micro_batches=micro_batches)})
    if global_batch is not None and dps:
        unit = dps[0] * min(micro_batches)
        return (
            f"--global-batch {global_batch} is not a multiple of dp x micro-batch of any layout csbp accepts here "
            f"(dp {', '.join(map(str, dps))}; micro-batches {', '.join(map(str, micro_batches))}) "
            f"(fix: --global-batch {-(-global_batch // unit) * unit}, a multiple of {unit})"
        )
    return f"no layout of {gpus} devices accepts --seq-len {seq_len} (fix: change --seq-len or --gpus)"


def rank(
    workload: Workload,
    layouts: Iterable[Layout],
    seq_len: int,
    hw: Hardware,
    cal: Calibration,
    *,
    global_batch: int | None = None,
    grad_accum: int = 1,
) -> Plan:
    """Predict every layout and rank them; the first feasible one is the plan's pick. An optimizer
    step trains ``global_batch`` samples, else ``grad_accum`` micro-steps of each layout's
    ``dp x micro_batch`` (a run config's ``train.grad_accum``)."""
    preds = [
        predict(
            workload, lay, seq_len, hw, cal,
            global_batch=global_batch if global_batch is not None else lay.dp * lay.micro_batch * grad_accum,
        )
        for lay in layouts
    ]
    # equal speed (e.g. a streaming ring whose traffic the model hides entirely): less memory, then
    # fewer K/V bytes, the layout least exposed to an overlap assumption that does not hold
    feasible = sorted((p for p in preds if p.fits), key=lambda p: (-p.tokens_per_s, p.mem_bytes, p.kv_bytes))
    infeasible = sorted((p for p in preds if not p.fits), key=lambda p: p.mem_bytes)
    return Plan(
        tuple(feasible),
        tuple(infeasible),
        explain(feasible, infeasible, cal, drafter=workload.objective.is_drafter),
    )


def describe(layout: Layout) -> str:
    """``dp4/cp4/bp4 collective, full checkpointing`` (+ micro-batch when > 1)."""
    text = layout.name
    if layout.cp > 1:
        text += " halo (cp-aware)" if layout.transport == "halo" and layout.kind == "cp" else f" {layout.transport}"
    if layout.schedule != "dual_end":
        text += f" {layout.schedule}"
    text += f", {'no' if layout.checkpointing == 'none' else layout.checkpointing} checkpointing"
    return text + (f", micro-batch {layout.micro_batch}" if layout.micro_batch > 1 else "")


def explain(
    feasible: Sequence[Prediction],
    infeasible: Sequence[Prediction],
    cal: Calibration | None = None,
    *,
    drafter: bool = False,
) -> str:
    """One sentence on why the best layout wins, against the fastest layout of another family
    (CP-only when the best is not CP-only) or, failing that, the runner-up."""
    if not feasible:
        if not infeasible:
            return "no layout csbp accepts for this sequence length and device count."
        smallest = infeasible[0]
        return f"nothing fits: the smallest layout, {describe(smallest.layout)}, {smallest.oom_reason()}."
    best = feasible[0]
    family = best.layout.kind
    rivals = [p for p in feasible if p.layout.kind == "cp"] if family != "cp" else []
    rivals = rivals or [p for p in feasible if p.layout.kind != family] or list(feasible[1:])
    if not rivals:
        return f"{describe(best.layout)} is the only layout that fits."
    rival = rivals[0]
    ratio = best.tokens_per_s / rival.tokens_per_s
    b, r = best.layout, rival.layout
    reasons = []
    if b.dp != r.dp:
        more = [p for p in infeasible if p.layout.kind == r.kind and p.layout.dp > r.dp]
        fit_note = ""
        if more:
            name, reason = more[0].layout.name, more[0].oom_reason()
            fit_note = f" (more {_family_name(r.kind)} replicas do not fit: {name} {reason})"
        reasons.append(f"it runs {b.dp} data-parallel replicas instead of {r.dp}{fit_note}")
    compute_b, compute_r = best.step_s - best.exposed_comm_s, rival.step_s - rival.exposed_comm_s
    if b.dp == r.dp and compute_r - compute_b > 0.02 * rival.step_s:
        why = ""
        if drafter and r.kind == "cp" and b.bp > 1:
            why = " (anchors are dealt over the BP ranks instead of repeated on every CP rank)"
        elif cal is not None and r.kind == "cp" and b.kind != "cp":
            why = (
                f" (one interval attention kernel, calibrated at {cal.interval_fwd:.2f}x/{cal.interval_bwd:.2f}x "
                "the CP-only kernel's forward/backward speed)"
            )
        reasons.append(f"its slowest rank computes {compute_r - compute_b:.2f} s less per step{why}")
    elif b.dp != r.dp and abs(best.step_s - rival.step_s) > 0.02 * rival.step_s:
        per_step = (best.tokens_per_s * best.step_s) / (rival.tokens_per_s * rival.step_s)
        reasons.append(
            f"a step takes {best.step_s:.2f} s against {rival.step_s:.2f} s and trains {per_step:.2f}x the tokens"
        )
    despite = ""  # a winner that sends more K/V wins in spite of it
    most = max(best.kv_bytes, rival.kv_bytes)
    if most >= 2**24 and abs(best.kv_bytes - rival.kv_bytes) > 0.1 * most:
        comm_gain = rival.exposed_comm_s - best.exposed_comm_s
        if best.kv_bytes < rival.kv_bytes:
            reasons.append(
                f"it sends {size(best.kv_bytes)} of K/V per device per step instead of {size(rival.kv_bytes)}"
                + (f" ({comm_gain:.2f} s less exposed communication)" if comm_gain >= 0.01 else "")
            )
        else:
            despite = f", although it sends {size(best.kv_bytes)} of K/V per device per step instead of {size(rival.kv_bytes)}"
    if not reasons:
        reasons.append("it is the fastest layout that fits")
    return (
        f"{describe(b)} wins at {ratio:.2f}x the best {_family_name(r.kind)} layout "
        f"({describe(r)}): {'; '.join(reasons)}{despite}."
    )


def _family_name(kind: str) -> str:
    return {"cp": "CP-only", "bp": "BP-only", "csbp": "CSBP", "data": "data-parallel"}[kind]
