"""``make gpu-check`` (``python -m csbp.gpu.check``): the one-command device check.

Runs a list of stages on the visible GPUs within a total time budget (default 450 s, under the
8 minutes the issue allows on one H200), prints one summary table and writes ``gpu-check.json``:

==================  =========================================================================
stage               what it runs
==================  =========================================================================
``cuda-tests``      ``pytest -m cuda tests``: kernels and transports on CUDA against the CPU
                    float64 reference, bf16 tolerances, a training step of every objective on one
                    GPU over NCCL (world size 1), activation checkpointing, a DFlash drafter step
``verify``          ``csbp verify --device cuda --nproc <min(GPUs, 4)>`` (skipped with < 2 GPUs)
``verify-dflash``   the same for DFlash drafter training
``kernels``         ``csbp bench kernels`` on CUDA: one layer's attention (flex backend, bf16, 16/4
                    heads of 128, B = 16 and 128) at 8K-128K tokens, the decomposed form with the
                    flex and sdpa (FlashAttention) block diagonals, the clean context as one Flex
                    partial or as cuDNN / FlashAttention-2 pieces; writes ``gpu-kernels.json``
                    row by row (a stage cut short keeps the rows it measured)
``train-table``     the single-GPU training table (``csbp.gpu.train_table``): Qwen3-0.6B shape,
                    BD3, bf16, activation checkpointing, 8K-64K tokens; DFlash at 64K, 512 anchors
==================  =========================================================================

Extending it: append a ``Stage`` to ``STAGES`` (before ``train-table``, which takes the time that
is left). A stage is a name, a one-line help and ``run(env) -> StageResult``; ``command_stage``
builds one from a command line (e.g. ``csbp bench ...``), so a new benchmark is one entry.

Without CUDA it prints one line saying so and exits 0. The exit status is 1 when a stage failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from csbp.bench.common import write_json_atomic
from csbp.gpu.flops import gpu_bf16_peak_tflops
from csbp.gpu.train_table import TableConfig, TableRow, format_train_table, rows_as_dicts, run_train_table

TRAIN_TABLE_RESERVE_S = 15.0
"""Seconds of the total budget kept back from the training table for writing the outputs."""


@dataclass(frozen=True)
class CheckEnv:
    """What stages may use: the machine, the options and the time left."""

    gpus: int
    device_name: str
    peak_tflops: float | None
    repo: Path
    args: argparse.Namespace
    deadline: float  # time.perf_counter() value the whole check must end by

    def seconds_left(self) -> float:
        return self.deadline - time.perf_counter()


@dataclass(frozen=True)
class StageResult:
    """The outcome of one stage: ``status`` is ``ok``, ``failed`` or ``skipped``; ``summary`` one line."""

    name: str
    status: str
    seconds: float
    summary: str
    details: dict[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class Stage:
    name: str
    help: str
    run: Callable[[CheckEnv], StageResult]


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def command_stage(
    name: str,
    help: str,
    argv: Callable[[CheckEnv], list[str] | str],
    *,
    timeout_s: float,
) -> Stage:
    """A stage running the command ``argv(env)`` in the repository root (``ok`` when it exits 0);
    ``argv`` returns a string instead to skip the stage with that reason."""

    def run(env: CheckEnv) -> StageResult:
        command = argv(env)
        if isinstance(command, str):
            return StageResult(name, "skipped", 0.0, command)
        limit = min(timeout_s, env.seconds_left())
        if limit <= 1:
            return StageResult(name, "skipped", 0.0, "no time left in the budget")
        start = time.perf_counter()
        try:
            done = subprocess.run(command, cwd=env.repo, capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired as expired:
            output = (expired.stdout or "") + (expired.stderr or "")
            output = output.decode() if isinstance(output, bytes) else output
            return StageResult(name, "failed", time.perf_counter() - start, f"timed out after {limit:.0f} s",
                               {"command": command, "output_tail": _tail(output)})
        output = done.stdout + done.stderr
        last = next((line for line in reversed(output.strip().splitlines()) if line.strip()), "")
        status = "ok" if done.returncode == 0 else "failed"
        return StageResult(name, status, time.perf_counter() - start, last.strip(),
                           {"command": command, "returncode": done.returncode, "output_tail": _tail(output)})

    return Stage(name, help, run)


def _cuda_tests(env: CheckEnv) -> list[str] | str:
    if not (env.repo / "tests").is_dir():
        return f"no tests/ directory under {env.repo} (run from a csbp checkout)"
    return [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", "tests"]


def _verify(objective: str) -> Callable[[CheckEnv], list[str] | str]:
    def argv(env: CheckEnv) -> list[str] | str:
        if env.gpus < 2:
            return f"needs at least 2 GPUs, {env.gpus} visible"
        nproc = min(env.gpus, 4)  # every layout of up to 4 ranks; more GPUs add launches, not coverage
        return [sys.executable, "-m", "csbp", "verify", "--device", "cuda", "--nproc", str(nproc),
                "--objective", objective]

    return argv


KERNEL_BENCH_ARGS: tuple[str, ...] = (
    "--device", "cuda", "--backends", "flex", "--dtype", "bfloat16", "--num-heads", "16", "--num-kv-heads", "4",
    "--head-dim", "128", "--block-sizes", "16", "128", "--seq-lens", "8192", "16384", "32768", "65536", "131072",
    "--diagonals", "flex", "sdpa", "--clean-kernels", "generic", "pieces-cudnn", "pieces", "--repeats", "2",
    "--json", "gpu-kernels.json",
)
"""``csbp bench kernels`` options of the ``kernels`` stage."""


def _kernels(env: CheckEnv) -> list[str]:
    return [sys.executable, "-m", "csbp", "bench", "kernels", *KERNEL_BENCH_ARGS]


def _train_table(env: CheckEnv) -> StageResult:
    args = env.args
    budget = env.seconds_left() - TRAIN_TABLE_RESERVE_S
    if budget <= 0:
        return StageResult("train-table", "skipped", 0.0, "no time left in the budget")
    cfg = TableConfig(
        seq_lens=tuple(args.train_seq_lens),
        activation_checkpointing=args.activation_checkpointing,
        dflash_seq_len=args.dflash_seq_len or None,
        dflash_anchors=args.dflash_anchors,
        repeats=args.repeats,
        budget_s=budget,
        peak_tflops=env.peak_tflops,
    )
    start = time.perf_counter()
    def progress(row: TableRow) -> None:
        print("   " + format_train_table([row]).splitlines()[-1], flush=True)

    rows = run_train_table(cfg, torch.device("cuda", 0), progress=progress)
    measured = sum(row.status.startswith("ok") for row in rows)
    failed = any(row.status.startswith(("out of memory", "error")) for row in rows)
    return StageResult(
        "train-table", "failed" if failed else "ok", time.perf_counter() - start,
        f"{measured} of {len(rows)} rows measured",
        {"rows": rows_as_dicts(rows), "table": format_train_table(rows)},
    )


STAGES: list[Stage] = [
    command_stage("cuda-tests", "pytest -m cuda: exactness and training steps on CUDA", _cuda_tests, timeout_s=240),
    command_stage("verify", "csbp verify --device cuda over every GPU (NCCL)", _verify("bd3"), timeout_s=150),
    command_stage("verify-dflash", "csbp verify --objective dflash --device cuda", _verify("dflash"), timeout_s=150),
    command_stage("kernels", "csbp bench kernels on CUDA (flex, bf16, 8K-128K)", _kernels, timeout_s=150),
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


def report(env_info: dict[str, object], results: Sequence[StageResult]) -> dict[str, object]:
    """The ``gpu-check.json`` payload."""
    return {
        "device": env_info,
        "ok": all(r.status != "failed" for r in results),
        "stages": [dataclasses.asdict(r) for r in results],
    }


def no_cuda_message() -> str | None:
    """The one line printed when there is nothing to check, else None."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return None
    build = f"torch {torch.__version__}, " + (f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only build")
    return f"gpu-check: no CUDA device is visible ({build}); nothing to check on this machine"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m csbp.gpu.check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--stages", nargs="+", default=None, help="run only these stages (default: all)")
    parser.add_argument("--list", action="store_true", help="list the stages and exit")
    parser.add_argument("--json", type=Path, default=Path("gpu-check.json"))
    parser.add_argument("--budget-s", type=float, default=450.0, help="total time budget (default 450 s)")
    parser.add_argument("--train-seq-lens", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    parser.add_argument("--dflash-seq-len", type=int, default=65536, help="0 to skip the DFlash row")
    parser.add_argument("--dflash-anchors", type=int, default=512)
    parser.add_argument("--activation-checkpointing", choices=("none", "full"), default="full")
    parser.add_argument("--repeats", type=int, default=2, help="timed steps per training-table row")
    parser.add_argument("--peak-tflops", type=float, default=None, help="bf16 peak (default: by GPU name)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        stages = select_stages(args.stages)
    except ValueError as exc:
        print(f"gpu-check: error: {exc}", file=sys.stderr)
        return 2
    if args.list:
        for stage in STAGES:
            print(f"{stage.name:<16} {stage.help}")
        return 0
    message = no_cuda_message()
    if message is not None:
        print(message)
        return 0
    name = torch.cuda.get_device_name(0)
    peak = args.peak_tflops if args.peak_tflops is not None else gpu_bf16_peak_tflops(name)
    env = CheckEnv(
        gpus=torch.cuda.device_count(), device_name=name, peak_tflops=peak, repo=Path.cwd(), args=args,
        deadline=time.perf_counter() + args.budget_s,
    )
    print(f"gpu-check: {env.gpus} x {name} (bf16 peak {peak} TFLOP/s), budget {args.budget_s:.0f} s", flush=True)
    results = []
    for stage in stages:
        print(f"== {stage.name}: {stage.help}", flush=True)
        started = time.perf_counter()
        try:
            result = stage.run(env)
        except Exception as exc:  # noqa: BLE001 - report it and still write gpu-check.json
            first_line = (str(exc).splitlines() or [""])[0]
            result = StageResult(stage.name, "failed", time.perf_counter() - started,
                                 f"{type(exc).__name__}: {first_line}")
        print(f"   {result.status} in {result.seconds:.1f} s: {result.summary}", flush=True)
        if result.status == "failed" and result.details.get("output_tail"):
            print("   " + str(result.details["output_tail"]).replace("\n", "\n   "), flush=True)
        results.append(result)
    info = {"gpus": env.gpus, "name": name, "bf16_peak_tflops": peak, "torch": torch.__version__,
            "cuda": torch.version.cuda}
    write_json_atomic(args.json, report(info, results))
    print(format_summary(results))
    for result in results:
        if "table" in result.details:
            print(result.details["table"])
    print(f"wrote {args.json}")
    return 0 if all(r.status != "failed" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
