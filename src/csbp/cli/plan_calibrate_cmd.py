"""``csbp plan calibrate``: fit the cost model's efficiency factors (``csbp.plan.fit``) to your own
``csbp bench attention|train|dflash --json`` records, or refit the packaged GPU calibration on the
published CSBP runs, and write them as a calibration JSON for ``csbp plan --calibration``.

Usage::

    csbp bench train --seq-lens 512 1024 2048 --json bench.json
    csbp plan calibrate bench.json --out cal.json && csbp plan ... --gpu cpu --calibration cal.json
    csbp plan calibrate --published --out published.json    # refit the packaged GPU calibration
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from csbp.cli.options import output_file, path_option, positive_int
from csbp.plan.calibration import save_calibration


def register_calibrate(sub: argparse._SubParsersAction) -> None:
    """Add ``calibrate`` to ``csbp plan``'s subcommands."""
    calibrate = sub.add_parser("calibrate", help="fit the cost model's efficiency factors to benchmark JSON")
    calibrate.add_argument(
        "bench",
        nargs="*",
        type=path_option,
        metavar="BENCH.json",
        help="`csbp bench attention|train|dflash --json` output files",
    )
    calibrate.add_argument(
        "--published",
        action="store_true",
        help="fit on the packaged published CSBP runs (fit: true points) instead",
    )
    calibrate.add_argument("--out", type=output_file, required=True, help="calibration JSON to write")
    calibrate.add_argument(
        "--fit-max-len",
        type=positive_int,
        default=None,
        metavar="L",
        help="fit only records with seq_len <= L; longer ones are predicted (held out); BENCH.json only",
    )
    calibrate.add_argument(
        "--timing",
        choices=("fastest", "median"),
        default=None,
        help="a layout's step time: its fastest repeat (default; robust to other load) or the median; "
        "BENCH.json only",
    )
    calibrate.set_defaults(func=run_calibrate)


def _held_notes(observations: list[Any], fitted: list[Any], one_document: bool, limit: int | None) -> list[str]:
    """Why records were held out (predicted, not fitted), and a factor no fitted record informs: the
    listing said only ``held``."""
    notes = []
    masked = [o for o in observations if o not in fitted and one_document and o.workload.doc_length]
    if masked:
        notes.append(
            f"note: {len(masked)} document-masked record(s) held: one-document records exist, and the kernels' speed per "
            "allowed pair differs under the document mask (docs/planning.md); calibrate on them alone to fit masked runs"
        )
    longer = [o for o in observations if o not in fitted and o not in masked]
    if longer:
        notes.append(f"note: {len(longer)} record(s) longer than --fit-max-len {limit} held")
    if any(o.workload.objective.is_drafter for o in observations) and not any(o.workload.objective.is_drafter for o in fitted):
        notes.append("note: drafter_eff keeps its prior: no drafter record was fitted")
    return notes


def run_calibrate(args: argparse.Namespace) -> int:
    from csbp.plan.fit import Observation, bench_observations, fit_bench, fit_published

    if args.published == bool(args.bench):
        raise ValueError("csbp plan calibrate takes BENCH.json files or --published (one of the two)")
    for flag, value in (("--fit-max-len", args.fit_max_len), ("--timing", args.timing)):
        if args.published and value is not None:  # the published runs are fitted whole, on their own times
            raise ValueError(f"{flag} {value}: applies to BENCH.json records, but --published fits on the packaged "
                             f"runs (fix: drop {flag}, or pass BENCH.json files instead of --published)")
    if args.published:
        cal = fit_published()
    else:
        skipped: list[str] = []
        observations = bench_observations(args.bench, fastest=args.timing != "median", skipped=skipped)
        if skipped:
            compiled = f"{len(skipped)} compiled record(s) (bench train --compile layers, first {skipped[0]})"
            if not observations:
                raise ValueError(f"{compiled} and no eager one: the cost model describes eager steps (fix: rerun "
                                 "the benchmark with --compile none, its default)")
            print(f"note: left out {compiled}: the cost model describes eager steps; fitted on the eager records")
        limit = args.fit_max_len
        # Document-masked records are predicted, not fitted, when one-document records exist: the
        # kernels' speed per allowed pair differs under the document mask (docs/planning.md, --doc-length).
        one_document = any(o.workload.doc_length is None for o in observations)

        def fits(obs: Observation) -> bool:
            return (limit is None or obs.seq_len <= limit) and not (one_document and obs.workload.doc_length)

        fitted = [o for o in observations if fits(o)]
        if not fitted:
            shortest = min(o.seq_len for o in observations if not (one_document and o.workload.doc_length))
            raise ValueError(f"--fit-max-len {limit} leaves no benchmark record to fit on (fix: --fit-max-len >= "
                             f"{shortest}, the shortest fitted record's seq_len, or drop it)")
        cal = fit_bench(
            fitted,
            source=f"fitted on {', '.join(str(p) for p in args.bench)}"
            + (f" (seq_len <= {limit})" if limit is not None else ""),
        )
        for obs in observations:
            value = obs.predicted(cal)
            tag = "fit " if fits(obs) else "held"
            print(
                f"  {tag} {obs.label:<40} measured {obs.value:>10.4g}  model {value:>10.4g}  "
                f"({value / obs.value - 1:+.0%})"
            )
        for line in _held_notes(observations, fitted, one_document, limit):
            print(line)
    save_calibration(cal, args.out)
    print(json.dumps({k: round(v, 4) for k, v in cal.to_json().items() if isinstance(v, float)}))
    print(f"wrote {args.out}")
    return 0
