"""``csbp compare CONFIG``: quality at equal wall-clock, one run per layout and round.

Examples::

    csbp compare dflash-demo --layouts cp,csbp --budget-s 120 --nproc 4
    csbp compare demo --layouts cp,csbp --budget-s 300 --points 6 --out runs/compare-demo
    csbp compare demo --layouts cp,csbp --budget-s 300 --out runs/compare-demo --resume
    csbp compare demo --layouts cp,csbp --budget-s 60 --repeats 4 --out runs/compare-demo-r4

Trains the run once per layout (same seed, data order, model, hyperparameters and global batch)
for ``--budget-s`` seconds of training on the same processes, one layout after the other, and
evaluates each at ``--points`` equal time points: by default validation loss for diffusion and AR
objectives, the acceptance length of lossless speculative decoding for DFlash drafters; ``--metric``
picks any other validation metric the run logs (``nelbo``, the unclipped NELBO logged as
``val_nelbo``, ``ppl_bound``, ``tau_mean``, ...; an unknown name fails before training with the
valid ones). ``--repeats R`` runs R rounds of every layout, each round with its own seed
(``run.seed + r - 1``, the same for every layout of the round) and the layout order rotated, and
reports the spread over rounds and the paired differences with a verdict only where the rounds
agree (:mod:`csbp.compare.rounds`, :mod:`csbp.compare.stats`). Prints a table and writes
``OUT/compare.json`` and ``OUT/compare.png``. Interrupted comparisons continue with ``--resume``.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from csbp.compare import CompareOptions

Results = list[dict[str, Any]]


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
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=1,
        help="rounds of every layout, each with its own seed and a rotated layout order (default 1)",
    )
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
    from csbp.compare.runner import metric_of
    from csbp.recipes import load_run_config
    from csbp.wording import counted

    cfg = load_run_config(args.config, args.overrides)
    options = CompareOptions(
        layouts=tuple(name.strip() for name in args.layouts.split(",") if name.strip()),
        budget_s=args.budget_s,
        nproc=args.nproc if args.nproc is not None else cfg.world_size,
        out_dir=args.out if args.out is not None else Path("runs") / f"compare-{cfg.run.name}",
        points=args.points,
        resume=args.resume,
        metric=args.metric,
        repeats=args.repeats,
    )
    metric, higher = metric_of(cfg, options.metric)

    def header() -> None:  # once every layout is checked: a refusal stays one line
        print(
            f"csbp compare: {cfg.run.name} ({cfg.objective.name}), layouts {', '.join(options.layouts)}, "
            f"{options.budget_s:g} s each on {counted(options.nproc, 'process', 'processes')}, "
            f"{counted(options.points, 'point')}"
            + (f", {options.repeats} rounds" if options.repeats > 1 else "")
            + f", out {options.out_dir}",
            flush=True,
        )

    results = run_compare(cfg, options, announce=header)
    common = {
        "run": cfg.run.name,
        "objective": cfg.objective.name,
        "metric": metric,
        "higher_is_better": higher,
        "budget_s": options.budget_s,
        "points": options.points,
        "nproc": options.nproc,
        "repeats": options.repeats,
    }
    clock = (
        "sum of training-step seconds (slowest rank), the first step's warm-up included; process start-up, "
        "evaluations, checkpoints and the final export excluded"
    )
    title = f"{cfg.run.name}: {metric} at equal wall-clock"
    if options.repeats == 1:
        text, json_path, png_path = _one_round(results, options, common, clock, title, metric, higher)
    else:
        text, json_path, png_path = _rounds(results, options, common, clock, title, metric, higher)
    print(text)
    notes = _notes(results, options, cfg.train.max_steps, compiled=cfg.train.compile != "none")
    for note in notes:
        print(note)
    print(f"wrote {json_path} and {png_path}")
    return 0


def _one_round(
    results: Results, options: CompareOptions, common: dict[str, Any], clock: str, title: str, metric: str, higher: bool
) -> tuple[str, Path, Path]:
    """Without ``--repeats``: one run per layout, the table of :mod:`csbp.compare.report`."""
    from csbp.compare.report import format_table, plot_compare, write_json

    payload = {**common, "clock": clock + "; one run per layout (no error bar)", "layouts": results}
    json_path = write_json(options.out_dir / "compare.json", payload)
    png_path = plot_compare(results, options.out_dir / "compare.png", metric=metric, title=title)
    return format_table(results, metric=metric, higher_is_better=higher), json_path, png_path


def _rounds(
    results: Results, options: CompareOptions, common: dict[str, Any], clock: str, title: str, metric: str, higher: bool
) -> tuple[str, Path, Path]:
    """``--repeats`` > 1: every round in ``compare.json``, the spread and paired differences."""
    from csbp.compare.report import write_json
    from csbp.compare.report_rounds import format_rounds_table, group_rounds, plot_rounds, summarize_rounds
    from csbp.compare.rounds import round_order

    rounds = group_rounds(results)
    summary = summarize_rounds(rounds)
    payload = {
        **common,
        "clock": clock + f"; {options.repeats} rounds, each layout once per round",
        "rounds": [
            {"round": index + 1, "seed": runs[0].get("seed"), "order": list(round_order(options.layouts, index)),
             "layouts": runs}
            for index, runs in enumerate(rounds)
        ],
        "summary": summary,
    }
    json_path = write_json(options.out_dir / "compare.json", payload)
    png_path = plot_rounds(rounds, summary, options.out_dir / "compare.png", metric=metric, title=title)
    return format_rounds_table(rounds, summary, metric=metric, higher_is_better=higher), json_path, png_path


def _notes(results: Results, options: CompareOptions, max_steps: int, *, compiled: bool = False) -> list[str]:
    """The budget notes of every round (prefixed with the round when there are several) and the
    order-balance note."""
    from csbp.compare.report import budget_notes
    from csbp.compare.report_rounds import group_rounds
    from csbp.compare.rounds import balance_note

    notes = []
    for index, runs in enumerate(group_rounds(results)):
        prefix = f"round {index + 1}: " if options.repeats > 1 else ""
        notes += [prefix + note for note in budget_notes(runs, budget_s=options.budget_s, max_steps=max_steps)]
    balance = balance_note(options.layouts, options.repeats, compiled=compiled)
    return notes + ([balance] if balance else [])
