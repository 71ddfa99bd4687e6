"""The JSON files csbp writes that users pass where a run config goes (``csbp train
artifacts/x/manifest.json``): YAML reads them, and each would be a dozen "unknown key" lines; instead
one line says what the file is and what to pass."""

from __future__ import annotations

from pathlib import Path
from typing import Any

DATA_MANIFEST_FORMAT = "csbp-packed-tokens"
FEATURES_MANIFEST_FORMAT = "csbp-dflash-features"
"""``csbp.data.artifact.FORMAT_NAME`` and ``csbp.dflash.features.FEATURES_FORMAT``, spelled out: importing
those modules would import numpy and torch into every config load (``csbp plan`` runs without torch)."""


def other_csbp_file(data: dict[Any, Any], path: Path) -> str | None:
    """``is <what>, not a run config (fix: ...)`` when ``data``, read from ``path``, is a data
    artifact's or feature store's manifest, a model's ``config.json`` or a checkpoint's
    ``trainer_state.json``; else None."""
    where = path.parent
    if data.get("format") == DATA_MANIFEST_FORMAT:
        return (
            f"a data artifact's manifest, not a run config (fix: name its directory in a run config, "
            f"data.train: {where}: e.g. csbp recipes copy demo run.yaml, set data.train and data.seq_len there, "
            "then csbp train run.yaml)"
        )
    if data.get("format") == FEATURES_MANIFEST_FORMAT:
        return (
            f"a DFlash feature store's manifest, not a run config (fix: name its directory in a drafter's run "
            f"config, objective.dflash.features: {where}: e.g. csbp recipes copy dflash-demo run.yaml)"
        )
    if "model_type" in data and "architectures" in data:
        run_config = where.parent / "config.yaml"
        fix = f"its run's config is {run_config}" if run_config.is_file() else "pass a run config (csbp recipes list)"
        return f"a model's HF config.json, not a run config (fix: {fix}; a model directory is csbp eval/generate's --model)"
    if "config_yaml" in data and "step" in data:
        run_dir = where.parent.parent if where.parent.name == "checkpoints" else Path("RUN")
        return (
            f"a training checkpoint's state, not a run config (fix: continue its run: csbp train "
            f"{run_dir / 'config.yaml'} --run-dir {run_dir} --resume)"
        )
    return None
