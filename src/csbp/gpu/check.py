"""``make gpu-check`` (``python -m csbp.gpu.check``): the one-command device check.

Runs a list of stages on the visible GPUs within a total time budget (default 540 s from the
process's start; with the watchdog's 10 s grace the check ends within 9.2 minutes of wall time,
which leaves a 15-minute device lease the machine's start and one rerun of a stage), prints one
summary table and keeps ``gpu-check.json`` current while it runs (``csbp.gpu.report``):

==================  =========================================================================
stage               what it runs (limit)
==================  =========================================================================
``cuda-tests``      ``pytest -m cuda tests`` (220 s): kernels and transports on CUDA against the
                    CPU float64 reference, bf16 tolerances, a training step of every objective on
                    one GPU over NCCL (world size 1), activation checkpointing, a DFlash drafter
                    step, ``csbp eval`` and packed documents on CUDA, no host sync inside a
                    layer's attention; pass/fail/skip counts and the slowest tests, also when cut
                    short
``verify``          ``csbp verify --device cuda --nproc <min(GPUs, 4)>`` (skipped with < 2 GPUs)
``verify-dflash``   the same for DFlash drafter training
``kernels``         ``csbp bench kernels`` on CUDA (150 s): one layer's attention (flex backend, bf16,
                    16/4 heads of 128, B = 16 and 128) at 16K, 128K, 64K, 32K and 8K tokens: first, at every
                    length, dense attention, the mixed forms and the decomposed form with cuDNN clean
                    pieces and the noisy blocks as one batched FlashAttention call (sdpa) or folded
                    into the pieces' Flex residual (flex); then the other decomposed forms
                    (FlashAttention-2 pieces; the clean context as one Flex partial) as time allows;
                    writes ``gpu-kernels.json`` next to
                    ``gpu-check.json`` row by row, and the stage copies the rows measured (all of
                    them, or those before its limit) into the report, with the kernel targets'
                    worst values (``csbp.bench.kernel_summary``; ``~`` where within the repeats' noise)
``layouts``         ``csbp bench kernels --layouts`` on CUDA (60 s): the busiest rank of CSBP cp4/bp8,
                    CP-only cp4 and BP-only bp4 at 64K, B = 128, through its transport, against
                    dense SDPA over its shapes; writes ``gpu-layouts.json``
``train-table``     the single-GPU training table (``csbp.gpu.train_table``, the time left):
                    Qwen3-0.6B shape, BD3, bf16, activation checkpointing, ``--backend`` (default
                    auto: flex on CUDA), 8K-64K tokens; DFlash at 64K, 512 anchors; the median of
                    ``--repeats`` timed steps and their spread (``±``); each row, every timed step
                    included, is in ``gpu-check.json`` as soon as it is measured
==================  =========================================================================

``--dry-run-cpu`` runs every stage on the CPU at tiny sizes instead (``csbp.gpu.profile``: the
CUDA test bodies with ``CSBP_CUDA_TESTS_DEVICE=cpu``, a stand-in of 2 GPUs for the verify stages,
the kernel benchmark on tiles, a two-layer training table), in about half a minute: it tests the
check's own code where no GPU is lent, and measures nothing.

Extending it: append a ``Stage`` to ``STAGES`` (before ``train-table``, which takes the time that
is left). A stage is a name, a one-line help and ``run(env) -> StageResult``; ``command_stage``
builds one from a command line (e.g. ``csbp bench ...``), so a new benchmark is one entry (both are
in ``csbp.gpu.stage``).

Without CUDA it prints one line saying so and exits 0; with a dependency missing (a device
image's Python without pydantic) one line saying how to bring it and exits 2
(``csbp.gpu.preflight``). The exit status is 1 when a stage failed.
"""

from __future__ import annotations

import time

STARTED = time.perf_counter()  # the budget counts from here, before torch's import

import sys  # noqa: E402

from csbp.gpu.preflight import report_missing  # noqa: E402 - standard library only

