"""Content fingerprints of the directories a run reads by path (``model.init_from``,
``objective.dflash.target``, ``objective.dflash.features``, ``objective.dflash.init_from``), so
``--resume`` recognises a moved copy and refuses a different one, at another path or overwritten in place at the same path.

A checkpoint records ``{field: fingerprint}`` in ``trainer_state.json`` (``input_fingerprints``);
a resume whose config names another path for that field is accepted when the new directory has
the same fingerprint, and a resume whose config names the same path is refused when that directory's
fingerprint changed (:mod:`csbp.training.resume_config`). Data files need no such record: their
manifests carry a content fingerprint of their own.

The fingerprint is cheap by design (a checkpoint directory can hold many GB): the sha256 over each
top-level file's name and size, and its first and last :data:`SAMPLE_BYTES` bytes. That covers
``config.json``, the safetensors header (names, shapes, dtypes) and the leading and trailing
weights of every shard, or a feature store's manifest and arrays; two trainings of one shape
differ there, while a copy (``cp -r``, ``mv``, ``rsync``) matches.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

#: bytes read from each end of every file
SAMPLE_BYTES = 1 << 20
#: the dotted config fields naming a directory whose contents define the run
IDENTIFIED_BY_CONTENT = (
    "model.init_from", "objective.dflash.target", "objective.dflash.features", "objective.dflash.init_from"
)


def directory_fingerprint(directory: Path) -> str | None:
    """The sha256 (hex) of ``directory``'s top-level files (module docstring); ``None`` when it is
    not a readable directory."""
    if not directory.is_dir():
        return None
    digest = hashlib.sha256()
    try:
        for path in sorted(p for p in directory.iterdir() if p.is_file()):
            size = path.stat().st_size
            digest.update(f"{path.name}\0{size}\0".encode())
            with open(path, "rb") as f:
                digest.update(f.read(SAMPLE_BYTES))
                if size > 2 * SAMPLE_BYTES:
                    f.seek(size - SAMPLE_BYTES)
                digest.update(f.read(SAMPLE_BYTES))
    except OSError:
        return None
    return digest.hexdigest()


def input_fingerprints(flat: dict[str, Any]) -> dict[str, str]:
    """``{field: fingerprint}`` for every :data:`IDENTIFIED_BY_CONTENT` field of the flat (dotted)
    config ``flat`` that names a readable directory."""
    out: dict[str, str] = {}
    for name in IDENTIFIED_BY_CONTENT:
        value = flat.get(name)
        fingerprint = directory_fingerprint(Path(value)) if isinstance(value, str) else None
        if fingerprint is not None:
            out[name] = fingerprint
    return out
