"""Fingerprints of a target's weights, recorded in a DFlash feature store and checked on opening it.

A feature store is only valid for the exact weights it was captured from: a fine-tuned target has
the same ``config.json`` (same shapes, same config hash) and other hidden states, so a drafter
trained on the old features would learn the wrong target. Two fingerprints, each a string naming
how it was taken:

* ``safetensors-sha256:<hex>`` (:func:`checkpoint_fingerprint`): a checkpoint directory. sha256 over
  the weight files ``csbp.models.hf_io`` reads (``model.safetensors``, or the shards that
  ``model.safetensors.index.json`` names, in sorted order), each as its name, its size and its
  bytes, streamed (no tensor is deserialised; memory stays at one read buffer). It reads the whole
  checkpoint: ~1-2 GB/s per core with a CPU's SHA instructions, 0.26 GB/s on the loaded CI
  machine. The value is kept per process, keyed by each file's size, modification time and inode, so
  that a second opening of the same checkpoint costs nothing. Re-saving the same weights (other
  shards, another header) changes it: the store is then refused and must be captured again.
* ``tensors-sha256:<hex>`` (:func:`module_fingerprint`): a target that exists only in memory (a
  randomly initialised one in tests or experiments, a library user's own module). sha256 over its
  state dict in sorted name order, each tensor as its name, dtype, shape and raw bytes. It depends on
  the dtype the module holds, and never equals a checkpoint fingerprint, so a store captured from a
  module can only be opened by naming that module's fingerprint again.

``csbp dflash prepare-features`` and ``csbp train`` always use the checkpoint fingerprint of the
target directory they are given.

Reading a large target once per process at every training start costs minutes (a 54 GB target is
about 40 s per process even at 1.5 GB/s), so the store also records each weight file's name, size
and modification time (``target_files``, :func:`checkpoint_identity`, taken before the bytes are
read). When a process opens the store and the target's weight files still have exactly those
sizes and modification times, the recorded fingerprint is taken without reading them
(``checkpoint_fingerprint(..., known=...)``), as ``make`` and ``rsync`` decide a file is unchanged;
any other difference (a rewritten shard, a copy that did not keep modification times) makes it hash
the files again. The fingerprint guards against mistakes, not tampering: a file rewritten with the
same size and its old modification time restored on purpose is not detected by the quick check.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

import torch

from csbp.models.hf_io import weight_files as hf_weight_files

CHECKPOINT_PREFIX = "safetensors-sha256:"
MODULE_PREFIX = "tensors-sha256:"
_READ_BYTES = 16 << 20

_cache: dict[tuple[str, tuple[tuple[str, int, int, int], ...]], str] = {}


def weight_files(directory: Path) -> list[Path]:
    """The safetensors files a checkpoint directory's weights are read from (the files
    ``csbp.models.hf_io.load_hf_checkpoint`` reads), sorted; ``ValueError`` naming what is missing."""
    return hf_weight_files(directory)[0]


def checkpoint_identity(directory: str | os.PathLike[str]) -> tuple[str, list[list[Any]]]:
    """The fingerprint of the checkpoint ``directory`` and its weight files' ``[name, size,
    mtime_ns]``, taken before the bytes are read (a file changed while it is hashed then no longer
    matches them, and the next check hashes it again)."""
    files = weight_files(_checkpoint_dir(directory))
    stats = _file_stats(files)
    return checkpoint_fingerprint(directory), stats


def checkpoint_fingerprint(
    directory: str | os.PathLike[str], *, known: tuple[str, Any] | None = None
) -> str:
    """``safetensors-sha256:<hex>`` of the weight files of the checkpoint ``directory`` (module
    docstring). ``known``: a fingerprint and the ``[name, size, mtime_ns]`` list recorded with it
    (:func:`checkpoint_identity`); when the files still match that list, the fingerprint is returned
    without reading them."""
    directory = _checkpoint_dir(directory)
    files = weight_files(directory)
    if known is not None:
        fingerprint, recorded = known
        if isinstance(fingerprint, str) and fingerprint.startswith(CHECKPOINT_PREFIX) and recorded == _file_stats(files):
            return fingerprint
    stats = [(path.name, os.stat(path)) for path in files]
    key = (
        str(directory.resolve()),
        tuple((name, st.st_size, st.st_mtime_ns, st.st_ino) for name, st in stats),
    )
    cached = _cache.get(key)
    if cached is not None:
        return cached
    digest = hashlib.sha256()
    buffer = bytearray(_READ_BYTES)
    view = memoryview(buffer)
    for path, (name, st) in zip(files, stats):
        digest.update(f"{name}\0{st.st_size}\0".encode())
        with open(path, "rb", buffering=0) as stream:
            while True:
                count = stream.readinto(view)
                if not count:
                    break
                digest.update(view[:count])
    fingerprint = CHECKPOINT_PREFIX + digest.hexdigest()
    _cache[key] = fingerprint
    return fingerprint


def _checkpoint_dir(directory: str | os.PathLike[str]) -> Path:
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"{directory} is not a checkpoint directory")
    return directory


def _file_stats(files: list[Path]) -> list[list[Any]]:
    return [[path.name, st.st_size, st.st_mtime_ns] for path, st in ((path, os.stat(path)) for path in files)]


@torch.no_grad()
def module_fingerprint(module: torch.nn.Module) -> str:
    """``tensors-sha256:<hex>`` of ``module``'s state dict (module docstring)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        digest.update(f"{name}\0{str(tensor.dtype)}\0{tuple(tensor.shape)}\0".encode())
        digest.update(flat.view(torch.uint8).numpy().tobytes())
    return MODULE_PREFIX + digest.hexdigest()
