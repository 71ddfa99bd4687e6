"""Reading training checkpoints safely: no code from checkpoint files, damage found before launch.

A ``torch.distributed.checkpoint`` (DCP) directory holds ``.metadata`` (a pickle) and
``__<rank>_0.distcp`` files (tensors, plus ``torch.save`` pickles for non-tensor values such as
optimizer hyper-parameters). Stock DCP unpickles both with the full :mod:`pickle` machinery, so a
crafted checkpoint runs code on load. Here:

* :func:`read_metadata` reads ``.metadata`` with :class:`MetadataUnpickler`, which admits only the
  DCP metadata dataclasses, ``torch.Size``, dtypes/layouts and plain containers, and mutates nothing
  but containers and metadata instances the file built (no attribute of a class, enum member or
  dtype can be set); anything else is a ``ValueError`` naming the file and what was refused, as is a
  data file named outside the checkpoint directory (``../x``, ``/etc/passwd``, a link leading out);
* :class:`SafeFileSystemReader` and :class:`SafeLoadPlanner` make ``dcp.load`` use that reader and
  load non-tensor items with ``torch.load(weights_only=True)``; :func:`safe_dcp_load` is the call;
* :func:`checkpoint_problem` checks a checkpoint before any tensor is loaded: ``trainer_state.json``
  parses, ``.metadata`` reads safely, every tensor shape it declares is backed by as many stored
  bytes (nothing is sized from a forged shape), every file it names exists and is long enough, and,
  when the checkpoint recorded checksums (:mod:`csbp.training.checkpoint_checksums`; older ones did
  not and are accepted without), every DCP file it was saved with still has its recorded CRC32: each
  file the metadata names (which must be recorded) and each file the record lists, also one no item
  names (DCP writes such a file for a rank that saved only replicated tensors): missing or changed, it
  means a partial copy or damage even where the load would not read it. A DCP file neither names
  (copied in after the save) is no part of the checkpoint and is ignored: every byte a load reads is
  still verified, and accidental damage does not create files;
* :func:`resume_checkpoint` picks the checkpoint ``--resume`` uses: the one ``latest`` names when it
  is intact, else the newest intact ``step_*`` directory (the damaged ones are reported), else a
  one-line ``ValueError``.
"""

from __future__ import annotations

import io
import json
import math
import pickle
import pickletools
import re
import reprlib
import warnings
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as filesystem_module
import torch.distributed.checkpoint.metadata as metadata_module
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import ReadItem

from csbp.interrupts import Interrupted
from csbp.training.checkpoint_checksums import CHECKSUMS_KEY, METADATA_FILE, checksum_problem, parse_record

STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d{7,})$")

_ALLOWED_GLOBALS: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "MetadataIndex",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo", "_StoragePrefix"}),
    "torch.distributed.checkpoint.planner": frozenset({"WriteItemType", "LoadItemType"}),
    "torch": frozenset({"Size"} | {name for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype)})
    | frozenset({"strided", "sparse_coo", "sparse_csr"}),
    "torch.serialization": frozenset({"_get_layout"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "tuple", "list", "dict", "slice", "complex"}),
    "copyreg": frozenset({"_reconstructor"}),
}


_BUILDABLE: frozenset[type] = frozenset(
    {
        metadata_module.Metadata,
        metadata_module.MetadataIndex,
        metadata_module.TensorStorageMetadata,
        metadata_module.BytesStorageMetadata,
        metadata_module.ChunkStorageMetadata,
        metadata_module.TensorProperties,
        metadata_module.StorageMeta,
        filesystem_module._StorageInfo,
        filesystem_module._StoragePrefix,
    }
)
"""The only types whose instances the BUILD opcode may fill in (DCP's metadata dataclasses)."""


def _mutated(unpickler: Any, opcode: bytes) -> object:
    """The object ``opcode`` is about to mutate: below its operands, or below the mark for the
    opcodes that take a marked run of items (the pure-Python unpickler keeps that in ``metastack``)."""
    if opcode in (pickle.SETITEMS, pickle.APPENDS, pickle.ADDITEMS):
        return unpickler.metastack[-1][-1]
    return unpickler.stack[-3] if opcode == pickle.SETITEM else unpickler.stack[-2]


