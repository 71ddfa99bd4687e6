"""Atomic, topology-independent training checkpoints with ``torch.distributed.checkpoint`` (DCP).

Layout of ``<run_dir>/checkpoints/``::

    step_0000100/            one checkpoint: DCP files (.metadata, __<rank>_0.distcp) holding the
                             model and optimizer, plus trainer_state.json
    step_0000200/
    latest                   text file naming the newest complete checkpoint ("step_0000200")

``trainer_state.json`` (plain JSON, never pickled) holds the step, the lr-scheduler state, the data
loader's global cursor, the global RNG states, the data fingerprint, every parameter's shape, the
topology it was written under, the run config (YAML text) and the values it resolved for it
(``resolved_config``: a dflash run's target layer ids), the ``train.nan_policy: skip`` streak
(``nan_skips_in_a_row``) and the CRC32 of every file DCP wrote
(``checksums``, :mod:`csbp.training.checkpoint_checksums`; absent in checkpoints of older versions).

Model and optimizer (and the weight average of ``optim.ema_decay`` as ``ema``, with its update count
``ema_updates`` in ``trainer_state.json``) are saved as *sharded* DCP state dicts keyed by parameter name
(:func:`sharded_state_dicts`): an FSDP-sharded parameter is written by each rank as its own shard
(``__<rank>_0.distcp`` holds that rank's part; nothing is gathered), and a parameter replicated on
every rank is written once (DCP's planner de-duplicates replicas). DCP records every piece's offset
in the global tensor, so a checkpoint written under one topology (CP2 x BP2, FSDP over dp=2, ...)
loads under any other one, or in a single process: each rank reads just the pieces of its own
shards (:func:`restore_sharded_state_dicts`).

Atomicity: DCP writes into ``step_XXXXXXX.tmp/``; every rank checksums the files it wrote, the
checksums are gathered (which also waits for every rank), and rank 0 adds ``trainer_state.json``,
renames the directory to ``step_XXXXXXX/`` and then replaces ``latest`` (write a temporary file,
``os.replace``). A crash at any point leaves ``latest`` naming the previous
complete checkpoint; stale ``.tmp`` directories are ignored and removed by the next save. Only the
newest ``keep`` checkpoints are kept.

Trust: DCP's ``.metadata`` file is a pickle, and DCP stores non-tensor values as pickles too.
:func:`load_checkpoint` reads them only through :mod:`csbp.training.checkpoint_integrity` (a
restricted unpickler and ``weights_only`` loads), so a planted checkpoint cannot run code. It resumes
from the checkpoint ``latest`` names when that one is intact, else from the newest intact one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from csbp.data.loader import PackedLoader
from csbp.training.checkpoint_checksums import CHECKSUMS_KEY, record_checksums
from csbp.training.checkpoint_integrity import find_resume_checkpoint, raise_if_interrupted, safe_dcp_load
from csbp.training.weight_average import EMA_KEY, WeightAverage

CHECKPOINT_DIR = "checkpoints"
LATEST_FILE = "latest"
STATE_FILE = "trainer_state.json"
FORMAT_VERSION = 1
_NAME_PATTERN = re.compile(r"^step_(\d{7,})$")
_SHARDED = StateDictOptions(full_state_dict=False)


def checkpoint_name(step: int) -> str:
    return f"step_{step:07d}"


def checkpoints_root(run_dir: Path) -> Path:
    """``RUN/checkpoints``: where a run's checkpoints live."""
    return Path(run_dir) / CHECKPOINT_DIR


