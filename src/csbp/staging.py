"""Staging directories of atomic writes, and the ones killed writers leave behind.

An atomic directory write (:mod:`csbp.atomic`, ``csbp data prepare``) builds its output in a hidden
sibling ``.NAME.tmp-XXXX`` and renames it into place. A writer killed with ``SIGKILL`` (or by the
out-of-memory killer, a lost node) cannot remove its sibling, and for a data artifact or a feature
store that can be as large as the output itself; nothing else would ever delete it.

So every staging directory has a lock file beside it, ``.NAME.tmp-XXXX.lock``, on which its writer
holds an exclusive ``flock`` for as long as it lives (the lock file is created under another name,
locked, then renamed into place, so no one can lock it first). The operating system releases the
lock when the writer dies, however it dies. The next write of the same ``NAME``
(:func:`staging_directory`) takes each sibling's lock without waiting: a lock it obtains belonged to
a dead writer, whose directory it removes, with one line on stderr; a lock it cannot obtain belongs
to a live writer, whose directory is left alone. A staging directory without a lock file (written
by an older csbp, or where locks are unavailable, e.g. some network filesystems) is never removed.

**Resumable writes** (a DFlash feature capture, hours long) pass ``resume``, which tells, for a
staging directory, how much of *this very write* it holds committed (``None``: nothing it can
continue; a ``ValueError``: the directory holds another write's progress, which is not thrown away
silently). A dead writer's directory with committed progress is then *adopted* (its lock kept, the
directory yielded as the staging directory) instead of removed: the one with the most progress,
while the other dead ones are removed as usual. And a write that fails or is interrupted (Ctrl-C,
``SIGTERM``) keeps its staging directory when ``resume`` says it holds progress, releasing the lock
so that the next write adopts it; a ``SIGKILL`` leaves it anyway.

Usage::

    with staging_directory(out_dir) as build_dir:
        ...  # fill build_dir, then publish it (rename) to out_dir
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # not a POSIX system: no locks, nothing is ever removed
    fcntl = None  # type: ignore[assignment]

LOCK_SUFFIX = ".lock"


def staging_prefix(target: Path) -> str:
    """The name prefix of ``target``'s staging directories."""
    return f".{target.name}.tmp-"


@contextlib.contextmanager
def staging_directory(target: Path, *, resume: Callable[[Path], int | None] | None = None) -> Iterator[Path]:
    """A locked staging directory beside ``target`` (``target``'s parent must exist), after removing
    those that dead writers of ``target`` left; on exit the directory (if it was not published) and
    its lock file are removed. With ``resume`` (module docstring) a dead writer's directory holding
    progress is yielded instead of a new one, and a failed write's directory holding progress is kept."""
    adopted = _adopt_abandoned_staging(target, resume) if resume is not None else None
    if adopted is None:
        remove_abandoned_staging(target)
        staging = Path(tempfile.mkdtemp(prefix=staging_prefix(target), dir=target.parent))
        lock = _hold_lock(staging)
    else:
        staging, lock = adopted
    keep = False
    try:
        yield staging
    except BaseException:
        keep = resume is not None and lock is not None and staging.is_dir() and _progress(resume, staging) is not None
        if keep:
            print(f"csbp: kept the interrupted write of {target} in {staging}; run the same command again to "
                  "resume it", file=sys.stderr)
        raise
    finally:
        if not keep:
            shutil.rmtree(staging, ignore_errors=True)  # gone already when it was published
        if lock is not None:
            if not keep:  # a kept directory's lock file marks it for the next write (its lock is free now)
                with contextlib.suppress(OSError):
                    os.unlink(f"{staging}{LOCK_SUFFIX}")
            os.close(lock)


def remove_abandoned_staging(target: Path, *, report: bool = True) -> list[Path]:
    """Remove the staging directories of ``target`` whose writers are dead (their lock is free);
    returns them (and says so on stderr with ``report``)."""
    removed = []
    for staging, fd in _lock_abandoned_staging(target):
        try:
            _remove_locked(staging)
            removed.append(staging)
        finally:
            os.close(fd)
    if report:
        _report_removed(target, removed)
    return removed


def _adopt_abandoned_staging(target: Path, resume: Callable[[Path], int | None]) -> tuple[Path, int] | None:
    """The dead writers' staging directory of ``target`` with the most progress, its lock held (the
    other dead writers' directories removed); None when none holds progress."""
    locked = _lock_abandoned_staging(target)
    try:
        progress = [(resume(staging), staging, fd) for staging, fd in locked]  # a ValueError: nothing touched
    except BaseException:
        for _, fd in locked:
            os.close(fd)
        raise
    candidates = [(done, staging.name, staging, fd) for done, staging, fd in progress if done is not None]
    chosen = max(candidates, key=lambda c: (c[0], c[1]), default=None)
    removed = []
    for _, staging, fd in progress:
        if chosen is not None and staging == chosen[2]:
            continue
        _remove_locked(staging)
        removed.append(staging)
        os.close(fd)
    _report_removed(target, removed)
    return None if chosen is None else (chosen[2], chosen[3])


def _progress(resume: Callable[[Path], int | None], staging: Path) -> int | None:
    """``resume(staging)``, None when it cannot tell (an unreadable directory is not worth keeping)."""
    try:
        return resume(staging)
    except (ValueError, OSError):
        return None


def _lock_abandoned_staging(target: Path) -> list[tuple[Path, int]]:
    """The staging directories of ``target`` whose writers are dead, each with an open descriptor
    holding its lock (the caller closes them)."""
    if fcntl is None or not target.parent.is_dir():
        return []
    locked = []
    for lock_file in sorted(target.parent.glob(f"{staging_prefix(target)}*{LOCK_SUFFIX}")):
        staging = lock_file.with_name(lock_file.name[: -len(LOCK_SUFFIX)])
        try:
            fd = os.open(lock_file, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue  # removed meanwhile, or a link: not ours to judge
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # its writer is alive (or locks do not work here): leave it
        if not lock_file.exists() or not staging.is_dir() or staging.is_symlink():
            if lock_file.exists():  # a lock file without its directory
                with contextlib.suppress(OSError):
                    os.unlink(lock_file)
            os.close(fd)
            continue
        locked.append((staging, fd))
    return locked


def _remove_locked(staging: Path) -> None:
    """Remove a dead writer's staging directory and its lock file (whose lock the caller holds)."""
    shutil.rmtree(staging, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.unlink(f"{staging}{LOCK_SUFFIX}")


def _report_removed(target: Path, removed: list[Path]) -> None:
    if removed:
        names = ", ".join(path.name for path in removed)
        print(f"csbp: removed {len(removed)} staging director{'y' if len(removed) == 1 else 'ies'} "
              f"that interrupted writes of {target} left ({names})", file=sys.stderr)


def _hold_lock(staging: Path) -> int | None:
    """An open descriptor holding the exclusive lock of ``staging``'s lock file; None where locks
    are unavailable (the staging directory is then never removed by anyone else)."""
    if fcntl is None:
        return None
    fd, pending = tempfile.mkstemp(prefix=f".{staging.name}.", suffix=".pending", dir=staging.parent)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # new file: only an unsupported lock can fail
        os.rename(pending, f"{staging}{LOCK_SUFFIX}")  # visible only once locked
    except OSError:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(pending)
        return None
    return fd
