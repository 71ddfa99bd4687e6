"""Single-process training runs: outputs of a run, exact resume, atomic checkpoints, resume checks,
precisions and objectives, and validation that fails before any work starts.

Everything trains a tiny decoder (hidden 32, 2 layers) on a tiny artifact (seq_len 32, a trained
byte-level BPE of ~300 ids) on the CPU in float32.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from csbp.cli import train_cmd
from csbp.cli.main import main
from csbp.cli.trained_settings import check_trained_overrides
from csbp.config import ConfigError, config_from_dict, load_config
from csbp.config.schema import RunConfig
from csbp.data.prepare import PrepareConfig, prepare_artifact
from csbp.evaluation.settings import run_config_settings
from csbp.generation.run_settings import run_objective_settings, trained_mask_token
from csbp.models.hf_io import load_hf_checkpoint
from csbp.training import LaunchOptions, TrainSummary, launch_training, train
from csbp.training import checkpoint as checkpoint_module
from csbp.training.metrics import read_metrics
from csbp.training.preflight import check_run

WORDS = "the quick brown fox jumps over a lazy dog while seven bright stars shine above calm water".split()
REQUIRED_KEYS = {"step", "loss", "lr", "tokens_per_s", "grad_norm", "peak_mem_bytes", "elapsed_s"}


def make_artifact(out_dir: Path, *, seq_len: int = 32, seed: int = 0, num_docs: int = 60) -> Path:
    """A prepared artifact of random word sequences with a trained 300-id BPE tokenizer."""
    generator = torch.Generator().manual_seed(seed)
    source = out_dir.parent / f"{out_dir.name}.jsonl"
    lines = []
    for _ in range(num_docs):
        length = int(torch.randint(8, 30, (1,), generator=generator))
        picks = torch.randint(0, len(WORDS), (length,), generator=generator).tolist()
        lines.append(json.dumps({"text": " ".join(WORDS[i] for i in picks)}))
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    prepare_artifact(
        PrepareConfig(
            inputs=(source,),
            out_dir=out_dir,
            seq_len=seq_len,
            train_tokenizer=True,
            vocab_size=300,
            val_fraction=0.1,
        )
    )
    return out_dir


def apply_dotted(data: dict[str, Any], changes: dict[str, Any]) -> None:
    """Set each dotted key of ``changes`` in the nested mapping ``data`` (``None`` removes the key)."""
    for dotted, value in changes.items():
        *parents, last = dotted.split(".")
        node = data
        for key in parents:
            node = node.setdefault(key, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value


def config_dict(artifact: Path, **changes: Any) -> dict[str, Any]:
    """A tiny BD3 run; ``changes`` maps dotted keys to values (``None`` removes a key)."""
    data: dict[str, Any] = {
        "run": {"name": "tiny", "seed": 0},
        "model": {
            "arch": "qwen3",
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_layers": 2,
            "num_heads": 4,
            "num_kv_heads": 2,
            "head_dim": 8,
        },
        "data": {"train": str(artifact), "seq_len": 32},
        "objective": {"name": "bd3", "block_size": 4},
        "optim": {"lr": 3e-3, "warmup_steps": 1},
        "train": {
            "max_steps": 4,
            "micro_batch_size": 2,
            "grad_accum": 2,
            "eval_every": 2,
            "eval_batches": 2,
            "save_every": 2,
            "log_every": 100,
        },
    }
    apply_dotted(data, changes)
    return data


def tiny_config(artifact: Path, **changes: Any) -> RunConfig:
    return config_from_dict(config_dict(artifact, **changes))


def metric_rows(run_dir: Path) -> list[dict[str, Any]]:
    return read_metrics(run_dir / "metrics.jsonl")


def trajectory(run_dir: Path) -> list[tuple[Any, ...]]:
    """Per step: every number that must repeat bit for bit on an exact resume."""
    return [(r["step"], r.get("loss"), r.get("lr"), r.get("grad_norm"), r.get("val_loss")) for r in metric_rows(run_dir)]


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_artifact(tmp_path_factory.mktemp("data") / "art")


@pytest.fixture(scope="module")
def full_run(artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """4 uninterrupted steps through the ``csbp train`` subcommand; returns (run dir, stdout)."""
    root = tmp_path_factory.mktemp("full")
    config_path = root / "run.yaml"
    data = config_dict(artifact, **{"train.generate_after": True})
    config_path.write_text(json.dumps(data), encoding="utf-8")  # JSON is YAML
    parser = argparse.ArgumentParser()
    train_cmd.register(parser.add_subparsers())
    args = parser.parse_args(["train", str(config_path), "--run-dir", str(root / "run")])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert args.func(args) == 0
    return root / "run", printed.getvalue()


@pytest.fixture(scope="module")
def run_at_step2(artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same run stopped after step 2 (``--max-steps 2``): a checkpoint to resume from."""
    run_dir = tmp_path_factory.mktemp("half") / "run"
    train(tiny_config(artifact), run_dir=run_dir, max_steps=2)
    return run_dir


