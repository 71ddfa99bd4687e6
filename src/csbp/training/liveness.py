"""Which rank stalled: heartbeats through the launch's key-value store.

Every rank of a multi-process run starts a :class:`Heartbeat`: a daemon thread that writes
``"<unix time> <pid> <host>"`` under ``csbp/heartbeat/<rank>`` of the rendezvous store
(``MASTER_ADDR:MASTER_PORT``, the store torch elastic and torchrun already run) once a second, on
its own connection. A rank whose collective times out asks :meth:`Heartbeat.silent_ranks` which
peers stopped writing and names them in its error (:func:`report_stall`).

Silent peers must then be ended by someone: a process stopped with ``SIGSTOP`` or wedged in a
kernel call ignores the launcher's ``SIGTERM``, and torch elastic waits 30 s before its ``SIGKILL``.
Under ``csbp train`` the reporting rank writes its report into ``$CSBP_STALL_REPORT_DIR`` and the
launching process (:class:`StallWatcher`) kills the silent peers once the reporting rank has exited,
so torch elastic records the reporter's error first; the watcher's report is also the message
``csbp train`` prints. Under another launcher the reporting rank kills local silent peers as it exits.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

PREFIX = "csbp/heartbeat/"
INTERVAL_S = 1.0
REPORT_DIR_ENV = "CSBP_STALL_REPORT_DIR"


@dataclass(frozen=True)
class SilentRank:
    """A rank whose last heartbeat is older than the limit (``age_s`` is None: it never wrote one)."""

    rank: int
    age_s: float | None
    pid: int | None
    host: str | None

    def describe(self) -> str:
        if self.age_s is None:
            return f"rank {self.rank} (no heartbeat)"
        return f"rank {self.rank} (pid {self.pid} on {self.host}, silent for {self.age_s:.0f} s)"


class Heartbeat:
    """Publish this rank's heartbeat until :meth:`stop`; a no-op without ``MASTER_ADDR``/``MASTER_PORT``."""

    def __init__(self, rank: int, world_size: int, *, interval_s: float = INTERVAL_S) -> None:
        self.rank, self.world_size, self.interval_s = rank, world_size, interval_s
        self._stop = threading.Event()
        self._store: dist.Store | None = None
        self._thread: threading.Thread | None = None
        host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if world_size < 2 or not host or not port:
            return
        try:
            self._store = dist.TCPStore(
                host, int(port), is_master=False, timeout=timedelta(seconds=10), wait_for_workers=False
            )
        except (RuntimeError, ValueError, OSError):
            return  # no store to reach: errors just will not name the silent rank
        self._beat()
        self._thread = threading.Thread(target=self._run, name="csbp-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        assert self._store is not None
        self._store.set(f"{PREFIX}{self.rank}", f"{time.time():.3f} {os.getpid()} {socket.gethostname()}")

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._beat()
            except (RuntimeError, OSError):
                return  # the store is gone: the launch is ending

    def stop(self) -> None:
        self._stop.set()

    def silent_ranks(self) -> list[SilentRank]:
        """Peers whose last heartbeat is older than three intervals."""
        if self._store is None:
            return []
        limit = 3 * self.interval_s
        now, silent = time.time(), []
        for rank in range(self.world_size):
            if rank == self.rank:
                continue
            key = f"{PREFIX}{rank}"
            try:
                if not self._store.check([key]):
                    silent.append(SilentRank(rank, None, None, None))
                    continue
                stamp, pid, host = self._store.get(key).decode().split(" ", 2)
            except (RuntimeError, OSError, ValueError):
                continue
            age = now - float(stamp)
            if age > limit:
                silent.append(SilentRank(rank, age, int(pid), host))
        return silent


def end_silent_local_peers(silent: list[SilentRank]) -> None:
    """``SIGKILL`` silent peers that run on this host (their run has failed already)."""
    here = socket.gethostname()
    for peer in silent:
        if peer.pid is not None and peer.host == here and peer.pid != os.getpid():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(peer.pid, signal.SIGKILL)


def report_stall(message: str, silent: list[SilentRank]) -> None:
    """Hand the silent peers to whoever ends them (see the module docstring)."""
    directory = os.environ.get(REPORT_DIR_ENV)
    if not directory:
        atexit.register(end_silent_local_peers, silent)
        return
    report = {
        "message": message,
        "reporter": os.getpid(),
        "host": socket.gethostname(),
        "pids": [peer.pid for peer in silent if peer.pid is not None and peer.host == socket.gethostname()],
    }
    path = Path(directory) / f"stall-{os.getpid()}.json"
    with contextlib.suppress(OSError):
        tmp = path.with_suffix(".writing")
        tmp.write_text(json.dumps(report), encoding="utf-8")
        os.replace(tmp, path)


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie waiting to be reaped counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


class StallWatcher:
    """In the launching process: act on stall reports written into ``directory`` (a thread)."""

    def __init__(self, directory: Path, *, poll_s: float = 0.1, grace_s: float = 5.0) -> None:
        self.directory, self.poll_s, self.grace_s = Path(directory), poll_s, grace_s
        self.message: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="csbp-stall-watcher", daemon=True)

    def __enter__(self) -> StallWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            reports = sorted(self.directory.glob("stall-*.json"))
            if not reports:
                continue
            try:
                report = json.loads(reports[0].read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            self.message = str(report.get("message", ""))
            deadline = time.monotonic() + self.grace_s
            while _alive(int(report.get("reporter", 0))) and time.monotonic() < deadline:
                time.sleep(self.poll_s)
            for pid in report.get("pids", []):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(int(pid), signal.SIGKILL)
            return