if __name__ == "__main__" and (_status := report_missing()) is not None:
    sys.exit(_status)  # before importing torch: a missing torch gets the same one line

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from csbp.attention.flex_backward import FLEX_BACKWARDS, resolve_flex_backward, set_flex_backward  # noqa: E402
from csbp.bench.kernel_summary import summarize_kernel_rows, summarize_rank_rows  # noqa: E402
from csbp.gpu.flops import gpu_bf16_peak_tflops  # noqa: E402
from csbp.gpu.profile import CPU_DRY_RUN, CUDA, CheckProfile  # noqa: E402
from csbp.gpu.report import CheckReport, StageResult, start_watchdog  # noqa: E402
from csbp.gpu.stage import CheckEnv, Stage, command_stage  # noqa: E402

DEFAULT_BUDGET_S = 540.0  # 480 until the layouts stage's 60 s: the training table keeps >= 95 s
WATCHDOG_GRACE_S = 10.0
"""Seconds past the budget before the watchdog ends the process (command stages end by the budget)."""
TRAIN_TABLE_RESERVE_S = 15.0
"""Seconds of the total budget kept back from the training table for writing the outputs."""


def _cuda_tests(env: CheckEnv) -> list[str] | str:
    if not (env.repo / "tests").is_dir():
        return f"no tests/ directory under {env.repo} (run from a csbp checkout)"
    # -vv with the project's addopts (-q): one line per test, so a run cut short still says what passed;
    # a test module that does not import on the device image must not stop the CUDA tests of the others
    # no log capture: torch's compile-time DEBUG records buried the failures' tracebacks (first H200 run)
    return [sys.executable, "-m", "pytest", "-m", "cuda", "-p", "no:cacheprovider", "-p", "no:logging", "-vv",
            "--tb=short", "--durations=15",
            "--continue-on-collection-errors", *env.profile.cuda_tests]


_PYTEST_LINE = re.compile(r"^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b")


def pytest_counts(output: str) -> tuple[dict[str, int], list[str]]:
    """Outcome counts of a verbose pytest run's per-test lines, and the failed or erroring tests."""
    counts: dict[str, int] = {}
    failed: list[str] = []
    for line in output.splitlines():
        match = _PYTEST_LINE.match(line)
        if match:
            test, outcome = match.groups()
            counts[outcome.lower()] = counts.get(outcome.lower(), 0) + 1
            if outcome in ("FAILED", "ERROR"):
                failed.append(test)
    return counts, failed


def _cuda_tests_report(env: CheckEnv, result: StageResult, output: str) -> StageResult:
    counts, failed = pytest_counts(output)
    summary = result.summary
    if summary.startswith("timed out"):  # cut short: say how far it got
        ran = ", ".join(f"{n} {outcome}" for outcome, n in counts.items()) or "no test finished"
        summary = f"{summary}; {ran} before the limit"
    return dataclasses.replace(result, summary=summary, details={**result.details, "counts": counts, "failed": failed})


def _verify(objective: str) -> Callable[[CheckEnv], list[str] | str]:
    def argv(env: CheckEnv) -> list[str] | str:
        if env.gpus < 2:
            return f"needs at least 2 GPUs, {env.gpus} visible"
        nproc = min(env.gpus, 4)  # every layout of up to 4 ranks; more GPUs add launches, not coverage
        return [sys.executable, "-m", "csbp", "verify", "--device", env.profile.device, "--nproc", str(nproc),
                "--objective", objective, *env.profile.verify]

    return argv


def _kernels_json(env: CheckEnv) -> Path:
    return env.out_dir / "gpu-kernels.json"


def _layouts_json(env: CheckEnv) -> Path:
    return env.out_dir / "gpu-layouts.json"


def _bench_kernels(env: CheckEnv, options: Sequence[str], path: Path) -> list[str]:
    """``csbp bench kernels`` with ``options``, its rows kept in ``path`` as they are measured."""
    path.unlink(missing_ok=True)  # rows of an earlier run must not pass for this one's
    return [sys.executable, "-m", "csbp", "bench", "kernels", *options, "--json", str(path),
            "--flex-backward", env.args.flex_backward]


def _kernels(env: CheckEnv) -> list[str]:
    return _bench_kernels(env, env.profile.kernels, _kernels_json(env))


def _layouts(env: CheckEnv) -> list[str]:
    return _bench_kernels(env, env.profile.layouts, _layouts_json(env))


def _rows_report(result: StageResult, path: Path, summarize: Callable[[list[dict[str, object]]], str]) -> StageResult:
    """``result`` with the rows ``path`` holds (those measured before a cut-off too) and their summary."""
    rows = json.loads(path.read_text()) if path.exists() else []
    summary = summarize(rows)
    if result.status != "ok":
        summary = f"{result.summary}; {summary} before that"
    return dataclasses.replace(result, summary=summary, details={**result.details, "json": str(path), "rows": rows})