def _guarded(opcode: bytes, allowed: tuple[type, ...]) -> Callable[[Any], None]:
    """A dispatch entry for ``opcode`` that runs the stock one only when the object it mutates is
    exactly of a type in ``allowed`` (and, for BUILD, the state is a plain attribute dict unless the
    type has its own ``__setstate__``)."""
    stock = pickle._Unpickler.dispatch[opcode[0]]  # type: ignore[attr-defined]
    name = next(op.name for op in pickletools.opcodes if op.code.encode("latin-1") == opcode)

    def load(self: Any) -> None:
        target = _mutated(self, opcode)
        if type(target) not in allowed:
            kind = target.__qualname__ if isinstance(target, type) else type(target).__qualname__
            shown = f"the class {kind}" if isinstance(target, type) else f"a {kind}"
            raise pickle.UnpicklingError(f"refused {name} on {shown}")
        if opcode == pickle.BUILD and "__setstate__" not in type(target).__dict__:
            state = self.stack[-1]
            if not (isinstance(state, dict) and all(type(key) is str for key in state)):
                raise pickle.UnpicklingError(f"refused BUILD with a {type(state).__name__} state")
        stock(self)

    return load


class MetadataUnpickler(pickle._Unpickler):  # type: ignore[name-defined,misc]
    """An unpickler for DCP ``.metadata`` that refuses every global outside ``_ALLOWED_GLOBALS`` and
    every mutation of anything but a container or DCP dataclass instance it built itself.

    The globals alone are not enough: ``BUILD`` on a class (or on a shared enum member or dtype) sets
    its attributes, so a crafted file could, say, set ``pathlib.PosixPath.iterdir = tuple`` for the
    whole process, after which every directory looks empty (``--overwrite``'s ownership check
    included). So ``BUILD`` is run only on instances of :data:`_BUILDABLE` with a plain ``dict``
    state (or their own ``__setstate__``), and ``SETITEM(S)``/``APPEND(S)``/``ADDITEMS`` only on
    ``dict``/``OrderedDict``, ``list`` and ``set``. This is the pure-Python unpickler, whose opcode
    table can be replaced (about 10x slower than the C one: ~7 ms for a 65 KB ``.metadata``)."""

    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]
    dispatch[pickle.BUILD[0]] = _guarded(pickle.BUILD, tuple(_BUILDABLE))
    dispatch[pickle.SETITEM[0]] = _guarded(pickle.SETITEM, (dict, OrderedDict))
    dispatch[pickle.SETITEMS[0]] = _guarded(pickle.SETITEMS, (dict, OrderedDict))
    dispatch[pickle.APPEND[0]] = _guarded(pickle.APPEND, (list,))
    dispatch[pickle.APPENDS[0]] = _guarded(pickle.APPENDS, (list,))
    dispatch[pickle.ADDITEMS[0]] = _guarded(pickle.ADDITEMS, (set,))

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED_GLOBALS.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused global {module}.{name}")


