"""``csbp bench attention|train|dflash|kernels``: side-by-side benchmarks, one command each.

Examples::

    csbp bench attention                                   # 1K..16K, block 16, 4 processes
    csbp bench attention --seq-lens 2048 8192 --window 256 --json attn.json
    csbp bench kernels --device cuda --seq-lens 8192 131072    # one layer's kernels per backend

Each benchmark runs every layout in the same invocation and prints ratios to CP-only, so the
numbers compare layouts on one machine state rather than across runs. The subcommands live next
to their benchmarks (``csbp.bench.attention``, ``csbp.bench.train_bench``,
``csbp.bench.dflash_cli``); their shared options and outputs are in ``csbp.bench.common``.
"""

from __future__ import annotations

import argparse

from csbp.bench.attention import register_attention_bench
from csbp.bench.dflash_cli import register_dflash_bench
from csbp.bench.kernels_cli import register_kernel_bench
from csbp.bench.train_cli import register_train_bench


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="benchmark parallel layouts side by side")
    kinds = parser.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    register_attention_bench(kinds)
    register_train_bench(kinds)
    register_dflash_bench(kinds)
    register_kernel_bench(kinds)
