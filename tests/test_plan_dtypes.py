"""The planner prices a csbp run in the element sizes csbp trains it in: activations and K/V in
``train.precision``'s compute dtype (bf16 autocasts; ``model.dtype`` is only the export's), dK/dV
reduced in the float32 accumulation dtype, and FSDP2/DDP states, a drafter's trainable states and
frozen vocabulary and an online target's weights in the master dtype (float32; float64 under fp64),
as ``training.model_factory.master_dtype`` holds them. The published presets' ZeRO-2 recipe and the
DFlash reference recipe (``context_rows == "windows"``) keep their own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from csbp.plan.calibration import packaged_calibration
from csbp.plan.hardware import hardware
from csbp.plan.layout import Layout
from csbp.plan.model import predict
from csbp.plan.run_config_workload import run_config_workload
from csbp.plan.workload import preset_workload
from csbp.recipes import load_run_config
from csbp.training.model_factory import master_dtype

SHAPE = ["model.vocab_size=512", "data.seq_len=4096"]


@pytest.mark.parametrize(
    ("precision", "dtype", "compute"), [("bf16", "float32", 2), ("fp32", "bfloat16", 4), ("fp64", "float64", 8)]
)
def test_a_run_config_is_priced_in_the_dtypes_csbp_trains_it_in(precision: str, dtype: str, compute: int) -> None:
    cfg = load_run_config("demo", [*SHAPE, f"train.precision={precision}", f"model.dtype={dtype}"])
    workload = run_config_workload(cfg)
    master = torch.empty((), dtype=master_dtype(cfg)).element_size()
    assert (workload.dtype_bytes, workload.state_bytes, workload.objective.kv_grad_bytes) == (compute, master, master)
    n = workload.model.total_params
    hw, cal = hardware("h200", gpus=4), packaged_calibration("h200")
    fsdp = predict(workload, Layout(2, 2, 2, sharding="fsdp2"), 4096, hw, cal)
    assert fsdp.mem_terms["grads+optimizer"] == 3 * master * n / 4  # gradient and two AdamW moments
    ddp = predict(workload, Layout(2, 2, 2, sharding="ddp"), 4096, hw, cal)
    assert ddp.mem_terms["weights"] + ddp.mem_terms["grads+optimizer"] == 4 * master * n


def test_presets_hold_csbps_float32_states_under_fsdp2_and_the_published_recipe_under_zero2() -> None:
    workload = preset_workload("nemotron-14b")
    n, hw, cal = workload.model.total_params, hardware("h200", gpus=16), packaged_calibration("h200")
    fsdp = predict(workload, Layout(4, 4, 4), 256 * 1024, hw, cal)
    assert fsdp.mem_terms["grads+optimizer"] == 12 * n / 16
    zero2 = predict(workload, Layout(4, 4, 4, sharding="zero2"), 256 * 1024, hw, cal)
    assert zero2.mem_terms["weights"] == 2 * n and zero2.mem_terms["grads+optimizer"] == 16 * n / 16


def test_a_drafter_holds_csbps_master_dtype_and_the_reference_its_own(tmp_path: Path) -> None:
    target = {
        "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4,
        "intermediate_size": 384, "vocab_size": 2048,
    }
    (tmp_path / "config.json").write_text(json.dumps(target))
    cfg = load_run_config("dflash-demo", [f"objective.dflash.target={tmp_path}", "train.precision=bf16"])
    workload = run_config_workload(cfg)
    hw, cal = hardware("h200", gpus=4), packaged_calibration("h200")
    pred = predict(workload, Layout(2, 2, 2, checkpointing="none"), 1024, hw, cal)
    trainable = workload.model.body_params + workload.model.extra_params
    assert pred.mem_terms["weights+grads+optimizer"] == 16 * trainable
    assert pred.mem_terms["frozen vocab"] == 4 * workload.model.embedding_params
    tp = workload.target_pass
    assert tp is not None and tp.mode == "sharded" and len(tp.model.groups) == 1
    assert pred.mem_terms["target weights"] == 4 * tp.layers * tp.model.layer_params(tp.model.groups[0])
    reference = preset_workload("dflash2-qwen3.8")
    ref = predict(reference, Layout(8, checkpointing="none"), 65536, hardware("h100", gpus=8), cal)
    ref_trainable = reference.model.body_params + reference.model.extra_params
    assert ref.mem_terms["weights+grads+optimizer"] == 12 * ref_trainable
    assert ref.mem_terms["frozen vocab"] == 2 * reference.model.embedding_params
