"""The verdict of ``csbp bench kernels``: per length, block size and backend, the fastest mixed and the
fastest decomposed form, their rates relative to dense attention and the decomposed form's speedup.

It reads the benchmark's rows as dictionaries (its ``--json`` output, or ``gpu-kernels.json`` of
``make gpu-check``), so the command, the device check and anyone holding a JSON file get the same
lines; where the rows hold their repeats (``times_s``) a speedup within their min-max range is said to
be no measurable difference, and a rate relative to dense whose seconds per pair overlap dense's over
the repeats is marked ``~`` (``csbp.bench.spread``: the table's ``x dense`` and ``decomp x`` marks, from
the same repeats, so a JSON file written before the marks reads the same). Rates are per useful
(allowed) pair; "dense" is dense SDPA over all pairs of the same shapes (FlashAttention on CUDA). The
kernel path's targets on CUDA (#8: bf16, head dim 128, L = 16K-128K) are ``KERNEL_TARGETS``;
``target_line`` says how a run measured against them (each worst value marked ``~`` in the same way).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from csbp.bench.spread import NOISE_MARK, rates_within_noise, within_noise

Row = Mapping[str, object]

MIXED_FORMS = ("mixed", "mixed-ag")


@dataclass(frozen=True)
class ShapeVerdict:
    """The fastest forms of one (length, block size, backend)."""

    seq_len: int
    block_size: int
    backend: str
    mixed_form: str  # the fastest mixed form ("" if none was measured)
    mixed_vs_dense: float
    decomposed_kernels: str  # "<diagonal> diagonal, <clean> clean" of the fastest decomposed row ("" if none)
    decomposed_vs_dense: float
    speedup: float  # t_mixed / t_decomposed of the fastest of each (nan if either is missing)
    within_noise: bool = False  # the two rows' repeats (``times_s``, where recorded) overlap: no speedup
    mixed_vs_dense_within_noise: bool = False  # the mixed row's seconds per pair overlap dense's over the repeats
    decomposed_vs_dense_within_noise: bool = False  # the same for the decomposed row


def _number(row: Row, key: str) -> float:
    value = row.get(key, math.nan)
    return float(value) if isinstance(value, int | float) else math.nan


def _times(row: Row) -> list[float]:
    times = row.get("times_s")
    return [float(t) for t in times if isinstance(t, int | float)] if isinstance(times, list | tuple) else []


def vs_dense_within_noise(row: Row, dense: Row | None) -> bool:
    """Whether ``row``'s rate per allowed pair and the dense row's could be equal on some pair of their
    repeats (False without repeats or pair counts: an older JSON file)."""
    if dense is None:
        return False
    return rates_within_noise(_times(row), _number(row, "useful_pairs"), _times(dense), _number(dense, "useful_pairs"))


def _dense_row(rows: Sequence[Row], seq_len: object) -> Row | None:
    """Dense SDPA's row at ``seq_len`` (the baseline of ``vs_dense``), if the rows hold one."""
    return next((r for r in rows if r.get("form") == "dense" and r.get("backend") == "sdpa"
                 and r.get("seq_len") == seq_len), None)


def _fastest(rows: Sequence[Row]) -> Row | None:
    timed = [r for r in rows if math.isfinite(_number(r, "time_s"))]
    return min(timed, key=lambda r: _number(r, "time_s")) if timed else None


def shape_verdicts(rows: Sequence[Row]) -> list[ShapeVerdict]:
    """One verdict per (length, block size, backend) with a mixed or decomposed row, in first-seen order
    (rows without those three keys are left out)."""
    shapes = dict.fromkeys(
        (r["seq_len"], r["block_size"], r["backend"]) for r in rows
        if r.get("form") in (*MIXED_FORMS, "decomposed") and all(key in r for key in ("seq_len", "block_size", "backend"))
    )
    verdicts = []
    for seq_len, block, backend in shapes:
        mine = [r for r in rows if (r.get("seq_len"), r.get("block_size"), r.get("backend")) == (seq_len, block, backend)]
        mixed = _fastest([r for r in mine if r.get("form") in MIXED_FORMS])
        dense = _dense_row(rows, seq_len)
        decomposed = _fastest([r for r in mine if r.get("form") == "decomposed"])
        speedup, noisy = math.nan, False
        if mixed is not None and decomposed is not None:
            speedup = _number(mixed, "time_s") / _number(decomposed, "time_s")
            noisy = within_noise(_times(mixed), _times(decomposed))
        verdicts.append(ShapeVerdict(
            int(seq_len), int(block), str(backend),  # type: ignore[call-overload]
            mixed_form=str(mixed["form"]) if mixed is not None else "",
            mixed_vs_dense=_number(mixed, "vs_dense") if mixed is not None else math.nan,
            decomposed_kernels=(f"{decomposed['diagonal']} diagonal, {decomposed['clean']} clean"
                                if decomposed is not None else ""),
            decomposed_vs_dense=_number(decomposed, "vs_dense") if decomposed is not None else math.nan,
            speedup=speedup,
            within_noise=noisy,
            mixed_vs_dense_within_noise=mixed is not None and vs_dense_within_noise(mixed, dense),
            decomposed_vs_dense_within_noise=decomposed is not None and vs_dense_within_noise(decomposed, dense),
        ))
    return verdicts


