"""Before launching, ``csbp train`` prices its explicit layout with ``csbp plan``'s cost model and warns
in one line when the prediction exceeds the device's usable memory, naming a fix the planner checked
(``csbp.training.memory_forecast``). Each prediction named is compared with the cost model's own
``predict`` of a layout written out by hand, and each fix is checked to be predicted to fit."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from csbp.config.schema import RunConfig
from csbp.plan import hardware as hardware_module
from csbp.plan.calibration import packaged_calibration
from csbp.plan.hardware import hardware
from csbp.plan.layout import Layout
from csbp.plan.model import GIB, predict
from csbp.plan.run_config_workload import run_config_workload
from csbp.recipes import load_run_config
from csbp.training import launch_training, memory_forecast
from csbp.training import launcher as launcher_module
from csbp.training.memory_forecast import forecast_line
from test_training_run import make_artifact, tiny_config

QWEN3_0_6B = [
    "model.vocab_size=151936", "model.hidden_size=1024", "model.intermediate_size=3072", "model.num_layers=28",
    "model.num_heads=16", "model.num_kv_heads=8", "model.head_dim=128", "objective.block_size=16",
    "train.micro_batch_size=1", "train.grad_accum=1", "train.fsdp=false",
]


def qwen_run(*changes: str) -> RunConfig:
    """The demo recipe reshaped to Qwen3-0.6B, one sequence per micro-step, with ``changes``."""
    return load_run_config("demo", [*QWEN3_0_6B, "topology.dp=1", "topology.cp=1", "topology.bp=1", *changes])


def by_hand(cfg: RunConfig, layout: Layout, preset: str = "h100") -> float:
    """The cost model's peak GiB per device of ``layout`` for ``cfg``'s workload, on ``cfg``'s processes."""
    hw = hardware(preset, gpus=layout.world, gpus_per_node=layout.world)
    prediction = predict(
        run_config_workload(cfg), layout, cfg.data.seq_len, hw, packaged_calibration(preset), global_batch=layout.dp
    )
    return prediction.mem_bytes / GIB


def test_a_run_predicted_to_fit_gets_no_warning() -> None:
    cfg = qwen_run("data.seq_len=32768", "train.activation_checkpointing=full")
    assert by_hand(cfg, Layout(1, checkpointing="full", sharding="ddp")) < 66.0
    assert forecast_line(cfg, nproc=1, preset="h100") is None


def test_a_layout_without_checkpointing_is_told_the_checkpointed_prediction() -> None:
    cfg = qwen_run("data.seq_len=65536", "train.activation_checkpointing=none")
    line = forecast_line(cfg, nproc=1, preset="h100")
    assert line is not None and "\n" not in line
    eager = by_hand(cfg, Layout(1, checkpointing="none", sharding="ddp"))
    recomputed = by_hand(cfg, Layout(1, checkpointing="full", sharding="ddp"))
    assert eager > 66.0 >= recomputed
    assert line.startswith(
        f"warning: csbp plan's cost model predicts {eager:.1f} GiB per device for this run's dp1, no checkpointing "
        "at data.seq_len 65,536, more than the 66.0 GiB an H100 may hold (largest term: activations, "
    )
    assert f"(fix: --set train.activation_checkpointing=full, predicted at {recomputed:.1f} GiB;" in line
    assert line.endswith("`csbp plan --model <config>` ranks every layout)")


def test_a_layout_the_search_beats_is_told_what_topology_auto_picks() -> None:
    cfg = qwen_run("data.seq_len=131072", "topology.dp=4", "train.activation_checkpointing=full")
    line = forecast_line(cfg, nproc=4, preset="h100")
    assert line is not None
    assert f"predicts {by_hand(cfg, Layout(4, checkpointing='full', sharding='ddp')):.1f} GiB" in line
    picked = re.search(r"--set topology=auto, which picks (dp\d+/cp\d+/bp\d+) (\w+), (\w+) checkpointing, predicted at "
                       r"([0-9.]+) GiB", line)
    assert picked is not None, line
    dp, cp, bp = (int(n) for n in re.findall(r"\d+", picked[1]))
    layout = Layout(dp, cp, bp, transport=picked[2], checkpointing=picked[3], sharding="ddp")  # type: ignore[arg-type]
    assert f"{by_hand(cfg, layout):.1f}" == picked[4]
    moved = qwen_run(
        "data.seq_len=131072", f"topology.dp={dp}", f"topology.cp={cp}", f"topology.bp={bp}",
        f"topology.transport={picked[2]}", f"train.activation_checkpointing={picked[3]}",
    )
    assert forecast_line(moved, nproc=4, preset="h100") is None


