"""The cost model: step time, throughput, K/V traffic and peak memory per GPU of one layout.

Everything that decides a layout is counted with csbp's own torch-free arithmetic
(``csbp.attention.counts``): per local rank, the noisy and clean rows it holds
(``layout_positions``), the (query, key) pairs the BD3 mask allows over them, window or full
(``position_pairs``), and the clean rows a sliding-window layer's halo exchange receives
(``halo_rows``). The slowest rank of a sample bounds the step. The calibration
(``csbp.plan.calibration``) turns FLOPs, bytes and rows into seconds and GiB:

* compute: dense ``2·params·rows`` per pass plus the LM head on loss rows; attention ``4·hd·H``
  per allowed pair; backward = 2x dense, 2.5x attention; full checkpointing adds one forward,
  selective checkpointing its dense part only (the attention's results are kept).
  CP-only attention runs at ``attn_eff``, the interval kernel of CSBP/BP/data layouts at
  ``attn_eff·interval_fwd|bwd``.
* K/V bytes per GPU (sent, what csbp's traffic counter records): per pass and layer
  ``(P-1)·shard·2·Hkv·hd·bytes`` with shard = ``2L/cp`` rows (CP-only: noisy and clean) or
  ``L/cp`` (CSBP: clean only); a CSBP window layer moves only its halo. Passes: forward,
  recompute (full checkpointing), dK/dV, plus the K/V re-circulation of the streaming backward.
* bandwidth: intra-node when the ring sits inside a node (``placement``), else the network; a
  halo all-to-all takes as long as its busiest member's larger direction (sent or received).
  Exposure: ``(1-overlap)`` of collective traffic (``collective_overlap``: ``overlap_cp`` for the
  generic CP-only all-gather, ``overlap_csbp`` for csbp's other async collectives, all-to-all
  included); streaming hides up to ``overlap_stream`` of the ring's attention time.
* step = micro-steps x (compute + exposed K/V) + exposed gradient sync + optimizer + overhead.
* memory: model states (by sharding), activations (checkpoints plus one layer's working set, with
  selective checkpointing also every layer's attention output, log-sum-exp and gathered K/V; or all
  layers' activations), gathered K/V (+ fp32 dK/dV), one logits chunk, a fitted constant.

With packed documents (``Workload.doc_length``, ``csbp.plan.documents``) the rows and pairs are
the document mask's; CSBP full-attention layers (unless ``streaming``) and CP-only ``halo``
(``cp-aware``: the interval kernel and the halo all-to-all, like CSBP) move only the halo rows the
ring's documents need; plain CP-only still all-gathers ``2L/cp`` rows per member.

DFlash drafters have their own terms (``csbp.plan.drafter``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from csbp.attention.counts import exchange_pays
from csbp.plan.artifact_documents import DocumentSample
from csbp.plan.calibration import Calibration
from csbp.plan.documents import (
    DocumentKey,
    document_halo_rows,
    halo_traffic_rows,
    layout_totals,
    packed_documents,
)
from csbp.plan.hardware import Hardware
from csbp.plan.layout import Layout
from csbp.plan.workload import LayerGroup, Workload

GIB = 2**30
CE_CHUNK_ROWS = 1024  # objective.ce_chunk_rows default: rows of one LM-head logits chunk


@dataclass(frozen=True)
class Prediction:
    """What the model predicts for one layout (per GPU, per optimizer step).

    Attributes:
        layout: the layout.
        step_s / tokens_per_s: step time and training tokens per second of the whole job.
        fwd_s / bwd_s: forward and backward span of one micro-step on the slowest rank (with exposed
            K/V traffic).
        exposed_comm_s: communication not hidden behind compute, per step.
        exposed_kv_s: the attention K/V part of it.
        kv_bytes: attention K/V bytes per GPU per step in the busiest direction (an all-gather
            member's sent = received bytes; a halo all-to-all's busiest member's larger direction).
        mem_terms: peak memory per GPU by term, bytes.
        capacity_bytes: what the device may hold.
    """

    layout: Layout
    step_s: float
    tokens_per_s: float
    fwd_s: float
    bwd_s: float
    exposed_comm_s: float
    exposed_kv_s: float
    kv_bytes: float
    mem_terms: dict[str, float]
    capacity_bytes: float

    @property
    def mem_bytes(self) -> float:
        return sum(self.mem_terms.values())

    @property
    def fits(self) -> bool:
        return self.mem_bytes <= self.capacity_bytes

    @property
    def largest_term(self) -> str:
        return max(self.mem_terms, key=lambda k: self.mem_terms[k])

    def oom_reason(self) -> str:
        """Why it does not fit: the total against capacity and the term that dominates."""
        term = self.largest_term
        return (
            f"needs {self.mem_bytes / GIB:.1f} GiB > {self.capacity_bytes / GIB:.1f} GiB; "
            f"largest term {term} {self.mem_terms[term] / GIB:.1f} GiB"
        )


@dataclass(frozen=True)
class RankCounts:
    """One local rank's rows and allowed pairs for one sample (one view) and one window."""

    noisy: int
    clean: int
    pairs: int


def rank_counts(
    seq_len: int, block: int, cp: int, bp: int, schedule: str, window: int, doc_length: DocumentKey | None = None
) -> tuple[RankCounts, ...]:
    """Per local rank of a sample, its rows and allowed pairs (``window`` 0: full attention;
    ``doc_length``: over the packed documents of ``csbp.plan.documents``, a mean or a real row)."""
    totals = layout_totals(seq_len, block, cp, bp, schedule, window, doc_length)
    return tuple(RankCounts(t.noisy, t.clean, t.pairs) for t in totals)


def kv_row_bytes(group: LayerGroup, dtype_bytes: int) -> int:
    """Bytes of one row's K and V in one layer."""
    return 2 * group.n_kv_heads * group.head_dim * dtype_bytes


def kv_passes(layout: Layout, kv_grad_ratio: float) -> tuple[float, float]:
    """``(forward passes, backward passes)`` of K/V-sized traffic per layer."""
    backward = kv_grad_ratio + (1.0 if layout.checkpointing == "full" else 0.0)
    if layout.transport == "streaming" and layout.kind in ("cp", "csbp"):
        backward += 1.0  # the streaming backward re-circulates K/V around the ring
    return 1.0, backward


def ring_bandwidth(layout: Layout, hw: Hardware, cal: Calibration) -> float:
    """Bytes/s of a CP ring: intra-node when every ring sits inside a node, else the network (the
    rings step together, so one ring cut by a node boundary sets the pace). csbp's rank order
    (``csbp.topology``: ``rank = dp_rank * local + local_rank``, ring ``local_rank // cp``) puts a
    ring's ``cp`` members on consecutive ranks, so a ``packed`` ring crosses nodes only when it is
    larger than a node or a node boundary cuts it (``gpus_per_node`` not a multiple of ``cp``); the
    BP ranks beyond the ring (``bp > cp``) exchange no K/V. ``striped`` rings span the nodes."""
    per_node = hw.gpus_per_node
    if layout.world <= per_node:
        across = False
    elif layout.placement == "striped":
        across = True
    else:
        across = layout.cp > per_node or per_node % layout.cp != 0
    return (hw.inter_gbps * cal.net_eff if across else hw.intra_gbps * cal.intra_eff) * 1e9


def _kv_per_pass(workload: Workload, layout: Layout, seq_len: int, group: LayerGroup) -> tuple[float, float]:
    """``(bytes per pass, gathered rows held)`` of one layer of ``group`` for one sample view. The
    bytes are the busiest GPU's in one direction (what the transfer's time follows): an all-gather
    member sends and receives the same ``(cp-1)·shard`` rows; in the halo all-to-all the busiest
    member's larger direction, sent or received (``documents.halo_traffic_rows``), while the rows it
    holds are those it receives."""
    row = kv_row_bytes(group, workload.dtype_bytes)
    cp, kind, docs = layout.cp, layout.kind, workload.doc_length
    if halo_used(workload, layout, seq_len, group):
        args = (seq_len, workload.objective.block, cp, layout.bp, layout.schedule, group.window, docs)
        own = seq_len // cp * (2 if kind == "cp" else 1)  # cp-aware holds its noisy and clean rows
        traffic = halo_traffic_rows(*args)  # type: ignore[arg-type]
        return float(traffic * row), float(own + document_halo_rows(*args))  # type: ignore[arg-type]
    if kind == "cp":
        shard = 2 * seq_len // cp
    elif kind == "csbp":
        shard = seq_len // cp
    else:
        return 0.0, 0.0
    held = 3 * shard if layout.transport == "streaming" else cp * shard
    return float((cp - 1) * shard * row), float(held)


def collective_overlap(layout: Layout, cal: Calibration) -> float:
    """Share of a ring's collective K/V traffic hidden behind compute (not ``streaming``, whose
    hiding is bounded by its ring attention). csbp starts each of these collectives asynchronously
    and runs the local partial meanwhile (``Comm.*(async_op=True)``): the all-gather and dK/dV
    reduce-scatter of ``collective``, the halo/window all-to-all of CSBP and cp-aware, DFlash's
    all-gather and context exchange; the all-to-all is modelled as the all-gather is, one share of
    its time. The generic CP-only all-gather takes ``overlap_cp`` (fitted on the published CP-only
    runs), every other ``overlap_csbp`` (fitted on the published CSBP runs' all-gathers: ~0; DFlash
    drafters take it for every ring, ``csbp.plan.drafter``). How
    much csbp's async collectives hide on a GPU is unmeasured, so no more is assumed (fail-safe:
    an overlap assumed and absent would rank layouts by traffic they still wait for)."""
    generic_cp = layout.kind == "cp" and layout.transport == "collective"
    return cal.overlap_cp if generic_cp else cal.overlap_csbp


def overlap_note(cal: Calibration) -> str:
    """Two lines: the K/V overlap the predictions assume, and where each share comes from."""

    def origin(name: str) -> str:
        return "fitted" if name in cal.fit else "prior"

    return (
        f"overlap: CP-only all-gather hides {cal.overlap_cp:.0%} of its K/V time (overlap_cp, {origin('overlap_cp')}); "
        f"CSBP all-gather, halo all-to-all, DFlash rings {cal.overlap_csbp:.0%} (overlap_csbp, "
        f"{origin('overlap_csbp')});\n         streaming up to {cal.overlap_stream:.0%} of its ring attention "
        f"(overlap_stream, {origin('overlap_stream')}); csbp's async collectives are unmeasured on GPU"
    )


def halo_used(workload: Workload, layout: Layout, seq_len: int, group: LayerGroup) -> bool:
    """Whether a layer of ``group`` runs the halo all-to-all for one row (``workload.doc_length`` a
    mean or one real row): ``uses_halo`` and the exchange pays, the runtime's rule
    (``transports.factory.halo_pays``, ``counts.exchange_pays``: the busiest member's busier
    direction at most 90% of the all-gather's rows); otherwise the ring all-gathers."""
    if not uses_halo(workload, layout, group):
        return False
    cp = layout.cp
    args = (seq_len, workload.objective.block, cp, layout.bp, layout.schedule, group.window, workload.doc_length)
    own = seq_len // cp * (2 if layout.kind == "cp" else 1)
    return exchange_pays([halo_traffic_rows(*args)], (cp - 1) * own)  # type: ignore[arg-type]


def uses_halo(workload: Workload, layout: Layout, group: LayerGroup) -> bool:
    """Whether a layer of ``group`` moves only halo rows (``attention.transports.factory``): CP-only
    with ``transport: halo`` (``cp-aware``), a CSBP window layer, or CSBP over packed documents
    unless ``streaming``."""
    if layout.kind == "cp":
        return layout.transport == "halo"
    sparse = bool(group.window) or (workload.doc_length is not None and layout.transport != "streaming")
    return layout.kind == "csbp" and sparse


def predict(
    workload: Workload,
    layout: Layout,
    seq_len: int,
    hw: Hardware,
    cal: Calibration,
    *,
    global_batch: int | None = None,
    step_memory_only: bool = False,
) -> Prediction:
    """Predict one decoder layout (BD3, Fast-dLLM v2, MDLM). ``global_batch`` samples per optimizer
    step (default ``dp·micro_batch``); ``step_memory_only`` leaves out the memory that exists before
    a step (weights and optimizer state), which is what ``csbp bench`` measures. Over an artifact's
    sample of real rows (``DocumentSample``): the mean of the rows' predictions (``mean_prediction``)."""
    if isinstance(workload.doc_length, DocumentSample):
        return mean_prediction(
            [
                predict(
                    replace(workload, doc_length=row), layout, seq_len, hw, cal,
                    global_batch=global_batch, step_memory_only=step_memory_only,
                )
                for row in workload.doc_length.rows
            ]
        )
    if workload.objective.is_drafter:
        from csbp.plan.drafter import predict_drafter

        return predict_drafter(
            workload, layout, seq_len, hw, cal, global_batch=global_batch, step_memory_only=step_memory_only
        )
    model, obj, p = workload.model, workload.objective, workload.dtype_bytes
    per_micro = layout.dp * layout.micro_batch
    batch = per_micro if global_batch is None else global_batch
    if batch % per_micro:
        raise ValueError(
            f"global batch {batch} is not a multiple of dp*micro_batch={per_micro} for {layout.name}"
        )
    accum = batch // per_micro
    samples = obj.views * layout.micro_batch  # sample views one rank holds per micro-step
    peak = hw.peak_tflops * 1e12
    ckpt = layout.checkpointing != "none"
    generic_cp = layout.kind == "cp" and layout.transport != "halo"  # cp-aware runs the interval kernel
    attn_fwd_rate = peak * cal.attn_eff * (1.0 if generic_cp else cal.interval_fwd)
    attn_bwd_rate = peak * cal.attn_eff * (1.0 if generic_cp else cal.interval_bwd)
    gemm_rate = peak * cal.gemm_eff

    # --- compute of the slowest rank (rows and pairs from csbp's own layouts)
    windows = sorted({g.window for g in model.groups})
    counts = {w: _counts(workload, layout, seq_len, w) for w in windows}
    local = len(counts[windows[0]])
    best = (-1.0, 0.0, 0.0, 0.0)
    for r in range(local):
        rows = counts[windows[0]][r].noisy + counts[windows[0]][r].clean
        loss_rows = counts[windows[0]][r].noisy
        dense = 2 * model.body_params * rows + 2 * model.vocab * model.d_model * loss_rows
        attn = sum(g.count * counts[g.window][r].pairs * 4 * g.head_dim * g.n_heads for g in model.groups)
        fwd = samples * (dense / gemm_rate + attn / attn_fwd_rate)
        attn_s = samples * (attn / attn_fwd_rate + 2.5 * attn / attn_bwd_rate)
        recompute = {"full": fwd, "selective": samples * dense / gemm_rate}.get(layout.checkpointing, 0.0)
        bwd = samples * (2 * dense / gemm_rate + 2.5 * attn / attn_bwd_rate) + recompute
        if fwd + bwd > best[0] + best[1]:
            best = (fwd, bwd, attn_s, float(rows))
    fwd_c, bwd_c, attn_s, max_rows = best

    # --- K/V traffic and its exposure
    passes_f, passes_b = kv_passes(layout, obj.kv_grad_bytes / p)
    bandwidth = ring_bandwidth(layout, hw, cal)
    per_pass = 0.0
    held_rows = 0.0
    kv_row_max = 0
    for g in model.groups:
        sent, held = _kv_per_pass(workload, layout, seq_len, g)
        per_pass += g.count * sent
        held_rows = max(held_rows, held)
        kv_row_max = max(kv_row_max, kv_row_bytes(g, p))
    kv_micro = samples * per_pass * (passes_f + passes_b)
    t_kv = kv_micro / bandwidth if kv_micro else 0.0
    if layout.transport == "streaming" and layout.cp > 1:
        exposed_kv = max(0.0, t_kv - cal.overlap_stream * attn_s)
    else:
        exposed_kv = (1.0 - collective_overlap(layout, cal)) * t_kv
    share_f = passes_f / (passes_f + passes_b)
    fwd_s = fwd_c + share_f * exposed_kv
    bwd_s = bwd_c + (1 - share_f) * exposed_kv

    # --- gradient synchronisation, optimizer, overhead (once per optimizer step)
    n = model.total_params
    world = layout.world
    s = workload.state_bytes  # FSDP2/DDP move and hold the master dtype (csbp: no mixed-precision policy)
    grad_bytes = {"zero2": 4.0, "fsdp2": 3.0 * s, "ddp": 2.0 * s}[layout.sharding]
    grad_bw = (
        hw.inter_gbps * cal.net_eff if world > hw.gpus_per_node else hw.intra_gbps * cal.intra_eff
    ) * 1e9
    t_grad = grad_bytes * n * (world - 1) / world / grad_bw if world > 1 else 0.0
    exposed_grad = (1.0 - cal.grad_overlap) * t_grad
    shard = world if layout.sharding != "ddp" else 1
    t_opt = (32.0 + (3.0 * s if workload.averaged else 0.0)) * n / shard / (hw.hbm_tbps * 1e12)  # + the average's update
    step = accum * (fwd_s + bwd_s) + exposed_grad + t_opt + cal.step_overhead_s

    # --- memory per GPU
    act_row = (
        sum(
            g.count
            * p
            * (6 * model.d_model + 2 * (g.n_heads + 2 * g.n_kv_heads) * g.head_dim + 4 * model.ffn)
            for g in model.groups
        )
        / model.num_layers
    )
    rows = samples * max_rows
    kv_held = samples * held_rows * kv_row_max
    terms: dict[str, float] = {}
    if not step_memory_only:
        if layout.sharding == "zero2":
            terms["weights"] = 2.0 * n
            terms["grads+optimizer"] = 16.0 * n / world
        elif layout.sharding == "fsdp2":
            terms["weights"] = s * n / world + 2 * s * model.max_layer_params
            terms["grads+optimizer"] = 3.0 * s * n / world
        else:
            terms["weights"] = s * n
            terms["grads+optimizer"] = 3.0 * s * n
        if workload.averaged:  # optim.ema_decay: one more copy, sharded as the weights are
            terms["weight average"] = s * n / (world if layout.sharding != "ddp" else 1)
    else:
        terms["grads"] = s * n / (world if layout.sharding != "ddp" else 1)
    if ckpt:
        terms["checkpoints"] = model.num_layers * rows * model.d_model * p
        working = cal.ws_factor * rows * act_row
        if layout.checkpointing == "full":
            gathered = kv_held * (1 + 4 / p)
            terms["layer working set" if working >= gathered else "gathered K/V"] = max(working, gathered)
        else:  # selective: every layer keeps its attention's output (p), lse (fp32) and gathered K/V
            terms["layer working set"] = working
            terms["kept attention"] = rows * sum(g.count * g.n_heads * (g.head_dim * p + 4) for g in model.groups)
            if kv_held:
                kept = 1 if layout.transport == "streaming" else model.num_layers
                terms["gathered K/V"] = kv_held * (kept + 4 / p)
    else:
        terms["activations"] = cal.act_factor * model.num_layers * rows * act_row
        if kv_held:
            # every layer saves its gathered (or halo-exchanged: cp-aware) K/V for its backward; only the
            # streaming ring passes shards on and re-circulates them in the backward
            kept = 1 if layout.transport == "streaming" else model.num_layers
            terms["gathered K/V"] = kv_held * (kept + 4 / p)
    terms["logits chunk"] = 2.0 * min(CE_CHUNK_ROWS, rows) * model.vocab * 4
    terms["fixed"] = cal.mem_fixed_gib * GIB
    return Prediction(
        layout=layout,
        step_s=step,
        tokens_per_s=batch * seq_len / step,
        fwd_s=fwd_s,
        bwd_s=bwd_s,
        exposed_comm_s=accum * exposed_kv + exposed_grad,
        exposed_kv_s=accum * exposed_kv,
        kv_bytes=accum * kv_micro,
        mem_terms=terms,
        capacity_bytes=hw.mem_gib * GIB,
    )


def mean_prediction(preds: list[Prediction]) -> Prediction:
    """One layout over several rows: times, traffic and throughput of the mean step (each row's
    step bounded by its own slowest rank), memory of the row that needs the most."""
    first = preds[0]
    step = float(np.mean([p.step_s for p in preds]))
    peak = max(preds, key=lambda p: p.mem_bytes)
    return Prediction(
        layout=first.layout,
        step_s=step,
        tokens_per_s=first.tokens_per_s * first.step_s / step,  # the same tokens per step
        fwd_s=float(np.mean([p.fwd_s for p in preds])),
        bwd_s=float(np.mean([p.bwd_s for p in preds])),
        exposed_comm_s=float(np.mean([p.exposed_comm_s for p in preds])),
        exposed_kv_s=float(np.mean([p.exposed_kv_s for p in preds])),
        kv_bytes=float(np.mean([p.kv_bytes for p in preds])),
        mem_terms=peak.mem_terms,
        capacity_bytes=first.capacity_bytes,
    )


def _counts(workload: Workload, layout: Layout, seq_len: int, window: int) -> tuple[RankCounts, ...]:
    """Rows and pairs per local rank; single-stream MDLM (bidirectional) and AR (causal) by formula."""
    obj = workload.objective
    if obj.single_stream and workload.doc_length is not None:
        start, stop = packed_documents(seq_len, workload.doc_length)
        positions = np.arange(seq_len)
        if obj.name == "ar":  # causal inside the document: keys [max(d_start, p+1-W), p]
            first = np.maximum(start, positions + 1 - window) if window else start
            pairs = int((positions + 1 - first).sum())
        else:  # bidirectional inside the document
            span = stop - start
            pairs = int((np.minimum(span, window) if window else span).sum())
        return (RankCounts(seq_len, 0, pairs),)
    if obj.single_stream:
        if obj.name == "ar":  # causal: position p sees min(p + 1, window) keys
            span = min(window, seq_len) if window else seq_len
            pairs = span * (span + 1) // 2 + (seq_len - span) * span
        else:
            pairs = seq_len * (min(window, seq_len) if window else seq_len)
        return (RankCounts(seq_len, 0, pairs),)
    return rank_counts(seq_len, obj.block, layout.cp, layout.bp, layout.schedule, window, workload.doc_length)
