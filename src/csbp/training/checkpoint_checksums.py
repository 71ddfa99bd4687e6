"""CRC32 checksums of a checkpoint's DCP files: recorded when it is saved, verified before it is used.

The structural checks of :func:`csbp.training.checkpoint_integrity.checkpoint_problem` (files
present, long enough, metadata readable) cannot see bytes that changed in place: a disk or copy
error, a bad sector, a partial ``rsync`` over an older checkpoint. So every file DCP writes into a
checkpoint (``.metadata`` and every ``__<rank>_<n>.distcp``) gets a CRC32 when it is saved:

* :func:`record_checksums` is called by every rank right after ``dcp.save``: each rank checksums
  only the ``__<rank>_*.distcp`` files it wrote (those the saved metadata names and those the
  directory holds: torch 2.11's DCP names no item in a file of a rank that saved only replicated
  tensors; the ranks read in parallel, each what it has just written, from its page cache), rank 0 ``.metadata``
  as well, and the per-rank results are gathered with ``all_gather_object`` on the world group (gloo
  on the CPU; NCCL on GPUs, where the trainer has made the rank's GPU current before the group
  exists). Rank 0 then checksums any DCP file of the directory no rank claimed (a safety net should
  DCP's file naming change) and writes the record into ``trainer_state.json`` as ``checksums``,
  before the checkpoint directory is published and ``latest`` moves (:mod:`csbp.training.checkpoint`).
* :func:`checksum_problem` compares the files with that record: size first (no read), then the CRC of
  each file, streamed in 16 MiB chunks. It returns one line naming the first file that differs.

CRC32 detects accidental corruption, not tampering (a crafted checkpoint is already harmless:
:mod:`csbp.training.checkpoint_integrity` unpickles nothing but DCP's metadata classes). A checkpoint
written before checksums were recorded (no ``checksums`` in ``trainer_state.json``) is accepted as
before, with its structural checks only.

Each file is read at most once per process: a file's CRC is remembered under its identity (path,
size, modification and change times, inode), so the pre-flight, the resume selection and the load of
one ``csbp train`` (or ``csbp export``'s selection and export) share one read, and a file that changes
afterwards is read again. The launcher hands what its pre-flight verified to the workers it starts
(:func:`verified_files`, :func:`remember_verified`), so a launch reads each file once per node, not
once per rank (under an outside ``torchrun`` every rank runs its own pre-flight: once per rank).

Measured cost on the shared 2-core development machine (page cache warm, a 1 GiB checkpoint in one
file): 0.55-0.65 s per GiB to checksum (``zlib.crc32`` over 16 MiB chunks, about 1.7 GiB/s), against
3.3-4.0 s per GiB for ``dcp.save`` itself; verifying costs the same per GiB read (cold files: what
the disk delivers). A save re-reads what each rank just wrote, from the page cache, so it takes
about that much longer per GiB on the rank with the most bytes; a second check of unchanged files in
one process reads nothing. See ``docs/failures.md``.
"""

from __future__ import annotations

import os
import re
import zlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch.distributed as dist

CHECKSUMS_KEY = "checksums"
"""The ``trainer_state.json`` field holding the record: ``{"algorithm": "crc32", "files": {name:
{"size": bytes, "crc32": "8 hex digits"}}}``."""
ALGORITHM = "crc32"
METADATA_FILE = ".metadata"
DATA_SUFFIX = ".distcp"
CHUNK_BYTES = 16 << 20
MAX_READERS = 8
"""Threads :func:`checksum_problem` reads files on."""
_HEX8 = re.compile(r"^[0-9a-f]{8}$")

_FileKey = tuple[str, int, int, int, int, int]
_crc_cache: dict[_FileKey, int] = {}


def file_crc32(path: Path) -> int:
    """The CRC32 of file ``path``, streamed in ``CHUNK_BYTES`` chunks (``OSError`` if unreadable)."""
    buffer = bytearray(CHUNK_BYTES)
    view = memoryview(buffer)
    crc = 0
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(buffer):
            crc = zlib.crc32(view[:count], crc)
    return crc


def _file_key(path: Path) -> _FileKey:
    stat = path.stat()
    return (str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, stat.st_dev)


def cached_crc32(path: Path) -> int:
    """:func:`file_crc32` of ``path``, read only when this process has not read that file as it is now."""
    key = _file_key(path)
    if key not in _crc_cache:
        _crc_cache[key] = file_crc32(path)
    return _crc_cache[key]


def verified_files() -> list[tuple[_FileKey, int]]:
    """The CRCs this process has read, as :func:`remember_verified` takes them (plain, picklable)."""
    return list(_crc_cache.items())


def remember_verified(entries: list[tuple[_FileKey, int]]) -> None:
    """Adopt CRCs another process of this command read (the launcher's pre-flight): a file whose
    identity still matches is not read again here."""
    for key, crc in entries:
        _crc_cache[tuple(key)] = int(crc)  # type: ignore[assignment]


def dcp_files(directory: Path) -> list[str]:
    """The names of the files DCP wrote into ``directory``: ``.metadata`` and every ``*.distcp``."""
    return sorted(p.name for p in Path(directory).iterdir() if _is_dcp_file(p.name) and p.is_file())


