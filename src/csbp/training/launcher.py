"""Start a training run: in this process, inside an existing torchrun launch, or on N local processes
through torchrun's own machinery (``torch.distributed.launcher.api.elastic_launch``).

:func:`launch_training` validates the config against its data and the run directory *before* any
process starts, then:

* inside a torchrun launch (``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK`` set): initialises the process
  group (NCCL on CUDA, gloo on CPU; timeout ``train.collective_timeout_s``) and trains this rank;
* world size 1: trains in this process, no process group;
* otherwise: starts ``--nproc`` workers per node with ``elastic_launch`` (no restarts). Single node:
  a private c10d rendezvous on a free local port. Multi-node: ``--rdzv-endpoint HOST:PORT`` and
  ``--rdzv-id`` are passed through (c10d rendezvous; with ``--node-rank`` the static one, whose
  endpoint is the master address). On CPU each worker gets one thread (``OMP_NUM_THREADS=1``).

What each rank runs in its process group (and an elastic worker's entry point) is
:mod:`csbp.training.worker`.

One process holds the run directory's lock (:mod:`csbp.training.run_lock`) from before the checks
until the run ends, so a second run in the same directory is refused before it reads any data: the
launching process on one node, global rank 0 with several nodes or under an outside torchrun.

A ``--resume`` pre-flight verifies the checkpoints' checksums (:mod:`csbp.training.checkpoint_checksums`);
the launching process hands what it read to the workers it starts, so each checkpoint file is read
once per node, not once per rank (under an outside torchrun each rank's own pre-flight reads them).

Failures: a worker that raises is reported by torch elastic, which stops the other workers (no
hang); :class:`TrainingFailed` carries the failing rank's message and traceback (the cause is
preferred over the connection errors it causes in its peers). Every process group is bounded by
``collective_timeout_s`` during the step loop; a rank whose collective times out names the peers whose
heartbeat stopped (:mod:`csbp.training.liveness`) and the launching process ends them. Ctrl-C
(``KeyboardInterrupt``) and ``SIGTERM`` (:class:`~csbp.interrupts.Interrupted`) are raised after the
workers are stopped; the workers start with ``SIGINT`` blocked until their task is loaded
(:func:`~csbp.interrupts.children_hold_sigint`), so a Ctrl-C while they import torch prints no
traceback from them. torch elastic's
temporary files live in a private directory removed after the launch, as are half-written
``checkpoints/step_N.tmp``. A single-node launch rendezvouses on 127.0.0.1 (its key-value stores listen on
loopback only: :mod:`csbp.parallel.loopback`) and keeps gloo on ``lo``. The run
directory must be on a filesystem every node sees (checkpoints are written by all ranks).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from csbp.config.schema import RunConfig
from csbp.devices import resolve_device
from csbp.interrupts import Interrupted, children_hold_sigint, signals_end_blocked_waits
from csbp.parallel.loopback import LOOPBACK, LOOPBACK_INTERFACE, register_loopback_rendezvous
from csbp.staging import remove_abandoned_staging
from csbp.training.checkpoint_checksums import verified_files
from csbp.training.finish import FINAL_DIR
from csbp.training.launch_failures import TrainingFailed, failure_from_elastic, is_root_cause
from csbp.training.liveness import REPORT_DIR_ENV, StallWatcher
from csbp.training.memory_fit import check_state_fits
from csbp.training.memory_forecast import forecast_line
from csbp.training.preflight import check_run, verify_data
from csbp.training.run_dir_checks import check_new_run_dir, check_writable_directory
from csbp.training.run_lock import run_dir_lock
from csbp.training.stop_request import STOP_SIGNAL, request_stop_of_workers
from csbp.training.trainer import TrainSummary, default_run_dir, stop_step_of, train
from csbp.training.worker import elastic_worker, train_in_process_group
from csbp.wording import counted

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
SIGNALS_TO_HANDLE = "SIGTERM,SIGHUP,SIGQUIT"
"""torch elastic's ``signals_to_handle`` without ``SIGINT``: Ctrl-C raises ``KeyboardInterrupt`` in the
launching process, and the agent stops the workers with ``SIGTERM``, which ends at once a worker still
importing torch (it holds ``SIGINT`` until then: :func:`csbp.interrupts.children_hold_sigint`)."""


@dataclass(frozen=True)
class LaunchOptions:
    """Process layout of ``csbp train`` (torchrun's flags).

    Attributes:
        nproc: processes on this node (default ``train.nproc``, else the topology's world size).
        nnodes: number of nodes.
        node_rank: this node's rank (selects the static rendezvous); None: assigned by c10d.
        rdzv_endpoint: ``HOST:PORT`` of the rendezvous (required for several nodes).
        rdzv_id: job id shared by all nodes (default ``csbp-<run.name>``).
    """

    nproc: int | None = None
    nnodes: int = 1
    node_rank: int | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str | None = None


def inside_torchrun() -> bool:
    """True when this process was started by torchrun (or another launcher setting its variables)."""
    return all(name in os.environ for name in TORCHRUN_ENV)


def launch_training(
    cfg: RunConfig,
    *,
    run_dir: str | Path | None = None,
    resume: bool = False,
    max_steps: int | None = None,
    options: LaunchOptions | None = None,
) -> TrainSummary | None:
    """Validate, then train (see the module docstring). Returns global rank 0's summary when it ran
    in this process or on this node, else None."""
    options = options or LaunchOptions()
    run_dir = Path(run_dir if run_dir is not None else default_run_dir(cfg)).absolute()
    if not holds_run_dir_lock(options):
        return _launch(cfg, run_dir=run_dir, resume=resume, max_steps=max_steps, options=options)
    # checked before the lock file is created there, so it never goes into a directory a run may not use
    check_writable_directory(run_dir, "--run-dir")
    if not resume:
        check_new_run_dir(run_dir)
    with run_dir_lock(run_dir):  # before any data is read: a second run in run_dir is refused here
        return _launch(cfg, run_dir=run_dir, resume=resume, max_steps=max_steps, options=options)


def holds_run_dir_lock(options: LaunchOptions) -> bool:
    """Whether this process takes the run directory's lock (:mod:`csbp.training.run_lock`): the
    launching process on one node; under an outside torchrun, and with several nodes (each of whose
    launchers starts workers), global rank 0's process."""
    if inside_torchrun():
        return os.environ.get("RANK") == "0"
    return options.nnodes == 1


def prints_once_per_run(options: LaunchOptions) -> bool:
    """Whether this process prints what one run says once (the memory forecast): global rank 0 under a
    torchrun launch, else the launching process of node 0 (``--node-rank 0``, or none given: one node,
    or several whose c10d rendezvous assigns the ranks later, where each node prints). Under csbp's own
    multi-node launch no ``RANK`` is set in the launching processes, so testing it alone had every
    node print."""
    if inside_torchrun():
        return os.environ.get("RANK") == "0"
    return options.node_rank in (None, 0)


def _launch(
    cfg: RunConfig, *, run_dir: Path, resume: bool, max_steps: int | None, options: LaunchOptions
) -> TrainSummary | None:
    launched = int(os.environ.get("WORLD_SIZE", cfg.world_size)) if inside_torchrun() else cfg.world_size
    if launched != cfg.world_size:  # before any data is read, and before the ranks wait for each other
        raise ValueError(launch_count_problem(cfg, launched, "torchrun's WORLD_SIZE"))
    stop_step = stop_step_of(cfg, max_steps)
    inputs = check_run(cfg, run_dir=run_dir, resume=resume, stop_step=stop_step, warn=_warn)
    nproc = options.nproc if options.nproc is not None else cfg.num_local_processes
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if inside_torchrun() else nproc
    verify_data(cfg, inputs)  # under torchrun every rank checks, so none waits for a failed one
    # after the data is vouched for: a forged manifest's vocabulary is named as such, not as a model too large
    check_state_fits(cfg, inputs, local_ranks=local)
    if prints_once_per_run(options):
        forecast = forecast_line(cfg, nproc=local)
        if forecast is not None:
            _warn(forecast)
    if inside_torchrun():
        return train_in_process_group(cfg, run_dir=run_dir, resume=resume, max_steps=max_steps)
    check_process_count(cfg, nproc, options)
    if cfg.world_size == 1:
        try:
            return train(cfg, run_dir=run_dir, resume=resume, max_steps=max_steps, lock_run_dir=False)
        finally:
            remove_staging_leftovers(run_dir)
    return _launch_workers(
        cfg, run_dir=run_dir, resume=resume, max_steps=max_steps, nproc=nproc, options=options
    )


def _warn(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def check_process_count(cfg: RunConfig, nproc: int, options: LaunchOptions) -> None:
    """``ValueError`` unless ``nproc * nnodes`` is the topology's world size and the rendezvous
    flags are complete."""
    if nproc < 1 or options.nnodes < 1:
        raise ValueError(f"--nproc {nproc} / --nnodes {options.nnodes}: both must be >= 1")
    if nproc * options.nnodes != cfg.world_size:
        raise ValueError(launch_count_problem(cfg, nproc * options.nnodes, f"--nproc {nproc} x --nnodes {options.nnodes}"))
    problem = node_flag_problem(options.nnodes, options.node_rank, options.rdzv_endpoint)
    if problem is not None:
        raise ValueError(problem)
    if torch.cuda.is_available():  # one GPU per local process (cuda:<LOCAL_RANK>)
        resolve_device("cuda", nproc=nproc)


def node_flag_problem(nnodes: int, node_rank: int | None, rdzv_endpoint: str | None) -> str | None:
    """The line refusing node flags that contradict each other, whatever the config, or None."""
    if node_rank is not None and not 0 <= node_rank < nnodes:
        return (f"--node-rank {node_rank}: must lie in [0, --nnodes {nnodes}) "
                f"(fix: number the nodes 0..{nnodes - 1}, or pass the --nnodes of the job)")
    if nnodes > 1 and not rdzv_endpoint:
        return "--rdzv-endpoint: required with --nnodes > 1 (fix: pass HOST:PORT of the first node)"
    return None


def launch_count_problem(cfg: RunConfig, launched: int, how: str) -> str:
    """The line refusing ``launched`` processes (started by ``how``) for a topology that needs another count."""
    topo = cfg.topology
    return (
        f"{how} = {counted(launched, 'process', 'processes')}, but the topology dp={topo.dp} cp={topo.cp} "
        f"bp={topo.bp} needs dp*max(cp, bp) = {cfg.world_size} "
        f"(fix: launch {counted(cfg.world_size, 'process', 'processes')} in all, or change the topology)"
    )


def _launch_workers(
    cfg: RunConfig, *, run_dir: Path, resume: bool, max_steps: int | None, nproc: int, options: LaunchOptions
) -> TrainSummary | None:
    log_dir = Path(tempfile.mkdtemp(prefix="csbp-launch-"))  # torch elastic's per-run files; removed below
    from torch.distributed.elastic.multiprocessing.api import DefaultLogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    local_addr = None
    if options.nnodes == 1 and options.rdzv_endpoint is None:
        # torch's c10d rendezvous, its stores listening on 127.0.0.1 only (csbp.parallel.loopback)
        backend, endpoint, rdzv_configs = register_loopback_rendezvous(), f"{LOOPBACK}:0", {}
        local_addr = LOOPBACK  # the workers' MASTER_ADDR (else this host's name)
    elif options.node_rank is not None:
        backend, endpoint, rdzv_configs = "static", str(options.rdzv_endpoint), {"rank": options.node_rank}
    else:
        backend, endpoint, rdzv_configs = "c10d", str(options.rdzv_endpoint), {}
    config = LaunchConfig(
        min_nodes=options.nnodes,
        max_nodes=options.nnodes,
        nproc_per_node=nproc,
        run_id=options.rdzv_id or f"csbp-{cfg.run.name}",
        rdzv_backend=backend,
        rdzv_endpoint=endpoint,
        rdzv_configs=rdzv_configs,
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir)),
        local_addr=local_addr,
        signals_to_handle=SIGNALS_TO_HANDLE,
    )
    env = {} if torch.cuda.is_available() else {"OMP_NUM_THREADS": "1"}
    env[REPORT_DIR_ENV] = str(log_dir)
    if options.nnodes == 1 and options.rdzv_endpoint is None and "GLOO_SOCKET_IFNAME" not in os.environ:
        env["GLOO_SOCKET_IFNAME"] = LOOPBACK_INTERFACE  # one node: worker traffic stays on loopback
    # multiprocessing's resource tracker (started with this interpreter's -W options) cleans up after
    # workers that were stopped by a signal, and would print a "leaked semaphore" warning about it.
    if _TRACKER_QUIET not in sys.warnoptions:
        sys.warnoptions.append(_TRACKER_QUIET)
    watcher = StallWatcher(log_dir)
    try:
        with (
            _environment(env), _private_tempdir(log_dir), _quiet_elastic_logs(), watcher,
            children_hold_sigint(_ctrl_c, also=(STOP_SIGNAL,)), _relays_stop_requests(log_dir),
            _rendezvous_ends_on_signals(options, log_dir),
        ):
            results: dict[int, Any] = elastic_launch(config, elastic_worker)(
                cfg, str(run_dir), resume, max_steps, options.nnodes > 1, verified_files(), os.getpid()
            )
    except ChildFailedError as exc:
        failure = failure_from_elastic(exc)
        if watcher.message and not is_root_cause(str(failure)):
            # a rank named a stalled peer and no rank raised an error of its own: that is the story
            failure = TrainingFailed(f"training failed: {watcher.message}", expected=True)
        raise failure from None
    except SignalException as exc:
        raise Interrupted(int(exc.sigval)) from None
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
        remove_staging_leftovers(run_dir)
    return results.get(0)


_TRACKER_QUIET = "ignore:resource_tracker:UserWarning"


@contextlib.contextmanager
def _relays_stop_requests(log_dir: Path) -> Iterator[None]:
    """Within the block a ``SIGUSR1`` to this process asks its workers to checkpoint after their current
    step and stop (:mod:`csbp.training.stop_request`); they start with it blocked, so one sent to them
    all while they start waits for their handler instead of ending them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def relay(signum: int, frame: FrameType | None) -> None:
        request_stop_of_workers(log_dir)
        print("csbp: SIGUSR1: the workers checkpoint after their current step and stop", file=sys.stderr, flush=True)

    previous = signal.signal(STOP_SIGNAL, relay)
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(STOP_SIGNAL, previous)


@contextlib.contextmanager
def _rendezvous_ends_on_signals(options: LaunchOptions, log_dir: Path) -> Iterator[None]:
    """With several nodes, say that this node waits for the others, and let Ctrl-C or ``SIGTERM``
    end that wait: torch's ``TCPStore`` waits in C++ (for a node not yet listening, or as the server
    for the other nodes) and retries through every signal until its rendezvous timeout. The wait is
    over when torch elastic installs its own ``SIGTERM`` handler, just before it starts the workers."""
    if options.nnodes == 1:
        yield
        return
    node = f"node {options.node_rank}" if options.node_rank is not None else "this node"
    _warn(
        f"csbp: {node} of {options.nnodes} joins the rendezvous at {options.rdzv_endpoint}; waiting for every node "
        "(Ctrl-C to stop)"
    )
    before = signal.getsignal(signal.SIGTERM)

    def end(signum: int) -> None:
        shutil.rmtree(log_dir, ignore_errors=True)
        _warn("csbp: interrupted while waiting for the other nodes")

    with signals_end_blocked_waits(still_waiting=lambda: signal.getsignal(signal.SIGTERM) is before, on_end=end):
        yield


def _ctrl_c(signum: int, frame: FrameType | None) -> None:
    """``KeyboardInterrupt``, except while torch elastic's agent starts the workers: raised there, it
    left a worker started but not yet handed its task (or its semaphores), which then died with an
    ``EOFError``/``FileNotFoundError`` traceback of its own, untracked by the agent. The Ctrl-C is
    sent again 20 ms later, until the workers are started and the agent stops them as usual."""
    while frame is not None:
        if frame.f_code.co_name == "_start_workers" and "elastic" in frame.f_code.co_filename:
            again = threading.Timer(0.02, os.kill, (os.getpid(), signum))
            again.daemon = True
            again.start()
            return
        frame = frame.f_back
    raise KeyboardInterrupt


def remove_staging_leftovers(run_dir: Path) -> None:
    """Delete half-written checkpoints (``checkpoints/step_*.tmp``, ``*.writing``) and the staging of
    ``final/`` (``.final.tmp-*``) a failed or interrupted run left behind (its workers end at once on
    Ctrl-C); ``latest`` never names one, so no complete checkpoint is touched."""
    with contextlib.suppress(OSError):  # a live writer's staging (its lock held) stays
        remove_abandoned_staging(Path(run_dir) / FINAL_DIR, report=False)
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return
    for entry in root.iterdir():
        if entry.name.startswith("step_") and entry.name.endswith(".tmp") and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        elif entry.name.endswith(".writing") and entry.is_file():
            entry.unlink(missing_ok=True)


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _private_tempdir(directory: Path) -> Iterator[None]:
    """Temporary files this process creates for the launch (torch's per-worker error files, which a
    killed worker never removes) go to ``directory``, which the launcher deletes afterwards."""
    saved = tempfile.tempdir
    tempfile.tempdir = str(directory)
    try:
        yield
    finally:
        tempfile.tempdir = saved


@contextlib.contextmanager
def _quiet_elastic_logs() -> Iterator[None]:
    """torch elastic logs every worker failure at length; csbp reports it once, as TrainingFailed."""
    prefixes = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
    names = set(prefixes) | {
        name for name in logging.root.manager.loggerDict if name.startswith(prefixes)
    }  # torch elastic gives its module loggers their own levels: quiet each one
    loggers = [logging.getLogger(name) for name in sorted(names)]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
