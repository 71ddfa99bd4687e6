"""Counted nouns in user-facing lines: one batch, one step, one process (never "1 batches")."""

from __future__ import annotations

from pathlib import Path

import pytest

from csbp.cli.config_cmd import summary_rows
from csbp.cli.main import main
from csbp.evaluation.runner import EvalReport
from csbp.recipes import load_run_config
from csbp.training.launcher import LaunchOptions, check_process_count
from csbp.wording import counted


def test_counted() -> None:
    assert [counted(n, "batch", "batches") for n in (0, 1, 2)] == ["0 batches", "1 batch", "2 batches"]
    assert counted(1, "row") == "1 row" and counted(3, "row") == "3 rows"


def test_an_eval_report_of_one_batch_and_one_draw() -> None:
    """`csbp eval` printed "1 rows in 1 batches" and "over 1 noise draws"."""
    report = EvalReport(
        objective="bd3", block_size=4, split="val", rows=1, batches=1, samples=1, t_min=1e-3, nelbo=2.0,
        nelbo_stderr=None, ppl_bound=7.39, nelbo_tokens=64, ltr_nll=None, ltr_ppl=None, ltr_tokens=0, seconds=0.1,
    )
    text = report.format()
    assert "val: 1 row in 1 batch, bd3 B=4" in text and "over 1 noise draw, t in" in text


def test_a_one_step_config_summary(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_run_config(
        "mdlm-demo", ["train.max_steps=1", "train.micro_batch_size=1", "topology.dp=1", "optim.warmup_steps=0"]
    )
    assert dict(summary_rows(cfg))["train"].startswith("1 step, 1 sequence per step, ")
    one_layer = load_run_config("demo", ["model.num_layers=1"])
    assert dict(summary_rows(one_layer))["model"].startswith("qwen3, 1 layer, hidden 128")
    drafter = load_run_config("dflash-demo", ["objective.dflash.num_draft_layers=1"])
    assert dict(summary_rows(drafter))["model"].startswith("DFlash drafter, 1 draft layer, shape from target")
    one_warmup = load_run_config("demo", ["optim.warmup_steps=1"])
    assert dict(summary_rows(one_warmup))["optim"] == "lr 0.003 (cosine, 1 warm-up step)"
    assert main(["config", "validate", "demo"]) == 0
    assert "  train      600 steps, 32 sequences per step, " in capsys.readouterr().out


def test_a_one_process_launch_mismatch(tmp_path: Path) -> None:
    cfg = load_run_config("demo")  # world size 2
    with pytest.raises(ValueError) as info:
        check_process_count(cfg, 1, LaunchOptions(nproc=1))
    assert str(info.value).startswith("--nproc 1 x --nnodes 1 = 1 process, but the topology dp=1 cp=2 bp=2")
    single = load_run_config("mdlm-demo", ["topology.dp=1"])  # world size 1
    with pytest.raises(ValueError, match=r"\(fix: launch 1 process in all, or change the topology\)"):
        check_process_count(single, 2, LaunchOptions(nproc=2))


def test_a_one_token_completion(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`csbp generate` printed "[bd3, 1 tokens, 1 block of 4, ...]"."""
    from test_generate_cli import export_tiny_run  # noqa: PLC0415

    final = export_tiny_run(tmp_path / "run")
    argv = ["generate", "--model", str(final), "--prompt", "the", "--device", "cpu", "--max-new-tokens", "1",
            "--block-size", "4"]
    assert main(argv) == 0
    assert "[bd3, 1 token, 1 block of 4, " in capsys.readouterr().out
