"""The run directory's lock for a program that calls :func:`csbp.training.train` itself.

``csbp train`` takes ``RUN_DIR/.lock`` in the process that launches the workers
(:mod:`csbp.training.launcher`) and calls ``train(..., lock_run_dir=False)``. A direct ``train``
call gets the same protection: global rank 0 (the one process of a run without a process group)
checks the directory as the launcher does (writable; a new run's may hold only what a run writes),
then takes the lock (:mod:`csbp.training.run_lock`) before any data is read and holds it until
``train`` returns. A second run in the directory, in this process or another, is refused with
:class:`~csbp.training.run_lock.RunDirInUse`, one line naming the holder's pid. With a process
group every rank learns whether rank 0 could start (one ``all_reduce``), so a refused run fails on
every rank at once instead of leaving the others waiting in a collective.

Usage::

    with train_run_dir_lock(run_dir, resume=resume, enabled=lock_run_dir):
        ...  # pre-flight, train, export
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from csbp.training.run_dir_checks import check_new_run_dir, check_writable_directory
from csbp.training.run_lock import run_dir_lock

FLAG = "run_dir"
"""How the messages name the directory: the ``train`` argument."""


@contextlib.contextmanager
def train_run_dir_lock(run_dir: Path, *, resume: bool, enabled: bool = True) -> Iterator[None]:
    """Hold ``run_dir``'s lock on global rank 0 for the ``with`` block (module docstring); nothing
    with ``enabled=False`` (the caller holds it)."""
    if not enabled:
        yield
        return
    with contextlib.ExitStack() as held:
        error: ValueError | None = None
        if not dist.is_initialized() or dist.get_rank() == 0:
            try:
                check_writable_directory(run_dir, FLAG)  # before the lock file goes into it
                if not resume:
                    check_new_run_dir(run_dir, FLAG)
                held.enter_context(run_dir_lock(run_dir, flag=FLAG))
            except ValueError as exc:
                error = exc
        if dist.is_initialized() and not _every_rank_may_start(error is None) and error is None:
            raise ValueError(
                f"{FLAG} {run_dir}: global rank 0 could not start the run there (see its error)"
            )
        if error is not None:
            raise error
        yield


def _every_rank_may_start(ok: bool) -> bool:
    """Whether ``ok`` holds on every rank of the world group (an ``all_reduce`` of the minimum)."""
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())
