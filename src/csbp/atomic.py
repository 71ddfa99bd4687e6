"""Atomic writes: directories (Hugging Face exports, DFlash exports, feature stores) and single files.

The directory is filled in a temporary sibling and moved into place with ``os.replace`` (swapped
with an existing one in a single step on Linux), so a reader never sees a half-written directory
and a crash never leaves the path empty. An existing target is replaced only on request, and only
when csbp recognises it as its own output (:class:`Ownership`): an empty directory, or one holding
the kind's marker file and no file csbp would not have written. Anything else, a symbolic link, the
working directory and its parents included, is refused with one line, before any work starts.
Single files go through a new temporary file and ``os.replace`` (:func:`write_text_atomic`).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Ownership:
    """How csbp recognises a directory it wrote: ``marker`` is present and every entry's name is in
    ``names`` (or ends with one of ``suffixes``); ``what`` names the kind in messages."""

    what: str
    marker: str
    names: frozenset[str]
    suffixes: tuple[str, ...] = ()

    def foreign_entry(self, directory: Path) -> str | None:
        """None when ``directory`` is recognisably ours (or empty), else a file that is not."""
        entries = sorted(entry.name for entry in directory.iterdir())
        if not entries:
            return None
        if self.marker not in entries:
            return f"no {self.marker}"
        for name in entries:
            if name not in self.names and not name.endswith(self.suffixes):
                return f"'{name}'"
        return None


def unwritable_reason(directory: str | os.PathLike[str]) -> str | None:
    """Why nothing can be created at or under ``directory`` (which may not exist yet), or None.

    Its nearest existing ancestor must be a directory in which a file can be created; the check
    creates and removes a temporary file there, so it also catches what ``os.access`` misses (root
    on a read-only or virtual filesystem)."""
    ancestor = Path(os.path.abspath(directory))
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        return f"{ancestor} is a file, not a directory"
    try:
        handle, probe = tempfile.mkstemp(prefix=".csbp-write-probe-", dir=ancestor)
    except OSError as exc:
        return f"{ancestor} is not writable ({exc.strerror or type(exc).__name__})"
    os.close(handle)
    os.unlink(probe)
    return None


def check_replaceable(target: str | os.PathLike[str], owned: Ownership | None, *, flag: str = "--out") -> Path:
    """``ValueError`` unless ``target`` may be replaced by an ``--overwrite`` write; returns its absolute path."""
    path = Path(os.path.abspath(target))
    if path.is_symlink():
        raise ValueError(
            f"{flag} {target}: is a symbolic link; --overwrite replaces only a real directory "
            "(fix: pass the directory it points to, or remove the link)"
        )
    cwd = Path.cwd().absolute()
    if path == cwd or path in cwd.parents:
        raise ValueError(
            f"{flag} {target}: is the working directory or one of its parents, which csbp never replaces "
            "(fix: pass a new subdirectory)"
        )
    problem = unwritable_reason(path.parent)
    if problem is not None:
        raise ValueError(f"{flag} {target}: {problem} (fix: choose another path)")
    if not path.exists():
        return path
    if not path.is_dir():
        raise ValueError(f"{flag} {target}: exists and is not a directory (fix: choose another path)")
    foreign = owned.foreign_entry(path) if owned is not None else ("an existing file" if any(path.iterdir()) else None)
    if foreign is not None:
        what = owned.what if owned is not None else "output"
        raise ValueError(
            f"{flag} {target}: --overwrite replaces only a {what} csbp wrote, and this directory has {foreign} "
            "(fix: choose another path, or remove it yourself)"
        )
    return path


def write_directory_atomically(
    path: str | os.PathLike[str],
    fill: Callable[[Path], None],
    *,
    overwrite: bool,
    owned: Ownership | None = None,
    flag: str = "--out",
) -> Path:
    """Call ``fill(staging_dir)`` and move the result to ``path``; returns ``path``.

    With ``overwrite`` an existing ``path`` is replaced when ``owned`` recognises it (see
    :func:`check_replaceable`); without it an existing ``path`` is an error.
    """
    target = Path(path)
    if target.exists() and not overwrite:
        raise ValueError(f"{flag} {target}: already exists (fix: choose another path, or pass --overwrite / overwrite=True)")
    absolute = check_replaceable(target, owned, flag=flag)
    absolute.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{absolute.name}.tmp-", dir=absolute.parent))
    try:
        staging.chmod(0o755)
        fill(staging)
        replace_directory(staging, absolute)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def replace_directory(built: Path, target: Path) -> None:
    """Move the finished directory ``built`` onto ``target``. An old ``target`` is swapped with it in
    one atomic step where the system can (Linux ``renameat2(RENAME_EXCHANGE)``), so a crash leaves
    the old or the new directory at ``target``, then removed; elsewhere it is moved aside first and
    removed after the swap (restored if the swap fails)."""
    if not target.exists():
        os.replace(built, target)
        return
    if _exchange(built, target):
        shutil.rmtree(built, ignore_errors=True)  # ``built`` now holds the old directory
        return
    retired = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    try:
        os.replace(target, retired / "previous")
        try:
            os.replace(built, target)
        except BaseException:
            os.replace(retired / "previous", target)
            raise
    finally:
        shutil.rmtree(retired, ignore_errors=True)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(first: Path, second: Path) -> bool:
    """Swap two directory entries atomically; False where the system or filesystem cannot."""
    if not sys.platform.startswith("linux"):
        return False
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:  # a C library without the wrapper (glibc < 2.28)
        return False
    result = renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE)
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EXDEV):  # overlayfs may refuse
        return False
    raise OSError(code, os.strerror(code), str(first), None, str(second))


def write_json_atomic(path: Path, payload: object) -> None:
    """Write JSON through a temporary file and ``os.replace`` (never a half-written artifact)."""
    write_text_atomic(path, json.dumps(payload, indent=2) + "\n")


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to a new temporary file next to ``path`` and ``os.replace`` it onto
    ``path``: a crash leaves the old file or the new one, never a mix (the temporary file is
    removed on an error, or left as ``.NAME.tmp-*`` by a crash)."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            stream.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
