"""Interrupts end ``csbp`` with one line: ``csbp: interrupted``, exit code ``128 + signal``.

Ctrl-C (``SIGINT``) already surfaces as ``KeyboardInterrupt``; :func:`sigterm_raises` makes
``SIGTERM`` surface as :class:`Interrupted` too, and the launcher turns torch elastic's
``SignalException`` (raised in the launching process when it receives ``SIGTERM``, or with a torch
before 2.9 ``SIGINT`` too, after it has stopped the workers) into :class:`Interrupted`.
``csbp.cli.main`` catches both.

Processes started inside :func:`children_hold_sigint` begin with ``SIGINT`` blocked, so a Ctrl-C
pressed while they import torch stays pending instead of printing a ``KeyboardInterrupt`` traceback
from each of them; they call :func:`end_on_sigint` once their task is loaded, and a pending Ctrl-C
then ends them at once, without a word (the launching process says ``csbp: interrupted``).

A C++ wait that retries through ``EINTR`` never returns to Python, so no Python handler runs
during it: torch's ``TCPStore`` connecting to a node that is not listening yet, or waiting as the
server for the other nodes, ignored Ctrl-C and ``SIGTERM`` for its whole rendezvous timeout
(15 minutes). Within :func:`signals_end_blocked_waits` such a signal ends the process anyway.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType


class Interrupted(Exception):
    """The run was stopped by signal ``signum``; ``exit_code`` is the shell convention ``128 + signum``."""

    def __init__(self, signum: int) -> None:
        self.signum = int(signum)
        super().__init__(f"interrupted by {signal.Signals(self.signum).name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _raise_interrupted(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signum)


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within the block, ``SIGTERM`` raises :class:`Interrupted` (main thread only; else a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def sigint_deferred() -> Iterator[None]:
    """Within the block a Ctrl-C is only noted, and raised as ``KeyboardInterrupt`` when the block
    ends (unless it ends with an exception of its own). For imports of C extensions: torch's and
    numpy's can swallow a ``KeyboardInterrupt`` raised inside them (the command went on as if no
    Ctrl-C had come) or leave a module half initialised (a later ``AttributeError`` traceback).
    Only where Ctrl-C raises ``KeyboardInterrupt`` (Python's default, main thread); else a no-op."""
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    ):
        yield
        return
    noted: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: noted.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if noted:
        raise KeyboardInterrupt


SigintHandler = Callable[[int, "FrameType | None"], object]


@contextlib.contextmanager
def children_hold_sigint(
    handler: SigintHandler = signal.default_int_handler, *, also: tuple[int, ...] = ()
) -> Iterator[None]:
    """Processes this thread starts within the block begin with ``SIGINT`` blocked (a signal mask is
    inherited through fork and exec; a handler is not, so ignoring it here would lose the Ctrl-C), and
    the signals ``also`` names (``SIGUSR1``: :mod:`csbp.training.stop_request`) too; this process keeps
    its own handlers for those.

    This process still takes Ctrl-C at once, through ``handler`` (``KeyboardInterrupt`` by default;
    unless a library it calls installs its own): a helper thread started before the mask receives the signal and
    Python runs the handler in the main thread as usual. multiprocessing's resource
    tracker is started first, because starting it unblocks ``SIGINT`` in the calling thread. Main
    thread on POSIX only (elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    done = threading.Event()
    receiver = threading.Thread(target=done.wait, name="csbp-sigint-receiver", daemon=True)
    receiver.start()
    outside = signal.signal(signal.SIGINT, handler)  # also when this process started ignoring it
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, *also})
    # Nested so that a KeyboardInterrupt raised inside this exit (the handler runs between any two
    # statements) skips no step after it: a skipped unmask left every later Ctrl-C pending, unseen.
    try:
        try:
            try:
                yield
            finally:
                if outside is not None:  # None: one installed outside Python, which cannot be put back
                    signal.signal(signal.SIGINT, outside)
        finally:
            done.set()
            receiver.join()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # a Ctrl-C still pending arrives now


def end_on_sigint() -> None:
    """In a process started within :func:`children_hold_sigint`: from now on ``SIGINT`` ends it at
    once (the default action, no ``KeyboardInterrupt`` that a library might catch and go on), and a
    Ctrl-C pressed while it started ends it now."""
    take_sigint_back(signal.SIG_DFL)


def take_sigint_back(handler: signal.Handlers | SigintHandler) -> None:
    """In a process started within :func:`children_hold_sigint`: ``SIGINT`` goes to ``handler`` from
    now on, a Ctrl-C pressed while the process started included (main thread)."""
    signal.signal(signal.SIGINT, handler)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


ENDING_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""The signals :func:`signals_end_blocked_waits` watches (both have Python handlers in csbp; a
``SIGHUP`` without one ends the process by its default action already)."""


@contextlib.contextmanager
def signals_end_blocked_waits(
    *, still_waiting: Callable[[], bool], on_end: Callable[[int], None], grace_s: float = 2.0
) -> Iterator[None]:
    """Within the block, a ``SIGINT`` or ``SIGTERM`` that the main thread has not acted on within
    ``grace_s`` while ``still_waiting()`` ends the process: ``on_end(signum)`` (a last word, clean-up
    that cannot wait for the main thread), then exit code ``128 + signum``. Once ``still_waiting()``
    is false (the wait is over) signals are left to their handlers. Python's signal handler writes
    each signal's number to a wakeup pipe from C, blocked main thread or not, and a daemon thread
    reads it. Main thread only (elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    block_ended = threading.Event()

    def watch() -> None:
        while not block_ended.is_set():
            try:
                received = os.read(read_end, 64)
            except OSError:
                return
            for signum in received:
                if signum not in ENDING_SIGNALS or not still_waiting():
                    continue
                if block_ended.wait(grace_s) or not still_waiting():
                    return
                on_end(signum)
                os._exit(128 + signum)

    previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    watcher = threading.Thread(target=watch, name="csbp-blocked-wait-watcher", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous)
        block_ended.set()
        with contextlib.suppress(OSError):
            os.write(write_end, b"\0")  # wakes the watcher
        watcher.join(timeout=grace_s + 1.0)
        os.close(write_end)
        os.close(read_end)