def find_latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint ``latest`` names, or None when there is none (``ValueError`` if it is broken)."""
    root = checkpoints_root(run_dir)
    pointer = root / LATEST_FILE
    if not pointer.is_file():
        return None
    name = pointer.read_text(encoding="utf-8").strip()
    if not _NAME_PATTERN.match(name):
        raise ValueError(
            f"{pointer}: {name!r} is not a checkpoint name (fix: restore the file or remove {root})"
        )
    path = root / name
    if not (path / STATE_FILE).is_file():
        raise ValueError(
            f"{pointer} names {name}, which is missing or incomplete (fix: restore it or remove {root})"
        )
    return path


def checkpoint_step(path: Path) -> int:
    """The step recorded in checkpoint directory ``path``."""
    return int(json.loads((path / STATE_FILE).read_text(encoding="utf-8"))["step"])


@dataclass(frozen=True)
class TrainingState:
    """The non-tensor part of a checkpoint (``trainer_state.json``)."""

    step: int
    scheduler: dict[str, Any]
    loader: dict[str, Any]
    rng: dict[str, Any]
    data_fingerprint: str
    param_shapes: dict[str, list[int]]
    topology: dict[str, Any]
    config_yaml: str
    #: content fingerprints of the directories the config names (``csbp.training.input_identity``);
    #: empty in checkpoints written before they were recorded
    input_fingerprints: dict[str, str] = field(default_factory=dict)
    #: ``train.nan_policy: skip``'s count of steps skipped in a row (:mod:`csbp.training.nan_policy`);
    #: 0 in checkpoints written before it was recorded
    nan_skips_in_a_row: int = 0
    #: config values as the run resolved them, keyed by dotted field (a dflash run's
    #: ``objective.dflash.target_layer_ids``, :mod:`csbp.training.dflash_layers`); empty in checkpoints
    #: written before they were recorded
    resolved_config: dict[str, Any] = field(default_factory=dict)
    #: the noise window ``[t_min, t_max]`` ``objective.clip_search_widths`` chose last
    #: (:mod:`csbp.training.clip_search`); None: the configured one (no search, or none ran yet)
    clip_window: list[float] | None = None
    #: updates of the weight average (``optim.ema_decay``, :mod:`csbp.training.weight_average`), stored as
    #: ``ema.*`` beside ``model.*``; None: the checkpoint has no average
    ema_updates: int | None = None

    def to_json(self) -> dict[str, Any]:
        return {"format_version": FORMAT_VERSION, **self.__dict__}

    @staticmethod
    def from_json(data: dict[str, Any], source: Path) -> TrainingState:
        if data.get("format_version") != FORMAT_VERSION:
            raise ValueError(
                f"{source}: checkpoint format {data.get('format_version')!r} is not {FORMAT_VERSION}"
            )
        fields = {key: data[key] for key in TrainingState.__dataclass_fields__ if key in data}
        required = {
            f.name
            for f in dataclasses.fields(TrainingState)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        }
        missing = sorted(required - set(fields))
        if missing:
            raise ValueError(f"{source}: missing fields {missing}; the checkpoint is corrupt")
        skips = fields.get("nan_skips_in_a_row", 0)
        if type(skips) is not int or skips < 0:
            raise ValueError(f"{source}: nan_skips_in_a_row is {skips!r}, not a count; the checkpoint is corrupt")
        if not isinstance(fields.get("resolved_config", {}), dict):
            raise ValueError(f"{source}: resolved_config is not a mapping; the checkpoint is corrupt")
        window = fields.get("clip_window")
        if window is not None and not (
            isinstance(window, list) and len(window) == 2
            and all(type(t) in (int, float) for t in window) and 0.0 <= window[0] < window[1] <= 1.0
        ):
            raise ValueError(f"{source}: clip_window is {window!r}, not a noise window [t_min, t_max]; the checkpoint is corrupt")
        updates = fields.get("ema_updates")
        if updates is not None and (type(updates) is not int or updates < 0):
            raise ValueError(f"{source}: ema_updates is {updates!r}, not a count; the checkpoint is corrupt")
        return TrainingState(**fields)


def param_shapes(model: nn.Module) -> dict[str, list[int]]:
    """Full (unsharded) shape of every parameter by name."""
    return {name: list(param.shape) for name, param in model.named_parameters()}


def rng_state() -> dict[str, Any]:
    """Global RNG states as JSON: torch CPU (and CUDA), numpy, Python ``random``."""
    np_state = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state().tolist(),
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": _jsonable(random.getstate()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


def _jsonable(value: Any) -> Any:
    return [_jsonable(v) for v in value] if isinstance(value, (tuple, list)) else value


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def save_checkpoint(
    run_dir: Path,
    *,
    model: nn.Module,
    optimizer: Optimizer,
    state: TrainingState,
    keep: int,
    average: WeightAverage | None = None,
) -> Path:
    """Write checkpoint ``state.step`` atomically (call on every rank); return its directory.

    A write that fails (a full disk, a read-only or vanished directory) raises
    :class:`CheckpointSaveFailed`, one line; ``latest`` still names the previous checkpoint. DCP
    reports a failure on any rank to every rank, so all of them raise it."""
    root = checkpoints_root(run_dir)
    name = checkpoint_name(state.step)
    staging, final = root / f"{name}.tmp", root / name
    try:
        if _is_rank0():
            shutil.rmtree(staging, ignore_errors=True)  # left by a crash during an earlier save
            staging.mkdir(parents=True)
        _barrier()
        metadata = save_sharded_state(model, optimizer, staging, average)
        data_files = {str(info.relative_path) for info in (metadata.storage_data or {}).values()}
        checksums = record_checksums(staging, data_files)  # each rank reads its own files; gathered (a barrier too)
        if _is_rank0():
            _write_json_durably(staging / STATE_FILE, {**state.to_json(), CHECKSUMS_KEY: checksums})
            _publish(staging, final)
            _write_text_durably(root / LATEST_FILE, name + "\n")
            prune_checkpoints(root, keep=keep, protect=name)
    except CheckpointException as exc:  # a BaseException: nothing above it would report it in one line
        raise_if_interrupted(exc)
        raise CheckpointSaveFailed(save_failure_message(root, name, _first_failure(exc))) from None
    except OSError as exc:
        raise CheckpointSaveFailed(save_failure_message(root, name, exc)) from None
    _barrier()
    return final


class CheckpointSaveFailed(ValueError):
    """A checkpoint could not be written; the message is one line naming the cause and the fix."""


def _first_failure(exc: CheckpointException) -> BaseException:
    """The exception of the lowest rank DCP reports as failed."""
    failures = sorted(exc.failures.items(), key=lambda item: item[0])
    if not failures:
        return exc
    cause = failures[0][1]
    return cause[0] if isinstance(cause, tuple) else cause


def save_failure_message(root: Path, name: str, cause: BaseException) -> str:
    """One line: checkpoint ``name`` could not be written in ``root`` because of ``cause``, the free
    space there, and what ``latest`` still names."""
    reason = (str(cause).strip().splitlines() or [""])[0]
    reason = f"{type(cause).__name__}: {reason}" if reason else type(cause).__name__
    try:
        free = f"{shutil.disk_usage(root).free / 2**20:.1f} MiB free there"
    except OSError:
        free = "its free space unknown"
    pointer = root / LATEST_FILE
    try:
        kept = pointer.read_text(encoding="utf-8").strip() if pointer.is_file() else None
    except OSError:
        kept = None
    previous = f"{pointer} still names {kept}" if kept else "no earlier checkpoint was completed"
    then = "continue with --resume" if kept else "start the run again"
    return (
        f"checkpoint {name} could not be written in {root} ({reason}; {free}); the run stopped and {previous} "
        f"(fix: free disk space there or lower train.keep_checkpoints, check the directory is writable, then {then})"
    )


# ----------------------------------------------------------------------------- sharded state (saving)


def sharded_state_dicts(model: nn.Module, optimizer: Optimizer, average: WeightAverage | None = None) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` (and ``"ema"``: the weight average) as this rank holds them: FSDP
    parameters, their optimizer state and average as ``DTensor`` shards, unsharded ones as plain tensors
    (never gathered)."""
    model_state, optim_state = get_state_dict(model, optimizer, options=_SHARDED)
    return {"model": model_state, "optim": optim_state, **({} if average is None else {EMA_KEY: average.shadow})}


