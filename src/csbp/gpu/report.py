"""``gpu-check.json``, kept current while the device check runs, and the budget's watchdog.

The report is rewritten atomically (``csbp.atomic``) when the check starts (the device alone),
when a stage starts (``"status": "running"``), whenever a stage reports progress (each training
table row) and when a stage ends; ``"complete": true`` only once every stage has ended. A check
cut short (a device session's time limit, a crash, the watchdog below) therefore leaves every
number measured so far on disk::

    report = CheckReport(Path("gpu-check.json"), device_info, budget_s=480.0)
    report.begin("kernels"); ...; report.finish(result)
    report.complete()

``start_watchdog`` ends the process at the end of the budget: a stage that runs in-process (the
training table) cannot be interrupted otherwise. It marks the running stage failed, writes the
report, kills the command stage's process group if one is still alive and exits with status 1.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from csbp.atomic import write_json_atomic


@dataclass(frozen=True)
class StageResult:
    """The outcome of one stage: ``status`` is ``ok``, ``failed`` or ``skipped``; ``summary`` one line."""

    name: str
    status: str
    seconds: float
    summary: str
    details: dict[str, object] = field(default_factory=dict)


class CheckReport:
    """The check's results so far and the one stage running; ``write`` puts them on disk."""

    def __init__(self, path: Path, device: dict[str, object], *, budget_s: float, started: float | None = None) -> None:
        self.path, self.device, self.budget_s = path, device, budget_s
        self.started = time.perf_counter() if started is None else started
        self.results: list[StageResult] = []
        self.running: tuple[str, float, dict[str, object]] | None = None  # (name, start time, details)
        self.children: set[int] = set()  # process groups of running command stages
        self.done = False
        self.cut_reason: str | None = None  # why the check was cut short (the watchdog), if it was
        self._lock = threading.RLock()

    def payload(self) -> dict[str, object]:
        """The ``gpu-check.json`` object."""
        with self._lock:
            stages = [dataclasses.asdict(r) for r in self.results]
            if self.running is not None:
                name, start, details = self.running
                stages.append(dataclasses.asdict(
                    StageResult(name, "running", time.perf_counter() - start, "running", dict(details))
                ))
            payload: dict[str, object] = {
                "device": self.device,
                "ok": all(r.status != "failed" for r in self.results) and self.running is None
                and self.cut_reason is None,
                "complete": self.done,
                "budget_s": self.budget_s,
                "elapsed_s": round(time.perf_counter() - self.started, 1),
                "stages": stages,
            }
            if self.cut_reason is not None:
                payload["cut"] = self.cut_reason
            return payload

    def write(self) -> None:
        with self._lock:
            write_json_atomic(self.path, self.payload())

    def begin(self, name: str) -> None:
        with self._lock:
            self.running = (name, time.perf_counter(), {})
            self.write()

    def progress(self, **details: object) -> None:
        """Merge ``details`` into the running stage's and write (e.g. the training rows so far)."""
        with self._lock:
            if self.running is not None:
                self.running[2].update(details)
                self.write()

    def finish(self, result: StageResult) -> None:
        with self._lock:
            self.results.append(result)
            self.running = None
            self.write()

    def complete(self) -> None:
        with self._lock:
            self.done = True
            self.write()

    def cut(self, reason: str) -> None:
        """End the running stage as failed with ``reason`` (keeping its progress) and write; the report
        says ``"ok": false`` and ``"cut": reason`` also when the cut falls between stages (the process
        exits 1: stages were left unrun)."""
        with self._lock:
            self.cut_reason = reason
            if self.running is not None:
                name, start, details = self.running
                self.results.append(StageResult(name, "failed", time.perf_counter() - start, reason, dict(details)))
                self.running = None
            self.write()


def kill_process_group(pgid: int) -> None:
    """SIGKILL a command stage's process group (its workers too), ignoring one already gone."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def expire(report: CheckReport, reason: str, *, exit: Callable[[int], object] = os._exit) -> None:
    """What the watchdog does at the end of the budget (module docstring)."""
    with report._lock:
        for pgid in list(report.children):
            kill_process_group(pgid)
        report.cut(reason)
        print(f"gpu-check: {reason}; wrote {report.path}", flush=True)
    exit(1)


def start_watchdog(
    seconds: float, report: CheckReport, *, exit: Callable[[int], object] = os._exit
) -> threading.Timer:
    """Call ``expire`` after ``seconds`` unless cancelled (a daemon thread: it never holds the exit)."""
    reason = f"cut at the end of the {report.budget_s:.0f} s budget"
    timer = threading.Timer(max(seconds, 0.0), expire, args=(report, reason), kwargs={"exit": exit})
    timer.daemon = True
    timer.start()
    return timer
