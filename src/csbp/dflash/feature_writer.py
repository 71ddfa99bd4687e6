"""Capturing an offline DFlash feature store (``csbp dflash prepare-features``), resumably.

The store (``csbp.dflash.features``: ``features.npy``, ``last_hidden.npy``, ``manifest.json``) is
built in a locked staging directory beside ``out_dir`` (``csbp.staging``) and renamed into place
when complete. On a real corpus the capture takes hours, so it is committed in chunks: at least
every ``commit_seconds`` (and after the last row) the arrays' written rows are flushed to disk
(``msync`` + ``fsync``), then ``progress.json`` records, atomically and durably, the number of rows
done together with the store's full manifest (target weights and config fingerprints, token hash,
layer ids, dtype, ``with_last_hidden``, split, device type and the target's dtype).

A capture that stops (Ctrl-C, ``SIGTERM``, an error, ``SIGKILL``, a lost node) leaves its staging
directory; running the same command again adopts it and continues after the last committed row.
Every row is captured on its own (``capture_target_features`` runs one sample at a time), so the
finished store is byte-identical to an uninterrupted capture on the same device; ``rows_per_batch``
may differ between the two runs. A rerun whose manifest differs from the interrupted one's is
refused with one line naming the first differing field (rerun with the old settings, or delete the
named staging directory to start over): hours of work are never thrown away silently.

Shape legend: ``R`` rows of the split, ``L`` sequence length, ``H`` hidden size, ``K`` fused layers.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from tqdm.auto import tqdm

from csbp.atomic import OutputExistsError, check_replaceable, publish_directory, write_text_atomic
from csbp.dflash.features import (
    FEATURE_OWNERSHIP,
    FEATURES_FORMAT,
    FEATURES_VERSION,
    STORE_DTYPES,
    TokenSplit,
    capture_target_features,
    target_config_hash,
    token_hash,
)
from csbp.models.decoder import Decoder
from csbp.staging import staging_directory
from csbp.wording import size

PROGRESS_FILE = "progress.json"
PROGRESS_FORMAT = "csbp-dflash-features-progress"
_FLAGS = {
    "dtype": "--feature-dtype",
    "target_dtype": "--model-dtype",
    "device": "--device",
    "layer_ids": "--layer-ids",
    "with_last_hidden": "--with-last-hidden",
    "split": "--split",
    "target_weights": "--target",
    "target_config_hash": "--target",
    "token_hash": "--data",
}
"""The ``prepare-features`` flag behind a manifest field, named when a resume is refused."""
COMMIT_SECONDS = 60.0
"""Default time between two commits of a capture: at most this much work is lost to a kill."""


def feature_manifest(
    target: Decoder,
    split: TokenSplit,
    *,
    layer_ids: tuple[int, ...],
    target_weights: str,
    with_last_hidden: bool,
    dtype: str,
    target_files: list[list[Any]] | None = None,
) -> dict[str, Any]:
    """The ``manifest.json`` of the store this capture writes (also its resume key, but for
    ``target_files``: the weight files' sizes and times, ``csbp.dflash.target_fingerprint``)."""
    num_rows, seq_len = (int(n) for n in split.tokens.shape)
    hidden = target.config.hidden_size
    weight = target.embed_tokens.weight
    manifest = {
        "format": FEATURES_FORMAT,
        "format_version": FEATURES_VERSION,
        "split": split.name,
        "rows": num_rows,
        "seq_len": seq_len,
        "layer_ids": list(layer_ids),
        "hidden_size": hidden,
        "width": len(layer_ids) * hidden,
        "dtype": dtype,
        "with_last_hidden": with_last_hidden,
        "target_config_hash": target_config_hash(target.config),
        "target_weights": target_weights,
        "target_dtype": str(weight.dtype).removeprefix("torch."),
        "device": weight.device.type,
        "token_hash": token_hash(split.tokens, split.doc_ids),
        "convention": "layer i = HF hidden_states[i+1], pre-final-norm; last_hidden final-normed",
    }
    if target_files is not None:
        manifest["target_files"] = target_files
    return manifest


def prepare_features(
    target: Decoder,
    split: TokenSplit,
    out_dir: str | os.PathLike[str],
    *,
    layer_ids: Sequence[int],
    target_weights: str,
    target_files: list[list[Any]] | None = None,
    with_last_hidden: bool = False,
    dtype: str = "bfloat16",
    rows_per_batch: int = 1,
    overwrite: bool = False,
    progress: bool = False,
    commit_seconds: float = COMMIT_SECONDS,
) -> Path:
    """Capture the features of every row of ``split`` into ``out_dir``, resuming an interrupted
    capture of the same store (module docstring); returns ``out_dir``.

    ``target_weights`` is the fingerprint of the target's weights recorded in the manifest
    (``csbp.dflash.target_fingerprint``: ``checkpoint_fingerprint(dir)`` for a checkpoint,
    ``module_fingerprint(target)`` for a target that exists only in memory), ``target_files`` the
    checkpoint's weight files as :func:`~csbp.dflash.target_fingerprint.checkpoint_identity` lists them
    (recorded so that opening the store skips hashing unchanged files); ``progress`` shows a bar of
    the rows captured (on a terminal only: tqdm's ``disable=None``)."""
    if dtype not in STORE_DTYPES:
        raise ValueError(f"feature dtype {dtype!r} must be one of {tuple(STORE_DTYPES)}")
    if rows_per_batch < 1:
        raise ValueError(f"rows_per_batch must be >= 1, got {rows_per_batch}")
    layer_ids = tuple(int(i) for i in layer_ids)
    num_layers = target.config.num_layers
    if not layer_ids or any(not 0 <= i < num_layers for i in layer_ids):
        raise ValueError(f"target_layer_ids {list(layer_ids)} must be in [0, {num_layers}) for this target")
    if not isinstance(target_weights, str) or not target_weights:
        raise ValueError("target_weights: pass the fingerprint of the target's weights (csbp.dflash.target_fingerprint)")
    manifest = feature_manifest(
        target, split, layer_ids=layer_ids, target_weights=target_weights, with_last_hidden=with_last_hidden,
        dtype=dtype, target_files=target_files,
    )
    shown = Path(out_dir)
    absolute = check_output(shown, overwrite=overwrite)
    absolute.parent.mkdir(parents=True, exist_ok=True)

    def resume(staging: Path) -> int | None:
        return committed_rows(staging, manifest)

    with staging_directory(absolute, resume=resume) as staging:
        staging.chmod(0o755)
        _capture(target, split, staging, manifest, rows_per_batch, progress, commit_seconds)
        publish_directory(staging, absolute, overwrite=overwrite, owned=FEATURE_OWNERSHIP, shown=shown)
    return shown


def check_output(out_dir: Path, *, overwrite: bool) -> Path:
    """The absolute path of ``out_dir`` after checking that a store may be written there (nothing
    there, or with ``overwrite`` a feature store csbp wrote); ``ValueError`` otherwise."""
    if os.path.lexists(out_dir) and not overwrite:
        raise OutputExistsError(
            f"--out {out_dir}: already exists (fix: choose another path, or pass --overwrite)"
        )
    return check_replaceable(out_dir, FEATURE_OWNERSHIP)


def committed_rows(staging: Path, manifest: dict[str, Any]) -> int | None:
    """The rows an interrupted capture of ``manifest`` committed in ``staging``; None when it holds
    no progress; ``ValueError`` when it holds another capture's progress."""
    path = staging / PROGRESS_FILE
    if not path.is_file():
        return None
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None  # cannot be ours: progress.json is only ever replaced whole
    if not isinstance(recorded, dict) or recorded.get("format") != PROGRESS_FORMAT:
        return None
    old = recorded.get("manifest")
    old = {k: v for k, v in old.items() if k != "target_files"} if isinstance(old, dict) else {}
    new = {k: v for k, v in manifest.items() if k != "target_files"}  # the same weights, maybe touched
    if old != new:
        key = next(k for k in sorted({*old, *new}) if old.get(k) != new.get(k))
        flag = f" ({_FLAGS[key]})" if key in _FLAGS else ""
        raise ValueError(
            f"{staging} holds an interrupted capture of this store with other settings ({key}{flag} {old.get(key)!r} "
            f"there, {new.get(key)!r} now) (fix: rerun with the settings it was started with to resume it, "
            f"or delete {staging} to start over)"
        )
    rows = recorded.get("rows_done")
    return rows if type(rows) is int and 0 <= rows <= manifest["rows"] else None


def _to_store(x: Tensor, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return x.to(torch.bfloat16).cpu().view(torch.int16).numpy().view(np.uint16)
    return x.to(torch.float32 if dtype == "float32" else torch.float16).cpu().numpy()


def _open_arrays(staging: Path, manifest: dict[str, Any], resumed: bool) -> list[np.memmap]:
    """``features.npy`` (and ``last_hidden.npy``) of the store: new, or an interrupted capture's."""
    rows, seq_len, hidden = manifest["rows"], manifest["seq_len"], manifest["hidden_size"]
    shapes = {"features.npy": (rows, seq_len, manifest["width"])}
    if manifest["with_last_hidden"]:
        shapes["last_hidden.npy"] = (rows, seq_len, hidden)
    dtype = STORE_DTYPES[manifest["dtype"]]
    arrays = []
    for name, shape in shapes.items():
        path, problem = staging / name, ""
        if not resumed:
            arrays.append(np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=shape))
            continue
        try:
            array = np.lib.format.open_memmap(path, mode="r+")
        except (OSError, ValueError) as exc:
            array, problem = None, str(exc)
        if array is None or array.shape != shape or array.dtype != dtype:
            found = problem if array is None else f"shape {array.shape} dtype {array.dtype}"
            raise ValueError(
                f"{path}: the interrupted capture's array is damaged ({found}) (fix: delete {staging} to start over)"
            )
        arrays.append(array)
    for array in arrays:
        _reserve(Path(array.filename), staging)
    return arrays


def _reserve(path: Path, staging: Path) -> None:
    """Allocate every block of ``path`` now (``posix_fallocate``). The arrays are sparse memory maps:
    a write to a page the full filesystem cannot back kills the process with ``SIGBUS`` and no message,
    possibly hours in; reserved up front, a full disk is one line before any row is captured. Where
    the call does not exist (not POSIX), the free space is compared instead."""
    stat = path.stat()
    missing = stat.st_size - getattr(stat, "st_blocks", 0) * 512  # a resumed array is partly allocated
    free = shutil.disk_usage(staging).free
    message = (
        f"--out: {path.name} needs {size(missing)} more and the filesystem of {staging.parent} has {size(free)} "
        "free (fix: free some space, or choose an --out on a larger filesystem)"
    )
    fallocate = getattr(os, "posix_fallocate", None)
    if fallocate is None:
        if missing > free:
            raise ValueError(message)
        return
    fd = os.open(path, os.O_RDWR)
    try:
        fallocate(fd, 0, stat.st_size)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise ValueError(message) from None
    finally:
        os.close(fd)


def _commit(staging: Path, arrays: list[np.memmap], manifest: dict[str, Any], rows_done: int) -> None:
    """Make the first ``rows_done`` rows durable, then record them (``progress.json``, atomic)."""
    for array in arrays:
        array.flush()
        fd = os.open(array.filename, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    progress = {"format": PROGRESS_FORMAT, "rows_done": rows_done, "manifest": manifest}
    write_text_atomic(staging / PROGRESS_FILE, json.dumps(progress, indent=2, sort_keys=True) + "\n")


def _capture(
    target: Decoder,
    split: TokenSplit,
    staging: Path,
    manifest: dict[str, Any],
    rows_per_batch: int,
    progress: bool,
    commit_seconds: float,
) -> None:
    """Fill ``staging`` with the store of ``manifest``, from its last committed row on."""
    num_rows, dtype = manifest["rows"], manifest["dtype"]
    first = committed_rows(staging, manifest)
    if first is not None:
        print(f"resuming the interrupted capture in {staging} at row {first} of {num_rows}", file=sys.stderr)
    arrays = _open_arrays(staging, manifest, resumed=first is not None)
    first = first or 0
    layer_ids = tuple(manifest["layer_ids"])
    device = target.embed_tokens.weight.device
    bar = tqdm(total=num_rows, initial=first, desc="features", unit="row", dynamic_ncols=True,
               disable=None if progress else True)
    committed_at = time.monotonic()
    for start in range(first, num_rows, rows_per_batch):
        stop = min(start + rows_per_batch, num_rows)
        ids = torch.from_numpy(np.asarray(split.tokens[start:stop], dtype=np.int64)).to(device)
        docs = torch.from_numpy(np.asarray(split.doc_ids[start:stop], dtype=np.int64)).to(device)
        captured = capture_target_features(
            target, ids, layer_ids, doc_ids_SL=docs, with_last_hidden=manifest["with_last_hidden"]
        )
        arrays[0][start:stop] = _to_store(captured.features, dtype)
        if len(arrays) > 1 and captured.last_hidden is not None:
            arrays[1][start:stop] = _to_store(captured.last_hidden, dtype)
        bar.update(stop - start)
        if stop < num_rows and time.monotonic() - committed_at >= commit_seconds:
            _commit(staging, arrays, manifest, stop)
            committed_at = time.monotonic()
    bar.close()
    _commit(staging, arrays, manifest, num_rows)
    del arrays
    (staging / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    (staging / PROGRESS_FILE).unlink()
