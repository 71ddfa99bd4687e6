"""What ``csbp plan`` prints and writes: the ranked table (with the calibration, the overlap it
assumed and the documents planned), the one-sentence reason, and the ``--json`` ranking."""

from __future__ import annotations

from dataclasses import replace

from csbp.plan.artifact_documents import DocumentSample
from csbp.plan.calibration import Calibration
from csbp.plan.documents import document_count
from csbp.plan.drafter import context_exchange_counts
from csbp.plan.hardware import Hardware
from csbp.plan.layout import SHORT_LABELS, Layout
from csbp.plan.model import GIB, Prediction, halo_used, overlap_note
from csbp.plan.search import Plan, describe
from csbp.plan.target_pass import describe_target_pass
from csbp.plan.workload import Workload


def exchange_label(workload: Workload, layout: Layout, seq_len: int) -> str:
    """Which K/V rows a ring exchanges: every row (CP-only), the clean rows (CSBP, full attention),
    only the halo (CSBP window layers, CSBP and cp-aware over packed documents), the target
    context (drafters; with documents, or CSBP sliding layers, their context exchange), or none."""
    if layout.cp == 1:
        return "-"
    if workload.objective.is_drafter:
        docs = workload.doc_length
        used = set()
        for key in docs.rows if isinstance(docs, DocumentSample) else (docs,):
            counts = context_exchange_counts(replace(workload, doc_length=key), layout, seq_len)
            used |= {False} if counts is None else set(counts.exchanged.values())
        return {frozenset({True}): "exchange", frozenset({False}): "context"}.get(frozenset(used), "ctx+exch")
    if layout.kind == "cp" and layout.transport != "halo":
        return "all rows"
    docs = workload.doc_length
    rows = [replace(workload, doc_length=row) for row in docs.rows] if isinstance(docs, DocumentSample) else [workload]
    halo = {halo_used(w, layout, seq_len, g) for w in rows for g in workload.model.groups}
    return {frozenset({True}): "halo", frozenset({False}): "clean"}.get(frozenset(halo), "clean+halo")


def _row(index: str, p: Prediction, workload: Workload, seq_len: int) -> str:
    lay = p.layout
    exchange = exchange_label(workload, lay, seq_len)
    return (
        f"{index:>3} {lay.name + (' bal' if lay.schedule == 'balanced' else ''):<18} {lay.transport if lay.cp > 1 else '-':<10} {exchange:<10} "
        f"{SHORT_LABELS[lay.checkpointing]:<5} {lay.micro_batch:>2} {p.step_s:>9.3f} {p.tokens_per_s:>11,.0f} "
        f"{p.mem_bytes / GIB:>7.1f}/{p.capacity_bytes / GIB:<6.1f} {p.kv_bytes / GIB:>8.2f} {p.exposed_comm_s:>8.3f}"
    )


def _param_count(count: float) -> str:
    """``13.51B``, ``2.36M``, ``850K``: billions as the published models are named, smaller units below."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.2f}{unit}"
    return f"{count:.0f}"


def _documents_note(workload: Workload, seq_len: int) -> str:
    if workload.doc_length is None:
        return ""
    if isinstance(workload.doc_length, DocumentSample):
        return f"\ndocuments (document mask; predictions averaged over the rows): {workload.doc_length.describe()}"
    count = document_count(seq_len, workload.doc_length)
    noun = "document" if count == 1 else "documents"
    return f", {count:,} packed {noun} of mean length {workload.doc_length:,} (document mask)"


def format_plan(
    plan: Plan, workload: Workload, seq_len: int, gpus: int, hw: Hardware, cal: Calibration, *, top: int
) -> str:
    obj = workload.objective
    lines = [
        f"csbp plan: {workload.model.name} ({_param_count(workload.model.total_params)} params, {obj.name}, "
        f"block {obj.block}) at L={seq_len:,} on {gpus}x{hw.name}"
        + ("" if hw.processes else f" ({hw.gpus_per_node}/node)")
        + _documents_note(workload, seq_len),
        f"calibration: {cal.source}",
        overlap_note(cal),
        *filter(None, [describe_target_pass(workload)]),
        "",
        f"{'#':>3} {'layout':<18} {'transport':<10} {'exchange':<10} {'ckpt':<5} {'mb':>2} {'step s':>9} "
        f"{'tokens/s':>11} {'mem GiB/cap':>14} {'K/V GiB':>8} {'exposed':>8}",
    ]
    lines += [_row(str(i + 1), p, workload, seq_len) for i, p in enumerate(plan.feasible[:top])]
    if len(plan.feasible) > top:
        lines.append(f"    ... {len(plan.feasible) - top} more feasible layouts (--top, --json)")
    if any(p.layout.schedule == "balanced" for p in plan.feasible[:top]):
        lines.append("    bal: the balanced block schedule (topology.schedule: balanced, blocks dealt by document cost)")
    if plan.infeasible:
        lines += ["", "out of memory:"]
        lines += [f"    {describe(p.layout)}: {p.oom_reason()}" for p in plan.infeasible[:top]]
        if len(plan.infeasible) > top:
            lines.append(f"    ... {len(plan.infeasible) - top} more")
    lines += ["", f"why: {plan.why}"]
    return "\n".join(lines)


def _prediction_json(p: Prediction, workload: Workload, seq_len: int) -> dict[str, object]:
    lay = p.layout
    return {
        "layout": lay.name,
        "schedule": lay.schedule,
        "exchange": exchange_label(workload, lay, seq_len),
        "dp": lay.dp,
        "cp": lay.cp,
        "bp": lay.bp,
        "transport": lay.transport,
        "activation_checkpointing": lay.checkpointing,
        "micro_batch": lay.micro_batch,
        "placement": lay.placement,
        "sharding": lay.sharding,
        "step_s": p.step_s,
        "tokens_per_s": p.tokens_per_s,
        "fwd_s": p.fwd_s,
        "bwd_s": p.bwd_s,
        "exposed_comm_s": p.exposed_comm_s,
        "kv_bytes_per_gpu": p.kv_bytes,
        "mem_gib": p.mem_bytes / GIB,
        "capacity_gib": p.capacity_bytes / GIB,
        "fits": p.fits,
        "mem_terms_gib": {k: v / GIB for k, v in p.mem_terms.items()},
    }


def plan_json(
    plan: Plan, workload: Workload, seq_len: int, gpus: int, hw: Hardware, cal: Calibration, *, error: str | None = None
) -> dict[str, object]:
    """The full ranking; ``fits`` is false and ``error`` the command's error line when no layout fits."""
    return {
        "model": workload.model.name,
        "objective": workload.objective.name,
        "seq_len": seq_len,
        "doc_length": workload.doc_length if isinstance(workload.doc_length, int) else None,
        "documents": workload.doc_length.summary() if isinstance(workload.doc_length, DocumentSample) else None,
        "gpus": gpus,
        "hardware": hw.name,
        "calibration": cal.to_json(),
        "overlap": overlap_note(cal),
        "target_pass": workload.target_pass.mode if workload.target_pass is not None else None,
        "why": plan.why,
        "fits": plan.best is not None,
        "error": error,
        "feasible": [_prediction_json(p, workload, seq_len) for p in plan.feasible],
        "infeasible": [{**_prediction_json(p, workload, seq_len), "reason": p.oom_reason()} for p in plan.infeasible],
    }