def save_sharded_state(
    model: nn.Module, optimizer: Optimizer, directory: Path, average: WeightAverage | None = None
) -> Metadata:
    """Write this rank's shards of model, optimizer (and weight average) into DCP ``directory`` (call on
    every rank); returns the checkpoint's metadata (every rank's, with the files they wrote)."""
    state = sharded_state_dicts(model, optimizer, average)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        return dcp.save(state, checkpoint_id=directory, no_dist=not dist.is_initialized())


def restore_sharded_state_dicts(model: nn.Module, optimizer: Optimizer, loaded: dict[str, Any]) -> None:
    """Put DCP-loaded ``{"model", "optim"}`` (from :func:`sharded_state_dicts`) into model and optimizer."""
    set_state_dict(
        model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"], options=_SHARDED
    )


def _write_json_durably(path: Path, data: dict[str, Any]) -> None:
    _write_text_durably(path, json.dumps(data, indent=1) + "\n")


def _write_text_durably(path: Path, text: str) -> None:
    """Write ``text`` to a temporary sibling, fsync it, ``os.replace`` it onto ``path``."""
    tmp = path.with_name(path.name + ".writing")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_directory(path.parent)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(staging: Path, final: Path) -> None:
    """Rename the finished staging directory onto its final name.

    A directory already at ``final`` is a leftover of a crash (published before ``latest`` was
    moved to it) or a damaged checkpoint the resume skipped (``latest`` may name that one; a crash
    before the rename then leaves ``latest`` naming nothing, and ``--resume`` takes the newest intact
    checkpoint), so it is replaced.
    """
    if final.exists():
        shutil.rmtree(final)
    os.replace(staging, final)
    _fsync_directory(final.parent)


PRUNING_SUFFIX = ".pruning"
"""A pruned checkpoint is renamed ``.step_N.pruning`` before it is deleted (a crash's leftover is
deleted by the next prune)."""


