"""Cost terms of DFlash / DFlash2 drafter training against a frozen target (csbp.md §14).

Per rank and optimizer step (``csbp.dflash.layouts`` decides who holds what):

* **Block-local work** over the draft rows a rank holds, ``anchors·B`` divided by ``bp`` (CSBP and
  BP-only deal anchors to ranks) or *repeated on every CP rank* (CP-only and data layouts): the
  drafter layers (``6·params`` per row, forward and backward), the frozen vocabulary head
  (``4·V·d``: forward and the input gradient) and attention over the block plus the sliding window
  of context (``4·hd·H`` per pair, x3.5 for forward and backward).
* **Context work**: the fusion and k/v projections of the target features over the context rows
  the rank holds (``L/cp``: what csbp does), or, for the published reference runs
  (``Objective.context_rows == "windows"``), over the rows its anchors' windows cover (anchors sit
  in one span, so the union sits in one zigzag chunk); their K/V gathered around the CP ring.
* **Gradient all-reduce** of the trainable parameters over all ranks.
* tokens/s = ``dp·anchors·(B-1)/step`` (supervised draft tokens), with the anchors csbp draws:
  ``min(max_anchors, #valid)`` (``L - 1`` valid positions in a one-document row).
* **Online target pass** (``Workload.target_pass`` ``sharded``/``replicated``; nothing for offline
  features, the presets' default, as in the published runs): the frozen target's forward, its
  blocking per-layer K/V all-gathers (in the K/V bytes, exposed in full), the target's layer weights
  and one target layer's working set (``csbp.plan.target_pass``).

With packed documents (``Workload.doc_length``, ``csbp.plan.documents``) the draft rows and
context pairs are the slowest rank's under the document mask, and where ``csbp.dflash.exchange``
replaces the all-gather by the context exchange (CSBP; CP-only only with ``transport: halo``, the
``cp-aware`` baseline) the K/V traffic is the exchange's: the busiest ring member's larger
direction, sent or received (csbp's step, ``context_rows == "all"``; the published reference's
``windows`` gather is kept as it is). With one document per row CSBP's sliding kinds exchange
their anchors' window rows too (``documents.one_document``; the same counts, used only for the
K/V terms: traffic, its exposed time and the received K/V kept for backward, per layer of the
kind; the compute keeps its one-document formulas). The gather and the exchange, both started asynchronously
and overlapped with the block partial, are exposed but for ``overlap_csbp`` (~0), CP-only included:
``overlap_cp`` describes the published BD3 baselines, and nothing measured the drafter rings'.

Memory: the trainable parameters' weights, gradients and AdamW moments (the published reference
recipe, ``context_rows == "windows"``: ``12 B`` per parameter, fused AdamW over bf16 weights; csbp's
step: ``4 x state_bytes``, float32 master weights and moments), the frozen vocabulary (embedding and
head: bf16 in the reference, the master dtype in csbp), the draft activations (no checkpointing; ``drafter_act_factor`` per
row-layer activation bytes), the fused context rows and their K/V, the context K/V received from
the ring (all-gathered or exchanged; every layer keeps it for its backward), the target features of the
rank's context rows (``L/cp`` rows, all ``L`` for BP-only and data layouts) and 1 GiB of runtime
(the calibration's constant where that is smaller, e.g. on CPU).
"""

from __future__ import annotations

from csbp.plan.calibration import Calibration
from csbp.plan.documents import DraftCounts, draft_counts, one_document
from csbp.plan.hardware import Hardware
from csbp.plan.layout import Layout
from csbp.plan.model import GIB, Prediction, kv_row_bytes, ring_bandwidth
from csbp.plan.target_pass import target_pass_memory, target_pass_times
from csbp.plan.workload import Workload

DRAFTER_FIXED_GIB = 1.0


