"""A worker of ``csbp train`` (or of :func:`csbp.parallel.launch.run_local`: eval, verify, bench) never
outlives the process that launched it.

torch elastic starts the workers with ``multiprocessing``'s spawn, and torch asks the kernel to
signal a worker when its parent dies (``PR_SET_PDEATHSIG``) only once the worker has imported
everything, seconds after it started. A launcher killed outright (``SIGKILL``, the OOM killer) in
those seconds left its workers running: they waited minutes for the dead launcher's rendezvous
store, holding the output pipe of whatever started ``csbp train`` open, while the run directory's
lock (held by the launcher) was already released. :func:`die_with_launcher`, the first thing a
worker does, closes that gap.

Usage (in the worker, with the launcher's pid passed in)::

    die_with_launcher(launcher_pid)
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
"""``prctl`` option: the signal this process gets when the thread that created it ends (Linux)."""


def die_with_launcher(launcher_pid: int) -> None:
    """Have the kernel ``SIGKILL`` this process when its parent ends (Linux), and end it at once when
    its parent is no longer ``launcher_pid`` (the launcher died before that was set up)."""
    if sys.platform.startswith("linux"):
        prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != launcher_pid:
        os._exit(1)
