"""Fit the cost model's efficiency factors to measurements: the published CSBP runs, or the
JSON output of ``csbp bench attention|train|dflash`` on the user's machine.

A measurement is an ``Observation`` (workload, layout, length, metric, value). ``fit_factors``
minimises the sum of squared log errors of the predictions over the named factors with a
deterministic Nelder-Mead search (fractions of peak and overlaps in logit space, so they stay in
``(0, 1)``; the others in log space); the model's structure is untouched.

Split of the published runs (honest by construction): only points marked ``fit: true`` in
``published-csbp-runs.json`` are fitted (the 256K table's tok/s and memory, the 14B 256K
forward/backward spans and exposed communication, the DP8 256K drafter tok/s and memory);
everything else (64K/128K, pure BP, contiguous schedule, traffic, step times, the drafters at
other lengths and layouts, OOM verdicts) is held out and only predicted.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from csbp.plan.calibration import Calibration
from csbp.plan.hardware import Hardware, hardware
from csbp.plan.layout import Layout, parse_topology
from csbp.plan.model import GIB, Prediction, predict
from csbp.plan.workload import LayerGroup, ModelShape, Objective, Workload, preset_workload, published_runs

# fractions of a nominal peak or of a step: fitted in logit space, so they stay in (0, 1)
LOGIT_FACTORS = frozenset(
    {"gemm_eff", "attn_eff", "drafter_eff", "overlap_cp", "overlap_csbp", "overlap_stream", "grad_overlap"}
)


@dataclass(frozen=True)
class Observation:
    """One measured number and what produced it.

    ``metric``: ``tok_s``, ``mem_gib``, ``fwd_s``, ``bwd_s``, ``exposed_s``, ``step_s``,
    ``traffic_gib`` or ``oom`` (value 1).
    """

    label: str
    workload: Workload
    layout: Layout
    seq_len: int
    hw: Hardware
    metric: str
    value: float
    fit: bool = False
    step_memory_only: bool = False

    def predict(self, cal: Calibration) -> Prediction:
        return predict(
            self.workload, self.layout, self.seq_len, self.hw, cal, step_memory_only=self.step_memory_only
        )

    def predicted(self, cal: Calibration) -> float:
        """The model's value of ``metric`` (``oom``: 1.0 when it predicts out of memory)."""
        pred = self.predict(cal)
        return {
            "tok_s": lambda: pred.tokens_per_s,
            "mem_gib": lambda: pred.mem_bytes / GIB,
            "fwd_s": lambda: pred.fwd_s,
            "bwd_s": lambda: pred.bwd_s,
            "exposed_s": lambda: pred.exposed_kv_s,
            "step_s": lambda: pred.step_s,
            "traffic_gib": lambda: pred.kv_bytes / GIB,
            "oom": lambda: 0.0 if pred.fits else 1.0,
        }[self.metric]()


# ----------------------------------------------------------------------------- fitting


def fit_factors(
    observations: Sequence[Observation], base: Calibration, factors: Sequence[str], *, source: str
) -> Calibration:
    """``base`` with ``factors`` fitted to ``observations`` (least squares of log errors)."""
    if not observations:
        raise ValueError(f"no measurements to fit {', '.join(factors)} on")
    x0 = np.array([_to_free(name, getattr(base, name)) for name in factors])

    def loss(x: np.ndarray) -> float:
        cal = base.with_values({n: _from_free(n, v) for n, v in zip(factors, x)}, source=source)
        total = 0.0
        for obs in observations:
            value = obs.predicted(cal)
            total += math.log(max(value, 1e-12) / obs.value) ** 2
        return total

    best = nelder_mead(loss, x0)
    return base.with_values({n: _from_free(n, v) for n, v in zip(factors, best)}, source=source)


