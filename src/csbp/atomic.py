"""Atomic writes: directories (Hugging Face exports, DFlash exports, feature stores) and single files.

The directory is filled in a temporary sibling and moved into place in one rename (swapped with
an existing one in a single step on Linux), so a reader never sees a half-written directory and a
crash never leaves the path empty. An existing target is replaced only on request, and only when
csbp recognises it as its own output (:class:`Ownership`): an empty directory, or one holding the
kind's marker file and no entry csbp would not have written (a subdirectory or link never is).
Anything else, a symbolic link, the working directory and its parents included, is refused with one
line, before any work starts.

The target is checked again when the finished directory is published (:func:`publish_directory`),
since another process may have created it while the output was being built: without ``overwrite``
the move never replaces anything (``renameat2(RENAME_NOREPLACE)`` on Linux; elsewhere the name is
first claimed with ``mkdir``, which fails on any existing entry), so a directory that appeared is
left untouched and the finished output is discarded with one line; with ``overwrite`` the target
must still pass :func:`check_replaceable`.
Single files go through a new temporary file and ``os.replace`` (:func:`write_text_atomic`), except
a path naming a character device, a named pipe or an open descriptor (``--json /dev/null``,
``/dev/stdout`` even when redirected to a file, a FIFO: :func:`streams_to`), which is written into: it has no contents to keep whole, and ``os.replace``
would put a regular file in its place (run as root, deleting ``/dev/null`` for the whole machine).

Durability: before the move every file of the finished directory (or the temporary file), and the
directory itself, is flushed to disk (``fsync``), and the parent directory is flushed after it, so
that a power cut or kernel crash, not only a killed process, leaves the old or the new complete
version (without this, ``--overwrite`` could leave the new directory's names with empty files after
the old one was deleted).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import re
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from csbp.staging import staging_directory


class OutputExistsError(ValueError):
    """Something exists where a write without ``overwrite`` would publish its output (it may have
    appeared while the output was being built); nothing was replaced."""


@dataclass(frozen=True)
class Ownership:
    """How csbp recognises a directory it wrote: ``marker`` is present and every entry is a regular
    file whose name is in ``names`` (or ends with one of ``suffixes``); ``what`` names the kind in
    messages. A subdirectory or link is never csbp's, whatever its name: ``rmtree`` would take a
    subdirectory's files with it."""

    what: str
    marker: str
    names: frozenset[str]
    suffixes: tuple[str, ...] = ()

    def foreign_entry(self, directory: Path) -> str | None:
        """None when ``directory`` is recognisably ours (or empty), else a file that is not."""
        entries = sorted(directory.iterdir())
        if not entries:
            return None
        if self.marker not in {entry.name for entry in entries}:
            return f"no {self.marker}"
        for entry in entries:
            if entry.name not in self.names and not entry.name.endswith(self.suffixes):
                return f"'{entry.name}'"
            if entry.is_symlink() or not entry.is_file():
                return f"'{entry.name}', which is not a regular file"
        return None


