"""DFlash drafter training through the trainer (``objective.name: dflash``).

A tiny artifact (seq_len 32, a trained 300-id BPE) and a random, never-trained 4-layer target
(hidden 32, 4/2 heads, head dim 8) exported with the artifact's tokenizer; a 2-layer drafter fusing
target layers (0, 2) with ``B = 4``, float32 on the CPU. Checked: the outputs of a single-process
run (metrics keys, ``final/`` in the public DFlash format, drafter-only checkpoints); that a run
interrupted and resumed equals the uninterrupted one step for step; that CSBP on 4 gloo processes
(dp=2 x cp=2 x bp=2, and cp=2 x bp=4 with sampled anchors) gives the single-process first step;
and the one-line errors for bad configs, targets and data.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from csbp.cli.main import main
from csbp.config import ConfigError, config_from_dict
from csbp.config.schema import RunConfig
from csbp.data import PackedLoader, open_artifact
from csbp.dflash.export import load_dflash
from csbp.dflash.feature_writer import prepare_features
from csbp.dflash.target_fingerprint import checkpoint_fingerprint
from csbp.dflash.target_record import weights_sample_fingerprint
from csbp.models.config import DecoderConfig
from csbp.models.decoder import Decoder
from csbp.models.hf_io import export_hf_checkpoint, load_hf_checkpoint
from csbp.parallel.launch import run_local
from csbp.training import train
from csbp.training.checkpoint import find_latest_checkpoint, read_training_state
from csbp.training.preflight import check_run
from test_training_run import REQUIRED_KEYS, apply_dotted, make_artifact, metric_rows

DFLASH_KEYS = REQUIRED_KEYS | {"token_accuracy", "tau_mean", "tflops_per_device"}  # the drafter's model FLOPs
VAL_KEYS = {
    "val_loss",
    "val_token_accuracy",
    "val_tau_mean",
    "val_acceptance_length",
    "val_accept_rate_1",
    "val_accept_rate_2",
    "val_accept_rate_3",
}
DRAFTER_LAYERS = 2


def export_target(
    directory: Path, vocab_size: int, *, tokenizer_dir: Path, hidden_size: int = 32, seed: int = 11
) -> Path:
    """A random 4-layer target (never trained) as a HF checkpoint with ``tokenizer_dir``'s tokenizer."""
    config = DecoderConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
    )
    return export_hf_checkpoint(Decoder(config, seed=seed), config, directory, tokenizer_dir=tokenizer_dir)


