"""Run a function on N local processes joined in one ``torch.distributed`` group.

Used by ``csbp verify``, the benchmarks and the multi-process tests. On the CPU (the default) the
processes join a gloo group (through a key-value store listening on 127.0.0.1 only:
:mod:`csbp.parallel.loopback`); with ``device="cuda"`` rank ``r`` selects ``cuda:r`` and joins an
NCCL group bound to it (``csbp.devices``), so ``build_parallel_context`` inside ``fn`` computes on
that GPU. Each worker gets ``threads`` intra-op threads, runs ``fn(rank, world_size, *args)``,
returns a picklable result, and
leaves through ``os._exit`` right after ``destroy_process_group()``: a known PyTorch bug aborts
20-50% of gloo exits after a clean shutdown, which must not make tests or commands flaky.

Usage::

    results = run_local(my_fn, nproc=4, args=(cfg,))                 # gloo, list indexed by rank
    results = run_local(my_fn, nproc=2, args=(cfg,), device="cuda")  # NCCL, one GPU per rank
"""

from __future__ import annotations

import multiprocessing.util
import os
import pickle
import socket
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from csbp.devices import device_for_rank, process_group_options, resolve_device, select_device
from csbp.parallel.loopback import LOOPBACK_INTERFACE, loopback_store


class WorkerError(RuntimeError):
    """A worker process raised; the message carries its rank and traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    out_dir: str,
    timeout_s: float,
    threads: int,
    device_kind: str = "cpu",
) -> None:
    torch.set_num_threads(threads)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    os.environ.setdefault("GLOO_SOCKET_IFNAME", LOOPBACK_INTERFACE)  # gloo's pair sockets on loopback too
    code = 0
    try:
        device = device_for_rank(device_kind, rank)
        select_device(device)  # before the process group: NCCL binds to the current GPU
        timeout = timedelta(seconds=timeout_s)
        store = loopback_store(port, is_master=rank == 0, world_size=world_size, timeout=timeout)
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
    with tempfile.TemporaryDirectory(prefix="csbp-run-") as out_dir:
        ctx = mp.get_context("spawn")
        port = free_port()
        procs = [
            ctx.Process(
                target=_worker,
                args=(r, nproc, port, fn, args, out_dir, timeout_s, threads, kind),
                daemon=False,
            )
            for r in range(nproc)
        ]
        try:
            for p in procs:
                p.start()
            for p in procs:
                p.join(join_timeout_s if join_timeout_s is not None else timeout_s + 60)
        except BaseException:  # interrupted (Ctrl-C, SIGTERM as csbp's Interrupted): leave no orphan ranks
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
            raise
        results: list[Any] = []
        errors: list[str] = []
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                p.join()
            path = Path(out_dir) / f"rank{r}.pkl"
            if not path.exists():
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
        if errors:
            raise WorkerError(errors[0] if len(errors) == 1 else "\n".join(errors))
        return results
