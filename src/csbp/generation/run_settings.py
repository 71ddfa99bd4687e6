"""What a run trained with, read from its ``config.yaml``: the objective, block size, mask token and
window that ``csbp generate`` samples with and ``csbp eval`` scores with by default.

A run's Hugging Face export is ``RUN/final``; the run config sits one directory up. Any other
checkpoint directory has no run config, so nothing is known about its training.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from csbp.config.loading import read_yaml_file

#: the block-diffusion objectives a model can be sampled and scored as, and whether each predicts
#: position ``i`` from row ``i - 1`` (token shift)
TOKEN_SHIFT_OBJECTIVES = {"bd3": False, "mdlm": False, "fast_dllm_v2": True}


def run_objective_settings(model_dir: Path) -> dict[str, Any]:
    """``{"objective", "block_size", "mask_token_id", "window"}`` (those set) from ``RUN/config.yaml``
    when ``model_dir`` is ``RUN/final``; empty for any other checkpoint directory."""
    config_file = model_dir.parent / "config.yaml"
    if model_dir.name != "final" or not config_file.is_file():
        return {}
    loaded = read_yaml_file(config_file) or {}
    objective = loaded.get("objective") if isinstance(loaded, dict) else None
    if not isinstance(objective, dict) or "name" not in objective:
        return {}
    name = str(objective["name"])
    if name not in TOKEN_SHIFT_OBJECTIVES:
        raise ValueError(
            f"{config_file} trained objective {name!r}; csbp generate samples block-diffusion models "
            f"({', '.join(TOKEN_SHIFT_OBJECTIVES)})"
        )
    settings: dict[str, Any] = {"objective": name}
    for field in ("block_size", "mask_token_id"):
        if objective.get(field) is not None:
            settings[field] = int(objective[field])
    topology = loaded.get("topology")
    if isinstance(topology, dict) and topology.get("window") is not None:
        settings["window"] = int(topology["window"])
    return settings