def predict_drafter(
    workload: Workload,
    layout: Layout,
    seq_len: int,
    hw: Hardware,
    cal: Calibration,
    *,
    global_batch: int | None = None,
    step_memory_only: bool = False,
) -> Prediction:
    """Predict one layout of DFlash drafter training (one sample per replica per micro-step).
    ``step_memory_only`` keeps only what a step allocates (gradients, activations; not the weights,
    optimizer state or the features loaded before it), what ``csbp bench dflash`` measures."""
    model, obj, p = workload.model, workload.objective, workload.dtype_bytes
    per_micro = layout.dp * layout.micro_batch
    batch = per_micro if global_batch is None else global_batch
    if batch % per_micro:
        raise ValueError(
            f"global batch {batch} is not a multiple of dp*micro_batch={per_micro} for {layout.name}"
        )
    accum = batch // per_micro
    mb = layout.micro_batch
    dealt = layout.bp if layout.bp > 1 else 1  # CP-only and data layouts repeat every anchor
    # csbp draws min(max_anchors, #valid) anchors (csbp.dflash.anchors): a one-document row has L-1
    live = min(obj.anchors, seq_len - 1)
    draft_rows = mb * live * obj.block / dealt
    held = seq_len // layout.cp if layout.cp > 1 else seq_len
    if obj.context_rows == "windows":  # anchors in one span: its windows sit in one zigzag chunk
        span = live * obj.block + obj.window
        context_rows = mb * min(held // 2 if layout.cp > 1 else held, span)
    else:
        context_rows = mb * held
    windows = tuple(sorted({g.window for g in model.groups}))
    docs = None
    if workload.doc_length is not None:
        docs = draft_counts(
            seq_len,
            workload.doc_length,
            block=obj.block,
            anchors=obj.anchors,
            cp=layout.cp,
            bp=layout.bp,
            transport=layout.transport,
            windows=windows,
        )
        draft_rows = mb * docs.anchors * obj.block
        live = docs.live
    # whose context exchange rows the K/V terms take (None: every kind all-gathers); with one document
    # per row only the K/V terms take them, the compute above keeps its one-document formulas
    exchange = context_exchange_counts(workload, layout, seq_len)
    kv_proj = sum(g.count * model.d_model * 2 * g.n_kv_heads * g.head_dim for g in model.groups)
    rate = hw.peak_tflops * 1e12 * cal.drafter_eff
    dense = draft_rows * (6 * model.body_params + 4 * model.vocab * model.d_model)
    attn = draft_rows * sum(
        g.count
        * ((min(g.window, seq_len) if g.window else seq_len / 2) + obj.block)
        * 4
        * g.head_dim
        * g.n_heads
        * 3.5
        for g in model.groups
    )
    if docs is not None:  # the document mask's context pairs of the slowest rank's draft rows
        attn = sum(
            g.count * (mb * docs.pairs[g.window] + draft_rows * obj.block) * 4 * g.head_dim * g.n_heads * 3.5
            for g in model.groups
        )
    context = context_rows * 2 * (obj.feature_width * model.d_model + kv_proj) * 3
    compute = (dense + attn + context) / rate
    fwd_s = compute / 3
    bwd_s = compute - fwd_s
    target = target_pass_times(workload, layout, seq_len, hw, cal)  # online features: the frozen target's pass
    if target is not None:
        fwd_s += target.compute_s + target.kv_s

    received = 0.0  # context K/V bytes a rank receives per micro-step, summed over layers
    moved = 0.0  # ... and the busiest member's larger direction (the all-gather's: both the same)
    for g in model.groups if layout.cp > 1 else ():
        exchanged = exchange is not None and exchange.exchanged[g.window]
        rows = mb * exchange.recv_rows[g.window] if exchanged else (layout.cp - 1) * context_rows  # type: ignore[union-attr]
        busiest = mb * exchange.traffic_rows[g.window] if exchanged else rows  # type: ignore[union-attr]
        received += g.count * kv_row_bytes(g, p) * rows
        moved += g.count * kv_row_bytes(g, p) * busiest
    kv_bytes = 0.0
    exposed_kv = 0.0
    if layout.cp > 1:
        kv_bytes = accum * moved * 2.0  # gather (or context exchange) + dK/dV
        # overlap_csbp for every ring, CP-only too (overlap_cp was fitted on the BD3 baselines only)
        exposed_kv = (1.0 - cal.overlap_csbp) * kv_bytes / ring_bandwidth(layout, hw, cal)
    trainable = model.body_params + model.extra_params
    # the reference recipe holds bf16 weights and 12 B/param of states; csbp the master dtype
    reference = obj.context_rows == "windows"
    held_bytes = p if reference else workload.state_bytes
    world = layout.world
    grad_bw = (
        hw.inter_gbps * cal.net_eff if world > hw.gpus_per_node else hw.intra_gbps * cal.intra_eff
    ) * 1e9
    t_grad = 2.0 * held_bytes * trainable * (world - 1) / world / grad_bw if world > 1 else 0.0
    t_opt = 32.0 * trainable / (hw.hbm_tbps * 1e12)
    if target is not None:  # its blocking K/V all-gathers: K/V traffic, exposed in full
        kv_bytes += accum * target.kv_bytes
        exposed_kv += accum * target.kv_s
        compute += target.compute_s
    step = accum * compute + exposed_kv + t_grad + t_opt

    act_row = sum(
        g.count * p * (6 * model.d_model + 2 * (g.n_heads + 2 * g.n_kv_heads) * g.head_dim + 4 * model.ffn)
        for g in model.groups
    )
    feature_rows = mb * held
    if step_memory_only:
        terms = {"grads": held_bytes * trainable}
    else:
        terms = {
            "weights+grads+optimizer": (12.0 if reference else 4.0 * held_bytes) * trainable,
            "frozen vocab": held_bytes * model.embedding_params,
            "target features": feature_rows * obj.feature_width * p,
            "fixed": min(DRAFTER_FIXED_GIB, cal.mem_fixed_gib) * GIB,
        }
    terms["draft activations"] = cal.drafter_act_factor * draft_rows * act_row
    # fused context rows (fc output, its norm) and every layer's context K/V, kept for backward
    kv_width = sum(g.count * 2 * g.n_kv_heads * g.head_dim for g in model.groups)
    terms["context activations"] = context_rows * (2 * model.d_model + kv_width) * p
    if received:  # every layer keeps the gathered (or exchanged) context K/V for its backward
        terms["received context K/V"] = received
    terms.update(target_pass_memory(
        workload, layout, seq_len, features=feature_rows * obj.feature_width * p, step_only=step_memory_only,
        step_activations=terms["draft activations"] + terms["context activations"] + received,
    ))
    return Prediction(
        layout=layout,
        step_s=step,
        tokens_per_s=batch * live * (obj.block - 1) / step,
        fwd_s=fwd_s,
        bwd_s=bwd_s,
        exposed_comm_s=exposed_kv + t_grad,
        exposed_kv_s=exposed_kv,
        kv_bytes=kv_bytes,
        mem_terms=terms,
        capacity_bytes=hw.mem_gib * GIB,
    )


def context_exchange_counts(workload: Workload, layout: Layout, seq_len: int) -> DraftCounts | None:
    """The drafter counts whose context-exchange rows price a ring's K/V (``DraftCounts.exchanged``
    per layer window), or None where every kind all-gathers: csbp's step (``context_rows ==
    "all"``) on a ring, over the row's packed documents, or over one document where CSBP's sliding
    kinds may exchange their window rows (``csbp.dflash.exchange.context_exchange_kinds``).
    ``workload.doc_length`` is one row's key (not a ``DocumentSample``)."""
    obj = workload.objective
    if layout.cp == 1 or obj.context_rows != "all":
        return None
    key = workload.doc_length
    if key is None:
        if not _sliding_exchange_possible(workload, layout):
            return None
        key = one_document(seq_len)
    return draft_counts(
        seq_len, key, block=obj.block, anchors=obj.anchors, cp=layout.cp, bp=layout.bp,  # type: ignore[arg-type]
        transport=layout.transport, windows=tuple(sorted({g.window for g in workload.model.groups})),
    )


def _sliding_exchange_possible(workload: Workload, layout: Layout) -> bool:
    """Whether a one-document row may exchange a sliding kind's window rows: csbp's step
    (``context_rows == "all"``) on a CSBP ring, not ``streaming``, with sliding layers
    (``csbp.dflash.exchange.context_exchange_kinds``; whether it pays is counted)."""
    return (
        workload.objective.context_rows == "all"
        and layout.cp > 1
        and layout.bp > 1
        and layout.transport != "streaming"
        and any(g.window for g in workload.model.groups)
    )
