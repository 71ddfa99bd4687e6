"""``csbp bench train``'s command line: its options and the command that runs the training steps of every
layout side by side (``csbp.bench.train_bench``) and writes the tables (``csbp.bench.train_tables``)."""

from __future__ import annotations

import argparse

from csbp.attention.backends import check_backend_trains_on
from csbp.attention.diagonal import check_diagonal_backend
from csbp.bench.common import (
    BALANCED_LAYOUTS,
    BENCH_DTYPES,
    add_head_options,
    add_layout_options,
    add_model_width_options,
    add_output_options,
    add_transport_option,
    check_device_option,
    check_head_options,
    write_outputs,
)
from csbp.bench.train_bench import TRAIN_BENCH_OBJECTIVES, run_train_bench
from csbp.bench.train_tables import format_table
from csbp.cli.options import add_clean_option, add_diagonal_option, positive_int
from csbp.training.activation_checkpointing import ACTIVATION_CHECKPOINTING_MODES
from csbp.training.compile_regions import COMPILE_MODES, check_compile_runs_on
from csbp.wording import counted


def register_train_bench(kinds: argparse._SubParsersAction) -> None:
    """Add ``csbp bench train`` to the ``csbp bench`` sub-subcommands."""
    train = kinds.add_parser(
        "train", help="CP-only vs BP-only vs CSBP full training steps (bd3, fast_dllm_v2)"
    )
    add_layout_options(
        train, seq_lens=[512, 1024, 2048, 4096], csbp_cp_help="CP degree of the CSBP layout (default nproc)",
        extra_layouts=BALANCED_LAYOUTS,
    )
    train.add_argument(
        "--objectives", nargs="+", default=list(TRAIN_BENCH_OBJECTIVES), choices=TRAIN_BENCH_OBJECTIVES
    )
    add_transport_option(train)
    train.add_argument(
        "--backend", choices=("auto", "tiles", "flex"), default="auto",
        help="attention backend, the run config's attention.backend (auto: flex on CUDA, tiles on CPU)",
    )
    add_diagonal_option(train)
    add_clean_option(train)
    train.add_argument("--samples", type=positive_int, default=1, help="samples per step")
    add_model_width_options(train, vocab_size=512, intermediate_size=256)
    train.add_argument("--num-layers", type=positive_int, default=2)
    add_head_options(train)
    train.add_argument("--dtype", choices=tuple(BENCH_DTYPES), default="float32")
    train.add_argument(
        "--activation-checkpointing",
        nargs="+",
        choices=ACTIVATION_CHECKPOINTING_MODES,
        default=["none"],
        help="modes to run every layout in; `none full` reports the peak-memory cut per rank",
    )
    train.add_argument(
        "--compile",
        nargs="+",
        choices=COMPILE_MODES,
        default=["none"],
        help="train.compile modes to run every layout in (layers: regional torch.compile, compiled in the "
        "untimed warmup step); `none layers` reports the step time of each",
    )
    add_output_options(train, png_help="speedup plot (default: next to --json, with suffix .png)")
    train.set_defaults(func=run_train_bench_command)


def run_train_bench_command(args: argparse.Namespace) -> int:
    check_head_options(args)  # before anything is printed or launched
    check_device_option(args)
    check_diagonal_backend(
        args.diagonal, check_backend_trains_on(args.backend, args.device, where="--backend"), where="--diagonal"
    )
    for mode in args.compile:
        check_compile_runs_on(mode, args.device, where="--compile")
    header = (
        f"csbp bench train: objectives={','.join(args.objectives)} nproc={args.nproc} block={args.block_size} "
        f"backend={args.backend} diagonal={args.diagonal} clean={args.clean} "
        f"model={args.num_layers}x{args.hidden_size} heads={args.num_heads}/{args.num_kv_heads}x{args.head_dim} "
        f"vocab={args.vocab_size} {args.dtype} doc_length={args.doc_length} (random tokens, 1 thread per process, "
        f"median of {counted(args.repeats, 'repeat')}, ± half their range; bytes: step {args.warmup + args.repeats - 1}, the last)"
    )
    records = run_train_bench(
        args.seq_lens,
        header=header,
        objectives=args.objectives,
        layouts=args.layouts,
        nproc=args.nproc,
        csbp_cp=args.csbp_cp,
        progress=True,
        device=args.device,
        block_size=args.block_size,
        transport=args.transport,
        backend=args.backend,
        diagonal=args.diagonal,
        clean=args.clean,
        doc_length=args.doc_length,
        samples=args.samples,
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        activation_checkpointing=tuple(args.activation_checkpointing),
        compile=tuple(args.compile),
        warmup=args.warmup,
        repeats=args.repeats,
    )
    first_mode, first_compile = args.activation_checkpointing[0], args.compile[0]
    write_outputs(
        format_table(records),
        records,
        args,
        plot_group_by="objective",
        plot_title="csbp bench train",
        plot_records=[r for r in records if r.activation_checkpointing == first_mode and r.compile == first_compile],
    )
    return 0