def _mark(noisy: bool) -> str:
    return NOISE_MARK if noisy else ""


def format_verdicts(verdicts: Sequence[ShapeVerdict]) -> str:
    """One line per shape: the fastest mixed and decomposed forms and the decomposed form's speedup (a
    rate within the noise of dense's marked ``~``, as in the table)."""
    lines = []
    for v in verdicts:
        parts = [f"L={v.seq_len} B={v.block_size} {v.backend}:"]
        if v.mixed_form:
            parts.append(f"fastest mixed ({v.mixed_form}) {v.mixed_vs_dense:.2f}x{_mark(v.mixed_vs_dense_within_noise)} "
                         "dense's rate;")
        if v.decomposed_kernels:
            parts.append(f"fastest decomposed ({v.decomposed_kernels}) {v.decomposed_vs_dense:.2f}x"
                         f"{_mark(v.decomposed_vs_dense_within_noise)} dense's rate")
        if math.isfinite(v.speedup):
            parts.append(f"= {v.speedup:.2f}x the mixed form's speed")
            if v.within_noise:
                parts.append("(within the repeats' min-max range: no measurable difference)")
        lines.append(" ".join(parts))
    return "\n".join(lines)


@dataclass(frozen=True)
class KernelTargets:
    """Rates a layout's attention must reach on CUDA (bf16, head dim 128, L in ``seq_lens``)."""

    min_vs_dense: float = 0.60  # every layout's (mixed, decomposed, busiest rank) rate per useful pair vs dense
    cpu_min_vs_dense: float = 0.50  # the same on the CPU (the tiles against dense SDPA)
    min_speedup: float = 1.0  # decomposed vs the fastest mixed form, every block size
    min_speedup_large_block: float = 1.2  # ... at block size ``large_block``
    large_block: int = 128
    seq_lens: tuple[int, int] = (16384, 131072)  # the range the targets hold over, inclusive


KERNEL_TARGETS = KernelTargets()


TARGET_NOISE_NOTE = "~: within the repeats' min-max range of its reference (no measurable difference)"
"""The end of ``target_line`` when one of its worst values is marked ``~``."""


def target_line(rows: Sequence[Row], targets: KernelTargets = KERNEL_TARGETS) -> str:
    """How the measured shapes inside the targets' range compare with them, on one line (the worst
    value of each target, marked ``~`` where that row's repeats overlap its reference's: dense's for a
    rate, the mixed form's for a speedup; "not measured" when no shape in the range was), ending with
    the verdict: ``met``, ``missed (<targets>)`` or ``not measured (<targets>)``, and the range's upper
    end when no shape reached it (a run cut short by a time limit)."""
    low, high = targets.seq_lens
    verdicts = [v for v in shape_verdicts(rows) if low <= v.seq_len <= high]
    if not verdicts:
        return f"targets: no shape measured at L = {low}-{high}"
    marked = False
    missed: list[str] = []
    unmeasured: list[str] = []

    def worst(name: str, values: list[tuple[float, bool]], minimum: float) -> str:
        nonlocal marked
        finite = [x for x in values if math.isfinite(x[0])]
        if not finite:
            unmeasured.append(name)
            return "not measured"
        value, noisy = min(finite, key=lambda x: x[0])
        marked |= noisy
        if value < minimum:
            missed.append(name)
        return f"{value:.2f}x{_mark(noisy)}"

    lengths = sorted({v.seq_len for v in verdicts})
    mixed = worst("mixed rate", [(v.mixed_vs_dense, v.mixed_vs_dense_within_noise) for v in verdicts],
                  targets.min_vs_dense)
    decomposed = worst("decomposed rate",
                       [(v.decomposed_vs_dense, v.decomposed_vs_dense_within_noise) for v in verdicts],
                       targets.min_vs_dense)
    speedup = worst("decomposed/mixed", [(v.speedup, v.within_noise) for v in verdicts], targets.min_speedup)
    large = worst(f"B={targets.large_block}",
                  [(v.speedup, v.within_noise) for v in verdicts if v.block_size == targets.large_block],
                  targets.min_speedup_large_block)
    line = (
        f"targets at L = {', '.join(str(n) for n in lengths)}: worst mixed {mixed}"
        f" and decomposed {decomposed} dense's rate (>= "
        f"{targets.min_vs_dense:.2f}x); decomposed/mixed worst {speedup} (>= "
        f"{targets.min_speedup:.1f}x), at B={targets.large_block} {large} (>= {targets.min_speedup_large_block:.1f}x)"
    )
    ranks = _fastest_rank_rows([r for r in rows if r.get("form") == "rank" and low <= _number(r, "seq_len") <= high])
    if ranks:  # --layouts: each layout's busiest rank (its fastest kernels), against dense over its own shapes
        value = worst("layout rate", [(_number(r, "vs_dense"), bool(r.get("vs_dense_within_noise"))) for r in ranks],
                      targets.min_vs_dense)
        timed = [r for r in ranks if math.isfinite(_number(r, "vs_dense"))]
        which = f" ({min(timed, key=lambda r: _number(r, 'vs_dense')).get('topology')})" if timed else ""
        line += f"; busiest ranks worst {value}{which} dense's rate (>= {targets.min_vs_dense:.2f}x)"
    verdict = [f"missed ({', '.join(missed)})"] if missed else []
    verdict += [f"not measured ({', '.join(unmeasured)})"] if unmeasured else []
    reach = f" (up to L = {lengths[-1]}: {high} not reached)" if lengths[-1] < high else ""
    line += "; verdict: " + ("; ".join(verdict) if verdict else "met") + reach
    return f"{line}; {TARGET_NOISE_NOTE}" if marked else line