def read_metadata(checkpoint: Path) -> Metadata:
    """The DCP metadata of ``checkpoint``, read without running code (``ValueError`` naming the file)."""
    path = Path(checkpoint) / METADATA_FILE
    if not path.is_file():
        raise ValueError(f"{path}: missing (the checkpoint is incomplete)")
    if path.is_symlink() and path.resolve().parent != Path(checkpoint).resolve():
        raise ValueError(f"{path} is a link to a file outside the checkpoint; it was not loaded")
    try:
        with open(path, "rb") as handle:
            metadata = MetadataUnpickler(handle).load()
    except pickle.UnpicklingError as exc:
        raise ValueError(
            f"{path}: not a checkpoint metadata file csbp accepts ({exc}); it was not loaded"
        ) from None
    except (EOFError, OSError, ValueError, TypeError, AttributeError, IndexError, KeyError) as exc:
        raise ValueError(f"{path}: unreadable ({type(exc).__name__}: {exc}); the file is damaged") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise ValueError(f"{path}: does not hold DCP checkpoint metadata")
    problem = _structure_problem(metadata)
    if problem is not None:
        raise ValueError(f"{path}: {problem}; the file is damaged or forged, it was not loaded")
    inside = Path(checkpoint).resolve()
    for name in sorted({info.relative_path for info in metadata.storage_data.values()}):
        # every reader opens checkpoint / relative_path: a plain name, and not a link leading out
        if not name or Path(name).name != name or name.startswith("."):
            raise ValueError(f"{path} names a data file {_shown(name)} outside the checkpoint; it was not loaded")
        if (Path(checkpoint) / name).is_symlink() and (Path(checkpoint) / name).resolve().parent != inside:
            raise ValueError(
                f"{Path(checkpoint) / name} is a link to a file outside the checkpoint; it was not loaded "
                "(fix: copy the checkpoint with its files, not links to them)"
            )
    return metadata


def _sizes(value: object) -> bool:
    return isinstance(value, (tuple, list)) and all(type(v) is int and v >= 0 for v in value)


_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother = 3, 60, 60


def _shown(value: object) -> str:
    """``repr(value)`` cut short (a forged file's value may be huge or nested 100000 deep)."""
    return _SHOWN.repr(value)


def _structure_problem(metadata: Metadata) -> str | None:
    """What in ``metadata`` is not of the types DCP writes (so that every later check and the load
    itself fail with this one line, never an ``AttributeError`` deep inside DCP), or None.
    Sizes, offsets and lengths must be non-negative integers."""
    if metadata.storage_data is None:
        metadata.storage_data = {}  # what DCP writes for a checkpoint without tensors
    if not isinstance(metadata.storage_data, dict) or not (
        metadata.storage_meta is None or isinstance(metadata.storage_meta, metadata_module.StorageMeta)
    ):
        return "storage_data or storage_meta is not what DCP writes"
    for index, info in metadata.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, filesystem_module._StorageInfo):
            return f"storage entry {_shown(index)} is not what DCP writes"
        if not isinstance(info.relative_path, str):
            return f"storage entry for {_shown(index.fqn)} names the data file {_shown(info.relative_path)}"
        if not (type(info.offset) is int and type(info.length) is int and info.offset >= 0 and info.length >= 0):
            return f"storage entry for {_shown(index.fqn)} has offset {_shown(info.offset)}, length {_shown(info.length)}"
    for fqn, item in metadata.state_dict_metadata.items():
        if not isinstance(fqn, str) or not isinstance(item, (TensorStorageMetadata, BytesStorageMetadata)):
            return f"item {_shown(fqn)} is not what DCP writes"
        if isinstance(item, BytesStorageMetadata):
            continue
        properties = item.properties
        if not isinstance(properties, metadata_module.TensorProperties) or not isinstance(properties.dtype, torch.dtype):
            return f"tensor {_shown(fqn)} has no dtype"
        if not _sizes(item.size):
            return f"tensor {_shown(fqn)} has size {_shown(item.size)}"
        if not isinstance(item.chunks, list):
            return f"tensor {_shown(fqn)} has chunks {_shown(item.chunks)}"
        for chunk in item.chunks:
            if not isinstance(chunk, ChunkStorageMetadata) or not (_sizes(chunk.offsets) and _sizes(chunk.sizes)):
                return f"tensor {_shown(fqn)} has a chunk {_shown(chunk)}"
    return None


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` goes through :class:`MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise ValueError("per-rank DCP metadata files are not supported")
        metadata = read_metadata(Path(self.path))
        if metadata.storage_meta is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that loads non-tensor items with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise ValueError(
                f"checkpoint item {read_item.dest_index.fqn!r} holds a pickle csbp does not load ({exc})"
            ) from None
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element  # noqa: PLC0415

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def safe_dcp_load(state_dict: dict[str, Any], checkpoint: Path, *, no_dist: bool) -> None:
    """``dcp.load`` into ``state_dict`` through the safe reader and planner; a failure on any rank
    is a ``ValueError`` naming the checkpoint and the first rank's error.

    The metadata is read (and its data-file paths checked) here first: torch releases before 2.13
    swallow a reader's exception and report only "metadata is None"."""
    read_metadata(checkpoint)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.load(
                state_dict,
                storage_reader=SafeFileSystemReader(str(checkpoint)),
                planner=SafeLoadPlanner(),
                no_dist=no_dist,
            )
    except CheckpointException as exc:
        raise_if_interrupted(exc)
        failures = sorted(exc.failures.items(), key=lambda item: item[0])
        first = f"rank {failures[0][0]}: {failures[0][1][0]}" if failures else str(exc)
        raise ValueError(f"checkpoint {checkpoint} could not be loaded: {first.splitlines()[0]}") from None


