"""``csbp bench kernels``: the command line (options, run, table, ``--json``/``--png``) of
``csbp.bench.kernels``, whose measurements it prints row by row as they come."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch

from csbp.attention.backends import CLEAN_KERNELS, check_backend, resolve_backend
from csbp.attention.flex_backward import FLEX_BACKWARDS, resolve_flex_backward
from csbp.bench.common import add_head_options, add_output_options, records_as_dicts, write_json_atomic
from csbp.bench.kernel_profile import StepProfile, format_profile
from csbp.bench.kernel_ranks import (
    RING_TRANSPORTS,
    check_layouts,
    parse_topologies,
    run_rank_rows,
)
from csbp.bench.kernel_summary import format_verdicts, shape_verdicts, summarize_rank_rows
from csbp.bench.kernel_timing import check_clean_kernels
from csbp.bench.kernels import DTYPES, KernelRecord, run_kernel_bench
from csbp.bench.spread import NOISE_MARK, NOISE_NOTE, format_spread
from csbp.cli.options import positive_int
from csbp.figures import save_figure
from csbp.wording import counted


def format_header() -> str:
    header = (
        f"{'L':>7} {'B':>4} {'backend':<6} {'form':<10} {'diagonal':<8} {'clean':<7} {'fwd+bwd ms':>11} {'±':>4} "
        f"{'TFLOP/s':>8} {'x dense':>8} "
        f"{'decomp x':>9} {'mask ms':>8} {'1st ms':>9} {'graphs':>6} {'aten ops':>9}"
    )
    return f"{header}\n{'-' * len(header)}"


def _marked(value: float, noisy: bool) -> str:
    """``value`` with two decimals and the noise mark (or a blank, so marked and plain rows align)."""
    return f"{value:.2f}{NOISE_MARK if noisy else ' '}"


def noisy_records(records: list[KernelRecord]) -> bool:
    """Whether any row's ``x dense`` or ``decomp x`` is marked ``~`` (the table then ends with the note)."""
    return any(r.speedup_within_noise or r.vs_dense_within_noise for r in records)


def format_row(r: KernelRecord) -> str:
    speedup = "- " if r.form != "decomposed" else _marked(r.decomposed_speedup, r.speedup_within_noise)
    form = r.form
    if r.form == "rank":  # its layout, rank and (other than the default) ring transport
        form = f"{r.topology} r{r.rank}" + (f" {r.transport}" if r.transport not in ("-", "collective") else "")
    return (
        f"{r.seq_len:>7} {r.block_size:>4} {r.backend:<6} {form:<10} {r.diagonal:<8} {r.clean:<7} "
        f"{r.time_s * 1e3:>11.2f} {format_spread(r.times_s)} "
        f"{r.tflops:>8.3f} {_marked(r.vs_dense, r.vs_dense_within_noise):>8} {speedup:>9} {r.mask_build_s * 1e3:>8.2f} "
        f"{'-' if math.isnan(r.first_call_s) else f'{r.first_call_s * 1e3:.1f}':>9} {r.compiled_graphs:>6} "
        f"{r.aten_ops if r.aten_ops else '-':>9}"
    )