def dflash_dict(artifact: Path, target: Path, **changes: Any) -> dict[str, Any]:
    """A tiny dflash run; ``changes`` maps dotted keys to values (``None`` removes a key)."""
    data: dict[str, Any] = {
        "run": {"name": "tiny-dflash", "seed": 0},
        "model": {"dtype": "float32"},
        "data": {"train": str(artifact), "seq_len": 32},
        "objective": {
            "name": "dflash",
            "block_size": 4,
            "dflash": {
                "target": str(target),
                "num_draft_layers": DRAFTER_LAYERS,
                "target_layer_ids": [0, 2],
                "max_anchors": 6,
                "gamma": 4.0,
                "eval_prompts": 2,  # speculative-decoding validation: 2 prompts of 8 new tokens
                "eval_new_tokens": 8,
            },
        },
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


def dflash_config(artifact: Path, target: Path, **changes: Any) -> RunConfig:
    return config_from_dict(dflash_dict(artifact, target, **changes))


def trajectory(run_dir: Path) -> list[tuple[Any, ...]]:
    """Per step: every number that must repeat bit for bit on an exact resume."""
    keys = ("step", "loss", "lr", "grad_norm", "token_accuracy", "tau_mean", "val_loss", "val_tau_mean")
    return [tuple(record.get(key) for key in keys) for record in metric_rows(run_dir)]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(artifact, target directory)."""
    root = tmp_path_factory.mktemp("dflash")
    artifact = make_artifact(root / "art")
    target = export_target(root / "target", open_artifact(artifact).vocab_size, tokenizer_dir=artifact)
    return artifact, target


@pytest.fixture(scope="module")
def full_run(inputs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 uninterrupted steps (grad_accum 2, validation and checkpoints every 2 steps)."""
    run_dir = tmp_path_factory.mktemp("full") / "run"
    summary = train(dflash_config(*inputs), run_dir=run_dir)
    assert (summary.start_step, summary.end_step, len(summary.losses)) == (0, 4, 4)
    assert summary.final_dir == run_dir / "final"  # the summary's export line names the drafter
    return run_dir


# ----------------------------------------------------------------------------- one process


def test_run_writes_metrics_drafter_checkpoints_and_the_public_format(
    inputs: tuple[Path, Path], full_run: Path
) -> None:
    artifact, target = inputs
    baseline, *records = metric_rows(full_run)
    assert baseline["step"] == 0 and VAL_KEYS <= set(baseline) and "loss" not in baseline  # untrained drafter
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for record in records:
        assert DFLASH_KEYS <= set(record), sorted(DFLASH_KEYS - set(record))
        assert (VAL_KEYS <= set(record)) == (record["step"] % 2 == 0)
        assert 0.0 <= record["token_accuracy"] <= 1.0
        assert 1.0 <= record["tau_mean"] <= 4.0  # one accepted anchor token up to the whole block
        assert np.isfinite(record["loss"]) and record["loss"] > 0.0
        assert record["tflops_per_device"] > 0.0 and "mfu" not in record  # no peak on the CPU
    final = full_run / "final"
    config = json.loads((final / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert (config["block_size"], config["num_hidden_layers"], config["num_target_layers"]) == (4, 2, 4)
    assert config["dflash_config"]["target_layer_ids"] == [0, 2]
    assert config["csbp_training"] == {"objective": {"name": "dflash", "dflash": {"context": "strict"}}}
    assert config["csbp_target"] == {"weights": weights_sample_fingerprint(target)}  # what dflash eval checks
    assert config["dflash_config"]["mask_token_id"] == open_artifact(artifact).mask_token_id
    target_positions = json.loads((target / "config.json").read_text())["max_position_embeddings"]
    assert config["max_position_embeddings"] == max(target_positions, 32)  # the context it serves at
    tensors = load_file(str(final / "model.safetensors"))
    assert "fc.weight" in tensors and "layers.1.mlp.down_proj.weight" in tensors
    assert not [name for name in tensors if "embed" in name or "lm_head" in name or name.startswith("model.")]
    assert (final / "tokenizer.json").read_bytes() == (target / "tokenizer.json").read_bytes()
    # the target holds a bare tokenizer.json: a config naming the generic class and the data's special tokens
    tokenizer_config = json.loads((final / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tokenizer_config["mask_token"] == "<|mask|>" and tokenizer_config["eos_token"] == "<|endoftext|>"
    target_model, _ = load_hf_checkpoint(target)
    drafter = load_dflash(final, target_model)
    assert torch.equal(drafter.fc.weight, tensors["fc.weight"])
    # checkpoints hold the drafter only (the target is frozen and shared by reference)
    state = read_training_state(find_latest_checkpoint(full_run))  # type: ignore[arg-type]
    assert state.step == 4
    assert set(state.param_shapes) == {name for name, _ in drafter.named_parameters()}


def test_validation_reports_the_acceptance_length_eval_measures(
    inputs: tuple[Path, Path], full_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The last ``val_acceptance_length`` of a run is what ``csbp dflash eval --data`` prints for its
    export (same prompts, same lossless speculative decoding), and the per-position rates add up."""
    artifact, target = inputs
    last = metric_rows(full_run)[-1]
    rates = [last[f"val_accept_rate_{k}"] for k in (1, 2, 3)]
    assert rates == sorted(rates, reverse=True) and all(0.0 <= r <= 1.0 for r in rates)
    assert 1.0 <= last["val_acceptance_length"] <= 4.0
    assert main(["dflash", "eval", "--target", str(target), "--drafter", str(full_run / "final"),
                 "--data", str(artifact), "--no-check-lossless", "--num-prompts", "2",
                 "--max-new-tokens", "8"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    assert printed.strip().splitlines()[-1] == f"acceptance_length: {last['val_acceptance_length']:.3f}"
    assert "per-position acceptance [" + " ".join(f"{r:.3f}" for r in rates) + "]" in printed


def test_dflash_export_carries_the_tokenizer_files_of_final(
    inputs: tuple[Path, Path], full_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``csbp dflash export`` of a run's checkpoint writes the tokenizer files its ``final/`` has, and a
    re-export of a drafter directory keeps them; before, it wrote none (``AutoTokenizer`` found nothing)."""
    target = str(inputs[1])
    final = full_run / "final"
    names = sorted(p.name for p in final.iterdir() if p.name.startswith("tokenizer"))
    assert names == ["tokenizer.json", "tokenizer_config.json"]
    checkpoint = full_run / "checkpoints" / "step_0000004"
    for source in (["--checkpoint", str(checkpoint)], ["--drafter", str(final)]):
        out = tmp_path / source[0].strip("-")
        assert main(["dflash", "export", *source, "--target", target, "--out", str(out)]) == 0
        for name in names:
            assert (out / name).is_file() and (out / name).read_bytes() == (final / name).read_bytes(), (source, name)
        printed = capsys.readouterr()
        assert "2 tokenizer files" in printed.out and printed.err == ""
        exported = json.loads((out / "config.json").read_text())["csbp_target"]  # carried, or the checked target's
        assert exported == json.loads((final / "config.json").read_text())["csbp_target"], source
    # never into a run's checkpoints/, where it would pass for a checkpoint (and be pruned or prune one)
    inside = full_run / "checkpoints" / "step_0000099"
    for source in (["--run-dir", str(full_run)], ["--checkpoint", str(checkpoint)], ["--drafter", str(final)]):
        assert main(["dflash", "export", *source, "--target", target, "--out", str(inside)]) == 2
        assert "which holds a run's checkpoints" in capsys.readouterr().err and not inside.exists()
    # a checkpoint whose data artifact is gone still exports, saying what it lacks
    moved = tmp_path / "moved" / "checkpoints" / "step_0000004"
    shutil.copytree(checkpoint, moved)
    state = json.loads((moved / "trainer_state.json").read_text())
    state["config_yaml"] = state["config_yaml"].replace(str(inputs[0]), str(tmp_path / "gone"))
    (moved / "trainer_state.json").write_text(json.dumps(state))
    checksums = moved / "checksums.json"
    if checksums.is_file():  # the edited trainer_state.json would not match its recorded checksum
        checksums.unlink()
    out = tmp_path / "no-tokenizer"
    mask = str(open_artifact(inputs[0]).mask_token_id)  # the run config leaves it to the artifact, gone now
    assert main(["dflash", "export", "--checkpoint", str(moved), "--target", target, "--out", str(out),
                 "--mask-token-id", mask]) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert "note: the export carries no tokenizer files:" in err and len(err.strip().splitlines()) == 1, err
    assert not list(out.glob("tokenizer*"))


def test_dflash_export_takes_the_target_the_run_recorded(
    inputs: tuple[Path, Path], full_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without ``--target`` an export of a run or checkpoint uses the ``objective.dflash.target`` it
    recorded, saying so; a ``--drafter`` directory records none, so there it stays required (one line)."""
    checkpoint = full_run / "checkpoints" / "step_0000004"
    for source in (["--run-dir", str(full_run)], ["--checkpoint", str(checkpoint)]):
        out = tmp_path / source[0].strip("-")
        assert main(["dflash", "export", *source, "--out", str(out)]) == 0
        err = capsys.readouterr().err
        assert f"target: {inputs[1]} (recorded by the run; --target overrides)" in err, err
        assert (out / "model.safetensors").is_file()
    assert main(["dflash", "export", "--drafter", str(full_run / "final"), "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--target is required with --drafter" in err and len(err.splitlines()) == 1, err


def test_interrupted_and_resumed_equals_uninterrupted(
    inputs: tuple[Path, Path], full_run: Path, tmp_path: Path
) -> None:
    run_dir = tmp_path / "run"
    train(dflash_config(*inputs), run_dir=run_dir, max_steps=2)
    assert [row[0] for row in trajectory(run_dir)] == [0, 1, 2]
    resumed = train(dflash_config(*inputs), run_dir=run_dir, resume=True)
    assert resumed.start_step == 2
    assert trajectory(run_dir) == trajectory(full_run)  # float32, one process: bit for bit
    exported = (run_dir / "final" / "model.safetensors").read_bytes()
    assert exported == (full_run / "final" / "model.safetensors").read_bytes()


def test_offline_features_train_like_online_capture(
    inputs: tuple[Path, Path], full_run: Path, tmp_path: Path
) -> None:
    artifact, target = inputs
    target_model, _ = load_hf_checkpoint(target)
    split = open_artifact(artifact).split("train")
    store = prepare_features(target_model, split, tmp_path / "features", layer_ids=(0, 2), dtype="float32",
                             target_weights=checkpoint_fingerprint(target))
    run_dir = tmp_path / "run"
    train(dflash_config(artifact, target, **{"objective.dflash.features": str(store)}), run_dir=run_dir)
    offline, online = trajectory(run_dir), trajectory(full_run)
    assert [row[0] for row in offline] == [0, 1, 2, 3, 4]
    for got, want in zip(offline[1:], online[1:]):  # same features up to float32 storage: same numbers
        assert got[1:4] == pytest.approx(want[1:4], rel=1e-6)
    wrong_layers = dflash_config(artifact, target, **{"objective.dflash.features": str(store),
                                                      "objective.dflash.target_layer_ids": [1, 2]})
    message = one_line_error(lambda: check_run(wrong_layers))
    assert message.startswith("objective.dflash.features: ") and "layer_ids=[0, 2] but expected [1, 2]" in message


def test_features_of_other_target_weights_are_refused(inputs: tuple[Path, Path], tmp_path: Path) -> None:
    # A fine-tune of the target has its config.json (same shapes, same config hash) and other hidden
    # states: a store captured from the base checkpoint must not train a drafter for the fine-tune.
    artifact, target = inputs
    split = open_artifact(artifact).split("train")
    tuned = tmp_path / "tuned"
    shutil.copytree(target, tuned)
    model, config = load_hf_checkpoint(target)
    with torch.no_grad():
        model.layers[0].mlp.up_proj.weight.mul_(1.01)
    export_hf_checkpoint(model, config, tuned, tokenizer_dir=artifact, overwrite=True)
    store = prepare_features(load_hf_checkpoint(target)[0], split, tmp_path / "features", layer_ids=(0, 2),
                             dtype="float32", target_weights=checkpoint_fingerprint(target))
    check_run(dflash_config(artifact, target, **{"objective.dflash.features": str(store)}))  # its own target: fine
    message = one_line_error(lambda: check_run(
        dflash_config(artifact, tuned, **{"objective.dflash.features": str(store)})))
    assert message.startswith("objective.dflash.features: ") and "target_weights='safetensors-sha256:" in message
    assert f"but expected '{checkpoint_fingerprint(tuned)}'" in message and "prepare-features" in message


# ----------------------------------------------------------------------------- 4 processes

ALL_ANCHORS = {"objective.dflash.max_anchors": 32}  # >= every valid anchor: no layout-dependent draw
ONE_STEP = {"train.max_steps": 1, "train.grad_accum": 1, "train.eval_every": 0}
LAYOUTS: dict[str, dict[str, Any]] = {
    # dp=2: each replica takes one of the two rows of the single-process batch
    "dp2_cp2_bp2": {"topology.dp": 2, "topology.cp": 2, "topology.bp": 2, "train.micro_batch_size": 1,
                    **ALL_ANCHORS},
    # dp=1: the single-process batch, 6 sampled anchors (every rank must draw the same ones)
    "cp2_bp4": {"topology.cp": 2, "topology.bp": 4},
}
SINGLE: dict[str, dict[str, Any]] = {"dp2_cp2_bp2": ALL_ANCHORS, "cp2_bp4": {}}


def _csbp_runs(rank: int, world: int, artifact: Path, target: Path, root: Path) -> dict[str, Any] | None:
    results = {}
    for name, layout in LAYOUTS.items():
        summary = train(dflash_config(artifact, target, **ONE_STEP, **layout), run_dir=root / name)
        results[name] = summary.first_loss
    return results if rank == 0 else None


def test_csbp_on_four_processes_matches_one_process(inputs: tuple[Path, Path], tmp_path: Path) -> None:
    artifact, target = inputs
    assert config_from_dict(dflash_dict(artifact, target, **LAYOUTS["cp2_bp4"])).world_size == 4
    losses = run_local(_csbp_runs, 4, (artifact, target, tmp_path), timeout_s=240)[0]
    for name in LAYOUTS:
        single = train(dflash_config(artifact, target, **ONE_STEP, **SINGLE[name]), run_dir=tmp_path / f"1_{name}")
        (parallel,) = metric_rows(tmp_path / name)
        (reference,) = metric_rows(tmp_path / f"1_{name}")
        assert losses[name] == pytest.approx(single.first_loss, abs=1e-5), name
        # float32, measured: loss within 2.4e-7 (abs), gradient norm within 1.3e-8 (rel; was checked at 1e-4)
        assert parallel["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-6), name
        assert parallel["tau_mean"] == pytest.approx(reference["tau_mean"], abs=1e-9), name
        assert parallel["token_accuracy"] == pytest.approx(reference["token_accuracy"], abs=1e-9), name
        assert (tmp_path / name / "final" / "model.safetensors").is_file()


# ----------------------------------------------------------------------------- errors, one line each


def one_line_error(action: Any) -> str:
    with pytest.raises(ValueError) as info:
        action()
    message = str(info.value)
    assert "\n" not in message, message
    return message


def test_config_rules(inputs: tuple[Path, Path]) -> None:
    artifact, target = inputs
    fused = {"topology.cp": 2, "topology.bp": 2}
    message = one_line_error(lambda: dflash_config(artifact, target, **fused, **{"objective.dflash.max_anchors": 1}))
    assert message == (
        "config: objective.dflash.max_anchors: max_anchors=1 is below bp=2: some BP ranks would own no anchor "
        "(fix: set max_anchors >= 2)"
    )
    with pytest.raises(ConfigError) as info:
        dflash_config(artifact, target, **fused, **{"data.seq_len": 34})
    assert info.value.lines == [
        "config: data.seq_len: seq_len=34 must split into 2*cp=4 equal zigzag chunks (fix: use a multiple of 4, "
        "e.g. 36)"
    ]
    message = one_line_error(lambda: check_run(dflash_config(artifact, target, **{"objective.t_min": 0.3})))
    assert message == (  # a drafter has no noise level: the option was silently ignored
        "objective.t_min: not supported here, dflash never reads it (its noise options: none) "
        "(fix: remove objective.t_min, or set its default: --set objective.t_min=0.001)"
    )  # --set cannot remove a key, and objective.t_min=null is not a number


def test_missing_target_directory(inputs: tuple[Path, Path], tmp_path: Path) -> None:
    artifact, _ = inputs
    cfg = dflash_config(artifact, tmp_path / "no-target")
    message = one_line_error(lambda: check_run(cfg))
    assert message.startswith(f"objective.dflash.target: {tmp_path / 'no-target'} does not exist (fix: ")
    (tmp_path / "empty").mkdir()
    message = one_line_error(lambda: check_run(dflash_config(artifact, tmp_path / "empty")))
    assert "is not a HF checkpoint directory (no config.json)" in message
    (tmp_path / "empty" / "config.json").write_text('{"architectures": [')  # named: it said "Expecting value"
    message = one_line_error(lambda: check_run(dflash_config(artifact, tmp_path / "empty")))
    assert message == f"{tmp_path / 'empty' / 'config.json'}: malformed JSON (Expecting value at line 1) (fix: restore the file)"


def test_target_and_drafter_must_agree(inputs: tuple[Path, Path], tmp_path: Path, full_run: Path) -> None:
    artifact, target = inputs
    beyond = dflash_config(artifact, target, **{"objective.dflash.target_layer_ids": [0, 4]})
    message = one_line_error(lambda: check_run(beyond))
    assert message.startswith("objective.dflash: DFlashConfig.target_layer_ids=[0, 4] must be distinct ids in ")
    small = export_target(tmp_path / "small", 64, tokenizer_dir=artifact)
    message = one_line_error(lambda: check_run(dflash_config(artifact, small)))
    assert "embeds 64 ids but the data" in message
    other_tokenizer = tmp_path / "other"
    shutil.copytree(target, other_tokenizer)
    with open(other_tokenizer / "tokenizer.json", "a", encoding="utf-8") as handle:
        handle.write(" ")
    message = one_line_error(lambda: check_run(dflash_config(artifact, other_tokenizer)))
    assert "is not the one" in message and "fingerprints differ" in message
    # resuming a run against another target (another hidden size) is refused before any weight loads
    wider = export_target(tmp_path / "wider", open_artifact(artifact).vocab_size, tokenizer_dir=artifact,
                          hidden_size=48)
    run_dir = tmp_path / "run"
    shutil.copytree(full_run, run_dir)
    message = one_line_error(
        lambda: check_run(dflash_config(artifact, wider, **{"train.max_steps": 6}), run_dir=run_dir, resume=True)
    )
    assert message.startswith("objective.dflash.target: checkpoint ") and f"the config sets {wider} (its contents differ);" in message


def test_a_target_overwritten_in_place_is_refused_on_resume(inputs: tuple[Path, Path], tmp_path: Path) -> None:
    """The same ``objective.dflash.target`` path with other contents (same shape, other weights) is
    refused by its content fingerprint; unchanged, the run resumes (it used to resume onto either)."""
    artifact, target = inputs
    own = tmp_path / "target"
    shutil.copytree(target, own)
    run_dir = tmp_path / "run"
    train(dflash_config(artifact, own), run_dir=run_dir, max_steps=2)
    resumed = dflash_config(artifact, own, **{"train.max_steps": 6})
    check_run(resumed, run_dir=run_dir, resume=True)
    shutil.rmtree(own)
    export_target(own, open_artifact(artifact).vocab_size, tokenizer_dir=artifact, seed=12)
    message = one_line_error(lambda: check_run(resumed, run_dir=run_dir, resume=True))
    assert message.startswith(f"objective.dflash.target: {own} has changed since checkpoint ")
    assert "its contents differ from the recorded fingerprint" in message


def test_rows_without_an_anchor_are_rejected(inputs: tuple[Path, Path], tmp_path: Path) -> None:
    artifact, target = inputs
    copy = tmp_path / "art"
    shutil.copytree(artifact, copy)
    split = open_artifact(copy).split("train")
    row = int(next(PackedLoader(split, batch_size=1, seed=0))["row_ids"][0])
    loss_mask = np.memmap(copy / "train.loss_mask.bin", dtype="u1", mode="r+", shape=split.loss_mask.shape)
    loss_mask[row, 1::2] = 0  # no two consecutive supervised tokens
    loss_mask.flush()
    message = one_line_error(lambda: check_run(dflash_config(copy, target)))
    assert message.startswith(f"data.train: row {row} has no valid DFlash anchor")
    # it said "filter such rows out of the data", which csbp has no way to do; a row inside a long
    # prompt or chat history (--chat-documents turn) is the usual cause: a longer --seq-len the fix
    assert "filter" not in message and message.endswith(
        "(fix: re-prepare the data with a longer --seq-len, so that no row lies wholly inside a prompt or chat "
        "history, or drop records whose unsupervised part is longer than a row)"
    )
