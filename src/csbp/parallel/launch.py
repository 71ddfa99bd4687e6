"""Run a function on N local processes joined in one ``torch.distributed`` group.

Used by ``csbp verify``, the benchmarks and the multi-process tests. On the CPU (the default) the
processes join a gloo group (through a key-value store listening on 127.0.0.1 only:
:mod:`csbp.parallel.loopback`); with ``device="cuda"`` rank ``r`` selects ``cuda:r`` and joins an
NCCL group bound to it (``csbp.devices``), so ``build_parallel_context`` inside ``fn`` computes on
that GPU. Each worker gets ``threads`` intra-op threads, runs ``fn(rank, world_size, *args)``,
returns a picklable result, and
leaves through ``os._exit`` right after ``destroy_process_group()``: a known PyTorch bug aborts
20-50% of gloo exits after a clean shutdown, which must not make tests or commands flaky.

Rank 0 binds its key-value store to a port the system picks and hands the number to the other
ranks through the run's temporary directory, so no other process can take the port between
choosing and binding it. When a rank fails, the others are given ``FAILURE_GRACE_S`` seconds to
finish and are then killed: a rank waiting in a collective for a peer that died would otherwise
hold the launch for the whole collective timeout.

Usage::

    results = run_local(my_fn, nproc=4, args=(cfg,))                 # gloo, list indexed by rank
    results = run_local(my_fn, nproc=2, args=(cfg,), device="cuda")  # NCCL, one GPU per rank
"""

from __future__ import annotations

import multiprocessing.util
import os
import pickle
import signal
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait as wait_for_any
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from csbp.devices import device_for_rank, process_group_options, resolve_device, select_device
from csbp.interrupts import children_hold_sigint, take_sigint_back
from csbp.parallel.loopback import LOOPBACK_INTERFACE, loopback_store
from csbp.parallel.orphans import die_with_launcher


class WorkerError(RuntimeError):
    """A worker process raised; the message carries its rank and traceback."""


FAILURE_GRACE_S = 10.0
"""Seconds the other ranks get to finish after one rank fails, before they are killed."""
_PORT_FILE = "store-port"
_PORT_POLL_S = 0.02


def _join_store(rank: int, world_size: int, out_dir: Path, timeout: timedelta) -> dist.TCPStore:
    """Rank 0: a loopback store on a port the system picks, published in ``out_dir``; other ranks:
    a client of it, once the port is published (or ``TimeoutError`` after ``timeout``)."""
    published = out_dir / _PORT_FILE
    if rank == 0:
        store = loopback_store(0, is_master=True, world_size=world_size, timeout=timeout)
        tmp = out_dir / f"{_PORT_FILE}.tmp"
        tmp.write_text(str(store.port))
        os.replace(tmp, published)
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while not published.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 published no store port within {timeout.total_seconds():.0f} s")
        time.sleep(_PORT_POLL_S)
    port = int(published.read_text())
    return loopback_store(port, is_master=False, world_size=world_size, timeout=timeout)