def plot_rates(records: list[KernelRecord], path: Path) -> None:
    """TFLOP/s on useful pairs against L, one panel per block size, one line per backend and form; the
    ``--layouts`` rows in one more panel, as bars of each busiest rank's rate against dense over its shapes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    forms = [r for r in records if r.form != "rank"]
    ranks = [r for r in records if r.form == "rank"]
    blocks = sorted({r.block_size for r in forms})
    panels = len(blocks) + bool(ranks)
    height = max(4.0, 1.5 + 0.3 * len(ranks))  # one bar per rank row
    figure, axes = plt.subplots(1, panels, figsize=(5.0 * panels + 2.0 * bool(ranks), height), squeeze=False)
    for axis, block in zip(axes[0], blocks):
        series = sorted({(r.backend, r.form, r.diagonal, r.clean) for r in forms if r.block_size == block})
        for backend, form, diagonal, clean in series:
            points = sorted((r.seq_len, r.tflops, *rate_range(r)) for r in forms
                            if (r.block_size, r.backend, r.form, r.diagonal, r.clean) == (block, backend, form, diagonal, clean))
            label = f"{backend} {form}" + (f" ({diagonal} diagonal, {clean} clean)" if diagonal != "-" else "")
            errors = [[max(0.0, p[1] - p[2]) for p in points], [max(0.0, p[3] - p[1]) for p in points]]  # min-max
            (line,) = axis.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
            axis.errorbar([p[0] for p in points], [p[1] for p in points], yerr=errors, fmt="none", capsize=3,
                          ecolor=line.get_color())
        axis.set_xscale("log", base=2)
        axis.set_xlabel("L (tokens; 2L rows)")
        axis.set_ylabel("TFLOP/s on allowed pairs (bars: min-max of the repeats)")
        axis.set_title(f"B = {block} ({records[0].device}, {records[0].dtype})")
        axis.grid(True, alpha=0.3)
        axis.legend()
    if ranks:
        axis = axes[0][-1]
        labels = [f"L={r.seq_len} B={r.block_size} {r.topology} r{r.rank} {r.clean}"
                  + (f" {r.transport}" if r.transport != "-" else "") for r in ranks]
        axis.barh(range(len(ranks)), [r.vs_dense for r in ranks], tick_label=labels)
        axis.axvline(0.6, color="grey", linestyle="--", label="0.6x (the CUDA target)")
        axis.invert_yaxis()
        axis.set_xlabel("rate per allowed pair / dense SDPA's over the rank's shapes")
        axis.set_title(f"busiest rank per layout ({records[0].device}, {records[0].dtype})")
        axis.legend(loc="lower right")
    figure.tight_layout()
    save_figure(figure, path, dpi=120)


def rate_range(record: KernelRecord) -> tuple[float, float]:
    """``(low, high)`` TFLOP/s of the slowest and the fastest repeat (the median's rate without repeats)."""
    finite = [t for t in record.times_s if math.isfinite(t) and t > 0]
    if not finite or not math.isfinite(record.tflops):
        return record.tflops, record.tflops
    return record.tflops * record.time_s / max(finite), record.tflops * record.time_s / min(finite)


# ----------------------------------------------------------------------------- CLI


def register_kernel_bench(kinds: argparse._SubParsersAction) -> None:
    """Add ``csbp bench kernels`` to the ``csbp bench`` sub-subcommands."""
    parser = kinds.add_parser("kernels", help="one layer's attention kernels, mixed vs decomposed, per backend")
    parser.add_argument("--seq-lens", type=positive_int, nargs="+", default=[1024, 2048])
    parser.add_argument("--block-sizes", type=positive_int, nargs="+", default=[16, 64])
    parser.add_argument("--backends", nargs="+", default=["auto"], help="auto, tiles, flex (default: auto)")
    parser.add_argument(
        "--diagonals", nargs="+", default=["auto"],
        help="block-diagonal kernels of the decomposed form: auto, matmul, sdpa, sdpa_fold, flex (flex backend only); "
        "default auto (on tiles sdpa for B >= 16 and matmul below, flex on flex; attention.diagonal of a run)",
    )
    parser.add_argument(
        "--clean-kernels", nargs="+", choices=CLEAN_KERNELS, default=["generic", "pieces"],
        help="clean-context kernels of the decomposed form: generic (one backend partial, what training runs), "
        "pieces (fused flash pieces + a residual on the backend; FlashAttention-2 on CUDA) and pieces-cudnn "
        "(cuDNN pieces, CUDA only); default generic pieces",
    )
    parser.add_argument(
        "--flex-backward", choices=FLEX_BACKWARDS, default="auto",
        help="backward of merged flex partials: direct (the kernel's backward from the merged statistics), "
        "recompute (the forward again, then the chain rule) or auto (direct where torch traces it)",
    )
    parser.add_argument(
        "--primary-first", type=int, nargs="?", const=1, default=0, metavar="N",
        help="measure the primary rows (dense, the mixed forms, the first N decomposed variants in --diagonals x "
        "--clean-kernels order; N defaults to 1) at every length before the other rows: a run cut short has "
        "them all",
    )
    parser.add_argument(
        "--profile-top", type=int, default=0, metavar="N",
        help="run each row's step once more under torch.profiler and record its kernel launches and the N "
        "costliest kernels (CUDA; aten ops on CPU); 0 (default): off",
    )
    parser.add_argument("--profile-seq-lens", type=positive_int, nargs="+", default=None,
                        help="profile only these lengths (default: every length)")
    parser.add_argument(
        "--layouts", nargs="+", default=[], metavar="TOPOLOGY",
        help="also time the busiest rank of each topology (cpA, bpB or cpA/bpB, e.g. cp4 bp4 cp4/bp8): its "
        "attention through its transport, the ring's collectives replaced by local copies, against dense SDPA "
        "over the rank's shapes (csbp.bench.kernel_ranks); default: none",
    )
    parser.add_argument("--no-forms", action="store_true",
                        help="measure only the --layouts rows (no dense, mixed, decomposed or diagonal rows)")
    parser.add_argument(
        "--layout-clean", nargs="+", choices=CLEAN_KERNELS, default=["generic"],
        help="clean-context kernels of the --layouts rows (default: generic, what training runs)",
    )
    parser.add_argument(
        "--layout-transports", nargs="+", choices=RING_TRANSPORTS, default=["collective"],
        help="ring transports of the --layouts rows with a ring (default: collective, the throughput default; "
        "streaming: the bounded-memory ring, one remote partial per hop)",
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default: bfloat16 on CUDA, else float32")
    parser.add_argument("--no-op-count", action="store_true", help="skip counting aten ops (CPU)")
    parser.add_argument(
        "--clock", choices=("wall", "cpu"), default="wall",
        help="wall time, or this process's CPU time (one thread; steadier on a shared machine)",
    )
    add_head_options(parser)
    parser.set_defaults(head_dim=64)
    add_output_options(parser, png_help="write a TFLOP/s plot here (default: --json with suffix .png)")
    parser.set_defaults(func=run_kernel_bench_command)


def run_kernel_bench_command(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is visible to this process")
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    threads = f", {counted(torch.get_num_threads(), 'thread')}" if device.type == "cpu" else ""
    flex_note = ""
    if any(resolve_backend(check_backend(name), device) == "flex" for name in args.backends):
        flex_note = f", flex backward {resolve_flex_backward(args.flex_backward, where='--flex-backward')}"
    header = (
        f"csbp bench kernels: device={device}{threads}, dtype={dtype}, heads={args.num_heads}/{args.num_kv_heads}x"
        f"{args.head_dim}, BD3 mask over 2L rows, fwd+bwd median of {counted(args.repeats, 'repeat')}, ± half their range "
        f"({args.clock} clock)"
        f"{flex_note}\n"
        f"{format_header()}"
    )
    topologies = parse_topologies(args.layouts)  # fail closed before anything runs
    if args.no_forms and not topologies:
        raise ValueError("--no-forms measures only the --layouts rows: name at least one, e.g. --layouts cp4 cp4/bp8")
    check_layouts(topologies, args.seq_lens, args.block_sizes)
    check_clean_kernels(args.layout_clean, device, "--layout-clean")
    measured: list[KernelRecord] = []

    def progress(record: KernelRecord) -> None:
        """Print each row as it is measured and keep --json current: a run cut short by a time limit
        (``make gpu-check``'s kernels stage) still leaves every finished row."""
        print(format_row(record), flush=True)
        if record.top_kernels:
            print(format_profile(StepProfile(record.launches, record.top_kernels, record.busy_ms, record.wall_ms,
                                             record.issue_ms, record.syncs, record.attention_ms)), flush=True)
        measured.append(record)
        if args.json is not None:
            write_json_atomic(args.json, records_as_dicts(measured))

    records = run_kernel_bench(
        args.seq_lens,
        args.block_sizes,
        args.backends,
        device=str(device),
        dtype=dtype,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        warmup=args.warmup,
        repeats=args.repeats,
        count_ops=not args.no_op_count,
        clock=args.clock,
        diagonals=tuple(args.diagonals),
        clean_kernels=tuple(args.clean_kernels),
        flex_backward=args.flex_backward,
        primary_first=args.primary_first,
        profile_top=args.profile_top,
        profile_seq_lens=None if args.profile_seq_lens is None else tuple(args.profile_seq_lens),
        progress=progress,
        header=header,
        forms=not args.no_forms,
    )
    if topologies:
        print("the busiest rank of each layout (--layouts): its attention through its transport on this device, "
              "the ring's collectives replaced by local copies; x dense: against dense SDPA over the rank's "
              "query rows x the key rows its partials read", flush=True)
        records += run_rank_rows(
            args.seq_lens, args.block_sizes, [resolve_backend(check_backend(name), device) for name in args.backends],
            topologies, device=device, dtype=dtype, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
            head_dim=args.head_dim, warmup=args.warmup, repeats=args.repeats, clock=args.clock,
            clean_kernels=args.layout_clean, transports=args.layout_transports, flex_backward=args.flex_backward,
            progress=progress,
        )
    if noisy_records(records):
        print(NOISE_NOTE)
    verdicts = format_verdicts(shape_verdicts(records_as_dicts(records)))
    if verdicts:
        print(verdicts)
    if topologies:  # each layout's fastest kernel and transport, against the CUDA target
        print(summarize_rank_rows(records_as_dicts(records)))
    if args.json is not None:
        print(f"wrote {args.json}")
    png = args.png if args.png is not None else (args.json.with_suffix(".png") if args.json is not None else None)
    if png is not None:
        plot_rates(records, png)
        print(f"wrote {png}")
    return 0