def prune_checkpoints(root: Path, *, keep: int, protect: str) -> None:
    """Delete all but the newest ``keep`` ``step_*`` directories of ``root``, never ``protect``
    (staging ``.tmp`` directories are left to the next save of their step).

    Each goes in one rename before its files are deleted: a reader (``csbp export`` of a live run)
    then finds the whole checkpoint gone, never a half-deleted one it would call damaged."""
    entries = list(root.iterdir())
    for entry in entries:
        if entry.name.startswith(".") and entry.name.endswith(PRUNING_SUFFIX):
            shutil.rmtree(entry, ignore_errors=True)
    steps = sorted(
        (int(match.group(1)), entry)
        for entry in entries
        if entry.is_dir() and (match := _NAME_PATTERN.match(entry.name))
    )
    for _, entry in steps[:-keep] if keep > 0 else steps:
        if entry.name != protect:
            doomed = entry.with_name(f".{entry.name}{PRUNING_SUFFIX}")
            try:
                os.replace(entry, doomed)
            except OSError:  # gone already, or a filesystem that refuses: delete it where it is
                doomed = entry
            shutil.rmtree(doomed, ignore_errors=True)


def load_checkpoint(
    run_dir: Path,
    *,
    model: nn.Module,
    optimizer: Optimizer,
    scheduler: LRScheduler,
    loader: PackedLoader,
    data_fingerprint: str,
    average: WeightAverage | None = None,
) -> TrainingState:
    """Restore the latest checkpoint of ``run_dir`` into model, optimizer, scheduler and loader, and
    into ``average`` the checkpoint's weight average (restarted from the restored weights when it has
    none: the caller says so, ``state.ema_updates is None``).

    The process's global RNGs (torch, numpy, ``random``) continue from the checkpoint's. Checks first
    (before reading any tensor) that the checkpoint was written for the same model
    shape and the same data; raises ``ValueError`` naming the first difference.
    """
    path = find_resume_checkpoint(run_dir)
    if path is None:
        raise ValueError(f"--resume: {run_dir} has no checkpoint (fix: drop --resume)")
    state = read_training_state(path)
    check_compatible(state, path, shapes=param_shapes(model), data_fingerprint=data_fingerprint)
    stored_average = average if state.ema_updates is not None else None
    loaded = sharded_state_dicts(model, optimizer, stored_average)  # DCP loads the average in place
    safe_dcp_load(loaded, path, no_dist=not dist.is_initialized())
    restore_sharded_state_dicts(model, optimizer, loaded)
    if average is not None:
        if state.ema_updates is None:
            average.restart_from_model()
        else:
            average.updates = state.ema_updates
    scheduler.load_state_dict(state.scheduler)
    loader.load_state_dict(state.loader)
    restore_rng_state(state.rng)  # csbp draws from its own generators; this is for code that does not
    return state


def read_training_state(path: Path) -> TrainingState:
    """The ``trainer_state.json`` of checkpoint directory ``path``."""
    state_file = path / STATE_FILE
    try:
        data = json.loads(state_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{state_file}: not valid JSON ({exc}); the checkpoint is damaged") from None
    if not isinstance(data, dict):
        raise ValueError(f"{state_file}: expected a JSON object; the checkpoint is damaged")
    return TrainingState.from_json(data, state_file)


def check_compatible(
    state: TrainingState, source: Path, *, shapes: dict[str, list[int]], data_fingerprint: str
) -> None:
    """``ValueError`` unless checkpoint ``state`` was written for this model shape and this data."""
    check_model_shapes(state.param_shapes, shapes, source)
    if state.data_fingerprint != data_fingerprint:
        raise ValueError(
            f"data.train: checkpoint {source} was trained on data with fingerprint "
            f"{state.data_fingerprint[:12]}..., the configured artifact has {data_fingerprint[:12]}... "
            "(fix: resume with the original artifact, or start a new run)"
        )


def check_model_shapes(saved: dict[str, list[int]], current: dict[str, list[int]], source: Path) -> None:
    """``ValueError`` naming the first parameter whose presence or shape differs."""
    for name in list(current) + [n for n in saved if n not in current]:
        if name not in saved:
            problem = f"parameter '{name}' is missing from the checkpoint"
        elif name not in current:
            problem = f"the checkpoint has parameter '{name}' that this model lacks"
        elif list(saved[name]) != list(current[name]):
            problem = (
                f"parameter '{name}' has shape {list(saved[name])} in the checkpoint, {current[name]} here"
            )
        else:
            continue
        raise ValueError(
            f"model: checkpoint {source} was written for another model shape: {problem} "
            "(fix: resume with the model settings of that run, or start a new run directory)"
        )
