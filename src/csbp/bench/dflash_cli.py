"""``csbp bench dflash``'s command line: its options and the command that runs the drafter steps
(``csbp.bench.dflash_bench``) or, with ``--target-pass``, the target pass alone
(``csbp.bench.dflash_target``), or, with ``--teacher-rows``, the KL teacher rows the ring exchanges
(``csbp.bench.dflash_teacher``)."""

from __future__ import annotations

import argparse

from csbp.bench.common import (
    BENCH_DTYPES,
    LAYOUTS,
    add_head_options,
    add_layout_options,
    add_model_width_options,
    add_output_options,
    add_overlap_ablation_option,
    check_device_option,
    check_head_options,
    write_outputs,
)
from csbp.bench.dflash_bench import GATHER_LAYOUTS, TARGET_CAPTURE_CHOICES, format_table, run_dflash_bench
from csbp.bench.dflash_target import run_target_pass_command
from csbp.bench.dflash_teacher import run_teacher_rows_command
from csbp.cli.options import positive_int
from csbp.wording import counted


def register_dflash_bench(kinds: argparse._SubParsersAction) -> None:
    """Add ``csbp bench dflash`` to the ``csbp bench`` sub-subcommands."""
    bench = kinds.add_parser("dflash", help="CP-only vs BP-only vs CSBP DFlash drafter training steps")
    add_layout_options(
        bench, seq_lens=[1024, 2048, 4096, 8192], csbp_cp_help="CP degree of CSBP (default nproc)",
        layouts=LAYOUTS,  # cp-aware: CP-only with the context exchange (differs from cp with --doc-length)
        extra_layouts=tuple(GATHER_LAYOUTS),
    )
    bench.set_defaults(layouts=["cp", "bp", "csbp"])
    bench.add_argument("--anchors", type=positive_int, nargs="+", default=[16, 64], help="anchor blocks per sample")
    bench.add_argument("--csbp-bp", type=positive_int, default=None, help="BP degree of CSBP (default nproc)")
    bench.add_argument("--samples", type=positive_int, default=None, help="samples per step (default: the largest dp)")
    bench.add_argument(
        "--doc-length", type=positive_int, default=None,
        help="pack random documents of this mean length (default: one document per row); CSBP and cp-aware "
        "then exchange only the context rows an anchor may see",
    )
    bench.add_argument(
        "--sliding-window", type=positive_int, default=None, metavar="W",
        help="every draft layer slides with window W (default: full attention); CSBP then exchanges only "
        "its anchors' window rows, also with one document per row (compare layout csbp-gather, the all-gather)",
    )
    add_model_width_options(bench, vocab_size=1024, intermediate_size=384)
    bench.add_argument("--num-target-layers", type=positive_int, default=2)
    bench.add_argument("--num-draft-layers", type=positive_int, default=1)
    add_head_options(bench)
    bench.add_argument("--dtype", choices=tuple(BENCH_DTYPES), default="float32")
    add_overlap_ablation_option(bench)
    bench.add_argument(
        "--target-capture", choices=TARGET_CAPTURE_CHOICES, default="offline",
        help="the target features of each step: offline (captured before the timer, default) or the step's "
        "online frozen-target pass inside the timer, sharded over the CP ring or replicated on every rank "
        "(objective.dflash.target_capture)",
    )
    bench.add_argument(
        "--target-pass", action="store_true",
        help="instead: the online target pass per rank, replicated vs context-sharded (csbp.bench.dflash_target)",
    )
    bench.add_argument(
        "--teacher-rows", action="store_true",
        help="instead: the KL teacher rows of the last hidden state each ring member sends under the sharded "
        "target pass, CP-only and CSBP (bp = nproc), against the all-gather (csbp.bench.dflash_teacher)",
    )
    add_output_options(bench, png_help="speedup plot (default: --json with suffix .png)")
    bench.set_defaults(func=run_dflash_bench_command)


def run_dflash_bench_command(args: argparse.Namespace) -> int:
    check_head_options(args)  # before anything is printed or launched
    check_device_option(args)
    if args.target_pass and args.teacher_rows:
        raise SystemExit("csbp bench dflash: --target-pass and --teacher-rows are two separate benchmarks; pass one")
    if args.target_pass:
        return run_target_pass_command(args)
    if args.teacher_rows:
        return run_teacher_rows_command(args)
    header = (
        f"csbp bench dflash: nproc={args.nproc} block={args.block_size} drafter={args.num_draft_layers}x"
        f"{args.hidden_size} heads={args.num_heads}/{args.num_kv_heads}x{args.head_dim} "
        f"vocab={args.vocab_size} {args.dtype} doc_length={args.doc_length} sliding_window={args.sliding_window} "
        f"(random tokens, 1 thread per "
        f"process, median of {counted(args.repeats, 'repeat')}, ± half their range; bytes: step "
        f"{args.warmup + args.repeats - 1}, the last)"
        + (f" target_capture={args.target_capture} (online, timed)" if args.target_capture != "offline" else "")
    )
    records = run_dflash_bench(
        args.seq_lens,
        args.anchors,
        header=header,
        layouts=args.layouts,
        nproc=args.nproc,
        csbp_cp=args.csbp_cp,
        csbp_bp=args.csbp_bp,
        samples=args.samples,
        progress=True,
        device=args.device,
        block_size=args.block_size,
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_target_layers=args.num_target_layers,
        num_draft_layers=args.num_draft_layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        warmup=args.warmup,
        repeats=args.repeats,
        doc_length=args.doc_length,
        sliding_window=args.sliding_window,
        ablate_overlap=args.ablate_overlap,
        target_capture=args.target_capture,
    )
    write_outputs(
        format_table(records), records, args, plot_group_by="anchors", plot_title="csbp bench dflash"
    )
    return 0
