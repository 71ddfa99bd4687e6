"""A node of a multi-node ``csbp train`` waiting for the others says so, and Ctrl-C or ``SIGTERM``
ends that wait at once.

Found by a CLI fuzz: torch's ``TCPStore`` waits in C++ (a node connecting to a first node that is
not listening yet, or the first node waiting for the others) and retries through every signal, so
``kill`` and Ctrl-C did nothing for the rendezvous timeout (15 minutes); only ``kill -9`` worked.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from test_training_run import config_dict, make_artifact

pytestmark = pytest.mark.multiprocess

JOINS = "joins the rendezvous at"


@pytest.fixture(scope="module")
def config_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("multinode")
    data = config_dict(make_artifact(root / "art"), **{"topology.dp": 2, "train.eval_every": 0})
    path = root / "run.yaml"
    path.write_text(json.dumps(data), encoding="utf-8")  # JSON is YAML
    return path


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _line_with(process: subprocess.Popen, text: str, *, timeout_s: float) -> str:
    """The first line of ``process``'s stderr holding ``text`` (fails after ``timeout_s``, or at its end)."""
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        assert process.stderr is not None
        for line in process.stderr:
            lines.put(line)
            if text in line:
                return
        lines.put("")  # the end

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
        except queue.Empty:
            pytest.fail(f"no line holding {text!r} within {timeout_s:g} s")
        if not line:
            pytest.fail(f"the node ended (rc {process.wait()}) without a line holding {text!r}")
        if text in line:
            return line


@pytest.mark.parametrize(("node_rank", "signum"), [(1, signal.SIGTERM), (0, signal.SIGINT)])
def test_a_signal_ends_a_node_waiting_for_the_others(
    node_rank: int, signum: signal.Signals, config_file: Path, tmp_path: Path
) -> None:
    """Node 1 connects to a first node that never listens; node 0 serves and no other node comes."""
    command = [
        sys.executable, "-m", "csbp", "train", str(config_file), "--run-dir", str(tmp_path / "run"),
        "--nnodes", "2", "--node-rank", str(node_rank), "--nproc", "1",
        "--rdzv-endpoint", f"127.0.0.1:{_free_port()}",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    node = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = _line_with(node, JOINS, timeout_s=120.0)
        assert f"csbp: node {node_rank} of 2 {JOINS} 127.0.0.1:" in line
        time.sleep(3.0)  # well inside torch's TCPStore wait
        sent = time.monotonic()
        node.send_signal(signum)
        rest = node.communicate(timeout=30)[1]
        waited = time.monotonic() - sent
    finally:
        node.kill()
    assert node.returncode == 128 + signum, rest[-2000:]
    assert waited < 15.0  # the watcher's grace is 2 s; the wait itself would have been 900 s
    # the watcher's line; "csbp: interrupted" when the signal came before torch's C++ wait began
    assert "csbp: interrupted" in rest
    assert "Traceback" not in rest