def _kernels_report(env: CheckEnv, result: StageResult, output: str) -> StageResult:
    targets = env.profile.device == "cuda"
    return _rows_report(result, _kernels_json(env), lambda rows: summarize_kernel_rows(rows, targets=targets))


def _layouts_report(env: CheckEnv, result: StageResult, output: str) -> StageResult:
    return _rows_report(result, _layouts_json(env), summarize_rank_rows)


def _train_table(env: CheckEnv) -> StageResult:
    # imported here, not at the top: the trainer needs pydantic, which the preflight checks first
    from csbp.attention.backends import resolve_backend
    from csbp.attention.diagonal import resolve_diagonal
    from csbp.gpu.train_table import TableConfig, TableRow, format_train_table, rows_as_dicts, run_train_table

    args = env.args
    budget = env.seconds_left() - TRAIN_TABLE_RESERVE_S
    if budget <= 0:
        return StageResult("train-table", "skipped", 0.0, "no time left in the budget")
    cfg = TableConfig(
        seq_lens=tuple(args.train_seq_lens),
        activation_checkpointing=args.activation_checkpointing,
        backend=args.backend,
        diagonal=args.diagonal,
        clean=args.clean,
        decomposed_seq_lens=tuple(args.decomposed_seq_lens),
        compiled_seq_lens=tuple(args.compiled_seq_lens),
        selective_seq_lens=tuple(args.selective_seq_lens),
        profile_seq_lens=tuple(args.profile_seq_lens),
        dflash_seq_len=args.dflash_seq_len or None,
        dflash_anchors=args.dflash_anchors,
        repeats=args.repeats,
        budget_s=budget,
        peak_tflops=env.peak_tflops,
    )
    cfg = dataclasses.replace(cfg, **env.profile.table)  # type: ignore[arg-type]
    device = torch.device("cuda", 0) if env.profile.device == "cuda" else torch.device(env.profile.device)
    start, measured_rows = time.perf_counter(), []

    def progress(row: TableRow) -> None:
        print("\n".join("   " + line for line in format_train_table([row]).splitlines()[2:]), flush=True)
        measured_rows.append(row)
        env.progress(rows=rows_as_dicts(measured_rows), table=format_train_table(measured_rows))

    rows = run_train_table(cfg, device, progress=progress)
    backend = resolve_backend(cfg.backend, device)
    diagonals = {name: resolve_diagonal(name, backend, cfg.block_size) for name in (cfg.diagonal, cfg.decomposed_diagonal)}
    measured = sum(row.status.startswith("ok") for row in rows)
    failed = any(row.status.startswith(("out of memory", "error")) for row in rows)
    return StageResult(
        "train-table", "failed" if failed else "ok", time.perf_counter() - start,
        f"{measured} of {len(rows)} rows measured ({backend} backend)",
        {"rows": rows_as_dicts(rows), "table": format_train_table(rows),
         "attention": {"backend": backend, "diagonal": diagonals[cfg.diagonal], "clean": cfg.clean},
         "decomposed_attention": {"diagonal": diagonals[cfg.decomposed_diagonal], "clean": cfg.decomposed_clean}},
    )


STAGES: list[Stage] = [
    command_stage("cuda-tests", "pytest -m cuda: exactness and training steps on CUDA", _cuda_tests, timeout_s=220,
                  report=_cuda_tests_report),
    command_stage("verify", "csbp verify --device cuda over every GPU (NCCL)", _verify("bd3"), timeout_s=150),
    command_stage("verify-dflash", "csbp verify --objective dflash --device cuda", _verify("dflash"), timeout_s=150),
    command_stage("kernels", "csbp bench kernels on CUDA (flex, bf16, 16K-128K)", _kernels, timeout_s=150,
                  report=_kernels_report),
    command_stage("layouts", "csbp bench kernels --layouts: each layout's busiest rank on CUDA", _layouts,
                  timeout_s=60, report=_layouts_report),
    Stage("train-table", "single-GPU BD3 / DFlash training table (Qwen3-0.6B shape, bf16)", _train_table),
]
"""The stages in run order; ``train-table`` last, it takes the time that is left."""