def raise_if_interrupted(exc: CheckpointException) -> None:
    """Re-raise the Ctrl-C (``KeyboardInterrupt``) or SIGTERM (:class:`~csbp.interrupts.Interrupted`)
    that stopped a rank's DCP read or write: DCP wraps every ``BaseException`` of a rank into its
    ``CheckpointException``, and an interruption must end the command as one."""
    for _, failure in sorted(exc.failures.items(), key=lambda item: item[0]):
        cause = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(cause, Interrupted) or not isinstance(cause, Exception):
            raise cause from None


def checkpoint_problem(checkpoint: Path, *, state_file: str | None = STATE_FILE) -> str | None:
    """None when ``checkpoint`` is intact, else one line naming the damaged file.

    Reads ``state_file`` (skipped when None) and ``.metadata`` (safely) and compares every data
    file's size with the byte ranges the metadata records. When the state file (``trainer_state.json``
    also with ``state_file=None``, if there is one) records checksums
    (:mod:`csbp.training.checkpoint_checksums`), ``.metadata`` must match its checksum before it is
    unpickled, and every data file the metadata names or the record lists (see the module docstring:
    one neither names is ignored) must match its own: same-size damage is found too, at the cost of
    reading every file once (streamed; once per process, however often this is called). A checkpoint
    written before checksums were recorded has none and is accepted on the checks above, as before.
    """
    checkpoint = Path(checkpoint)
    state_path = checkpoint / (state_file or STATE_FILE)
    problem, state = _read_state(state_path)
    if state_file is not None and problem is not None:
        return problem
    record = state.get(CHECKSUMS_KEY) if state is not None else None
    if record is not None:
        problem = checksum_problem(checkpoint, record, state_path, names=[METADATA_FILE])
        if problem is not None:
            return problem
    try:
        metadata = read_metadata(checkpoint)
    except ValueError as exc:
        return str(exc)
    declared = _declared_size_problem(metadata)
    if declared is not None:
        return f"{checkpoint / METADATA_FILE} {declared}"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        name = str(info.relative_path)  # a plain file name in the checkpoint (read_metadata checks)
        end = int(getattr(info, "offset", 0)) + int(getattr(info, "length", 0))
        needed[name] = max(needed.get(name, 0), end)
    for name, end in sorted(needed.items()):
        path = checkpoint / name
        if not path.is_file():
            return f"{path} is missing"
        size = path.stat().st_size
        if size < end:
            return f"{path} is truncated ({size} bytes, the metadata needs {end})"
    if record is None:
        return None
    recorded = parse_record(record, state_path)
    data_files = sorted((set(recorded) if isinstance(recorded, dict) else set()) | set(needed))
    return checksum_problem(checkpoint, record, state_path, names=[n for n in data_files if n != METADATA_FILE])


