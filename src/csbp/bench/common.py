"""What the three layout benchmarks (``csbp bench attention|train|dflash``) share.

* the checks of the run options every benchmark config has (``check_run_options``);
* the layouts compared (``layout_topologies``, ``select_topologies``) and one launch of a cell of
  layouts on ``nproc`` processes with a fixed glibc mmap threshold (``launch_cell``): gloo on the
  CPU, or with ``--device cuda`` one process per GPU over NCCL (workers compute on
  ``ctx.device``);
* one timed step on a rank (``measured_step``: the slowest rank's time and the peak memory growth)
  and the series of measured steps of one layout (``StepSeries``: every repeat, median time, peak
  memory);
* the text table with each metric's ratio to CP-only in the same cell (``Column``,
  ``format_ratio_table``), a timing's spread over the repeats (``±%``) and a ``~`` on a ratio within
  that noise (``csbp.bench.spread``);
* the command-line option groups of the three subcommands and their outputs (the table, ``--json``
  through an atomic write, the ``--png`` speedup plot);
* the overlap ablation of ``csbp bench attention|dflash --ablate-overlap`` (``overlap_modes``,
  ``serialized_if``, ``OVERLAP_COLUMNS``): every measured step also runs with the collectives
  waited for at issue, alternating with the overlapped step in the same processes.

Worker protocol of ``launch_cell``: ``worker(rank, world, topologies, cfg)`` is a module-level
function that returns one ``dict[str, float]`` of results per topology, in order.
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from csbp.atomic import write_json_atomic
from csbp.attention.documents import Documents, seeded_documents
from csbp.bench.measure import PeakMemory, fixed_mmap_threshold
from csbp.bench.spread import NOISE_MARK, NOISE_NOTE, format_spread, rates_within_noise, within_noise
from csbp.cli.options import int_at_least, output_file, positive_int
from csbp.devices import DEVICE_KINDS, backend_device, resolve_device
from csbp.parallel.comm import serialized_collectives
from csbp.parallel.launch import run_local
from csbp.topology import Topology, sequence_error_in_flags

LAYOUTS: tuple[str, ...] = ("cp", "cp-aware", "bp", "csbp")
LAYOUT_TRANSPORTS = {"cp-aware": "halo"}
"""Layouts that differ from another only by their transport: ``cp-aware`` is CP-only's topology with
the halo all-to-all (only the clean rows some remote query may see), the strongest CP baseline."""
BALANCED_LAYOUTS: tuple[str, ...] = ("bp-balanced", "csbp-balanced")
"""``csbp bench train`` layouts that differ from ``bp`` / ``csbp`` only by their block schedule:
``balanced`` deals each sample's blocks by their document cost (``counts.document_schedule``)."""
BENCH_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}

# ----------------------------------------------------------------------------- layouts and launches


def print_header(header: str | None) -> None:
    """A benchmark's header, printed (flushed) once its inputs are checked and before it runs."""
    if header is not None:
        print(header, flush=True)


def check_run_options(cfg: Any, *, at_least_one: tuple[str, ...]) -> None:
    """Fail unless ``cfg.dtype`` is in ``BENCH_DTYPES``, each field of ``at_least_one`` is >= 1 and
    ``cfg.warmup`` >= 0."""
    if cfg.dtype not in BENCH_DTYPES:
        raise ValueError(f"dtype {cfg.dtype!r} is not one of {tuple(BENCH_DTYPES)}")
    for name in at_least_one:
        if getattr(cfg, name) < 1:
            raise ValueError(f"{name} must be >= 1, got {getattr(cfg, name)}")
    if cfg.warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {cfg.warmup}")


