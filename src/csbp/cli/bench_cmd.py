"""``csbp bench attention|train|dflash``: side-by-side layout benchmarks, one command each.

Examples::

    csbp bench attention                                   # 1K..16K, block 16, 4 processes
    csbp bench attention --seq-lens 2048 8192 --window 256 --json attn.json

Each benchmark runs every layout in the same invocation and prints ratios to CP-only, so the
numbers compare layouts on one machine state rather than across runs.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="benchmark parallel layouts side by side")
    kinds = parser.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    attn = kinds.add_parser("attention", help="CP-only vs BP-only vs CSBP attention (fwd+bwd)")
    attn.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    attn.add_argument("--block-size", type=int, default=16)
    attn.add_argument("--nproc", type=int, default=4)
    attn.add_argument("--csbp-cp", type=int, default=None, help="CP degree of the CSBP layout (default nproc)")
    attn.add_argument("--layouts", nargs="+", default=["cp", "bp", "csbp"], choices=["cp", "bp", "csbp"])
    attn.add_argument("--transport", choices=("collective", "streaming"), default="collective")
    attn.add_argument("--window", type=int, default=None, help="sliding window W (tokens)")
    attn.add_argument("--num-heads", type=int, default=4)
    attn.add_argument("--num-kv-heads", type=int, default=2)
    attn.add_argument("--head-dim", type=int, default=32)
    attn.add_argument("--num-layers", type=int, default=1)
    attn.add_argument("--repeats", type=int, default=3)
    attn.add_argument("--warmup", type=int, default=1)
    attn.add_argument("--json", type=Path, default=None, help="write the records to this JSON file")
    attn.set_defaults(func=run_attention)

    # lazy: these modules import write_json_atomic from this one
    from csbp.bench.dflash_bench import register_dflash_bench
    from csbp.bench.train_bench import register_train_bench

    register_train_bench(kinds)
    register_dflash_bench(kinds)


def write_json_atomic(path: Path, payload: object) -> None:
    """Write JSON through a temporary file and ``os.replace`` (never a half-written artifact)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, path)


def run_attention(args: argparse.Namespace) -> int:
    from csbp.bench.attention import format_table, records_as_dicts, run_attention_bench

    print(
        f"csbp bench attention: nproc={args.nproc} block={args.block_size} heads={args.num_heads}/"
        f"{args.num_kv_heads}x{args.head_dim} layers={args.num_layers} window={args.window} "
        f"transport={args.transport} (1 thread per process, median of {args.repeats})",
        flush=True,
    )
    records = run_attention_bench(
        args.seq_lens,
        nproc=args.nproc,
        layouts=args.layouts,
        csbp_cp=args.csbp_cp,
        block_size=args.block_size,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        num_layers=args.num_layers,
        window=args.window,
        transport=args.transport,
        warmup=args.warmup,
        repeats=args.repeats,
    )
    print(format_table(records))
    if args.json is not None:
        write_json_atomic(args.json, records_as_dicts(records))
        print(f"wrote {args.json}")
    return 0