def select_stages(names: Sequence[str] | None, stages: Sequence[Stage] | None = None) -> list[Stage]:
    """The stages named (in ``stages`` order, default ``STAGES``), all when ``names`` is None;
    unknown names fail."""
    stages = STAGES if stages is None else stages
    known = [stage.name for stage in stages]
    if names is None:
        return list(stages)
    unknown = [name for name in names if name not in known]
    if unknown or not names:
        raise ValueError(f"--stages: unknown or no stage(s) {unknown}; choose from {known}")
    return [stage for stage in stages if stage.name in names]


def format_summary(results: Sequence[StageResult]) -> str:
    """One line per stage: name, status, seconds, summary."""
    width = max([len("stage")] + [len(r.name) for r in results])
    header = f"{'stage':<{width}}  {'status':<8} {'seconds':>8}  summary"
    lines = [header, "-" * len(header)]
    lines += [f"{r.name:<{width}}  {r.status:<8} {r.seconds:>8.1f}  {r.summary}" for r in results]
    return "\n".join(lines)


def no_cuda_message() -> str | None:
    """The one line printed when there is nothing to check, else None."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return None
    build = f"torch {torch.__version__}, " + (f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only build")
    return f"gpu-check: no CUDA device is visible ({build}); nothing to check on this machine"


def build_parser() -> argparse.ArgumentParser:
    from csbp.attention.backends import BACKENDS, CLEAN_KERNELS
    from csbp.attention.diagonal import DIAGONALS

    parser = argparse.ArgumentParser(prog="python -m csbp.gpu.check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", nargs="+", default=None, help="run only these stages (default: all)")
    parser.add_argument("--list", action="store_true", help="list the stages and exit")
    parser.add_argument("--json", type=Path, default=Path("gpu-check.json"),
                        help="the report (gpu-kernels.json and gpu-layouts.json go next to it)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help=f"total time budget from the process's start (default {DEFAULT_BUDGET_S:.0f} s)")
    parser.add_argument("--train-seq-lens", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    parser.add_argument("--dflash-seq-len", type=int, default=65536, help="0 to skip the DFlash row")
    parser.add_argument("--dflash-anchors", type=int, default=512)
    parser.add_argument("--activation-checkpointing", choices=("none", "full"), default="full")
    parser.add_argument("--backend", choices=BACKENDS, default="auto",
                        help="attention backend of the training table (auto: flex on CUDA)")
    parser.add_argument("--diagonal", choices=DIAGONALS, default="auto",
                        help="block-diagonal kernel of the training table (csbp.attention.diagonal)")
    parser.add_argument("--clean", choices=CLEAN_KERNELS, default="generic",
                        help="clean-context kernel of the training table's BD3 rows (csbp.attention.flash_pieces)")
    parser.add_argument("--decomposed-seq-lens", type=int, nargs="*", default=[32768, 65536],
                        help="lengths of the table's 'bd3 decomposed' rows (cuDNN clean pieces, the noisy blocks "
                        "folded into their Flex residual), after the BD3 rows as the budget allows; none: no such rows")
    parser.add_argument("--compiled-seq-lens", type=int, nargs="*", default=[8192, 32768],
                        help="lengths of the table's 'bd3 compiled' rows (train.compile: layers), after the "
                        "decomposed rows as the budget allows; none: no such rows")
    parser.add_argument("--selective-seq-lens", type=int, nargs="*", default=[32768, 65536],
                        help="lengths of the table's 'bd3 selective' rows (train.activation_checkpointing: selective), "
                        "after the compiled rows as the budget allows; none: no such rows")
    parser.add_argument("--profile-seq-lens", type=int, nargs="*", default=[8192],
                        help="lengths whose BD3 rows (plain, decomposed, compiled) are profiled after their timed steps "
                        "(three more steps: syncs counted, wall time, the profiler): launches, busy against wall time, "
                        "syncs, the costliest kernels; none: no profile")
    parser.add_argument("--flex-backward", choices=FLEX_BACKWARDS, default="auto",
                        help="backward of merged Flex partials in the kernels stage and the training table "
                        "(csbp.attention.flex_backward; auto: direct where this torch traces it). recompute: the "
                        "way to rerun those stages should the direct kernel fail to compile on the device")
    parser.add_argument("--repeats", type=int, default=2,
                        help="timed steps per training-table row (2: what the budget allows at 64K; their ± is "
                        "the range of two steps, a rough guide)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="bf16 peak (default: by GPU name)")
    parser.add_argument("--dry-run-cpu", action="store_true",
                        help="run every stage on the CPU at tiny sizes: tests the check's code, measures nothing")
    return parser


def _machine(args: argparse.Namespace, profile: CheckProfile) -> tuple[int, str, float | None]:
    """``(GPUs the stages see, device name, bf16 peak)``."""
    if profile.stand_in_gpus is not None:
        return profile.stand_in_gpus, "cpu (dry run)", args.peak_tflops or 1.0  # 1.0: MFU gets formatted
    name = torch.cuda.get_device_name(0)
    peak = args.peak_tflops if args.peak_tflops is not None else gpu_bf16_peak_tflops(name)
    return torch.cuda.device_count(), name, peak


def main(argv: Sequence[str] | None = None, *, started: float | None = None) -> int:
    """The check; its budget counts from ``started`` (the process's start when run as a module, else
    this call)."""
    started = time.perf_counter() if started is None else started
    args = build_parser().parse_args(argv)
    try:
        stages = select_stages(args.stages)
        resolve_flex_backward(args.flex_backward, where="--flex-backward")  # direct on a torch that cannot: refused
    except ValueError as exc:
        print(f"gpu-check: error: {exc}", file=sys.stderr)
        return 2
    if args.list:
        for stage in STAGES:
            print(f"{stage.name:<16} {stage.help}")
        return 0
    status = report_missing()
    if status is not None:
        return status
    profile = CPU_DRY_RUN if args.dry_run_cpu else CUDA
    message = None if args.dry_run_cpu else no_cuda_message()
    if message is not None:
        print(message)
        return 0
    gpus, name, peak = _machine(args, profile)
    # the training table runs in this process; the kernels stage is told (the CUDA tests choose per test)
    flex_backward = set_flex_backward(args.flex_backward, where="--flex-backward")
    info = {"gpus": gpus, "name": name, "bf16_peak_tflops": peak, "torch": torch.__version__,
            "cuda": torch.version.cuda, "python": sys.version.split()[0], "dry_run": args.dry_run_cpu,
            "flex_backward": flex_backward}
    report = CheckReport(args.json, info, budget_s=args.budget_s, started=started)
    env = CheckEnv(gpus=gpus, device_name=name, peak_tflops=peak, repo=Path.cwd(), args=args,
                   deadline=started + args.budget_s, profile=profile, out_dir=args.json.parent, report=report)
    print(f"gpu-check: {gpus} x {name} (bf16 peak {peak} TFLOP/s), torch {torch.__version__} (flex backward "
          f"{info['flex_backward']}), budget "
          f"{args.budget_s:.0f} s ({env.seconds_left():.0f} s left){', CPU dry run' if args.dry_run_cpu else ''}",
          flush=True)
    report.write()  # the device alone: a crash in the first stage still leaves a report
    watchdog = start_watchdog(env.seconds_left() + WATCHDOG_GRACE_S, report)
    for stage in stages:
        print(f"== {stage.name}: {stage.help}", flush=True)
        report.begin(stage.name)
        stage_start = time.perf_counter()
        try:
            result = stage.run(env)
        except Exception as exc:  # noqa: BLE001 - report it and still write gpu-check.json
            first_line = (str(exc).splitlines() or [""])[0]
            result = StageResult(stage.name, "failed", time.perf_counter() - stage_start,
                                 f"{type(exc).__name__}: {first_line}")
        print(f"   {result.status} in {result.seconds:.1f} s: {result.summary}", flush=True)
        if result.status == "failed" and result.details.get("output_tail"):
            print("   " + str(result.details["output_tail"]).replace("\n", "\n   "), flush=True)
        report.finish(result)
    watchdog.cancel()
    report.complete()
    print(format_summary(report.results))
    for result in report.results:
        if "table" in result.details:
            print(result.details["table"])
    beside = [str(env.out_dir / f"gpu-{s.name}.json") for s in stages if s.name in ("kernels", "layouts")]
    print(f"wrote {' and '.join([str(args.json), *beside])}")
    return 0 if all(r.status != "failed" for r in report.results) else 1


if __name__ == "__main__":
    sys.exit(main(started=STARTED))
