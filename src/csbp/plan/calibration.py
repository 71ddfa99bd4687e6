"""Efficiency factors of the cost model: what a machine achieves of its nominal numbers.

The model's structure (rows, allowed pairs, bytes, memory terms) is exact csbp arithmetic; the
factors below turn work into seconds and bytes into GiB on real hardware. ``fit`` lists the
factors a calibration fitted (the others are priors). Packaged calibrations:

* ``calibration-published.json``: fitted on the points of the published CSBP runs marked
  ``fit: true`` (``csbp.plan.fit.fit_published``); default for the GPU presets.
* ``calibration-cpu.json``: fitted on ``csbp bench train`` on this machine (``csbp plan calibrate``);
  default for ``--gpu cpu``.

Files are plain JSON, read without executing anything and written atomically.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from importlib import resources
from pathlib import Path

from csbp.atomic import write_json_atomic


@dataclass(frozen=True)
class Calibration:
    """Efficiency factors (dimensionless unless the name says otherwise).

    Attributes:
        gemm_eff: fraction of peak reached by the dense matmuls.
        attn_eff: fraction of peak reached by CP-only (chunked, ring) attention per allowed pair.
        interval_fwd / interval_bwd: speed of the one-interval kernel of CSBP, BP-only and data
            layouts relative to ``attn_eff`` (forward / backward).
        net_eff / intra_eff: fraction of the nominal network / intra-node bandwidth reached.
        overlap_cp / overlap_csbp: share of the collective K/V traffic hidden behind compute.
        overlap_stream: share of the ring attention compute that a streaming transport can hide
            traffic behind.
        grad_overlap: share of the gradient synchronisation hidden behind backward.
        step_overhead_s: fixed seconds per optimizer step (launches, logging, data).
        ws_factor: one layer's working set, in units of its per-row activation bytes.
        act_factor: stored activations without checkpointing, in units of the per-row bytes.
        mem_fixed_gib: constant memory (allocator slack, communication buffers, runtime).
        drafter_eff / drafter_act_factor: DFlash drafter compute efficiency and activation bytes.
        source: how it was obtained.
        fit: names of the fitted factors.
    """

    gemm_eff: float = 0.55
    attn_eff: float = 0.5
    interval_fwd: float = 1.0
    interval_bwd: float = 1.0
    net_eff: float = 0.8
    intra_eff: float = 0.8
    overlap_cp: float = 0.45
    overlap_csbp: float = 0.0
    overlap_stream: float = 0.8
    grad_overlap: float = 0.8
    step_overhead_s: float = 0.3
    ws_factor: float = 0.5
    act_factor: float = 1.0
    mem_fixed_gib: float = 10.0
    drafter_eff: float = 0.4
    drafter_act_factor: float = 1.5
    source: str = "priors"
    fit: tuple[str, ...] = field(default_factory=tuple)

    def with_values(self, values: dict[str, float], *, source: str) -> Calibration:
        """A copy with ``values`` fitted (added to ``fit``)."""
        unknown = sorted(set(values) - set(FACTOR_NAMES))
        if unknown:
            raise ValueError(f"unknown calibration factor(s) {unknown}: known are {', '.join(FACTOR_NAMES)}")
        fitted = tuple(dict.fromkeys((*self.fit, *values)))
        return replace(self, **{k: float(v) for k, v in values.items()}, source=source, fit=fitted)

    def to_json(self) -> dict[str, object]:
        payload = asdict(self)
        payload["fit"] = list(self.fit)
        return payload


FACTOR_NAMES: tuple[str, ...] = tuple(f.name for f in fields(Calibration) if f.type in ("float", float))

SHARES = frozenset({"overlap_cp", "overlap_csbp", "overlap_stream", "grad_overlap"})
"""Factors that are a share of something (hidden traffic): in ``[0, 1]``; above 1 the exposed time
would be negative."""
RATES = frozenset({"gemm_eff", "attn_eff", "interval_fwd", "interval_bwd", "net_eff", "intra_eff", "drafter_eff"})
"""Factors that divide work or bytes into seconds: ``> 0`` (0 is an infinitely slow machine)."""


def factor_problem(name: str, value: object) -> str | None:
    """Why ``value`` is no value of factor ``name``, with the fix (finite; a share in [0, 1], a rate
    > 0, anything else >= 0), or None."""
    refit = "or refit it with csbp plan calibrate"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return f"must be a finite number, got {value!r} (fix: a number, {refit})"
    if name in SHARES and not 0 <= value <= 1:
        return f"is the share of traffic hidden, got {value!r} (fix: a value in [0, 1], {refit})"
    if name in RATES and not value > 0:
        return f"divides work or bytes into seconds, got {value!r} (fix: a value > 0, {refit})"
    if not value >= 0:
        return f"must be >= 0, got {value!r} (fix: a value >= 0, {refit})"
    return None


def calibration_from_json(payload: object, *, source: str) -> Calibration:
    """Parse a calibration dict, naming ``source`` in the one-line error."""
    if not isinstance(payload, dict):
        raise ValueError(f"{source}: a calibration file is a JSON object of factors")
    values = {}
    for key, value in payload.items():
        if key in ("source", "fit"):
            continue
        if key not in FACTOR_NAMES:
            raise ValueError(f"{source}: unknown factor {key!r} (known: {', '.join(FACTOR_NAMES)})")
        problem = factor_problem(key, value)
        if problem is not None:
            raise ValueError(f"{source}: factor {key!r} {problem}")
        values[key] = float(value)
    fit = payload.get("fit", [])
    if not isinstance(fit, list) or not all(isinstance(name, str) for name in fit):
        raise ValueError(f"{source}: 'fit' must be a list of factor names")
    base = Calibration(source=str(payload.get("source", source)), fit=tuple(fit))
    return replace(base, **values)


def load_calibration(path: Path) -> Calibration:
    """Read a calibration file written by ``csbp plan calibrate``."""
    if not path.is_file():
        raise FileNotFoundError(f"calibration file not found: {path}")
    try:
        payload = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from exc
    return calibration_from_json(payload, source=str(path))


def packaged_calibration(gpu: str) -> Calibration:
    """The default calibration of a hardware preset: fitted here for ``cpu``, on the published
    runs for the GPUs."""
    name = "calibration-cpu.json" if gpu == "cpu" else "calibration-published.json"
    text = resources.files("csbp.plan").joinpath(f"data/{name}").read_text()
    return calibration_from_json(json.loads(text), source=f"csbp/plan/data/{name}")


def save_calibration(calibration: Calibration, path: Path) -> None:
    """Write ``calibration`` as JSON atomically (temporary file, then ``os.replace``)."""
    write_json_atomic(path, calibration.to_json())
