"""Atomic directory writes: Hugging Face exports, DFlash exports and feature stores.

The directory is filled in a temporary sibling and moved into place with ``os.replace``, so a
reader never sees a half-written directory; an existing target is replaced only on request.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_directory_atomically(
    path: str | os.PathLike[str], fill: Callable[[Path], None], *, overwrite: bool
) -> Path:
    """Call ``fill(staging_dir)`` and move the result to ``path``; returns ``path``."""
    target = Path(path)
    if target.exists() and not (overwrite and target.is_dir()):
        raise ValueError(f"output path {target} already exists; pass overwrite=True to replace a directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        staging.chmod(0o755)
        fill(staging)
        if target.exists():
            retired = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.replace(target, retired / "previous")
            os.replace(staging, target)
            shutil.rmtree(retired, ignore_errors=True)
        else:
            os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def write_json_atomic(path: Path, payload: object) -> None:
    """Write JSON through a temporary file and ``os.replace`` (never a half-written artifact)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(tmp, path)
