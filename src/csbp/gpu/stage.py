"""What a ``make gpu-check`` stage is (``csbp.gpu.check`` runs the list of them): the ``CheckEnv`` a
stage may use (the machine, the options, the time left, the profile and the report), the ``Stage``
itself (a name, a one-line help and ``run(env) -> StageResult``), and ``command_stage``, which makes a
stage of a command line: run in its own process group with the profile's environment, killed whole at
its limit, its output written to ``gpu-<name>.log`` as it comes.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from csbp.gpu.profile import CUDA, CheckProfile
from csbp.gpu.report import CheckReport, StageResult, kill_process_group


@dataclass(frozen=True)
class CheckEnv:
    """What stages may use: the machine, the options, the time left, the profile and the report."""

    gpus: int
    device_name: str
    peak_tflops: float | None
    repo: Path
    args: argparse.Namespace
    deadline: float  # time.perf_counter() value the whole check must end by
    profile: CheckProfile = CUDA
    out_dir: Path = Path(".")  # where gpu-check.json, gpu-kernels.json and gpu-layouts.json go
    report: CheckReport | None = None

    def seconds_left(self) -> float:
        return self.deadline - time.perf_counter()

    def progress(self, **details: object) -> None:
        if self.report is not None:
            self.report.progress(**details)


@dataclass(frozen=True)
class Stage:
    name: str
    help: str
    run: Callable[[CheckEnv], StageResult]


def _tail(text: str, lines: int = 40) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def _last_line(text: str) -> str:
    return next((line.strip() for line in reversed(text.strip().splitlines()) if line.strip()), "")


Report = Callable[[CheckEnv, StageResult, str], StageResult]
"""A command stage's post-processing: ``(env, result, full output) -> result`` with more details."""


def command_stage(
    name: str,
    help: str,
    argv: Callable[[CheckEnv], list[str] | str],
    *,
    timeout_s: float,
    report: Report | None = None,
) -> Stage:
    """A stage running the command ``argv(env)`` in the repository root (``ok`` when it exits 0);
    ``argv`` returns a string instead to skip the stage with that reason. The command runs in its
    own process group with the profile's environment; at its limit the whole group is killed (a
    launcher's workers too) and ``report`` still sees what it printed. The whole output is written to
    ``gpu-<name>.log`` beside the report as it comes (the first H200 run's report held a failing stage's
    tail only, without the tracebacks, and a device call cut at its limit returned nothing of a stage)."""

    def run(env: CheckEnv) -> StageResult:
        command = argv(env)
        if isinstance(command, str):
            return StageResult(name, "skipped", 0.0, command)
        limit = min(timeout_s, env.seconds_left())
        if limit <= 1:
            return StageResult(name, "skipped", 0.0, "no time left in the budget")
        start = time.perf_counter()
        child_env = {**os.environ, **env.profile.child_env, "PYTHONUNBUFFERED": "1"}
        # the output goes straight to gpu-<name>.log, so a check cut short (the lease's limit, the
        # watchdog) still leaves everything the stage printed where the lease sends files back
        log = env.out_dir / f"gpu-{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w", encoding="utf-8") as sink:
            process = subprocess.Popen(command, cwd=env.repo, stdout=sink, stderr=subprocess.STDOUT, env=child_env,
                                       start_new_session=True)
            children = env.report.children if env.report is not None else set()
            children.add(process.pid)
            try:
                process.wait(timeout=limit)
                timed_out = False
            except subprocess.TimeoutExpired:
                kill_process_group(process.pid)
                process.wait()
                timed_out = True
            finally:
                children.discard(process.pid)
        output = log.read_text(encoding="utf-8", errors="replace")
        if timed_out:
            status, summary = "failed", f"timed out after {limit:.0f} s"
        else:
            status, summary = ("ok" if process.returncode == 0 else "failed"), _last_line(output)
        details = {"command": command, "returncode": process.returncode, "output_tail": _tail(output), "log": str(log)}
        result = StageResult(name, status, time.perf_counter() - start, summary, details)
        return result if report is None else report(env, result, output)

    return Stage(name, help, run)
