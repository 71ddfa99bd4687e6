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
from collections.abc import Iterator
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
def staging_directory(target: Path) -> Iterator[Path]:
    """A new, locked staging directory beside ``target`` (``target``'s parent must exist), after
    removing those that dead writers of ``target`` left; on exit the directory (if it was not
    published) and its lock file are removed."""
    remove_abandoned_staging(target)
    staging = Path(tempfile.mkdtemp(prefix=staging_prefix(target), dir=target.parent))
    lock = _hold_lock(staging)
    try:
        yield staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone already when it was published
        if lock is not None:
            with contextlib.suppress(OSError):
                os.unlink(f"{staging}{LOCK_SUFFIX}")
            os.close(lock)


def remove_abandoned_staging(target: Path) -> list[Path]:
    """Remove the staging directories of ``target`` whose writers are dead (their lock is free);
    returns them."""
    if fcntl is None or not target.parent.is_dir():
        return []
    removed = []
    for lock_file in sorted(target.parent.glob(f"{staging_prefix(target)}*{LOCK_SUFFIX}")):
        staging = lock_file.with_name(lock_file.name[: -len(LOCK_SUFFIX)])
        try:
            fd = os.open(lock_file, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue  # removed meanwhile, or a link: not ours to judge
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its writer is alive (or locks do not work here): leave it
            if staging.is_dir() and not staging.is_symlink():
                shutil.rmtree(staging, ignore_errors=True)
                removed.append(staging)
            with contextlib.suppress(OSError):
                os.unlink(lock_file)
        finally:
            os.close(fd)
    if removed:
        names = ", ".join(path.name for path in removed)
        print(f"csbp: removed {len(removed)} staging director{'y' if len(removed) == 1 else 'ies'} "
              f"that interrupted writes of {target} left ({names})", file=sys.stderr)
    return removed


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
