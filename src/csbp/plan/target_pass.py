"""Cost terms of the online DFlash target pass (``objective.dflash.target_capture``; csbp.md §14).

Online drafter training runs the frozen target under ``no_grad`` inside every micro-step to
produce the fused features (and, with ``loss: kl``, the last hidden state). Its mode is named as
in the run config:

* ``offline``: the features were captured ahead of time (``csbp dflash prepare-features``,
  ``objective.dflash.features``); no target in the step. The published DFlash2 runs are priced this
  way (their memory model holds the features ``L/cp × width`` and no target), so it is the
  presets' default.
* ``sharded`` (csbp's default for ``cp > 1``, ``csbp.dflash.target_shard``): each CP ring member
  runs the target on its ``L/cp`` zigzag rows and all-gathers the ring's K/V once per layer.
* ``replicated``: every rank runs the full sequence (also what ``sharded`` does at ``cp == 1``).

Per rank and micro-step (``R`` rows the rank runs: ``L/cp`` sharded, else ``L``; ``n`` target
layers run: every layer with the KL teacher, else up to the deepest fused one):

* forward FLOPs ``2·params_layer·R`` per layer at ``gemm_eff`` plus causal attention pairs
  ``R·(L+1)/2`` (the zigzag rows of a member hold exactly ``1/cp`` of the row's pairs; with a
  sliding window ``W`` at most ``W`` keys a query) at ``4·hd·H`` per pair and ``attn_eff``;
* bytes: ``(cp − 1)·(L/cp)·2·Hkv·hd`` per layer (what ``sharded_target_bytes`` counts under
  ``dflash.target``), a blocking all-gather (exposed in full at the ring's bandwidth);
* memory: the frozen target's layer weights, in the master dtype csbp holds it in (the embedding and head are the drafter's, already
  counted) and, under ``no_grad``, one layer's working set at a time: the rank's hidden rows,
  q/k/v, the SwiGLU intermediate and the gathered (or local) K/V of all ``L`` rows. The pass ends
  before the drafter's forward starts, so only what the working set exceeds of the draft step's
  activations adds to the peak. The features it keeps are the drafter's ``target features`` term.

Packed documents are not modelled here (one document per row: an upper bound on the pairs), nor is
the KL teacher rows' exchange (``csbp.dflash.teacher_rows``: at most ``anchors·(B−1)`` rows of
``H``, small next to the K/V gather).
"""

from __future__ import annotations

from dataclasses import dataclass

from csbp.plan.calibration import Calibration
from csbp.plan.hardware import Hardware
from csbp.plan.layout import Layout
from csbp.plan.model import ring_bandwidth
from csbp.plan.workload import LayerGroup, ModelShape, Workload

TARGET_PASSES = ("offline", "sharded", "replicated")


@dataclass(frozen=True)
class TargetPass:
    """The online target pass of a drafter workload: its ``mode`` (module docstring), the frozen
    target's shape and how many of its layers a capture runs (``layers``)."""

    mode: str
    model: ModelShape
    layers: int

    def __post_init__(self) -> None:
        if self.mode not in TARGET_PASSES:
            raise ValueError(f"target pass {self.mode!r} must be one of {', '.join(TARGET_PASSES)}")
        if not 1 <= self.layers <= self.model.num_layers:
            raise ValueError(f"target pass layers={self.layers} must be in [1, {self.model.num_layers}]")


@dataclass(frozen=True)
class TargetPassCost:
    """One rank's target pass per micro-step: forward FLOPs (dense, attention), the bytes it sends
    around the ring, the target's weights and one layer's working set (bytes)."""

    dense_flops: float
    attention_flops: float
    kv_bytes: float
    weight_bytes: float
    working_set_bytes: float


def target_pass_rows(mode: str, seq_len: int, cp: int) -> int:
    """Rows a rank runs the target on: its ``L/cp`` zigzag rows when sharded over a ring, else ``L``."""
    return seq_len // cp if mode == "sharded" and cp > 1 else seq_len


def _layer_groups(model: ModelShape, layers: int) -> list[tuple[int, LayerGroup]]:
    """``(count, group)`` of the first ``layers`` layers (groups in model order)."""
    out: list[tuple[int, LayerGroup]] = []
    left = layers
    for group in model.groups:
        take = min(group.count, left)
        if take:
            out.append((take, group))
        left -= take
    return out


