"""Interrupts end ``csbp`` with one line: ``csbp: interrupted``, exit code ``128 + signal``.

Ctrl-C (``SIGINT``) already surfaces as ``KeyboardInterrupt``; :func:`sigterm_raises` makes
``SIGTERM`` surface as :class:`Interrupted` too, and the launcher turns torch elastic's
``SignalException`` (raised in the launching process when it receives either signal, after it has
stopped the workers) into :class:`Interrupted`. ``csbp.cli.main`` catches both.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
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