WRITE_PROBE_PREFIX = ".csbp-write-probe-"
"""Name prefix of the file :func:`unwritable_reason` creates and removes at once (another process
checking the same directory may see one)."""


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
        handle, probe = tempfile.mkstemp(prefix=WRITE_PROBE_PREFIX, dir=ancestor)
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
    :func:`check_replaceable`); without it an existing ``path`` is an :class:`OutputExistsError`.
    Both are checked before ``fill`` and again when the result is published
    (:func:`publish_directory`); on any error the staging directory is removed.
    """
    target = Path(path)
    if os.path.lexists(target) and not overwrite:
        raise OutputExistsError(
            f"{flag} {target}: already exists (fix: choose another path, or pass --overwrite)"
        )
    absolute = check_replaceable(target, owned, flag=flag)
    absolute.parent.mkdir(parents=True, exist_ok=True)
    with staging_directory(absolute) as staging:  # removed on any error; a killed writer's by the next one
        staging.chmod(0o755)
        fill(staging)
        publish_directory(staging, absolute, overwrite=overwrite, owned=owned, flag=flag, shown=target)
    return target


def publish_directory(
    built: Path,
    target: Path,
    *,
    overwrite: bool,
    owned: Ownership | None,
    flag: str = "--out",
    shown: str | os.PathLike[str] | None = None,
) -> None:
    """Move the finished directory ``built`` to ``target``, checking ``target`` again first: building
    takes a while, and another process may have created ``target`` meanwhile.

    Without ``overwrite`` nothing at ``target`` is ever replaced (an empty directory, a file or a link
    included): the move fails with an :class:`OutputExistsError` naming ``shown`` (default
    ``target``). With it, an existing ``target`` must still pass :func:`check_replaceable` and is
    swapped out by :func:`replace_directory`. On an error ``built`` is left for the caller to remove.
    """
    shown = target if shown is None else shown
    sync_tree(built)
    if overwrite:
        check_replaceable(target, owned, flag=flag)
        if os.path.lexists(target):
            replace_directory(built, target)
            sync_directory(target.parent)
            return
    if move_without_replacing(built, target):
        sync_directory(target.parent)
        return
    if overwrite:
        raise OutputExistsError(
            f"{flag} {shown}: was created by someone else while csbp was writing it; csbp left it untouched and "
            f"discarded its own output (fix: run again to replace it, or choose another {flag})"
        )
    raise OutputExistsError(
        f"{flag} {shown}: was created by someone else while csbp was writing it; csbp left it untouched and "
        f"discarded its own output (fix: choose another {flag}, or pass --overwrite)"
    )


def replace_directory(built: Path, target: Path) -> None:
    """Move the finished directory ``built`` onto ``target``, which the caller has checked may be
    replaced. An old ``target`` is swapped with it in one atomic step where the system can (Linux
    ``renameat2(RENAME_EXCHANGE)``), so a crash leaves the old or the new directory at ``target``,
    then removed; elsewhere it is moved aside first and removed after the swap (restored if the swap
    fails). A missing ``target`` is created by :func:`move_without_replacing` (an
    :class:`OutputExistsError` if something appears there first)."""
    if not os.path.lexists(target):
        if not move_without_replacing(built, target):
            raise OutputExistsError(f"{target}: another process created it first (fix: run again)")
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


def move_without_replacing(source: Path, target: Path) -> bool:
    """Rename the directory ``source`` to ``target`` unless anything exists at ``target``; False
    (nothing moved, nothing removed) if something does.

    Linux: ``renameat2(RENAME_NOREPLACE)``, one atomic step. Windows' rename never replaces. Other
    systems, and Linux filesystems without the flag: a POSIX rename would silently replace an empty
    directory, so the name is claimed first with ``mkdir`` (which fails on any existing entry) and
    ``source`` renamed onto that claim; a claim someone filled meanwhile makes the rename fail, and
    is kept. (A crash between the two steps leaves an empty directory at ``target``.)"""
    code = _renameat2(source, target, _RENAME_NOREPLACE)
    if code == 0:
        return True
    if code == errno.EEXIST:
        return False
    if code is not None and code not in _UNSUPPORTED:
        raise OSError(code, os.strerror(code), str(source), None, str(target))
    if os.name == "nt":
        try:
            os.rename(source, target)
        except FileExistsError:
            return False
        return True
    try:
        os.mkdir(target, 0o700)
    except FileExistsError:
        return False
    try:
        os.rename(source, target)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.rmdir(target)  # our claim, if still empty; never anything someone put in it
        if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
            return False
        raise
    return True


_AT_FDCWD = -100
_RENAME_NOREPLACE = 1
_RENAME_EXCHANGE = 2
_UNSUPPORTED = (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP)
"""``renameat2`` errors meaning the kernel or filesystem lacks the flag (overlayfs may refuse)."""


def _renameat2(first: Path, second: Path, flags: int) -> int | None:
    """``renameat2(first, second, flags)``: 0 on success, else its errno; None where the call does not
    exist (not Linux, or a C library without the wrapper: glibc < 2.28)."""
    if not sys.platform.startswith("linux"):
        return None
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return None
    if renameat2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), flags) == 0:
        return 0
    return ctypes.get_errno()


def _exchange(first: Path, second: Path) -> bool:
    """Swap two directory entries atomically; False where the system or filesystem cannot."""
    code = _renameat2(first, second, _RENAME_EXCHANGE)
    if code == 0:
        return True
    if code is None or code in (*_UNSUPPORTED, errno.EXDEV):
        return False
    raise OSError(code, os.strerror(code), str(first), None, str(second))


def sync_directory(directory: Path) -> None:
    """``fsync`` a directory, making the entries created, renamed or removed in it durable (a no-op
    on Windows, which cannot open a directory)."""
    if os.name == "nt":
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(directory: Path) -> None:
    """``fsync`` every regular file under ``directory`` and every directory in it, itself included."""
    for root, _, files in os.walk(directory):
        for name in files:
            path = os.path.join(root, name)
            if os.path.isfile(path) and not os.path.islink(path):
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        sync_directory(Path(root))


def write_json_atomic(path: Path, payload: object) -> None:
    """Write JSON through a temporary file and ``os.replace`` (never a half-written artifact)."""
    write_text_atomic(path, json.dumps(payload, indent=2) + "\n")


FD_NAME = re.compile(r"^/(proc/(self|thread-self|\d+)(/task/\d+)?|dev)/fd/\d+$")  # a descriptor by name


def streams_to(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` (links followed) is an existing character device or named pipe, or names an open
    descriptor (:func:`names_a_descriptor`), which a write goes into instead of replacing (module docstring)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return stat.S_ISCHR(mode) or stat.S_ISFIFO(mode) or names_a_descriptor(path)


def names_a_descriptor(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is, or links through, an open file descriptor's name (``/dev/stdout`` ->
    ``/proc/self/fd/1``, ``/dev/fd/N``): redirected to a regular file it is no device, yet replacing it
    would put a file in place of the ``/dev/stdout`` link (run as root, for the whole machine)."""
    current = os.path.abspath(path)
    for _ in range(40):  # the kernel's own limit on links followed
        if FD_NAME.match(current):
            return True
        if not os.path.islink(current):
            return False
        current = os.path.normpath(os.path.join(os.path.dirname(current), os.readlink(current)))
    return False


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` as :func:`write_bytes_atomic` does."""
    write_bytes_atomic(path, text.encode("utf-8"))


def write_bytes_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to a new temporary file next to ``path`` and ``os.replace`` it onto ``path``: a
    crash leaves the old file or the new one, never a mix (the temporary file is removed on an error,
    or left as ``.NAME.tmp-*`` by a crash). A device or pipe is written into (:func:`streams_to`)."""
    target = Path(path)
    if streams_to(target):
        with open(target, "wb") as stream:
            stream.write(data)
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, tmp = tempfile.mkstemp(prefix=f".{target.name}.tmp-", dir=target.parent)
    try:
        with os.fdopen(handle, "wb") as stream:
            stream.write(data)
            stream.flush()
            os.fsync(stream.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
        sync_directory(target.parent)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
