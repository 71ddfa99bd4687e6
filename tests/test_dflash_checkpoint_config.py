"""``csbp dflash export --checkpoint`` reads the run config its ``trainer_state.json`` records
(``config_yaml``) and, for the mask token, the data artifact's manifest; a damaged record is one line
naming the fix, as every other field of it already was, never a traceback.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_dflash_checkpoint_config.py -q``
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from csbp.cli.dflash_checkpoint import _checkpoint_drafter_config
from csbp.dflash.verify import TARGET_CONFIG

SHAPES = {  # a 1-layer drafter of the verification target (hidden 32, head_dim 8, 2 target layers)
    "fc.weight": (32, 64),
    "layers.0.self_attn.q_norm.weight": (8,),
    "layers.0.self_attn.q_proj.weight": (32, 32),
    "layers.0.self_attn.k_proj.weight": (16, 32),
    "layers.0.mlp.gate_proj.weight": (64, 32),
}
NO_FLAGS = argparse.Namespace(block_size=None, mask_token_id=None, layer_ids=None)


def _config(run: dict[str, Any]) -> None:
    _checkpoint_drafter_config(SHAPES, TARGET_CONFIG, run, NO_FLAGS, recorded={}, source="ckpt/trainer_state.json")


@pytest.mark.parametrize("data", ["artifacts/x", ["artifacts/x"], 3])
def test_a_recorded_data_section_that_is_no_mapping_is_one_line(data: object) -> None:
    # AttributeError ('str' object has no attribute 'get') while naming the mask token's source
    with pytest.raises(ValueError, match="records no block_size or mask_token_id; pass --block-size and --mask"):
        _config({"objective": {"name": "dflash", "block_size": 4}, "data": data})


def test_an_artifact_whose_special_ids_are_no_mapping_is_one_line(tmp_path: Path) -> None:
    # AttributeError ('list' object has no attribute 'get') reading the artifact's mask token
    (tmp_path / "manifest.json").write_text(json.dumps({"special_ids": [1, 2]}))
    with pytest.raises(ValueError, match="records no block_size or mask_token_id; pass --block-size and --mask"):
        _config({"objective": {"name": "dflash", "block_size": 4}, "data": {"train": str(tmp_path)}})