def nelder_mead(
    f: Callable[[np.ndarray], float], x0: np.ndarray, *, iters: int = 600, tol: float = 1e-10
) -> np.ndarray:
    """Deterministic Nelder-Mead minimisation of ``f`` from ``x0`` (standard coefficients)."""
    n = len(x0)
    simplex = [x0.astype(float)] + [x0 + np.eye(n)[i] * 0.5 for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(iters):
        order = np.argsort(values)
        simplex = [simplex[i] for i in order]
        values = [values[i] for i in order]
        if values[-1] - values[0] < tol:
            break
        centroid = np.mean(simplex[:-1], axis=0)
        reflected = centroid + (centroid - simplex[-1])
        fr = f(reflected)
        if fr < values[0]:
            expanded = centroid + 2.0 * (centroid - simplex[-1])
            fe = f(expanded)
            simplex[-1], values[-1] = (expanded, fe) if fe < fr else (reflected, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = reflected, fr
        else:
            contracted = centroid + 0.5 * (simplex[-1] - centroid)
            fc = f(contracted)
            if fc < values[-1]:
                simplex[-1], values[-1] = contracted, fc
            else:
                simplex = [simplex[0] + 0.5 * (x - simplex[0]) for x in simplex]
                values = [values[0]] + [f(x) for x in simplex[1:]]
    return simplex[int(np.argmin(values))]


def _to_free(name: str, value: float) -> float:
    if name in LOGIT_FACTORS:
        value = min(max(value, 1e-4), 1 - 1e-4)
        return math.log(value / (1 - value))
    return math.log(max(value, 1e-9))


def _from_free(name: str, x: float) -> float:
    return 1 / (1 + math.exp(-x)) if name in LOGIT_FACTORS else math.exp(x)


# ----------------------------------------------------------------------------- published runs


def published_observations() -> list[Observation]:
    """Every point of the packaged published runs, with the published recipe's layout knobs:
    dense runs full checkpointing, ZeRO-2, rings striped across nodes, collective transport;
    drafters no checkpointing."""
    data = published_runs()
    out = []
    for point in data["points"]:
        spec = data["workloads"][point["workload"]]
        workload = preset_workload(point["workload"])
        dp, cp, bp = parse_topology(point["topology"])
        drafter = workload.objective.is_drafter
        layout = Layout(
            dp,
            cp,
            bp,
            checkpointing="none" if drafter else "full",
            placement="striped",
            sharding="zero2",
            schedule=point["schedule"],
        )
        hw = hardware(spec["hardware"], gpus=spec["gpus"])
        label = f"{point['workload']} {point['seq_len'] // 1024}K {point['topology']} {point['schedule']} {point['metric']}"
        out.append(
            Observation(
                label,
                workload,
                layout,
                point["seq_len"],
                hw,
                point["metric"],
                float(point["value"]),
                bool(point["fit"]),
            )
        )
    return out


def fit_published() -> Calibration:
    """The packaged GPU calibration: every factor fitted on the ``fit: true`` points only."""
    source = "fitted on the fit:true points of published-csbp-runs.json (csbp plan calibrate --published)"
    obs = [o for o in published_observations() if o.fit]
    dense = [o for o in obs if not o.workload.objective.is_drafter]
    drafter = [o for o in obs if o.workload.objective.is_drafter]
    cal = Calibration()
    cal = fit_factors(
        [o for o in dense if o.metric != "mem_gib"],
        cal,
        ["attn_eff", "interval_fwd", "interval_bwd", "net_eff", "overlap_cp", "overlap_csbp"],
        source=source,
    )
    cal = fit_factors(
        [o for o in dense if o.metric == "mem_gib"], cal, ["ws_factor", "mem_fixed_gib"], source=source
    )
    cal = fit_factors([o for o in drafter if o.metric == "tok_s"], cal, ["drafter_eff"], source=source)
    return fit_factors(
        [o for o in drafter if o.metric == "mem_gib"], cal, ["drafter_act_factor"], source=source
    )


# ----------------------------------------------------------------------------- csbp bench output

_BENCH_SHAPE = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")


def bench_observations(
    paths: Sequence[Path], *, fastest: bool = True, skipped: list[str] | None = None
) -> list[Observation]:
    """Observations (step time and peak memory growth per layout) from ``csbp bench`` JSON files.
    ``fastest``: time a layout by its fastest repeat (the repeat least disturbed by other load on a
    shared machine; ``record_seconds``), else by the median ``step_time_s``. A compiled record
    (``bench train --compile layers``: a step the eager cost model does not describe) is refused, or,
    given a ``skipped`` list, left out and named there (``csbp plan calibrate`` says so; a file of
    ``--compile none layers`` holds eager records beside them)."""
    out = []
    for path in paths:
        if not path.is_file():
            raise FileNotFoundError(f"benchmark file not found: {path}")
        try:
            records = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from exc
        if not isinstance(records, list) or not records:
            raise ValueError(f"{path}: expected the list of records `csbp bench ... --json` writes")
        for index, record in enumerate(records):
            where = f"{path}[{index}]"
            if skipped is not None and isinstance(record, dict) and record.get("compile", "none") != "none":
                skipped.append(where)
                continue
            out.extend(_record_observations(record, where, fastest))
    return out


def record_seconds(record: dict, fastest: bool) -> float:
    """A record's step time: the median ``step_time_s``, or with ``fastest`` its fastest repeat: the least
    of ``step_times_s`` (every ``csbp bench attention|train|dflash`` record keeps them), else
    ``step_time_min_s`` (``bench train`` records before them), else the median (older files)."""
    if fastest:
        repeats = [float(t) for t in record.get("step_times_s") or () if isinstance(t, int | float) and t > 0]
        if repeats:
            return min(repeats)
        if record.get("step_time_min_s"):
            return float(record["step_time_min_s"])
    return float(record["step_time_s"])


def _record_observations(record: dict, where: str, fastest: bool) -> list[Observation]:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a benchmark record is a JSON object")
    kind = record.get("bench", "train" if "objective" in record else "attention")
    if kind not in ("train", "attention", "dflash"):
        raise ValueError(
            f"{where}: csbp plan calibrate reads `csbp bench train|attention|dflash` records, not {kind!r}"
        )
    needed = (*_BENCH_SHAPE, "seq_len", "block_size", "nproc", "cp", "bp", "step_time_s", "peak_mem_bytes")
    needed += ("vocab_size", "intermediate_size") if kind != "attention" else ()
    needed += ("anchors", "feature_width") if kind == "dflash" else ()
    missing = [k for k in needed if k not in record or (k in _BENCH_SHAPE and not record[k])]
    if missing:
        raise ValueError(
            f"{where}: record lacks {missing[0]!r}: rerun the benchmark with this csbp version (its --json records the model shape)"
        )
    if kind == "dflash" and record.get("target_capture", "offline") != "offline":
        raise ValueError(
            f"{where}: timed with `--target-capture {record['target_capture']}` (the online target pass), which "
            "the drafter's fitted terms leave out; calibrate on offline records (csbp bench dflash's default)"
        )
    if record.get("compile", "none") != "none":
        raise ValueError(
            f"{where}: timed with `--compile {record['compile']}` (compiled layers), whose step the cost model's "
            "eager efficiencies do not describe; calibrate on eager records (csbp bench train's default --compile none)"
        )
    p = {"float32": 4, "bfloat16": 2, "float64": 8}.get(record.get("dtype", "float32"), 4)
    group = LayerGroup(
        record["num_layers"],
        record["num_heads"],
        record["num_kv_heads"],
        record["head_dim"],
        record.get("window") or record.get("sliding_window") or 0,  # bench dflash --sliding-window
    )
    if kind == "attention":
        model = ModelShape("attention-stack", record["hidden_size"], 0, 0, (group,))
        objective = Objective("bd3", block=record["block_size"], kv_grad_bytes=p)
    elif kind == "dflash":
        d = record["hidden_size"]
        model = ModelShape(
            "bench-drafter",
            d,
            record["vocab_size"],
            record["intermediate_size"],
            (group,),
            extra_params=record["feature_width"] * d,  # the fusion fc
        )
        objective = Objective(
            "dflash",
            block=record["block_size"],
            anchors=record["anchors"],
            feature_width=record["feature_width"],
        )
    else:
        model = ModelShape(
            "bench-decoder",
            record["hidden_size"],
            record["vocab_size"],
            record["intermediate_size"],
            (group,),
        )
        name = record.get("objective", "bd3")
        objective = Objective(
            name, block=record["block_size"], views=2 if name == "fast_dllm_v2" else 1, kv_grad_bytes=p
        )
    nproc, cp, bp = record["nproc"], record["cp"], record["bp"]
    dp = nproc // max(cp, bp)
    # bench train runs every sample on every replica; bench dflash deals --samples over the replicas
    samples = record.get("samples", 1)
    layout = Layout(
        dp,
        cp,
        bp,
        transport={"cp-aware": "halo", "csbp-gather": "streaming"}.get(  # dflash's all-gather baseline
            str(record.get("layout")), record.get("transport") or "collective"),
        checkpointing={"full": "full", "selective": "selective"}.get(str(record.get("activation_checkpointing")), "none"),
        micro_batch=max(samples // dp, 1) if kind == "dflash" else samples,
        sharding="ddp",
        schedule="balanced" if str(record.get("layout", "")).endswith("-balanced") else "dual_end",
    )
    hw = hardware("cpu", gpus=nproc)
    # the bench builds its model in the record's dtype: no master weights (state_bytes = p)
    workload = Workload(model, objective, p, state_bytes=p).with_options(doc_length=record.get("doc_length"))
    label = f"bench {kind} {record.get('objective', '')} L={record['seq_len']} {record.get('layout', layout.name)}"
    label += f" ac={layout.checkpointing}" if layout.checkpointing != "none" else ""
    label += f" doc={record['doc_length']}" if record.get("doc_length") else ""
    seconds = Observation(
        label + " step_s",
        workload,
        layout,
        record["seq_len"],
        hw,
        "step_s",
        record_seconds(record, fastest),
        True,
    )
    memory = Observation(
        label + " mem_gib",
        workload,
        layout,
        record["seq_len"],
        hw,
        "mem_gib",
        max(float(record["peak_mem_bytes"]), 1.0) / GIB,
        True,
        step_memory_only=True,
    )
    return [seconds, memory]


def fit_bench(observations: Sequence[Observation], *, source: str) -> Calibration:
    """A calibration for ``--gpu cpu`` (or any machine the benchmarks ran on): compute, attention,
    link and per-step overhead from step times, activation and constant memory from peaks. The
    interval-kernel factors stay 1: csbp runs the same kernel in every layout. ``csbp bench dflash``
    records fit the drafter's compute and activation factors."""
    base = Calibration(
        interval_fwd=1.0,
        interval_bwd=1.0,
        overlap_cp=0.0,
        overlap_csbp=0.0,
        grad_overlap=0.0,  # csbp bench averages gradients after the backward
        step_overhead_s=0.01,
    )
    cal = base
    decoder = [o for o in observations if not o.workload.objective.is_drafter]
    drafter = [o for o in observations if o.workload.objective.is_drafter]
    if decoder:
        times = [o for o in decoder if o.metric == "step_s"]
        memory = [o for o in decoder if o.metric == "mem_gib"]
        cal = fit_factors(times, cal, ["gemm_eff", "attn_eff", "intra_eff", "step_overhead_s"], source=source)
        factors = ["act_factor", "mem_fixed_gib"]
        if any(o.layout.checkpointing != "none" for o in memory):
            factors.append("ws_factor")
        cal = fit_factors(memory, cal, factors, source=source)
    if drafter:
        times = [o for o in drafter if o.metric == "step_s"]
        memory = [o for o in drafter if o.metric == "mem_gib"]
        cal = fit_factors(times, cal, ["drafter_eff"], source=source)
        cal = fit_factors(memory, cal, ["drafter_act_factor"], source=source)
    return cal