def _is_dcp_file(name: str) -> bool:
    return name == METADATA_FILE or name.endswith(DATA_SUFFIX)


def rank_files(data_files: Iterable[str], rank: int) -> list[str]:
    """Of the data files one ``dcp.save`` wrote (the names its metadata records), those rank ``rank``
    wrote: DCP names them ``__<rank>_<n>.distcp``. The coordinator, rank 0, also wrote ``.metadata``."""
    prefix = f"__{rank}_"
    own = sorted({name for name in data_files if name.startswith(prefix) and name.endswith(DATA_SUFFIX)})
    return [METADATA_FILE, *own] if rank == 0 else own


def checksum_entries(directory: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """``{name: {"size", "crc32"}}`` of the files ``names`` of ``directory``."""
    entries = {}
    for name in names:
        path = Path(directory) / name
        entries[name] = {"size": path.stat().st_size, "crc32": f"{file_crc32(path):08x}"}
    return entries


def record_checksums(directory: Path, data_files: Iterable[str]) -> dict[str, Any]:
    """The checksum record of the DCP checkpoint just saved into ``directory``, whose metadata names
    ``data_files`` (call on every rank after ``dcp.save``; a collective when ``torch.distributed`` is
    initialised). Each rank reads only the files it wrote; rank 0, which writes the record, also lists
    the directory and reads any DCP file no rank claimed (a data file DCP wrote without an item in it,
    or another naming in a later torch). Every rank returns the gathered record."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    own = checksum_entries(directory, rank_files({*data_files, *dcp_files(directory)}, rank))
    parts: list[Any] = [own]
    if dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, own)  # NCCL: the rank's GPU is current (csbp.training.trainer)
    files: dict[str, dict[str, Any]] = {}
    for part in parts:
        files.update(part or {})
    if rank == 0:
        files.update(checksum_entries(directory, [name for name in dcp_files(directory) if name not in files]))
    return {"algorithm": ALGORITHM, "files": dict(sorted(files.items()))}


def parse_record(record: Any, source: Path) -> dict[str, tuple[int, int]] | str:
    """``{name: (size, crc)}`` from a ``checksums`` record, or one line saying why it is malformed."""
    bad = f"{source}: its '{CHECKSUMS_KEY}' record is malformed; the checkpoint is damaged"
    if not isinstance(record, dict) or record.get("algorithm") != ALGORITHM:
        return bad
    files = record.get("files")
    if not isinstance(files, dict) or METADATA_FILE not in files:
        return bad
    parsed: dict[str, tuple[int, int]] = {}
    for name, entry in files.items():
        if not isinstance(name, str) or Path(name).name != name or not _is_dcp_file(name):
            return bad
        size = entry.get("size") if isinstance(entry, dict) else None
        crc = entry.get("crc32") if isinstance(entry, dict) else None
        if type(size) is not int or size < 0 or not isinstance(crc, str) or not _HEX8.match(crc):
            return bad
        parsed[name] = (size, int(crc, 16))
    return parsed


def checksum_problem(checkpoint: Path, record: Any, source: Path, *, names: list[str] | None = None) -> str | None:
    """None when the files of ``checkpoint`` match checksum ``record`` (read from ``source``), else
    one line naming the first file that does not (or the malformed record). ``names`` limits the check
    to those files (each must have a checksum); by default every recorded file is checked, ``.metadata``
    first. Sizes are compared before any file is read; the CRCs of several files are computed on up to
    ``MAX_READERS`` threads (``zlib.crc32`` releases the GIL)."""
    parsed = parse_record(record, source)
    if isinstance(parsed, str):
        return parsed
    order = names if names is not None else sorted(parsed, key=lambda n: (n != METADATA_FILE, n))
    for name in order:
        path = Path(checkpoint) / name
        if name not in parsed:
            return f"{path} has no checksum in {source} (the checkpoint was changed after it was saved)"
        try:
            found_size = path.stat().st_size
        except FileNotFoundError:
            return f"{path} is missing"
        except OSError as exc:
            return f"{path} is unreadable ({exc.strerror or exc})"
        size = parsed[name][0]
        if found_size != size:
            shorter = "is truncated" if found_size < size else "has grown"
            return f"{path} {shorter} ({found_size} bytes, {size} when it was saved)"
    readers = max(1, min(len(order), os.cpu_count() or 1, MAX_READERS))
    with ThreadPoolExecutor(max_workers=readers) as pool:
        found = list(pool.map(lambda name: _crc_or_error(Path(checkpoint) / name), order))
    for name, crc in zip(order, found, strict=True):
        path = Path(checkpoint) / name
        if isinstance(crc, OSError):
            return f"{path} is unreadable ({crc.strerror or crc})"
        if crc != parsed[name][1]:
            return (
                f"{path} does not match the checksum recorded when it was saved "
                f"(crc32 {crc:08x}, recorded {parsed[name][1]:08x}): its bytes were changed or damaged"
            )
    return None


def _crc_or_error(path: Path) -> int | OSError:
    try:
        return cached_crc32(path)
    except OSError as exc:
        return exc