def _worker(
    rank: int,
    world_size: int,
    fn: Callable[..., Any],
    args: tuple,
    out_dir: str,
    timeout_s: float,
    threads: int,
    device_kind: str = "cpu",
    launcher_pid: int | None = None,
) -> None:
    if launcher_pid is not None:  # a launcher killed outright (kill -9, the OOM killer) takes its ranks along
        die_with_launcher(launcher_pid)
    torch.set_num_threads(threads)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    os.environ.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK_INTERFACE)  # gloo's pair sockets on loopback too
    code = 0
    try:
        take_sigint_back(signal.default_int_handler)  # started holding it: see run_local
        device = device_for_rank(device_kind, rank)
        select_device(device)  # before the process group: NCCL binds to the current GPU
        timeout = timedelta(seconds=timeout_s)
        store = _join_store(rank, world_size, Path(out_dir), timeout)
        os.environ["MASTER_PORT"] = str(store.port)
        dist.init_process_group(
            **process_group_options(device), store=store, rank=rank, world_size=world_size, timeout=timeout
        )
        result: Any = ("ok", fn(rank, world_size, *args))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        result = ("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        code = 1
    tmp = Path(out_dir) / f"rank{rank}.tmp"
    with open(tmp, "wb") as f:
        pickle.dump(result, f)
    os.replace(tmp, Path(out_dir) / f"rank{rank}.pkl")
    try:
        if dist.is_initialized():
            if code == 0:
                dist.barrier()
            dist.destroy_process_group()
    finally:
        _release_multiprocessing_resources()
        os._exit(code)


def _release_multiprocessing_resources() -> None:
    """Run the exit finalizers that ``os._exit`` would skip: the ones multiprocessing's spawn
    bootstrap runs after the target returns. They unlink the named semaphores the worker created
    (tqdm's write lock, any ``multiprocessing`` lock) and unregister them from the parent's
    resource tracker, which otherwise warns "There appear to be N leaked semaphore objects"
    when the parent exits."""
    try:
        multiprocessing.util._exit_function()
    except Exception:  # noqa: BLE001 - the worker's result is already written; exit regardless
        traceback.print_exc()


MIN_PROCESS_LIMIT = 64
PROCESSES_PER_CORE = 8
"""CPU ranks ``run_local`` starts at most: 8 per core, and at least 64 (what the layout tests need)."""


def run_local(
    fn: Callable[..., Any],
    nproc: int,
    args: tuple = (),
    *,
    timeout_s: float = 300.0,
    threads: int = 1,
    device: str = "cpu",
    join_timeout_s: float | None = None,
) -> list[Any]:
    """Run ``fn(rank, nproc, *args)`` on ``nproc`` processes (gloo on the CPU, NCCL with one GPU per
    rank for ``device="cuda"``); return results by rank.

    ``timeout_s`` bounds each collective; the workers are waited for ``join_timeout_s`` seconds
    (default ``timeout_s + 60``) and killed after that.
    ``fn`` must be importable (a module-level function). Raises ``WorkerError`` with the first
    failing rank's traceback if any worker raised or died, ``ValueError`` (before starting anything)
    when ``device="cuda"`` and fewer than ``nproc`` GPUs are visible.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    kind = resolve_device(device, nproc=nproc).type
    cores = os.cpu_count() or 1
    if kind == "cpu" and nproc > max(MIN_PROCESS_LIMIT, PROCESSES_PER_CORE * cores):
        limit = max(MIN_PROCESS_LIMIT, PROCESSES_PER_CORE * cores)
        raise ValueError(  # --nproc 10**30 built that many Process objects and exhausted memory
            f"--nproc {nproc}: more than {limit} processes on this machine's {cores} CPU cores would only thrash "
            f"it (fix: --nproc {limit} or fewer)"
        )
    with tempfile.TemporaryDirectory(prefix="csbp-run-") as out_dir:
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, nproc, fn, args, out_dir, timeout_s, threads, kind, os.getpid()),
                daemon=False,
            )
            for r in range(nproc)
        ]
        try:
            with children_hold_sigint():  # a Ctrl-C while they import torch: no traceback per rank
                for p in procs:
                    p.start()
            _wait_for_workers(procs, join_timeout_s if join_timeout_s is not None else timeout_s + 60)
        except BaseException:  # interrupted (Ctrl-C, SIGTERM as csbp's Interrupted): leave no orphan ranks
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
            raise
        failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        results: list[Any] = []
        errors: list[str] = []
        killed: list[str] = []
        for r, p in enumerate(procs):
            was_alive = p.is_alive()
            if was_alive:
                p.kill()
                p.join()
            path = Path(out_dir) / f"rank{r}.pkl"
            if not path.exists():
                if was_alive and failed:
                    killed.append(f"rank {r}: killed {FAILURE_GRACE_S:.0f} s after rank {failed[0]} failed")
                elif was_alive:
                    errors.append(f"rank {r}: still running after the join timeout; killed")
                else:
                    errors.append(f"rank {r}: died without a result (exit code {p.exitcode})")
                results.append(None)
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)  # our own temp file, written by our own worker
            if status == "error":
                errors.append(value)
                results.append(None)
            else:
                results.append(value)
        errors += killed  # the ranks that failed first, then those stopped because of them
        if errors:
            raise WorkerError(errors[0] if len(errors) == 1 else "\n".join(errors))
        return results


def _wait_for_workers(procs: list[Any], join_timeout_s: float) -> None:
    """Return when every worker has exited, ``FAILURE_GRACE_S`` after the first one failed, or at
    ``join_timeout_s``, whichever comes first (the caller kills what is still running)."""
    deadline = time.monotonic() + join_timeout_s
    failed_at: float | None = None
    while True:
        alive = [p for p in procs if p.is_alive()]
        now = time.monotonic()
        if failed_at is None and any(p.exitcode not in (None, 0) for p in procs):
            failed_at = now
        stop = deadline if failed_at is None else min(deadline, failed_at + FAILURE_GRACE_S)
        if not alive or now >= stop:
            return
        wait_for_any([p.sentinel for p in alive], timeout=stop - now)
