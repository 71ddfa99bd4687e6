"""How a failed training launch is reported: the failing rank's one line, chosen from torch elastic's
error report, and the message of a rank whose collective failed or timed out (naming the peers whose
heartbeat stopped, :mod:`csbp.training.liveness`).

:func:`failure_from_elastic` prefers a rank's own error (the root cause) over the connection errors
it causes in its peers and over ranks that were killed; a checked condition with its own one-line
message (``EXPECTED_ERRORS``) is marked ``expected`` so ``csbp train`` shows no traceback.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from csbp.config.schema import RunConfig
from csbp.training.liveness import Heartbeat, report_stall

STALL_MARKER = "stopped responding"


class TrainingFailed(RuntimeError):
    """A training process failed; ``str()`` is the failing rank's message, ``details`` its traceback,
    ``expected`` whether it is a checked condition (a one-line error, no traceback) rather than a bug."""

    def __init__(self, message: str, details: str = "", *, expected: bool = False) -> None:
        super().__init__(message)
        self.details = details
        self.expected = expected


def collective_failure_message(cfg: RunConfig, rank: int, exc: BaseException, heartbeat: Heartbeat) -> str:
    """One line: which collective limit was hit and which peers stopped answering (those on this
    host are ended, so the launcher need not wait for them)."""
    first_line = (str(exc).splitlines() or [type(exc).__name__])[0]
    limit = f"train.collective_timeout_s={cfg.train.collective_timeout_s:g} s"
    silent = heartbeat.silent_ranks() if is_timeout(exc) else []  # a dead peer closes its connections
    if silent:
        names = ", ".join(peer.describe() for peer in silent)
        message = (
            f"rank {rank}: a collective failed or timed out ({limit}): {names} {STALL_MARKER}, "
            f"so the run was stopped (fix: find out why that rank stalled, then resume with --resume) "
            f"[{first_line}]"
        )
        report_stall(message, silent)
        return message
    return (
        f"rank {rank}: a collective failed or timed out ({limit}); another rank probably died, see its "
        f"error: {first_line}"
    )


COLLECTIVE_FAILURE_MARKERS = (
    "gloo",
    "nccl",
    "connection closed",
    "connection reset",
    "timed out",
    "timeout",
)


def is_timeout(exc: BaseException) -> bool:
    """True when a collective gave up waiting (rather than finding its peer gone)."""
    return any(marker in str(exc).lower() for marker in ("timed out", "timeout"))


def is_collective_failure(exc: BaseException) -> bool:
    """True for errors of the communication backend: a peer that died or a collective timeout.

    NCCL and the c10d store raise ``torch.distributed.DistError`` subclasses; gloo raises a plain
    ``RuntimeError`` ("[...gloo/transport/tcp/pair.cc] Connection closed by peer", "Timed out
    waiting ... for recv").
    """
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(marker in text for marker in COLLECTIVE_FAILURE_MARKERS)


def failure_from_elastic(exc: Any) -> TrainingFailed:
    """The first failing rank's message (and traceback) from torch elastic's error report.

    Preferred, earliest first: a rank's own error (the root cause), then a rank naming a stalled
    peer, then any collective failure, over ranks that were killed (a stalled rank ended by the
    launcher, or a worker torch elastic stopped), whose report says nothing."""
    rank, failure = exc.get_first_failure()
    texts = {r: failure_text(f) for r, f in exc.failures.items()}
    preferences = (
        lambda text: bool(text) and not text.startswith(("TrainingFailed: ", "Signal ")),  # a rank's own error
        lambda text: STALL_MARKER in text,
        lambda text: bool(text) and not text.startswith("Signal "),
    )
    for wanted in preferences:
        chosen = sorted((f.timestamp, r) for r, f in exc.failures.items() if wanted(texts[r]))
        if chosen:
            rank = chosen[0][1]
            failure = exc.failures[rank]
            break
    message: Any = failure.message
    details = ""
    if isinstance(message, dict):
        details = str(message.get("extraInfo", {}).get("py_callstack", ""))
    text = failure_text(failure)
    if not text:
        text = f"exited with code {failure.exitcode} (killed or crashed without a Python error)"
    # A checked condition with its own one-line message is not a bug: csbp train shows no traceback.
    expected = text.startswith(EXPECTED_ERRORS)
    return TrainingFailed(f"training failed on rank {rank}: {text}", details, expected=expected)


EXPECTED_ERRORS = (
    "TrainingFailed: ", "ValueError: ", "NonFiniteTraining: ", "ConfigError: ", "RunDirInUse: ", "CheckpointSaveFailed: ",
    "OutOfDeviceMemory: ",
)


def is_root_cause(message: str) -> bool:
    """True for a rank's own error (not a collective that failed because of another rank, not a kill)."""
    text = message.split(": ", 1)[-1]
    return bool(text) and not text.startswith(("TrainingFailed: ", "Signal ", "exited with code"))


def failure_text(failure: Any) -> str:
    message: Any = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    text = str(message).strip()
    return "" if text.startswith("To enable traceback") else text
