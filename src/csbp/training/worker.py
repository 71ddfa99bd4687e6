"""One training rank in a process group: what each of ``csbp train``'s ranks runs, whoever started
it (:mod:`csbp.training.launcher` decides that).

``train_in_process_group`` initialises ``torch.distributed`` from the launcher's environment (the
rank's GPU current first), trains and tears the group down; a rank that fails leaves at once with
its error on record, a collective timeout naming the peers whose heartbeat stopped. The entry point
of a worker torch elastic starts (``elastic_worker``) ends with its launcher, takes Ctrl-C back,
and holds the run directory's lock on global rank 0 of a multi-node launch.
``skip_teardown_at_exit`` ends a successful rank with exit code 0 before the interpreter's teardown.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from csbp.config.schema import RunConfig
from csbp.devices import process_group_options
from csbp.interrupts import end_on_sigint
from csbp.parallel.orphans import die_with_launcher
from csbp.training.checkpoint_checksums import remember_verified
from csbp.training.launch_failures import TrainingFailed, collective_failure_message, is_collective_failure
from csbp.training.liveness import Heartbeat
from csbp.training.run_lock import run_dir_lock
from csbp.training.trainer import STARTUP_TIMEOUT_S, TrainSummary, train, training_device


def train_in_process_group(
    cfg: RunConfig, *, run_dir: Path, resume: bool, max_steps: int | None
) -> TrainSummary | None:
    """Initialise ``torch.distributed`` from the launcher's environment, train, tear down.

    Returns the summary on global rank 0, None elsewhere.
    """
    device = training_device()  # the rank's GPU is current before NCCL creates any communicator
    # Start-up (imports, pre-flight on every rank) may take longer than a collective may; the trainer
    # bounds every group, the world's included, by train.collective_timeout_s once all ranks are up.
    timeout = timedelta(seconds=max(cfg.train.collective_timeout_s, STARTUP_TIMEOUT_S))
    dist.init_process_group(**process_group_options(device), timeout=timeout)
    rank = dist.get_rank()
    heartbeat = Heartbeat(rank, dist.get_world_size())
    try:
        # the launching process (or global rank 0's worker) holds the run directory's lock
        summary = train(cfg, run_dir=run_dir, resume=resume, max_steps=max_steps, lock_run_dir=False)
    except BaseException as exc:
        # No teardown on failure: this process ends as soon as its error is on record (atexit runs
        # after torch elastic's error file is written). Tearing the groups down first would close
        # the connections, so the peers would report "connection closed" before this rank reported
        # the cause, and with a stalled peer the teardown itself would block.
        atexit.register(_leave_now, 1)
        if isinstance(exc, (dist.DistError, RuntimeError)) and is_collective_failure(exc):
            raise TrainingFailed(collective_failure_message(cfg, rank, exc, heartbeat)) from exc
        raise
    finally:
        heartbeat.stop()
    dist.destroy_process_group()
    return summary if rank == 0 else None


def elastic_worker(
    cfg: RunConfig,
    run_dir: str,
    resume: bool,
    max_steps: int | None,
    lock: bool,
    verified: list[tuple[Any, int]] | None = None,
    launcher_pid: int | None = None,
) -> TrainSummary | None:
    """Entry point of one worker started by ``elastic_launch`` (module level: it is pickled by name);
    with ``lock`` (several nodes) global rank 0 holds the run directory's lock. ``verified``: the
    checkpoint file checksums the launcher's pre-flight read, so no worker reads those files again.
    The worker ends with ``launcher_pid`` (:mod:`csbp.parallel.orphans`)."""
    if launcher_pid is not None:
        die_with_launcher(launcher_pid)
    # Ctrl-C reaches every worker as well as the launching process, which reports it once and stops
    # the workers: a worker just ends, and one pressed while it started (SIGINT was blocked while it
    # imported torch and unpickled this task) ends it here. Checkpoints are written atomically, and
    # the launcher removes a half-written one.
    end_on_sigint()
    remember_verified(verified or [])
    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    holder = lock and os.environ.get("RANK") == "0"
    with run_dir_lock(run_dir) if holder else contextlib.nullcontext():
        summary = train_in_process_group(cfg, run_dir=Path(run_dir), resume=resume, max_steps=max_steps)
    skip_teardown_at_exit()
    return summary


def _leave_now(code: int) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def skip_teardown_at_exit(code: int = 0) -> None:
    """End this process with exit code ``code`` (0; 75 for a ``SIGUSR1`` stop) as soon as the interpreter starts to exit.

    A known PyTorch bug aborts a fraction of gloo processes during interpreter teardown after a
    clean ``destroy_process_group`` (see ``csbp.parallel.launch``); torch elastic or torchrun would
    report that abort as a failed worker. Call it only after a successful run, in a process whose
    exit code must be 0 (an elastic worker whose result the agent has read, or ``csbp train`` under
    torchrun): the atexit hook flushes the standard streams and calls ``os._exit(code)``.
    """

    atexit.register(_leave_now, code)
