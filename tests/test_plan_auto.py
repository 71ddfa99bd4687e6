"""``topology: auto`` and ``csbp plan --model run.yaml`` search the same space: a run config's
``train.fsdp``, ``train.micro_batch_size`` and ``train.grad_accum`` (``csbp.plan.auto.run_search``),
so the plan table's first row is the layout ``auto`` launches; ``csbp plan`` accepts a config that
says ``topology: auto``; the auto line says how many sequences an optimizer step trains."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from csbp.cli.main import main
from csbp.plan import hardware as hardware_module
from csbp.plan.calibration import packaged_calibration
from csbp.plan.hardware import hardware
from csbp.plan.layout import Layout
from csbp.plan.model import predict
from csbp.plan.search import rank
from csbp.plan.workload import preset_workload
from csbp.recipes import copy_recipe, load_run_config

# a run whose layouts differ in what fits: DDP (train.fsdp false), 2 sequences per replica, 2 micro-steps
RUN = {
    "model.vocab_size": 512,
    "model.hidden_size": 1024,
    "model.intermediate_size": 3072,
    "model.num_layers": 8,
    "model.num_heads": 8,
    "model.num_kv_heads": 4,
    "model.head_dim": 128,
    "data.seq_len": 16384,
    "train.micro_batch_size": 2,
    "train.grad_accum": 2,
    "train.fsdp": False,
}


@pytest.fixture
def auto_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The demo recipe with ``RUN`` and ``topology: auto`` in the file, planned on a 24 GiB machine."""
    monkeypatch.setattr(hardware_module, "machine_ram_gib", lambda: 24.0)
    path = copy_recipe("demo", tmp_path)
    data = yaml.safe_load(path.read_text())
    for key, value in RUN.items():
        section, field = key.split(".")
        data[section][field] = value
    data["topology"] = "auto"
    path.write_text(yaml.safe_dump(data))
    return path


