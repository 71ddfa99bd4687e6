"""``csbp compare CONFIG``: quality at equal wall-clock, one run per layout.

Examples::

    csbp compare dflash-demo --layouts cp,csbp --budget-s 120 --nproc 4
    csbp compare demo --layouts cp,csbp --budget-s 300 --points 6 --out runs/compare-demo
    csbp compare demo --layouts cp,csbp --budget-s 300 --out runs/compare-demo --resume

Trains the run once per layout (same seed, data order, model, hyperparameters and global batch)
for ``--budget-s`` seconds of training on the same processes, one layout after the other, and
evaluates each at ``--points`` equal time points: by default validation loss for diffusion and AR
objectives, the acceptance length of lossless speculative decoding for DFlash drafters; ``--metric``
picks any other validation metric the run logs (``nelbo``, the unclipped NELBO logged as
``val_nelbo``, ``ppl_bound``, ``tau_mean``, ...; an unknown name fails before training with the
valid ones). Prints a table and writes
``OUT/compare.json`` and ``OUT/compare.png``. Interrupted comparisons continue with ``--resume``.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    from csbp.cli.config_cmd import add_override_argument
    from csbp.cli.options import positive_float, positive_int

    parser = subparsers.add_parser(
        "compare",
        help="train a run once per layout for the same wall-clock budget and compare quality",
        description="Quality at equal wall-clock: the same run in several layouts, evaluated at equal time points.",
    )
    parser.add_argument("config", metavar="CONFIG", help="YAML config file, or a packaged recipe name")
    add_override_argument(parser)
    parser.add_argument(
        "--layouts", default="cp,csbp", help="comma-separated layouts from data, cp, bp, csbp (default cp,csbp)"
    )
    parser.add_argument("--budget-s", type=positive_float, required=True, help="training seconds per layout")
    parser.add_argument("--points", type=positive_int, default=5, help="equal time intervals to evaluate at (default 5)")
    parser.add_argument("--nproc", type=positive_int, default=None, help="processes (default: the run's world size)")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default runs/compare-<run.name>)")
    parser.add_argument("--resume", action="store_true", help="continue an interrupted comparison in --out")
    parser.add_argument(
        "--metric",
        default=None,
        help="validation metric to compare, e.g. nelbo (default: val_loss; acceptance_length for DFlash)",
    )
    parser.set_defaults(func=run_compare_command)


def run_compare_command(args: argparse.Namespace) -> int:
    from csbp.compare import CompareOptions, run_compare
    from csbp.compare.report import budget_notes, format_table, plot_compare, write_json
    from csbp.compare.runner import metric_of
    from csbp.recipes import load_run_config

    cfg = load_run_config(args.config, args.overrides)
    options = CompareOptions(
        layouts=tuple(name.strip() for name in args.layouts.split(",") if name.strip()),
        budget_s=args.budget_s,
        nproc=args.nproc if args.nproc is not None else cfg.world_size,
        out_dir=args.out if args.out is not None else Path("runs") / f"compare-{cfg.run.name}",
        points=args.points,
        resume=args.resume,
        metric=args.metric,
    )
    metric, higher = metric_of(cfg, options.metric)
    print(
        f"csbp compare: {cfg.run.name} ({cfg.objective.name}), layouts {', '.join(options.layouts)}, "
        f"{options.budget_s:g} s each on {options.nproc} processes, {options.points} points, out {options.out_dir}",
        flush=True,
    )
    results = run_compare(cfg, options)
    payload = {
        "run": cfg.run.name,
        "objective": cfg.objective.name,
        "metric": metric,
        "higher_is_better": higher,
        "budget_s": options.budget_s,
        "points": options.points,
        "nproc": options.nproc,
        "clock": (
            "sum of training-step seconds (slowest rank), the first step's warm-up included; process start-up, "
            "evaluations, checkpoints and the final export excluded; one run per layout (no error bar)"
        ),
        "layouts": results,
    }
    json_path = write_json(options.out_dir / "compare.json", payload)
    png_path = plot_compare(
        results, options.out_dir / "compare.png", metric=metric, title=f"{cfg.run.name}: {metric} at equal wall-clock"
    )
    print(format_table(results, metric=metric, higher_is_better=higher))
    for note in budget_notes(results, budget_s=options.budget_s, max_steps=cfg.train.max_steps):
        print(note)
    print(f"wrote {json_path} and {png_path}")
    return 0
