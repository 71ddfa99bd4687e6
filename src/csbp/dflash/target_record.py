"""Which target a drafter export was trained against, recorded in its ``config.json`` and checked by
``csbp dflash eval`` before either model is loaded.

A drafter predicts its target's next tokens from its target's hidden states; paired with another
target of the same shape (another seed, a fine-tune) it loads, runs and accepts almost nothing,
silently (acceptance length 1.0). The shapes and the vocabulary, all a ``config.json`` can compare,
cannot tell the two apart, so the export records the target's weights:
``csbp_target: {weights: "safetensors-sample-sha256:<hex>"}`` (a top-level key public readers ignore).

The fingerprint samples the weight files (:func:`weights_sample_fingerprint`: each file's name and
size, its first, middle and last MiB), so it costs a few MiB of reads for any target size instead of
the whole checkpoint that :func:`csbp.dflash.target_fingerprint.checkpoint_fingerprint` reads. Other
weights change those bytes (the middle MiB of every shard holds tensor data, which any training
moves); it guards against mistakes, not tampering. A re-saved copy of the same weights with other
shards or another header reads as another target; ``csbp dflash eval --any-target`` then measures it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from csbp.dflash.export import TARGET_RECORD_KEY as RECORD_KEY
from csbp.dflash.target_fingerprint import weight_files

SAMPLE_PREFIX = "safetensors-sample-sha256:"
_SAMPLE_BYTES = 1 << 20


def weights_sample_fingerprint(target_dir: Path) -> str:
    """``safetensors-sample-sha256:<hex>`` of the target checkpoint ``target_dir``'s weight files (module
    docstring); ``ValueError`` when it has none csbp reads."""
    digest = hashlib.sha256()
    for path in weight_files(Path(target_dir)):
        size = path.stat().st_size
        digest.update(f"{path.name}\0{size}\0".encode())
        with open(path, "rb") as stream:
            for start in sorted({0, max(size // 2 - _SAMPLE_BYTES // 2, 0), max(size - _SAMPLE_BYTES, 0)}):
                stream.seek(start)
                digest.update(stream.read(_SAMPLE_BYTES))
    return SAMPLE_PREFIX + digest.hexdigest()


def target_record(target_dir: Path) -> dict[str, str]:
    """The ``csbp_target`` record of a drafter trained against ``target_dir``."""
    return {"weights": weights_sample_fingerprint(target_dir)}


def recorded_target_record(drafter_dir: Path) -> dict[str, str] | None:
    """The ``csbp_target`` record of drafter export ``drafter_dir`` (None when it records none), for a
    re-export to carry."""
    weights = recorded_target_weights(drafter_dir)
    return None if weights is None else {"weights": weights}


def recorded_target_weights(drafter_dir: Path) -> str | None:
    """The target fingerprint drafter export ``drafter_dir`` records; None for one that records none (a
    released drafter, an export of an older csbp)."""
    config_file = Path(drafter_dir) / "config.json"
    try:
        record = json.loads(config_file.read_text(encoding="utf-8")).get(RECORD_KEY)
    except (OSError, ValueError, AttributeError):
        return None  # an unreadable config.json is read_drafter_config's to report
    weights = record.get("weights") if isinstance(record, dict) else None
    return weights if isinstance(weights, str) and weights.startswith(SAMPLE_PREFIX) else None


def check_trained_target(drafter_dir: Path, target_dir: Path, *, any_target: bool) -> str | None:
    """``ValueError`` (one line) when drafter export ``drafter_dir`` records a target whose weights are not
    ``target_dir``'s; with ``any_target`` the note to print instead. None when they match or nothing is
    recorded."""
    recorded = recorded_target_weights(drafter_dir)
    if recorded is None or weights_sample_fingerprint(target_dir) == recorded:
        return None
    if any_target:
        return (
            f"note: --target {target_dir} is not the target drafter {drafter_dir} was trained against (other "
            "weights of the same shape); measuring it anyway (--any-target)"
        )
    raise ValueError(
        f"--drafter {drafter_dir} was trained against a target with other weights than --target {target_dir} "
        f"(same shapes; {drafter_dir / 'config.json'} records {RECORD_KEY}.weights {recorded[len(SAMPLE_PREFIX):][:12]}...) "
        "(fix: pass the target it was trained against, its run's objective.dflash.target, or --any-target to "
        "measure this pair anyway)"
    )