def _declared_size_problem(metadata: Metadata) -> str | None:
    """Why the tensor shapes ``metadata`` declares are not backed by the bytes it stores for them, or
    None. Loading allocates every declared shape first, so a forged ``.metadata`` claiming a 10^12
    element tensor over 16 stored bytes must be refused before that."""
    storage = metadata.storage_data or {}
    for info in storage.values():
        if getattr(info, "transform_descriptors", None):
            return "uses storage transforms (compression), which csbp checkpoints never do"
    for fqn, item in metadata.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            continue
        itemsize = torch.empty((), dtype=item.properties.dtype).element_size()
        for chunk in item.chunks:
            info = storage.get(MetadataIndex(fqn, chunk.offsets))
            numel = math.prod(int(size) for size in chunk.sizes)
            if info is None or int(info.length) < numel * itemsize:
                stored = "no bytes" if info is None else f"{int(info.length)} bytes"
                return f"declares {_shown(list(chunk.sizes))} {item.properties.dtype} for '{fqn}' but stores {stored}"
    return None


def _read_state(state_path: Path) -> tuple[str | None, dict[str, Any] | None]:
    """``(problem, None)`` when ``state_path`` is missing or not a state file, else ``(None, state)``."""
    if not state_path.is_file():
        return f"{state_path} is missing", None
    try:
        state = json.loads(state_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"{state_path} is unreadable ({exc})", None
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        return f"{state_path} has no integer 'step'", None
    return None, state


def step_directories(root: Path) -> list[Path]:
    """The ``step_*`` checkpoint directories of ``root``, newest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return [path for _, path in sorted(found, reverse=True)]


RESUME_FIX = "restore the files, or start a new run directory"
"""The fix :func:`resume_checkpoint` names by default (for ``--resume``)."""


def resume_checkpoint(
    root: Path,
    named: Path | None,
    *,
    warn: Callable[[str], None] | None = None,
    caller: str = "--resume",
    fix: str = RESUME_FIX,
) -> Path | None:
    """The checkpoint to resume from in checkpoints directory ``root``.

    ``named`` is what the ``latest`` pointer names (None when there is no usable pointer). Returns
    ``named`` when it is intact, else the newest intact ``step_*`` directory, reporting every damaged
    one it passes through ``warn``; None when ``root`` holds no checkpoint at all. ``ValueError``
    (one line, starting with ``caller``, the flag or command that asked, and ending with ``fix``)
    when checkpoints exist but none is intact.
    """
    candidates = step_directories(root)
    if named is not None:
        candidates = [named] + [path for path in candidates if path != named]
    damaged: list[str] = []
    for path in candidates:
        problem = checkpoint_problem(path)
        if problem is None:
            if damaged and warn is not None:
                using = "resuming from" if caller == "--resume" else f"{caller} uses"
                warn(f"warning: skipping damaged checkpoint(s): {'; '.join(damaged)}; {using} {path.name}")
            return path
        damaged.append(problem)
    if damaged:  # every one of them: restoring only the newest may not be what the user can do
        raise ValueError(f"{caller}: no intact checkpoint in {root}: {'; '.join(damaged)} (fix: {fix})")
    return None


def find_resume_checkpoint(
    run_dir: Path,
    *,
    warn: Callable[[str], None] | None = None,
    caller: str = "--resume",
    fix: str = RESUME_FIX,
) -> Path | None:
    """The checkpoint ``--resume`` restores in ``run_dir`` (see :func:`resume_checkpoint`, whose error
    names ``caller`` and ``fix``: other commands that read a run's latest checkpoint pass their own);
    a broken ``latest`` pointer is reported through ``warn`` and the newest intact checkpoint is used."""
    root = Path(run_dir) / "checkpoints"
    pointer = root / "latest"
    named: Path | None = None
    if pointer.is_file():
        name = pointer.read_bytes()[:256].decode("utf-8", errors="replace").strip()
        if _STEP_DIR.match(name) and (root / name).is_dir():
            named = root / name
        elif warn is not None:
            warn(f"warning: {pointer} names {name!r}, which is not a checkpoint directory here")
    return resume_checkpoint(root, named, warn=warn, caller=caller, fix=fix)


def has_checkpoints(run_dir: Path) -> bool:
    """True when ``run_dir`` holds a ``latest`` pointer or any ``step_*`` checkpoint directory."""
    root = Path(run_dir) / "checkpoints"
    return (root / "latest").exists() or bool(step_directories(root))
