"""One csbp process per run directory: an exclusive advisory lock on ``RUN_DIR/.lock``.

Two ``csbp train`` (or ``csbp compare``) processes writing the same directory corrupt each other's
run: their checkpoint staging directories collide and ``metrics.jsonl`` interleaves. The process
that starts the run (the launcher of the workers, see :mod:`csbp.training.launcher`) takes a
non-blocking ``fcntl.flock`` on ``RUN_DIR/.lock`` before any data is read or process started and
holds it until the run ends; a second one is refused with :class:`RunDirInUse`, one line naming the
holder's pid, which the lock file records.

The operating system releases the lock when its holder dies (``SIGKILL`` included); the file then
left behind is one of the entries a run directory may hold (``RUN_DIR_ENTRIES`` of
:mod:`csbp.training.preflight`) and is reused by the next run. On a normal exit, error or not, the
holder removes the file, and the directory if it created it and nothing else was written. A
process that opened the file just before it was removed would lock a deleted file, so after
locking it checks that the path still names the file it holds, and starts over if not.

Usage::

    with run_dir_lock(run_dir):
        ...  # check, load data, launch workers, train
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
from collections.abc import Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # not a POSIX system: no advisory locks, nothing is checked
    fcntl = None  # type: ignore[assignment]

LOCK_FILE = ".lock"
"""The lock file's name in a run directory."""

_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
"""``flock`` errors of a filesystem without locks (an NFS mount without a lock daemon, some FUSE)."""


class RunDirInUse(ValueError):
    """Another live process holds the directory's lock; the message is one line with the fix."""


@contextlib.contextmanager
def run_dir_lock(
    run_dir: str | os.PathLike[str], *, flag: str = "--run-dir", what: str = "run directory"
) -> Iterator[None]:
    """Hold the exclusive lock of ``run_dir`` (created if absent) for the ``with`` block.

    Raises :class:`RunDirInUse`, naming ``what``, ``run_dir``, the holder's pid and ``flag`` in its
    fix, when another process holds it. On a filesystem that cannot lock, a note goes to stderr and
    the block runs unlocked.
    """
    directory = Path(run_dir)
    created = _missing_directories(directory)
    directory.mkdir(parents=True, exist_ok=True)
    try:
        handle = _acquire(directory / LOCK_FILE, f"{what} {run_dir}", flag)
    except BaseException:
        _remove_if_empty(created)
        raise
    try:
        yield
    finally:
        if handle is not None:
            _release(handle, directory / LOCK_FILE)
        _remove_if_empty(created)


def _acquire(path: Path, named: str, flag: str) -> int | None:
    """The open, locked descriptor of ``path`` with this pid written in it; None where locks are
    unavailable."""
    if fcntl is None:
        return None
    while True:
        handle = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _recorded_pid(handle)
            os.close(handle)
            holder = f"another csbp process (pid {pid})" if pid is not None else "another csbp process"
            raise RunDirInUse(
                f"{named} is in use by {holder} (fix: wait for it, or choose another {flag})"
            ) from None
        except OSError as exc:
            os.close(handle)
            if exc.errno not in _NO_LOCKS:
                raise
            print(
                f"note: {path}: this filesystem cannot lock files ({exc.strerror}), so csbp cannot tell whether "
                "another process uses this directory; run one process per directory",
                file=sys.stderr,
                flush=True,
            )
            return None
        if _names(path, handle):
            break
        os.close(handle)  # its holder removed it after this process opened it: lock the new one
    os.ftruncate(handle, 0)
    os.write(handle, f"{os.getpid()}\n".encode())
    return handle


def _release(handle: int, path: Path) -> None:
    """Remove the lock file (still locked, so no process can take it in between), then unlock."""
    try:
        if _names(path, handle):
            with contextlib.suppress(OSError):
                path.unlink()
    finally:
        os.close(handle)


def _names(path: Path, handle: int) -> bool:
    """True when ``path`` is the file open as ``handle`` (not removed or replaced since)."""
    try:
        current = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    held = os.fstat(handle)
    return (current.st_dev, current.st_ino) == (held.st_dev, held.st_ino)


def _recorded_pid(handle: int) -> int | None:
    """The pid the holder wrote, or None (not written yet, or not a number)."""
    with contextlib.suppress(OSError, ValueError):
        return int(os.pread(handle, 32, 0).decode("ascii").strip())
    return None


def _missing_directories(directory: Path) -> list[Path]:
    """``directory`` and its ancestors that do not exist yet, deepest first."""
    missing = []
    for candidate in (directory, *directory.parents):
        if os.path.lexists(candidate):
            break
        missing.append(candidate)
    return missing


def _remove_if_empty(created: list[Path]) -> None:
    """Remove the directories this process created, deepest first, while nothing was written to them
    (``rmdir`` never removes more), so a run refused before it started leaves nothing behind."""
    for directory in created:
        try:
            directory.rmdir()
        except OSError:
            return
