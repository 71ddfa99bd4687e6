"""BD3-LM's published two-stage recipe: pretrain with MDLM (one block: the sequence), then fine-tune
with BD3 at the target block size from the MDLM run's export (``model.init_from``).

The export of an ``mdlm`` run is a plain decoder: a ``bd3`` run starts from it (the model's shape
from its ``config.json``), records its own objective, and starts below a fresh model's NELBO.
"""

from __future__ import annotations

import json
from pathlib import Path

from csbp.training import train
from test_training_run import make_artifact, metric_rows, tiny_config

SHAPE = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "arch")


def test_a_bd3_run_fine_tunes_an_mdlm_runs_export(tmp_path: Path) -> None:
    artifact = make_artifact(tmp_path / "art")
    train(tiny_config(artifact, **{"objective.name": "mdlm", "objective.block_size": None}), run_dir=tmp_path / "mdlm")
    from_mdlm = {"model.init_from": str(tmp_path / "mdlm" / "final"), **{f"model.{name}": None for name in SHAPE}}
    train(tiny_config(artifact, **from_mdlm), run_dir=tmp_path / "bd3")
    train(tiny_config(artifact), run_dir=tmp_path / "scratch")
    start = {name: metric_rows(tmp_path / name)[0]["val_nelbo"] for name in ("bd3", "scratch")}
    assert start["bd3"] < start["scratch"]  # the pretrained weights carried over
    record = json.loads((tmp_path / "bd3" / "final" / "config.json").read_text(encoding="utf-8"))["csbp_training"]
    assert record["objective"]["name"] == "bd3" and record["objective"]["block_size"] == 4