def test_plan_of_an_auto_config_ranks_first_the_layout_auto_launches(
    auto_config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from csbp.plan.auto import resolve_auto_topology

    resolved = resolve_auto_topology(str(auto_config), [], nproc=8)
    line = capsys.readouterr().out
    chosen = dict(item.split("=", 1) for item in resolved if "=" in item and item != "topology={}")
    out_json = tmp_path / "plan.json"
    assert main(["plan", "--model", str(auto_config), "--gpus", "8", "--gpu", "cpu", "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "run config: train.micro_batch_size 2 x train.grad_accum 2 per replica, sharding ddp (train.fsdp)" in out
    first = json.loads(out_json.read_text())["feasible"][0]
    assert (first["dp"], first["cp"], first["bp"]) == tuple(int(chosen[f"topology.{k}"]) for k in ("dp", "cp", "bp"))
    assert first["transport"] == chosen["topology.transport"]
    assert first["activation_checkpointing"] == chosen["train.activation_checkpointing"]
    assert (first["micro_batch"], first["sharding"]) == (2, "ddp")
    assert f"predicted {first['step_s']:.3f} s/step" in line  # the step of 2 micro-steps, priced once
    sequences = first["dp"] * 2 * 2
    assert f"{sequences} sequences ({sequences * 16384:,} tokens) per optimizer step, {first['dp']}x one replica's" in line
    cfg = load_run_config(str(auto_config), resolved)
    assert cfg.world_size == 8 and not cfg.train.fsdp
    # --sharding overrides the config's, and says so
    assert main(["plan", "--model", str(auto_config), "--gpus", "8", "--gpu", "cpu", "--sharding", "fsdp2"]) == 0
    assert "sharding fsdp2 (--sharding)" in capsys.readouterr().out


def test_plan_prices_a_run_configs_gradient_accumulation(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hardware_module, "machine_ram_gib", lambda: 24.0)
    overrides = [f"{k}={str(v).lower()}" for k, v in RUN.items()]
    args = ["plan", "--model", "demo", "--gpus", "4", "--gpu", "cpu", "--topology", "dp2/cp2/bp2", "--checkpointing", "full"]
    assert main([*args, *(a for o in overrides for a in ("--set", o))]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if re.match(r"\s+1 dp2/cp2/bp2", line))
    cfg = load_run_config("demo", [*overrides, "topology.dp=2", "topology.cp=2", "topology.bp=2"])
    from csbp.plan.run_config_workload import run_config_workload

    workload = run_config_workload(cfg)
    layout = Layout(2, 2, 2, transport=row.split()[2], micro_batch=2, sharding="ddp")
    expected = predict(workload, layout, 16384, hardware("cpu", gpus=4), packaged_calibration("cpu"), global_batch=8)
    assert f"{expected.step_s:9.3f}" in row and " 2 " in row


def test_equal_speed_ranks_the_layout_that_moves_fewer_kv_bytes_first() -> None:
    workload = preset_workload("nemotron-8b")
    cal = packaged_calibration("h200")
    slow_network = hardware("h200", gpus=8)
    layouts = [Layout(2, 4, 1, transport="streaming"), Layout(2, 4, 4, transport="streaming")]
    fast = cal.with_values({"interval_fwd": 1.0, "interval_bwd": 1.0, "overlap_stream": 0.9999}, source="test")
    plan = rank(workload, layouts, 8192, slow_network, fast)
    cp, csbp = sorted(plan.feasible, key=lambda p: p.layout.bp)
    assert cp.tokens_per_s == csbp.tokens_per_s and cp.mem_bytes == csbp.mem_bytes and csbp.kv_bytes < cp.kv_bytes
    assert plan.best is not None and plan.best.layout.bp == 4


def test_a_missing_hf_config_names_the_flag_or_field_it_came_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "no-target"
    code = main(["plan", "--model", "dflash-demo", "--set", f"objective.dflash.target={missing}", "--gpus", "4", "--gpu", "cpu"])
    err = capsys.readouterr().err
    assert code != 0 and f"objective.dflash.target {missing}: no Hugging Face config.json" in err and "--model" not in err
    code = main(["plan", "--model", "dflash2-qwen3.8", "--seq-len", "64K", "--gpus", "8", "--target-pass", "sharded",
                 "--target-config", str(missing)])
    err = capsys.readouterr().err
    assert code != 0 and f"--target-config {missing}: no Hugging Face config.json" in err and "--model" not in err


def test_topology_auto_under_your_own_torchrun_plans_for_its_processes(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`torchrun --nproc-per-node 2 -m csbp train demo --set topology=auto` was refused with "pass
    --nproc N", a flag the launch under torchrun never reads: torchrun says how many processes run."""
    from csbp.cli import train_cmd

    launched, teardown_skipped = [], []
    monkeypatch.setattr(train_cmd, "launch_training", lambda cfg, **kwargs: launched.append(cfg))
    monkeypatch.setattr(train_cmd, "skip_teardown_at_exit", lambda code=0: teardown_skipped.append(code == 0))
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "2")):
        monkeypatch.setenv(name, value)
    argv = ["train", "demo", "--set", "topology=auto", "--set", "model.vocab_size=512", "--run-dir", str(tmp_path / "r")]
    assert main(argv) == 0
    assert "topology: auto -> " in capsys.readouterr().out and launched[0].world_size == 2
    assert teardown_skipped == [True]  # a torchrun rank that succeeded skips the teardown (not pytest's)
    monkeypatch.setenv("WORLD_SIZE", "4")  # 2 nodes of 2
    args = train_cmd.argparse.Namespace(nproc=None, nnodes=1)
    assert train_cmd.launched_processes(args) == (2, 2)
    args.nproc = 3  # the flag, when given, as before
    assert train_cmd.launched_processes(args) == (3, 1)


def test_no_test_leaves_an_exit_status_override_behind() -> None:
    """The suite's guard (conftest's autouse fixture) drops the exit hook a torchrun rank registers:
    a process that registered it and then ran the guard keeps its own exit status (3, not 0)."""
    import subprocess
    import sys

    code = (
        f"import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from conftest import forget_forced_exit\n"
        "from csbp.training.worker import skip_teardown_at_exit\n"
        "skip_teardown_at_exit()\n"
        "if sys.argv[1] == 'guard': forget_forced_exit()\n"
        "sys.exit(3)\n"
    )
    statuses = [subprocess.run([sys.executable, "-c", code, arm], check=False).returncode for arm in ("none", "guard")]
    assert statuses == [0, 3]  # unguarded, the hook turns a failure into exit status 0


def test_the_overlap_named_is_the_one_the_prediction_used() -> None:
    from dataclasses import replace

    from csbp.plan.auto import _overlap_assumed

    cal = replace(packaged_calibration("h200"), overlap_cp=0.25, overlap_csbp=0.5, overlap_stream=0.75)
    assert _overlap_assumed(Layout(2, 1, 1), cal) == "overlap: no K/V ring"
    assert _overlap_assumed(Layout(1, 4), cal) == "overlap: 25% of K/V traffic hidden (overlap_cp)"
    assert _overlap_assumed(Layout(1, 4, 4), cal) == "overlap: 50% of K/V traffic hidden (overlap_csbp)"
    streaming = "overlap: streaming hides K/V traffic up to 75% of its ring attention (overlap_stream)"
    assert _overlap_assumed(Layout(1, 4, transport="streaming"), cal) == streaming
    assert _overlap_assumed(Layout(1, 2, 4, transport="streaming"), cal) == streaming


def test_plan_of_a_compiled_run_config_says_its_prediction_is_the_eager_step(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hardware_module, "machine_ram_gib", lambda: 24.0)
    # the vocabulary set here: a fresh clone has no demo artifact to read it from
    plan = ["plan", "--model", "demo", "--gpus", "4", "--gpu", "cpu", "--top", "1", "--set", "model.vocab_size=512"]
    assert main([*plan, "--set", "train.compile=layers"]) == 0
    assert "note: demo sets train.compile: layers; the times and memory below are the eager step's" in (
        capsys.readouterr().out
    )
    assert main(plan) == 0
    assert "train.compile" not in capsys.readouterr().out