def test_when_no_layout_of_the_processes_fits_the_fixes_are_the_checked_changes() -> None:
    cfg = qwen_run("data.seq_len=131072", "train.activation_checkpointing=full")
    line = forecast_line(cfg, nproc=1, preset="h100")
    assert line is not None
    fixes = re.search(r"\(fix: no layout of 1 process is predicted to fit as configured; --set topology=auto with "
                      r"(.*); `csbp plan", line)
    assert fixes is not None, line
    named = fixes[1].split(" or with ")
    assert "2 processes in all (--nproc x --nnodes)" in named
    shorter = next(fix for fix in named if fix.startswith("--set data.seq_len="))
    assert forecast_line(qwen_run(shorter.removeprefix("--set "), "train.activation_checkpointing=full"),
                         nproc=1, preset="h100") is None


def test_a_gpu_no_preset_describes_gets_no_forecast(monkeypatch: pytest.MonkeyPatch) -> None:
    def unknown() -> str:
        raise ValueError("topology: auto has no hardware preset for 'NVIDIA L4'")

    monkeypatch.setattr(memory_forecast, "gpu_preset", unknown)
    assert forecast_line(qwen_run("data.seq_len=65536", "train.activation_checkpointing=none"), nproc=1) is None


def test_the_launcher_warns_before_it_trains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """On the CPU the preset is this machine's RAM over the processes: a machine of almost none gets the
    warning, on stderr, before training starts (and the run still starts: it is a warning)."""
    cfg = tiny_config(make_artifact(tmp_path / "art"))
    trained: list[str] = []

    def train_stub(*args: object, **kwargs: object) -> None:
        trained.append(capsys.readouterr().err)

    monkeypatch.setattr(launcher_module, "train", train_stub)
    launch_training(cfg, run_dir=tmp_path / "fits", max_steps=1)
    assert trained == [""]
    monkeypatch.setattr(hardware_module, "machine_ram_gib", lambda: 1e-6)
    launch_training(cfg, run_dir=tmp_path / "tight", max_steps=1)
    assert len(trained) == 2
    assert re.fullmatch(
        r"warning: csbp plan's cost model predicts [0-9.]+ MiB per device for this run's dp1, no checkpointing, "
        r"micro-batch 2 at "
        r"data\.seq_len 32, more than the 0\.0 MiB of this machine's RAM per process .*\n",
        trained[1],
    ), trained[1]


@pytest.mark.parametrize(
    ("environment", "node_rank", "prints"),
    [
        ({}, None, True),  # one node
        ({}, 0, True),  # csbp's own multi-node launch: no RANK in the launching processes
        ({}, 1, False),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, None, True),  # an outside torchrun
        ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}, None, False),  # rank 0 of the second node
    ],
    ids=["one node", "node 0", "node 1", "torchrun rank 0", "torchrun rank 1"],
)
def test_the_forecast_is_printed_once_per_run(
    environment: dict[str, str], node_rank: int | None, prints: bool,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path,
) -> None:
    """``csbp train --nnodes 2 --node-rank R`` sets no ``RANK`` in either node's launching process, so
    testing ``RANK`` alone printed the forecast on every node; node 0's launcher prints it, and under
    torchrun global rank 0 (the checks and the launch itself are stubbed out here)."""
    for name in launcher_module.TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    for heavy in ("check_run", "verify_data", "check_state_fits", "check_process_count", "_launch_workers",
                  "train_in_process_group"):
        monkeypatch.setattr(launcher_module, heavy, lambda *args, **kwargs: None)
    monkeypatch.setattr(launcher_module, "forecast_line", lambda cfg, nproc: f"warning: forecast for {nproc}")
    options = launcher_module.LaunchOptions(nproc=1, nnodes=2 if node_rank is not None else 1, node_rank=node_rank)
    launcher_module._launch(qwen_run("topology.dp=2"), run_dir=tmp_path, resume=False, max_steps=1, options=options)
    assert capsys.readouterr().err == ("warning: forecast for 1\n" if prints else "")