def copy_run(run_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "run"
    shutil.copytree(run_dir, target)
    return target


# ----------------------------------------------------------------------------- outputs of a run


def test_run_writes_metrics_plot_checkpoints_export_and_summary(
    full_run: tuple[Path, str], artifact: Path
) -> None:
    run_dir, printed = full_run
    baseline, *rows = metric_rows(run_dir)
    # the untrained model's validation opens the file (it was only printed), so the val curve starts at 0
    assert baseline["step"] == 0 and "loss" not in baseline and "lr" not in baseline
    assert {"val_loss", "val_nelbo", "val_ppl_bound", "elapsed_s"} <= set(baseline)
    assert baseline["val_loss"] > rows[-1]["val_loss"]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for row in rows:
        assert REQUIRED_KEYS <= set(row), sorted(REQUIRED_KEYS - set(row))
        assert row["tokens_per_s"] > 0 and row["peak_mem_bytes"] > 0 and row["grad_norm"] > 0
    assert [r["step"] for r in rows if "val_loss" in r] == [2, 4]
    assert rows[0]["lr"] == pytest.approx(3e-3) and rows[-1]["lr"] < rows[1]["lr"]  # warm-up, then cosine
    assert all(
        torch.isfinite(torch.tensor([r["loss"], r["val_loss"] if "val_loss" in r else 0.0])).all()
        for r in rows
    )

    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any(p.name.startswith("events.out.tfevents") for p in (run_dir / "tb").iterdir())
    assert load_config(run_dir / "config.yaml") == tiny_config(artifact, **{"train.generate_after": True})

    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_0000004"
    assert sorted(p.name for p in checkpoints.iterdir() if p.is_dir()) == ["step_0000002", "step_0000004"]
    state = json.loads((checkpoints / "step_0000004" / "trainer_state.json").read_text())
    assert state["step"] == 4 and state["loader"]["cursor"] > 0

    model, config = load_hf_checkpoint(run_dir / "final")
    assert (config.hidden_size, config.num_layers) == (32, 2)
    assert (run_dir / "final" / "tokenizer.json").read_bytes() == (artifact / "tokenizer.json").read_bytes()
    hf_config = json.loads((run_dir / "final" / "config.json").read_text())
    assert hf_config["mask_token_id"] == 1 and hf_config["eos_token_id"] == 0

    assert "train loss  first" in printed and "steps       0 -> 4 of 4" in printed
    assert "sample      '" in printed and " => " in printed


def test_an_export_moved_out_of_its_run_keeps_its_training_settings(
    full_run: tuple[Path, str], tmp_path: Path
) -> None:
    """``csbp generate``/``csbp eval`` on a copied ``final/`` sample and score as trained (they used to
    fall back to bd3 with B = 16, or to ask for --objective and --block-size)."""
    final = full_run[0] / "final"
    moved = tmp_path / "my model"
    shutil.copytree(final, moved)
    record = json.loads((moved / "config.json").read_text())["csbp_training"]
    assert record["objective"] == {"name": "bd3", "block_size": 4, "noise": "rotated", "mask_token_id": 1}
    in_run, away = run_config_settings(final), run_config_settings(moved)
    assert in_run.pop("source") == full_run[0] / "config.yaml" and away.pop("source") == moved / "config.json"
    assert away == in_run
    # the run config leaves the mask token to the artifact (1): read from the export, in the run or away
    assert trained_mask_token(final) == (1, final / "config.json")
    assert trained_mask_token(moved) == (1, moved / "config.json")
    assert away["seq_len"] == record["data"]["seq_len"] == 32  # the row length csbp generate notes past
    assert in_run["eos_token_id"] == away["eos_token_id"] == record["data"]["eos_token_id"] == 0  # the data's EOS
    args = argparse.Namespace(objective="mdlm", block_size=None, allow_objective_change=False, allow_block_size_change=False)
    with pytest.raises(ValueError, match=r"trained with objective bd3 \(.*my model/config\.json\)"):
        check_trained_overrides("generate", args, moved, run_objective_settings(moved))


def test_csbp_export_writes_a_checkpoint_as_final_would(
    full_run: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``csbp export RUN/checkpoints/step_N`` (or ``RUN``: its latest checkpoint) gives the HF
    directory ``final/`` holds at that step; ``--model`` on a checkpoint names that fix."""
    run_dir = full_run[0]
    out = tmp_path / "step 4"
    assert main(["export", str(run_dir / "checkpoints" / "step_0000004"), "--out", str(out)]) == 0
    assert "(run tiny, step 4, bd3) ->" in capsys.readouterr().out
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (run_dir / "final" / name).read_bytes(), name
    assert json.loads((out / "config.json").read_text()) == json.loads((run_dir / "final" / "config.json").read_text())
    assert main(["export", str(run_dir), "--out", str(out)]) == 2  # exists: --overwrite
    assert "already exists" in capsys.readouterr().err
    assert main(["export", str(run_dir), "--out", str(out), "--overwrite"]) == 0
    step2 = tmp_path / "step2"
    assert main(["export", str(run_dir / "checkpoints" / "step_0000002"), "--out", str(step2)]) == 0
    assert (step2 / "model.safetensors").read_bytes() != (out / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert main(["eval", "--model", str(run_dir / "checkpoints" / "step_0000002"), "--data", str(tmp_path)]) == 2
    assert "(fix: export one first, `csbp export" in capsys.readouterr().err


def test_csbp_export_refuses_an_out_among_the_runs_checkpoints(
    full_run: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before, ``--out RUN/checkpoints/step_0000099`` was written: every later ``--resume`` took it for
    the newest checkpoint (damaged, a warning) and pruning counted it, deleting a real checkpoint instead."""
    run_dir = copy_run(full_run[0], tmp_path)
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    for out in (run_dir / "checkpoints" / "step_0000099", run_dir / "checkpoints" / "step_0000004" / "hf"):
        assert main(["export", str(run_dir), "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert f"is inside {run_dir / 'checkpoints'}, which holds a run's checkpoints" in err, err
        assert len(err.strip().splitlines()) == 1
    # nor into another run's: exporting the original run into this copy's checkpoints/
    assert main(["export", str(full_run[0]), "--out", str(run_dir / "checkpoints" / "step_0000099")]) == 2
    assert "which holds a run's checkpoints" in capsys.readouterr().err
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before
    assert not (run_dir / "checkpoints" / "step_0000004" / "hf").exists()
    assert main(["export", str(run_dir), "--out", str(run_dir / "exports" / "step4")]) == 0  # elsewhere in RUN: fine


# ----------------------------------------------------------------------------- exact resume


def test_resume_is_bit_identical_to_an_uninterrupted_run(
    full_run: tuple[Path, str], run_at_step2: Path, artifact: Path, tmp_path: Path
) -> None:
    run_dir = copy_run(run_at_step2, tmp_path)
    summary = train(tiny_config(artifact), run_dir=run_dir, resume=True)
    assert (summary.start_step, summary.end_step) == (2, 4)
    assert trajectory(run_dir) == trajectory(full_run[0])  # float32 CPU: exact equality
    # the printed summary's first numbers are the run's (step 0), not this invocation's first (step 3)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    assert val[0][0] == 0 and summary.first_loss == records[0 if "loss" in records[0] else 1]["loss"]
    text = summary.format()
    assert f"val loss    first {val[0][1]:.4f} (step 0)" in text, text
    assert text.splitlines()[-1] == f"val_loss: {val[0][1]:.4f} -> {val[-1][1]:.4f}"


def test_resume_inside_the_warmup_and_between_validations_is_bit_identical(artifact: Path, tmp_path: Path) -> None:
    """Stopped at step 2 of a 3-step warm-up, validation every 4 steps: the resumed lr, loss, gradient
    norm and validation match the uninterrupted run bit for bit, and so do the exported weights. The
    only difference is the validation every invocation runs at its last step (step 2 here)."""
    changes = {"train.max_steps": 5, "optim.warmup_steps": 3, "train.eval_every": 4, "train.save_every": 0}
    train(tiny_config(artifact, **changes), run_dir=tmp_path / "full")
    train(tiny_config(artifact, **changes), run_dir=tmp_path / "half", max_steps=2)
    train(tiny_config(artifact, **changes), run_dir=tmp_path / "half", resume=True)
    full, resumed = trajectory(tmp_path / "full"), trajectory(tmp_path / "half")
    assert full[0][0] == 0 and full[0][4] is not None  # the step-0 validation, kept across the resume
    assert [row[2] for row in full][1:4] == pytest.approx([1e-3, 2e-3, 3e-3])  # warm-up lr crosses the resume
    assert resumed[2][4] is not None and full[2][4] is None  # the stopped invocation validated at its end
    assert resumed[:2] + [resumed[2][:4] + (None,)] + resumed[3:] == full
    weights = "final/model.safetensors"
    assert (tmp_path / "half" / weights).read_bytes() == (tmp_path / "full" / weights).read_bytes()


def test_crash_while_saving_keeps_the_previous_checkpoint(
    full_run: tuple[Path, str],
    run_at_step2: Path,
    artifact: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    run_dir = copy_run(run_at_step2, tmp_path)

    def crash(staging: Path, final: Path) -> None:
        raise RuntimeError("simulated crash after DCP wrote the staging directory")

    monkeypatch.setattr(checkpoint_module, "_publish", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        train(tiny_config(artifact), run_dir=run_dir, resume=True)
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_0000002"
    assert (checkpoints / "step_0000004.tmp" / ".metadata").is_file()
    assert not (checkpoints / "step_0000004").exists()

    monkeypatch.undo()
    train(tiny_config(artifact), run_dir=run_dir, resume=True)
    assert trajectory(run_dir) == trajectory(full_run[0])
    assert not (checkpoints / "step_0000004.tmp").exists()


def test_a_run_stopped_while_exporting_names_the_export_that_finishes_it(
    full_run: tuple[Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Killed after its last checkpoint, before ``final/`` was written: ``--resume`` has nothing to
    train, and its fix used to be only "raise --max-steps or train.max_steps" (another schedule,
    another model). It now names the export that writes ``final/`` from that checkpoint."""
    run_dir = copy_run(full_run[0], tmp_path)
    shutil.rmtree(run_dir / "final")
    config = full_run[0].parent / "run.yaml"
    capsys.readouterr()
    assert main(["train", str(config), "--run-dir", str(run_dir), "--resume"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"{run_dir / 'final'} is missing" in lines[0], lines
    command = lines[0].split("(fix: ")[1].split(";")[0]
    assert command == f"csbp export {run_dir} --out {run_dir / 'final'}"
    assert main(command.split()[1:]) == 0
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (run_dir / "final" / name).read_bytes() == (full_run[0] / "final" / name).read_bytes(), name


def test_resume_rejects_another_model_shape(run_at_step2: Path, artifact: Path, tmp_path: Path) -> None:
    run_dir = copy_run(run_at_step2, tmp_path)
    cfg = tiny_config(artifact, **{"model.num_kv_heads": 4})
    with pytest.raises(ValueError, match=r"model\.num_kv_heads: .* trained with model\.num_kv_heads=2, the config sets 4"):
        launch_training(cfg, run_dir=run_dir, resume=True)
    state_file = next((run_dir / "checkpoints").glob("step_*")) / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({**state, "config_yaml": ""}))  # no config recorded: the shapes still say it
    with pytest.raises(
        ValueError, match=r"another model shape: parameter 'layers\.0\.self_attn\.k_proj\.weight'"
    ):
        launch_training(cfg, run_dir=run_dir, resume=True)


def test_resume_rejects_changed_data(run_at_step2: Path, artifact: Path, tmp_path: Path) -> None:
    run_dir = copy_run(run_at_step2, tmp_path)
    changed = tmp_path / "changed"
    shutil.copytree(artifact, changed)
    manifest = json.loads((changed / "manifest.json").read_text())
    manifest["content_fingerprint"] = "0" * 64  # as if the files had been re-prepared
    (changed / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="fingerprint"):
        launch_training(tiny_config(artifact, **{"data.train": str(changed)}), run_dir=run_dir, resume=True)


def test_run_dir_rules(run_at_step2: Path, artifact: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="already holds checkpoint step_0000002"):
        launch_training(tiny_config(artifact), run_dir=run_at_step2)
    with pytest.raises(ValueError, match="no checkpoint to resume"):
        launch_training(tiny_config(artifact), run_dir=tmp_path / "empty", resume=True)
    with pytest.raises(ValueError, match="nothing is left to do before step 2"):
        launch_training(tiny_config(artifact), run_dir=run_at_step2, resume=True, max_steps=2)


# ----------------------------------------------------------------------------- precisions, objectives


def first_step_loss(cfg: RunConfig, run_dir: Path) -> TrainSummary:
    return train(cfg, run_dir=run_dir, max_steps=1)


def test_fp64_and_bf16_first_step_agree_with_fp32(
    full_run: tuple[Path, str], artifact: Path, tmp_path: Path
) -> None:
    fp32_loss = metric_rows(full_run[0])[1]["loss"]  # [0] is the step-0 validation
    fp64 = first_step_loss(
        tiny_config(artifact, **{"train.precision": "fp64", "model.dtype": "float64"}), tmp_path / "fp64"
    )
    bf16 = first_step_loss(tiny_config(artifact, **{"train.precision": "bf16"}), tmp_path / "bf16")
    assert fp64.first_loss == pytest.approx(fp32_loss, rel=1e-5)
    assert bf16.first_loss != fp32_loss, "bf16 must run under autocast"
    assert bf16.first_loss == pytest.approx(fp32_loss, rel=1e-2)


@pytest.mark.parametrize(
    "changes",
    [
        {"objective.name": "mdlm", "objective.block_size": None},
        {"objective.name": "ar", "objective.block_size": None, "objective.loss_weight": "unit"},
        {"objective.name": "fast_dllm_v2", "objective.loss_weight": "unit"},
        {"data.document_mask": True, "data.reset_positions": True},
    ],
    ids=["mdlm", "ar", "fast_dllm_v2", "bd3-documents"],
)
def test_other_objectives_train(changes: dict[str, Any], artifact: Path, tmp_path: Path) -> None:
    cfg = tiny_config(
        artifact, **{"train.eval_every": 0, "train.grad_accum": 1, "train.generate_after": True, **changes}
    )
    summary = train(cfg, run_dir=tmp_path / "run", max_steps=2)
    assert len(summary.losses) == 2 and all(0.0 < loss < 20.0 for loss in summary.losses)
    assert summary.sample is not None
    assert ("no sample" in summary.sample) == (cfg.objective.name == "ar")


# ----------------------------------------------------------------------------- validation before work


def test_config_validate_checks_existing_inputs_like_train(
    artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from csbp.cli.main import main

    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(config_dict(artifact)))  # JSON is YAML
    assert main(["config", "validate", str(path)]) == 0
    assert f"inputs     {artifact} fits" in capsys.readouterr().out
    assert main(["config", "validate", str(path), "--set", "data.seq_len=64", "--set", "objective.block_size=4"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "packed with seq_len=32" in err and len(err.splitlines()) == 1
    # attention.backend=flex is a GPU config: validated offline, refused only by `csbp train` off CUDA
    assert main(["config", "validate", str(path), "--set", "attention.backend=flex"]) == 0
    capsys.readouterr()


def test_flex_backward_is_validated_and_a_direct_it_cannot_run_refused_before_training(
    artifact: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``attention.flex_backward``: a typo is one config line; on a CUDA machine whose torch cannot
    trace the direct backward, ``direct`` is refused by the pre-flight (``auto`` takes recompute)."""
    import csbp.attention.flex_backward as flex_backward

    with pytest.raises(ConfigError, match="attention.flex_backward"):
        config_from_dict(config_dict(artifact, **{"attention.flex_backward": "fast"}))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # flex is what auto means on CUDA
    monkeypatch.setattr(flex_backward, "direct_backward_support", lambda: (False, "Unsupported: old dynamo"))
    check_run(tiny_config(artifact, **{"attention.flex_backward": "auto"}))
    with pytest.raises(ValueError) as error:
        check_run(tiny_config(artifact, **{"attention.flex_backward": "direct"}))
    assert "\n" not in str(error.value)
    assert str(error.value).startswith("attention.flex_backward=direct needs a torch whose torch.compile traces")
    assert str(error.value).endswith("set attention.flex_backward to auto or recompute")


def test_config_errors_are_raised_before_any_process_starts(artifact: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "never"
    with pytest.raises(ConfigError, match="bp must be a multiple of cp"):
        config_from_dict(config_dict(artifact, **{"topology.cp": 3, "topology.bp": 4}))
    cases = [
        (
            {"objective.name": "mdlm", "objective.block_size": None, "topology.cp": 2},
            "is a single.stream",  # the config rule (or, past it, the preflight check)
        ),
        ({"data.seq_len": 64, "objective.block_size": 4}, "packed with seq_len=32"),
        ({"model.vocab_size": 100}, "model.vocab_size: 100 ids, but the data artifact"),
        ({"objective.mask_token_id": 400}, "outside the model vocabulary"),
        ({"train.fsdp": True}, "train.fsdp: FSDP shards over the data-parallel group"),
        ({"train.micro_batch_size": 500}, "training rows"),
        (
            {"objective.name": "fast_dllm_v2", "objective.loss_weight": "inv_t"},
            "fast_dllm_v2 uses unit weights",
        ),
    ]
    if not torch.cuda.is_available():  # FlexAttention has no CPU backward
        cases.append(({"attention.backend": "flex"}, "attention.backend=flex cannot train on cpu"))
    for changes, message in cases:
        with pytest.raises(ValueError, match=message):
            launch_training(tiny_config(artifact, **changes), run_dir=run_dir)
    with pytest.raises(ValueError, match="needs dp\\*max\\(cp, bp\\) = 2"):
        cfg = tiny_config(artifact, **{"topology.bp": 2, "topology.replicate_clean_prefix": True})
        launch_training(cfg, run_dir=run_dir, options=LaunchOptions(nproc=3))
    assert not run_dir.exists(), "validation must fail before anything is written"