def layout_topologies(
    nproc: int, csbp_cp: int | None = None, csbp_bp: int | None = None
) -> dict[str, Topology]:
    """CP-only (cp = nproc; generic ``cp`` and mask-aware ``cp-aware``), BP-only (bp = nproc) and
    CSBP (cp x bp, default nproc x nproc; the remaining factor of ``nproc`` becomes data parallelism,
    e.g. cp = bp = 2 on 4 ranks is dp = 2)."""
    cp, bp = csbp_cp or nproc, csbp_bp or nproc
    local = max(cp, bp)
    if nproc % local != 0:
        raise ValueError(
            f"CSBP cp={cp}, bp={bp} uses {local} ranks per sample, which does not divide nproc={nproc}"
        )
    return {
        "cp": Topology(cp=nproc),
        "cp-aware": Topology(cp=nproc),
        "bp": Topology(bp=nproc, replicate_clean_prefix=True),
        "csbp": Topology(dp=nproc // local, cp=cp, bp=bp),
    }


def require_parallel(nproc: int) -> None:
    """Fail when ``nproc`` cannot hold a parallel layout."""
    if nproc < 2:
        raise ValueError(f"nproc must be >= 2 to compare parallel layouts, got {nproc}")


def select_topologies(
    layouts: Sequence[str], nproc: int, csbp_cp: int | None = None, csbp_bp: int | None = None
) -> list[Topology]:
    """The topologies of ``layouts`` (names from ``LAYOUTS``), in order."""
    topologies = layout_topologies(nproc, csbp_cp, csbp_bp)
    unknown = [name for name in layouts if name not in topologies]
    if unknown or not layouts:
        raise ValueError(f"unknown or no layout(s) {unknown}: choose from {sorted(topologies)}")
    return [topologies[name] for name in layouts]


def check_cell_sequence(cell: Sequence[Topology], seq_len: int, block_size: int) -> None:
    """Every topology of ``cell`` takes one ``--seq-lens`` length (errors in the command's flags)."""
    for topology in cell:
        try:
            topology.validate_sequence(seq_len, block_size)
        except ValueError as error:
            raise ValueError(sequence_error_in_flags(str(error), seq_len="--seq-lens")) from None


def check_zigzag_lengths(seq_lens: Sequence[int], nproc: int) -> None:
    """Every ``--seq-lens`` length splits into ``2·nproc`` zigzag shards, checked before any runs (a bad
    last one was refused after the others ran)."""
    for seq_len in seq_lens:
        if seq_len % (2 * nproc):
            raise ValueError(f"--seq-lens {seq_len} must be a multiple of 2·nproc={2 * nproc} (zigzag shards)")


def launch_cell(
    worker: Callable[..., list[dict[str, float]]],
    nproc: int,
    cell: list[Topology],
    cfg: object,
    *,
    timeout_s: float,
    device: str = "cpu",
) -> list[list[dict[str, float]]]:
    """Run ``worker`` over ``cell`` on ``nproc`` processes (one GPU each for ``device="cuda"``);
    ``results[entry][rank]`` for each entry the worker returns (one per layout, or per layout and
    variant)."""
    with fixed_mmap_threshold():
        per_rank = run_local(worker, nproc, (cell, cfg), timeout_s=timeout_s, device=device)
    return [[rank_results[index] for rank_results in per_rank] for index in range(len(per_rank[0]))]


def max_over_ranks(results: list[dict[str, float]], key: str) -> int:
    """The largest ``key`` over the ranks' results, as an integer (bytes, FLOPs)."""
    return int(max(r[key] for r in results))


# ----------------------------------------------------------------------------- steps on one rank


@dataclass
class StepMeasurement:
    """One step: ``seconds`` of the slowest rank and this rank's peak memory growth."""

    seconds: float = 0.0
    peak_bytes: int = 0


@contextmanager
def measured_step(counter: Any = None) -> Iterator[StepMeasurement]:
    """``with measured_step(ctx.counter) as step: ...`` times the body on every rank (after a barrier;
    ``counter``, if given, is reset first) and fills ``step`` with the slowest rank's time. On a GPU
    the device is synchronised before the clock stops."""
    if counter is not None:
        counter.reset()
    device = backend_device()
    dist.barrier()
    step = StepMeasurement()
    with PeakMemory(device) as memory:
        start = time.perf_counter()
        yield step
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
    step.peak_bytes = memory.bytes
    slowest = torch.tensor([elapsed], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    step.seconds = float(slowest[0])


@dataclass
class StepSeries:
    """The measured steps of one layout on one rank."""

    times_s: list[float] = field(default_factory=list)
    peak_bytes: int = 0

    def add(self, step: StepMeasurement) -> None:
        self.times_s.append(step.seconds)
        self.peak_bytes = max(self.peak_bytes, step.peak_bytes)

    def median_s(self) -> float:
        return statistics.median(self.times_s)

    def repeats_s(self) -> dict[str, float]:
        """Every repeat as ``{"repeat_<i>": seconds}`` (a worker's results are flat ``dict[str, float]``)."""
        return {f"repeat_{i}": t for i, t in enumerate(self.times_s)}


def repeats_of(result: dict[str, float], prefix: str = "repeat_") -> tuple[float, ...]:
    """The repeats ``StepSeries.repeats_s`` (keys ``<prefix><i>``) put in a worker's result, in order."""
    found = sorted((int(key[len(prefix):]), value) for key, value in result.items()
                   if key.startswith(prefix) and key[len(prefix):].isdigit())
    return tuple(value for _, value in found)


# ----------------------------------------------------------------------------- tables


@dataclass(frozen=True)
class Column:
    """One table column: record attribute ``name`` printed with format ``spec`` (whose alignment and
    width also place ``header``), after ``shown`` (e.g. a unit change); ``vs_cp`` adds an ``x cp``
    column with the raw value's ratio to the CP-only record of the same cell. ``times`` names the
    record attribute holding the value's timed repeats: its ``x cp`` ratio is marked ``~`` when the
    two records' repeats overlap, and with ``spread`` a ``±`` column follows the value. ``per`` names
    the record attribute (an amount of work: FLOPs) the value is a time per: its ``x cp`` is a ratio of
    rates over different work, marked when the two records' seconds per unit of work overlap
    (``spread.rates_within_noise``). ``noise`` names two attributes of the same record holding
    repeats whose overlap marks this column's value (a ratio of the two, e.g. ``x serial``)."""

    header: str
    name: str
    spec: str
    vs_cp: bool = False
    shown: Callable[[Any], Any] | None = None
    times: str | None = None
    spread: bool = False
    noise: tuple[str, str] | None = None
    per: str | None = None


SPREAD_WIDTH = 4


def _ratio(value: float, reference: float | None, noisy: bool = False) -> str:
    return f"{value / reference:5.2f}{NOISE_MARK if noisy else ' '}" if reference else "    - "


def format_ratio_table(records: Sequence[Any], cell_fields: tuple[str, ...], columns: list[Column]) -> str:
    """A text table of ``records`` (one row each); a cell is the records with equal ``cell_fields``."""

    def cell(record: Any) -> tuple[object, ...]:
        return tuple(getattr(record, name) for name in cell_fields)

    base = {cell(r): r for r in records if r.layout == "cp"}
    header_parts = []
    for column in columns:
        header_parts.append(format(column.header, re.match(r"[<>^]?\d*", column.spec).group()))  # type: ignore[union-attr]
        if column.spread:
            header_parts.append(f"{'±':>{SPREAD_WIDTH}}")
        if column.vs_cp:
            header_parts.append(f"{'x cp':>6}")
    header = " ".join(header_parts)
    lines = [header, "-" * len(header)]
    marked = False
    for r in records:
        b = base.get(cell(r))
        parts = []
        for column in columns:
            value = getattr(r, column.name)
            text = format(column.shown(value) if column.shown else value, column.spec)
            if column.noise is not None:  # one more character: the mark or a blank
                noisy = within_noise(*(getattr(r, name) or () for name in column.noise))
                text, marked = text + (NOISE_MARK if noisy else " "), marked or noisy
            parts.append(text)
            if column.spread:
                parts.append(format_spread(getattr(r, column.times or ""), SPREAD_WIDTH))
            if column.vs_cp:
                noisy = bool(b and column.times and b is not r and _ratio_within_noise(column, r, b))
                marked |= noisy
                parts.append(_ratio(value, b and getattr(b, column.name), noisy))
        lines.append(" ".join(parts))
    if marked:
        lines.append(NOISE_NOTE)
    return "\n".join(lines)


def _ratio_within_noise(column: Column, record: Any, base: Any) -> bool:
    """Whether ``column``'s ratio of ``record`` to ``base`` is within their repeats' noise (its
    ``times``, per unit of its ``per`` work when it has one)."""
    times, base_times = getattr(record, column.times or ""), getattr(base, column.times or "")
    if column.per is None:
        return within_noise(times, base_times)
    return rates_within_noise(times, getattr(record, column.per), base_times, getattr(base, column.per))


def records_as_dicts(records: Sequence[Any]) -> list[dict[str, object]]:
    """The records (dataclasses) as the dicts of the ``--json`` output."""
    return [asdict(r) for r in records]


# ----------------------------------------------------------------------------- command line


def add_layout_options(
    parser: argparse.ArgumentParser,
    *,
    seq_lens: list[int],
    csbp_cp_help: str,
    layouts: tuple[str, ...] = LAYOUTS,
    extra_layouts: tuple[str, ...] = (),
) -> None:
    """``--seq-lens``, ``--layouts`` (from ``layouts``, default; or ``extra_layouts`` on request),
    ``--nproc``, ``--device``, ``--csbp-cp`` and ``--block-size``."""
    parser.add_argument("--seq-lens", type=positive_int, nargs="+", default=seq_lens)
    parser.add_argument("--layouts", nargs="+", default=list(layouts), choices=(*layouts, *extra_layouts))
    parser.add_argument("--nproc", type=positive_int, default=4)
    parser.add_argument(
        "--device", choices=DEVICE_KINDS, default="cpu",
        help="cpu: gloo processes (default); cuda: one process per GPU over NCCL",
    )
    parser.add_argument("--csbp-cp", type=positive_int, default=None, help=csbp_cp_help)
    parser.add_argument("--block-size", type=positive_int, default=16)


def check_device_option(args: argparse.Namespace) -> None:
    """Refuse ``--device cuda`` with more processes than visible GPUs, before anything starts."""
    resolve_device(args.device, nproc=args.nproc)


def add_transport_option(parser: argparse.ArgumentParser) -> None:
    """``--transport`` of the generic CP and CSBP layouts, and ``--doc-length``."""
    parser.add_argument("--transport", choices=("collective", "streaming"), default="collective")
    parser.add_argument(
        "--doc-length",
        type=positive_int,
        default=None,
        help="pack random documents of this mean length and mask across them (default: one document)",
    )


def layout_schedule(name: str) -> tuple[str, str]:
    """``(layout, block schedule)`` of a layout name: ``csbp-balanced`` is ``("csbp", "balanced")``,
    any other name runs the default ``dual_end``."""
    if name in BALANCED_LAYOUTS:
        return name.removesuffix("-balanced"), "balanced"
    return name, "dual_end"


def layout_transport(name: str, transport: str) -> str:
    """The transport layout ``name`` runs with when the benchmark's ``--transport`` is ``transport``."""
    return LAYOUT_TRANSPORTS.get(name, transport)


def bench_documents(seq_len: int, doc_length: int | None, seed: int, sample: int = 0) -> Documents | None:
    """The packed documents of one benchmark sample (the same on every rank), or None."""
    if doc_length is None:
        return None
    return seeded_documents(seq_len, doc_length, seed * 1009 + sample)


def add_head_options(parser: argparse.ArgumentParser) -> None:
    """``--num-heads``, ``--num-kv-heads`` and ``--head-dim``."""
    parser.add_argument("--num-heads", type=positive_int, default=4)
    parser.add_argument("--num-kv-heads", type=positive_int, default=2)
    parser.add_argument("--head-dim", type=positive_int, default=32)


def check_head_options(args: argparse.Namespace) -> None:
    """``--num-heads`` must be a multiple of ``--num-kv-heads`` (grouped-query attention)."""
    if args.num_heads % args.num_kv_heads != 0:
        raise ValueError(
            f"--num-kv-heads {args.num_kv_heads}: --num-heads {args.num_heads} must be a multiple of it "
            "(grouped-query attention)"
        )


def add_model_width_options(
    parser: argparse.ArgumentParser, *, vocab_size: int, intermediate_size: int
) -> None:
    """``--vocab-size``, ``--hidden-size`` (default 128) and ``--intermediate-size``."""
    parser.add_argument("--vocab-size", type=positive_int, default=vocab_size)
    parser.add_argument("--hidden-size", type=positive_int, default=128)
    parser.add_argument("--intermediate-size", type=positive_int, default=intermediate_size)


def add_overlap_ablation_option(parser: argparse.ArgumentParser) -> None:
    """``--ablate-overlap``: also time every layout with its collectives serialized."""
    parser.add_argument(
        "--ablate-overlap", action="store_true",
        help="also time every layout with its attention collectives waited for at issue (no overlap), "
        "alternating step by step with the overlapped steps in the same processes; adds the "
        "`serial s` and `x serial` columns",
    )


def overlap_modes(step: int, ablate: bool) -> tuple[bool, ...]:
    """The ``serialized`` flags of one measured step: overlapped only, or both in an order that
    alternates with ``step`` (neither mode always runs first on a warm cache)."""
    if not ablate:
        return (False,)
    return (False, True) if step % 2 == 0 else (True, False)


def serialized_if(serialized: bool) -> AbstractContextManager[None]:
    """``serialized_collectives()`` when ``serialized``, else nothing."""
    return serialized_collectives() if serialized else nullcontext()


OVERLAP_COLUMNS = [
    Column("serial s", "serialized_step_time_s", ">8.3f", shown=lambda v: float("nan") if v is None else v),
    Column("x serial", "overlap_ratio", ">8.3f", shown=lambda v: float("nan") if v is None else v,
           noise=("step_times_s", "serialized_step_times_s")),
]
"""Table columns of ``--ablate-overlap``: the serialized step time and overlapped / serialized (``~``:
the two modes' repeats overlap)."""


def overlap_ratio(step_time_s: float, serialized_step_time_s: float | None) -> float | None:
    """Overlapped over serialized step time (< 1: the overlap pays), None without the ablation."""
    return None if serialized_step_time_s is None else step_time_s / serialized_step_time_s


def add_output_options(parser: argparse.ArgumentParser, *, png_help: str | None = None) -> None:
    """``--repeats``, ``--warmup``, ``--json`` and, when ``png_help`` is given, ``--png``."""
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--warmup", type=int_at_least(0), default=1)  # a negative count once crashed
    parser.add_argument("--json", type=output_file, default=None, help="write the records to this JSON file")
    if png_help is not None:
        parser.add_argument("--png", type=output_file, default=None, help=png_help)


def write_outputs(
    table: str,
    records: Sequence[Any],
    args: argparse.Namespace,
    *,
    plot_group_by: str | None = None,
    plot_title: str | None = None,
    plot_records: Sequence[Any] | None = None,
) -> None:
    """Print ``table``, write ``--json``, and with ``plot_title`` the speedup plot to ``--png`` (default:
    ``--json`` with suffix ``.png``) when the layouts include CP-only; ``plot_records`` (default: all)
    are the records plotted."""
    print(table)
    if args.json is not None:
        write_json_atomic(args.json, records_as_dicts(records))
        print(f"wrote {args.json}")
    if plot_title is None:
        return
    png = args.png if args.png is not None else (args.json.with_suffix(".png") if args.json is not None else None)
    if png is None:
        return
    if "cp" in args.layouts:
        from csbp.bench.plot import plot_speedups

        plotted = records if plot_records is None else plot_records
        plot_speedups(records_as_dicts(plotted), png, group_by=plot_group_by, title=plot_title)
        print(f"wrote {png}")
    else:
        print("no plot: speedups are relative to CP-only, add 'cp' to --layouts")