@pytest.mark.parametrize(
    ("error", "note"),
    [
        (ValueError("objective.dflash.target: no config.json"),
         "cannot price this run, so its memory is not forecast (objective.dflash.target: no config.json)"),
        (ZeroDivisionError("division by zero"),  # not even a bug in the cost model may stop a run
         "failed on this run, so its memory is not forecast (ZeroDivisionError: division by zero; please report it)"),
    ],
)
def test_a_run_the_planner_cannot_price_gets_a_note_not_a_refusal(
    error: Exception, note: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unpriceable(cfg: RunConfig) -> None:
        raise error

    monkeypatch.setattr(memory_forecast, "run_config_workload", unpriceable)
    line = forecast_line(qwen_run("data.seq_len=65536"), nproc=1, preset="h100")
    assert line == f"note: csbp plan's cost model {note}"


def test_on_the_cpu_a_node_shares_its_ram_among_its_own_processes_not_the_jobs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``--nproc 2 --nnodes 4`` on CPUs: each machine's RAM serves its 2 processes. Dividing it by the job's
    8 warned a run that fits (it needs between 3 and 12 GiB per process, and each has 12 GiB)."""
    monkeypatch.setattr(hardware_module, "machine_ram_gib", lambda: 24.0)
    assert hardware("cpu", gpus=8, gpus_per_node=2).mem_gib == 12.0
    assert hardware("cpu", gpus=2).mem_gib == 12.0
    changes = ["model.vocab_size=4096", "model.hidden_size=512", "model.intermediate_size=1536", "model.num_layers=8",
               "model.num_heads=8", "model.num_kv_heads=4", "model.head_dim=64", "train.micro_batch_size=1",
               "data.seq_len=16384"]
    one_node = load_run_config("mdlm-demo", [*changes, "topology.dp=2"])
    four_nodes = load_run_config("mdlm-demo", [*changes, "topology.dp=8"])
    need = by_hand(one_node, Layout(2, checkpointing="none", sharding="ddp"), preset="cpu")
    assert 24.0 / 8 < need < 24.0 / 2
    assert forecast_line(one_node, nproc=2, preset="cpu") is None
    assert forecast_line(four_nodes, nproc=2, preset="cpu") is None



def test_the_priced_layout_is_the_runs_own() -> None:
    """Every field of the run's layout reaches the cost model (mutation audit: pricing an FSDP run as DDP,
    or dropping the configured transport or block schedule for the planner's defaults, survived: every
    forecast test priced a DDP run with the default transport and schedule)."""
    from csbp.training.memory_forecast import run_layout

    cfg = qwen_run(
        "topology.dp=2", "topology.cp=2", "topology.bp=2", "topology.transport=streaming", "topology.schedule=contiguous",
        "train.fsdp=true", "train.activation_checkpointing=full", "train.micro_batch_size=3",
    )
    assert run_layout(cfg) == Layout(
        2, 2, 2, transport="streaming", checkpointing="full", micro_batch=3, sharding="fsdp2", schedule="contiguous"
    )
    plain = qwen_run("topology.cp=2", "topology.schedule=dual_end")
    assert run_layout(plain) == Layout(1, 2, 1, transport="collective", checkpointing=plain.train.activation_checkpointing,
                                       micro_batch=1, sharding="ddp", schedule="dual_end")


def test_a_document_masked_run_is_priced_over_its_own_documents(tmp_path: Path) -> None:
    """Under ``data.document_mask`` the run's rows hold its artifact's documents (as ``topology: auto``
    prices them); pricing one document a row survived the mutation audit."""
    from csbp.plan.artifact_documents import run_config_documents

    cfg = tiny_config(make_artifact(tmp_path / "art"), **{"data.document_mask": True})
    sample = run_config_documents(cfg)
    assert sample is not None
    assert memory_forecast._workload(cfg).doc_length == sample
    assert memory_forecast._workload(tiny_config(tmp_path / "art")).doc_length is None


def test_checkpointing_is_not_offered_when_it_would_not_fit_either() -> None:
    """At 131K tokens on one process even full recomputation is predicted not to fit: the fix is then the
    checked changes, not ``activation_checkpointing=full`` (offering it unchecked survived the audit)."""
    line = forecast_line(qwen_run("data.seq_len=131072", "train.activation_checkpointing=none"), nproc=1, preset="h100")
    assert line is not None
    assert "activation_checkpointing=full, predicted" not in line
    assert "(fix: no layout of 1 process is predicted to fit as configured; --set topology=auto with " in line