def summarize_rank_rows(rows: Sequence[Row], targets: KernelTargets = KERNEL_TARGETS) -> str:
    """One line for ``--layouts`` rows: per layout's busiest rank (its fastest clean-context kernel and
    transport), its rate against dense over its own shapes, and the worst against the target of the rows'
    device (``min_vs_dense`` on CUDA, ``cpu_min_vs_dense`` elsewhere)."""
    best = [r for r in _fastest_rank_rows([r for r in rows if r.get("form") == "rank"])
            if math.isfinite(_number(r, "vs_dense"))]
    if not best:
        return f"{len(rows)} rows, none timed"
    parts = [f"{r.get('topology')} r{r.get('rank')} ({r.get('clean')}"
             f"{', ' + str(r.get('transport')) if r.get('transport') not in (None, '-') else ''}) "
             f"{_number(r, 'vs_dense'):.2f}x"
             f"{_mark(bool(r.get('vs_dense_within_noise')))} at L={r.get('seq_len')} B={r.get('block_size')}"
             for r in best]
    worst = min(_number(r, "vs_dense") for r in best)
    on_cuda = all(str(r.get("device", "")).startswith("cuda") for r in best)
    minimum = targets.min_vs_dense if on_cuda else targets.cpu_min_vs_dense
    verdict = "met" if worst >= minimum else "missed"
    return (f"{len(rows)} rows; busiest rank's rate against dense over its shapes: {', '.join(parts)}; "
            f"worst {worst:.2f}x (>= {minimum:.2f}x {'on CUDA' if on_cuda else 'on the CPU'}): {verdict}")


def _fastest_rank_rows(rows: Sequence[Row]) -> list[Row]:
    """Per (length, block size, backend, topology), the rank row with the best rate over its clean kernels and
    transports (a failed one only when its shape has no other)."""
    best: dict[tuple[object, ...], Row] = {}
    for r in rows:
        key = (r.get("seq_len"), r.get("block_size"), r.get("backend"), r.get("topology"))
        rate = _number(r, "vs_dense")
        if key not in best or (math.isfinite(rate) and not rate <= _number(best[key], "vs_dense")):
            best[key] = r
    return list(best.values())


def summarize_kernel_rows(rows: list[dict[str, object]], *, targets: bool = False) -> str:
    """One line: rows measured, the best rate relative to dense SDPA, the decomposed/mixed range and
    the kernel targets' verdict (``kernel_summary.target_line``) when a shape in their range was
    measured, or with ``targets`` (the CUDA check, whose verdict they are) always."""
    def values(key: str, forms: tuple[str, ...]) -> list[float]:
        found = (float(r.get(key, math.nan)) for r in rows if r.get("form") in forms)  # type: ignore[arg-type]
        return [v for v in found if math.isfinite(v)]

    vs_dense = values("vs_dense", ("mixed", "mixed-ag", "decomposed", "diagonal"))
    speedups = values("decomposed_speedup", ("decomposed",))
    parts = [f"{len(rows)} rows"]
    if vs_dense:
        parts.append(f"best {max(vs_dense):.2f}x dense SDPA's rate")
    if speedups:
        parts.append(f"decomposed/mixed {min(speedups):.2f}-{max(speedups):.2f}x")
    graphs = sum(int(r.get("compiled_graphs", 0)) for r in rows)  # type: ignore[call-overload]
    firsts = values("first_call_s", ("mixed", "mixed-ag", "decomposed", "diagonal"))
    if graphs or firsts:
        parts.append(f"{graphs} graphs compiled, slowest first call {max(firsts, default=0.0):.1f} s")
    verdict = target_line(rows)
    return ", ".join(parts) + ("" if verdict.startswith("targets: no shape") and not targets else f"; {verdict}")
