"""The online DFlash target pass in ``csbp plan`` (``csbp.plan.target_pass``): its priced terms equal
the runtime's own counts (the ``dflash.target`` bytes of ``sharded_target_bytes``, the layers a
capture runs, the causal pairs of each ring member's zigzag rows, the target's layer parameters);
presets stay offline (the published setup: their predictions are unchanged); a DFlash run config
prices what it runs (``objective.dflash.target_capture``, offline with ``features``); and the CLI's
``--target-pass``/``--target-config`` fail closed."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from csbp.bench.dflash_target import causal_pairs
from csbp.cli.main import USER_ERROR_EXIT_CODE, main
from csbp.dflash.layouts import context_positions
from csbp.dflash.target_shard import sharded_target_bytes, target_layers_run
from csbp.models.config import DecoderConfig
from csbp.models.decoder import Decoder
from csbp.plan.calibration import packaged_calibration
from csbp.plan.drafter import predict_drafter
from csbp.plan.hardware import hardware
from csbp.plan.layout import Layout
from csbp.plan.run_config_workload import run_config_workload
from csbp.plan.target_pass import TargetPass, target_pass_cost
from csbp.plan.workload import LayerGroup, ModelShape, preset_workload
from csbp.recipes import load_run_config

TARGET = DecoderConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=8
)
SHAPE = ModelShape("tiny", 32, 64, 64, (LayerGroup(4, 4, 2, 8),))
HF_TARGET = {
    "hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4,
    "intermediate_size": 384, "vocab_size": 2048,
}


@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("kl", [False, True])
def test_priced_terms_equal_the_runtime_counts(cp: int, kl: bool) -> None:
    seq_len, element = 64, 8
    layers = target_layers_run(TARGET.num_layers, (0, 2), with_last_hidden=kl)
    cost = target_pass_cost(TargetPass("sharded", SHAPE, layers), seq_len, cp, element)
    decoder = Decoder(TARGET, seed=0)
    assert cost.kv_bytes == sharded_target_bytes(decoder, seq_len, cp, num_layers=layers, element_size=element)
    per_pair = 4 * TARGET.head_dim * TARGET.num_heads * layers
    for rank in range(cp):  # the zigzag rows of every member hold exactly 1/cp of the causal pairs
        assert cost.attention_flops == causal_pairs(context_positions(seq_len, cp, rank)) * per_pair
    # the planner's layer: projections, MLP and the two layer norms (not the head_dim-wide q/k norms)
    layer_params = sum(p.numel() for n, p in decoder.layers[0].named_parameters() if not n.startswith(("self_attn.q_norm", "self_attn.k_norm")))
    assert cost.dense_flops == 2 * layer_params * (seq_len // cp) * layers
    assert cost.weight_bytes == layer_params * layers * element
    replicated = target_pass_cost(TargetPass("replicated", SHAPE, layers), seq_len, cp, element)
    assert replicated.kv_bytes == 0 and replicated.attention_flops == causal_pairs(torch.arange(seq_len)) * per_pair
    assert replicated.dense_flops == cp * cost.dense_flops and replicated.working_set_bytes > cost.working_set_bytes


def test_presets_stay_offline_and_the_online_pass_adds_its_terms(tmp_path: Path) -> None:
    workload = preset_workload("dflash2-qwen3.8")
    assert workload.target_pass is None
    hw, cal = hardware("h200", gpus=8), packaged_calibration("h200")
    layout = Layout(2, 4, 4, checkpointing="none")
    offline = predict_drafter(workload, layout, 65536, hw, cal)
    assert predict_drafter(workload.with_target_pass("offline"), layout, 65536, hw, cal) == offline
    with pytest.raises(ValueError, match="--target-config"):
        workload.with_target_pass("sharded")
    (tmp_path / "config.json").write_text(json.dumps(HF_TARGET))
    sharded = predict_drafter(workload.with_target_pass("sharded", tmp_path), layout, 65536, hw, cal)
    replicated = predict_drafter(workload.with_target_pass("replicated", tmp_path), layout, 65536, hw, cal)
    assert offline.step_s < sharded.step_s < replicated.step_s
    assert sharded.kv_bytes > offline.kv_bytes == replicated.kv_bytes
    assert "target weights" in sharded.mem_terms and "target weights" not in offline.mem_terms
    step_only = predict_drafter(workload.with_target_pass("sharded", tmp_path), layout, 65536, hw, cal,
                                step_memory_only=True)
    assert "target features" in step_only.mem_terms and "target weights" not in step_only.mem_terms


def test_a_run_config_prices_what_it_runs(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(HF_TARGET))
    base = [f"objective.dflash.target={tmp_path}"]
    workload = run_config_workload(load_run_config("dflash-demo", base))
    assert workload.target_pass is not None and workload.target_pass.mode == "sharded"
    assert workload.target_pass.layers == 3  # loss ce: up to the default fused layer 4 // 2 = 2
    kl = run_config_workload(load_run_config("dflash-demo", [*base, "objective.dflash.loss=kl"]))
    assert kl.target_pass is not None and kl.target_pass.layers == 4
    replicated = run_config_workload(
        load_run_config("dflash-demo", [*base, "objective.dflash.target_capture=replicated"])
    )
    assert replicated.target_pass is not None and replicated.target_pass.mode == "replicated"
    offline = replace(workload, target_pass=replace(workload.target_pass, mode="offline"))
    assert offline.with_target_pass("sharded").target_pass == workload.target_pass


def test_cli_target_pass(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "config.json").write_text(json.dumps(HF_TARGET))
    args = ["plan", "--model", "dflash2-qwen3.8", "--seq-len", "64K", "--gpus", "8", "--gpu", "h200", "--top", "1"]
    assert main([*args, "--target-pass", "sharded"]) == USER_ERROR_EXIT_CODE
    assert "--target-config" in capsys.readouterr().err
    assert main([*args, "--target-pass", "sharded", "--target-config", str(tmp_path)]) == 0
    assert "target pass: sharded" in capsys.readouterr().out
    assert main([*args]) == 0 and "target pass" not in capsys.readouterr().out
    bd3 = ["plan", "--model", "nemotron-3b", "--seq-len", "4K", "--gpus", "4", "--target-pass", "sharded"]
    assert main(bd3) == USER_ERROR_EXIT_CODE and "DFlash drafter" in capsys.readouterr().err
