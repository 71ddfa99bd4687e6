"""The local launcher returns per-rank results, surfaces worker errors, listens on loopback only
and leaves no multiprocessing semaphore behind."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from csbp.parallel.launch import FAILURE_GRACE_S, WorkerError, run_local
from test_security import listening_addresses, not_loopback


def _sum_ranks(rank: int, world: int) -> float:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return float(t.item())


def _fail_on_one(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("boom")


def _sum_ranks_and_listeners(rank: int, world: int) -> tuple[float, list[str]]:
    return _sum_ranks(rank, world), listening_addresses([os.getpid()])  # after the collective: all up


_HELD: list[object] = []


def _hold_a_semaphore(rank: int, world: int) -> int:
    """Like tqdm's write lock: a named semaphore alive until the worker exits."""
    _HELD.append(multiprocessing.get_context("spawn").Lock())
    return rank


@pytest.mark.multiprocess
@pytest.mark.slow
def test_run_local_workers_release_their_semaphores():
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); from csbp.parallel.launch import run_local; "
        "from test_launch import _hold_a_semaphore; assert run_local(_hold_a_semaphore, 2) == [0, 1]"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(Path(__file__).parent)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    assert "leaked semaphore" not in done.stderr, done.stderr  # the parent's resource tracker at exit


def test_run_local_all_reduce_with_every_socket_on_loopback():
    results = run_local(_sum_ranks_and_listeners, 3)
    assert [total for total, _ in results] == [3.0, 3.0, 3.0]
    addresses = [address for _, found in results for address in found]
    assert results[0][1], "rank 0 hosts the key-value store"
    assert not_loopback(addresses) == [], addresses  # the store and gloo listen on 127.0.0.1 only


def test_run_local_reports_rank_error():
    with pytest.raises(WorkerError, match="rank 1: ValueError: boom"):
        run_local(_fail_on_one, 2, timeout_s=20)


def _fail_on_zero_while_one_waits(rank: int, world: int) -> None:
    if rank == 0:
        raise ValueError("early")
    time.sleep(300)  # a rank stuck where no peer's exit reaches it (a store connect, a compute loop)


def test_a_failed_rank_stops_the_launch_without_waiting_for_the_collective_timeout():
    started = time.monotonic()
    with pytest.raises(WorkerError) as caught:
        run_local(_fail_on_zero_while_one_waits, 2, timeout_s=300)
    elapsed = time.monotonic() - started
    assert elapsed < FAILURE_GRACE_S + 30, elapsed  # it used to wait for the 300 s collective timeout
    message = str(caught.value)
    assert message.startswith("rank 0: ValueError: early"), message  # the cause first
    assert f"rank 1: killed {FAILURE_GRACE_S:.0f} s after rank 0 failed" in message, message


def _store_port(rank: int, world: int) -> str:
    return os.environ["MASTER_PORT"]


def test_ranks_join_the_port_rank_zero_bound():
    ports = run_local(_store_port, 3)
    assert len(set(ports)) == 1 and int(ports[0]) > 0, ports
