"""Checkpoint and stop on ``SIGUSR1``: a preemption notice (SLURM's ``--signal=USR1@120``, ``kill -USR1``).

``SIGTERM`` and Ctrl-C end a run at once (:mod:`csbp.interrupts`): whatever it trained since its last
checkpoint is lost. ``SIGUSR1`` asks it to stop *after* the step it is in: every rank finishes that
step, the run writes a checkpoint there (not ``final/``: it is not done), says so in one line, and
``csbp train`` exits with :data:`STOPPED_EXIT_CODE` (75, ``EX_TEMPFAIL``: try again), so a job script
can requeue it; ``--resume`` then continues exactly as the uninterrupted run would have.

Who receives it. The launching ``csbp train`` process (its workers start with ``SIGUSR1`` blocked, as
they do ``SIGINT``: :func:`csbp.interrupts.children_hold_sigint`) relays it through a file in its
workers' private directory (:func:`request_stop_of_workers`); a rank that receives it itself (one
process, a rank under your own ``torchrun``, a job scheduler signalling every process) notes it
through the handler :func:`stop_on_sigusr1` installs. A step ends in one collective on every rank
(:meth:`StopRequest.agreed`: whether any rank noted one), so they all stop after the same step,
wherever the signal landed. A rank listens from the start of :func:`csbp.training.trainer.train` (a
request during start-up stops the run after its first step) through its export; a request during
the last step lets the run finish (``final/``, exit 0), since nothing would be left to resume. Under
your own ``torchrun`` every rank exits 75 (torchrun itself then reports a failed launch, 1).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import torch

from csbp.engine.context import ParallelContext
from csbp.training.liveness import REPORT_DIR_ENV

STOP_SIGNAL = signal.SIGUSR1
STOPPED_EXIT_CODE = 75
"""``csbp train``'s exit status after a ``SIGUSR1`` stop (``EX_TEMPFAIL``): checkpointed, not finished."""
STOP_FILE = "stop-requested"
"""Name of the file the launching process writes in :data:`REPORT_DIR_ENV` to relay the request."""


class StopRequest:
    """This rank's note of a stop request, and the ranks' agreement on it after each step."""

    def __init__(self) -> None:
        self.received = False
        directory = os.environ.get(REPORT_DIR_ENV)
        self._relay = Path(directory) / STOP_FILE if directory else None

    def noted(self) -> bool:
        """Whether this rank has received the signal or the launching process relayed it."""
        if not self.received and self._relay is not None and self._relay.exists():
            self.received = True
        return self.received

    def agreed(self, ctx: ParallelContext) -> bool:
        """Whether any rank has noted a request (a collective over the run's world: call it on every
        rank, at the same point of every step)."""
        noted = self.noted()
        comm = ctx.world_comm("control")
        if comm is None:
            return noted
        flag = torch.tensor([int(noted)], dtype=torch.int32, device=ctx.device)
        return bool(comm.all_reduce(flag).item() > 0)


@contextlib.contextmanager
def stop_on_sigusr1(request: StopRequest) -> Iterator[None]:
    """Within the block ``SIGUSR1`` is noted in ``request``, one that arrived while this process was held
    from it at start-up included; the previous handler is put back after it (main thread; elsewhere a
    no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def note(signum: int, frame: FrameType | None) -> None:
        request.received = True

    previous = signal.signal(STOP_SIGNAL, note)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {STOP_SIGNAL})
    try:
        yield
    finally:
        if previous is not None:  # None: installed outside Python, which cannot be put back
            signal.signal(STOP_SIGNAL, previous)


def request_stop_of_workers(report_dir: Path) -> None:
    """In the launching process: ask the workers it started to stop after their current step."""
    (report_dir / STOP_FILE).touch()


def stopped_line(step: int, checkpoint: Path | None, run_dir: Path) -> str:
    """The run's last line after a ``SIGUSR1`` stop."""
    where = f"checkpoint {checkpoint}" if checkpoint is not None else "no checkpoint"
    return (
        f"stopped after step {step} on SIGUSR1 ({where}; the run is not finished, so no final/ was written); "
        f"continue it with: csbp train CONFIG --run-dir {run_dir} --resume"
    )