def target_pass_cost(
    tp: TargetPass, seq_len: int, cp: int, dtype_bytes: int, weight_bytes: int | None = None
) -> TargetPassCost:
    """The terms of one sample's pass on one rank of a ring of ``cp`` (module docstring), computed
    in ``dtype_bytes`` elements over weights held in ``weight_bytes`` (default the same; csbp holds
    the frozen target in the master dtype, ``Workload.state_bytes``)."""
    model = tp.model
    rows = target_pass_rows(tp.mode, seq_len, cp)
    dense = attention = kv = widest = weights = 0.0
    sharded = tp.mode == "sharded" and cp > 1
    for count, group in _layer_groups(model, tp.layers):
        weights += count * model.layer_params(group)
        keys = min(group.window, (seq_len + 1) / 2) if group.window else (seq_len + 1) / 2  # mean keys a query
        dense += count * 2.0 * model.layer_params(group) * rows
        attention += count * rows * keys * 4.0 * group.head_dim * group.n_heads
        kv_row = 2 * group.n_kv_heads * group.head_dim * dtype_bytes
        if sharded:
            kv += count * (cp - 1) * (seq_len // cp) * kv_row
        qkv = (group.n_heads + 2 * group.n_kv_heads) * group.head_dim
        layer = rows * (2 * model.d_model + qkv + 3 * model.ffn) * dtype_bytes + seq_len * kv_row
        widest = max(widest, layer)
    return TargetPassCost(dense, attention, kv, weights * (weight_bytes or dtype_bytes), widest)


def online_target_pass(workload: Workload) -> TargetPass | None:
    """The workload's online target pass, or None when the features are offline."""
    tp = workload.target_pass
    return None if tp is None or tp.mode == "offline" else tp


@dataclass(frozen=True)
class TargetPassTimes:
    """One micro-step's target pass on the slowest rank: forward compute and the exposed K/V
    all-gathers (seconds), and the bytes those send (what ``dflash.target`` counts)."""

    compute_s: float
    kv_s: float
    kv_bytes: float


def target_pass_times(
    workload: Workload, layout: Layout, seq_len: int, hw: Hardware, cal: Calibration
) -> TargetPassTimes | None:
    """``layout``'s target pass per micro-step (``micro_batch`` samples), or None offline."""
    tp = online_target_pass(workload)
    if tp is None:
        return None
    cost = target_pass_cost(tp, seq_len, layout.cp, workload.dtype_bytes)
    peak = hw.peak_tflops * 1e12
    mb = layout.micro_batch
    compute = mb * (cost.dense_flops / (peak * cal.gemm_eff) + cost.attention_flops / (peak * cal.attn_eff))
    kv_bytes = mb * cost.kv_bytes
    kv_s = kv_bytes / ring_bandwidth(layout, hw, cal) if kv_bytes else 0.0
    return TargetPassTimes(compute, kv_s, kv_bytes)


def target_pass_memory(
    workload: Workload, layout: Layout, seq_len: int, *, step_activations: float, features: float, step_only: bool
) -> dict[str, float]:
    """The memory terms an online pass adds (module docstring): the target's layer weights (not in a
    step-only measure), the features it produces inside the step (``features``, only for a step-only
    measure: the full prediction holds them already) and what one target layer's working set exceeds
    of ``step_activations`` (the draft step's activations, allocated after the pass)."""
    tp = online_target_pass(workload)
    if tp is None:
        return {}
    cost = target_pass_cost(tp, seq_len, layout.cp, workload.dtype_bytes, workload.state_bytes)
    terms = {"target features": features} if step_only else {"target weights": cost.weight_bytes}
    if cost.working_set_bytes > step_activations:
        terms["target pass working set"] = cost.working_set_bytes - step_activations
    return terms


def describe_target_pass(workload: Workload) -> str | None:
    """One line on a drafter's target features for ``csbp plan`` (None: no target shape known)."""
    tp = workload.target_pass
    if tp is None:
        return None
    if tp.mode == "offline":
        return f"target pass: offline features (no {tp.model.name} in the step; --target-pass sharded|replicated)"
    how = "each CP ring member runs its L/cp rows, K/V all-gathered per layer" if tp.mode == "sharded" else (
        "every rank runs the full row"
    )
    return f"target pass: {tp.mode}, {tp.model.name}, {tp.layers} of {tp.model.num_layers} layers ({how})"
