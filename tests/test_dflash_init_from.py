"""A dflash run started from a drafter directory (``objective.dflash.init_from``).

The tiny setup of ``test_training_dflash`` (a random 4-layer target, hidden 32; a 2-layer drafter on
target layers (0, 2), ``B = 4``) trains 2 steps and ``csbp dflash export`` writes its drafter. A new run
from that export starts with its weights exactly (and the exporting run's last validation loss) and
trains on; a DFlash2 drafter written under the released tensor names loads too. Every architecture
mismatch, and a directory without safetensors weights, is refused in one line before any work.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

from csbp.cli.config_cmd import missing_path_notes
from csbp.cli.main import main
from csbp.data import open_artifact
from csbp.dflash.config import DFlashConfig
from csbp.dflash.drafter import DFlashDrafter
from csbp.dflash.export import csbp_name, export_dflash
from csbp.models.hf_io import load_hf_checkpoint
from csbp.parallel.launch import run_local
from csbp.training import train
from csbp.training.drafter import build_drafter
from csbp.training.preflight import check_run
from test_training_dflash import (
    ALL_ANCHORS,
    LAYOUTS,
    ONE_STEP,
    dflash_config,
    dflash_dict,
    export_target,
    one_line_error,
)
from test_training_run import make_artifact, metric_rows

INIT = "objective.dflash.init_from"
SHORT = {"train.max_steps": 2}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(artifact, target directory)."""
    root = tmp_path_factory.mktemp("init")
    artifact = make_artifact(root / "art")
    target = export_target(root / "target", open_artifact(artifact).vocab_size, tokenizer_dir=artifact)
    return artifact, target


@pytest.fixture(scope="module")
def exported(inputs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(run directory of 2 steps, its ``csbp dflash export``)."""
    root = tmp_path_factory.mktemp("exported")
    train(dflash_config(*inputs, **SHORT), run_dir=root / "run")
    assert main(["dflash", "export", "--run-dir", str(root / "run"), "--out", str(root / "drafter")]) == 0
    return root / "run", root / "drafter"


def stored_weights(directory: Path) -> dict[str, torch.Tensor]:
    return {csbp_name(name): t for name, t in load_file(str(directory / "model.safetensors")).items()}


def step0_weights(cfg: Any) -> dict[str, torch.Tensor]:
    """The drafter weights a run of ``cfg`` starts from (what ``csbp train`` builds at step 0)."""
    inputs = check_run(cfg)
    assert inputs.dflash is not None
    drafter = build_drafter(cfg, inputs.dflash, device=torch.device("cpu"))
    return {name: t.detach().clone() for name, t in drafter.state_dict().items()}


def test_a_run_starts_from_an_export_and_trains_on(
    inputs: tuple[Path, Path], exported: tuple[Path, Path], tmp_path: Path
) -> None:
    run_dir, drafter_dir = exported
    cfg = dflash_config(*inputs, **SHORT, **{INIT: str(drafter_dir)})
    start, stored = step0_weights(cfg), stored_weights(drafter_dir)
    assert set(start) == set(stored)
    for name, tensor in stored.items():
        assert torch.equal(start[name], tensor), name
    # without init_from the seeded drafter is another one
    assert not torch.equal(step0_weights(dflash_config(*inputs, **SHORT))["fc.weight"], stored["fc.weight"])
    # the same data and settings: the new run's step-0 validation is the exporting run's last one
    new_run = tmp_path / "run"
    summary = train(cfg, run_dir=new_run)
    assert (summary.start_step, summary.end_step) == (0, 2)
    before, after = metric_rows(run_dir)[-1], metric_rows(new_run)[0]
    assert (before["step"], after["step"]) == (2, 0)
    assert after["val_loss"] == before["val_loss"]
    assert after["val_acceptance_length"] == before["val_acceptance_length"]
    # and it trains on: finite losses, weights moved away from the export
    assert all(torch.isfinite(torch.tensor(r["loss"])) for r in metric_rows(new_run)[1:])
    final = stored_weights(new_run / "final")
    assert not torch.equal(final["fc.weight"], stored["fc.weight"])
    assert yaml.safe_load((new_run / "config.yaml").read_text())["objective"]["dflash"]["init_from"] == str(drafter_dir)
    # a resume takes the checkpoint's weights, and refuses another init_from drafter (its contents differ)
    resumed = dflash_config(*inputs, **{"train.max_steps": 3, INIT: str(drafter_dir)})
    check_run(resumed, run_dir=new_run, resume=True)
    other = tmp_path / "other"
    shutil.copytree(new_run / "final", other)
    message = one_line_error(
        lambda: check_run(dflash_config(*inputs, **{"train.max_steps": 3, INIT: str(other)}), run_dir=new_run, resume=True)
    )
    assert message.startswith(f"{INIT}: checkpoint ") and "(its contents differ)" in message


def test_a_dflash2_drafter_under_the_released_names_loads(inputs: tuple[Path, Path], tmp_path: Path) -> None:
    artifact, target = inputs
    options = {"conv_kernel_size": 3, "conv_group_size": 8, "selector_rank": 4, "selector_top_k": 4}
    target_model, target_config = load_hf_checkpoint(target)
    config = DFlashConfig.from_target(
        target_config, num_layers=2, block_size=4, mask_token_id=open_artifact(artifact).mask_token_id,
        target_layer_ids=(0, 2), **options,
    )  # fmt: skip
    drafter_dir = export_dflash(DFlashDrafter(config, target=target_model, seed=5), tmp_path / "dflash2")
    names = set(load_file(str(drafter_dir / "model.safetensors")))
    assert "candidate_selector.predecessor_codebook" in names and "layers.0.attention_conv.base_kernel" in names
    assert json.loads((drafter_dir / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    cfg = dflash_config(artifact, target, **{f"objective.dflash.{k}": v for k, v in options.items()},
                        **{INIT: str(drafter_dir)})  # fmt: skip
    start, stored = step0_weights(cfg), stored_weights(drafter_dir)
    assert set(start) == set(stored) and all(torch.equal(start[n], t) for n, t in stored.items())
    # the run without the DFlash2 modules is refused, naming the first
    message = one_line_error(lambda: check_run(dflash_config(artifact, target, **{INIT: str(drafter_dir)})))
    assert message == (
        f"objective.dflash.conv_kernel_size: the run's drafter has 0, but {INIT} {drafter_dir / 'config.json'} has "
        f"conv_kernel_size 3 (fix: set objective.dflash.conv_kernel_size: 3 to start from that drafter, or remove {INIT})"
    )


@pytest.mark.parametrize(
    ("changes", "field", "key", "ours", "theirs"),
    [
        ({"objective.dflash.num_draft_layers": 3, "objective.dflash.target_layer_ids": [0, 1, 2]},
         "objective.dflash.num_draft_layers", "num_hidden_layers", "3", "2"),
        ({"objective.block_size": 8}, "objective.block_size", "block_size", "8", "4"),
        ({"objective.dflash.target_layer_ids": [1, 3]}, "objective.dflash.target_layer_ids",
         "dflash_config.target_layer_ids", "[1, 3]", "[0, 2]"),
        ({"objective.dflash.intermediate_size": 48}, "objective.dflash.intermediate_size", "intermediate_size",
         "48", "64"),
        ({"objective.dflash.layer_types": ["full_attention", "sliding_attention"], "objective.dflash.sliding_window": 8},
         "objective.dflash.layer_types", "layer_types", "[full_attention, sliding_attention]",
         "[full_attention, full_attention]"),
        ({"objective.dflash.selector_rank": 4}, "objective.dflash.selector_rank", "selector_rank", "4", "0"),
    ],
)  # fmt: skip
def test_each_architecture_mismatch_is_refused(
    inputs: tuple[Path, Path], exported: tuple[Path, Path], changes: dict[str, Any], field: str, key: str,
    ours: str, theirs: str,
) -> None:  # fmt: skip
    drafter_dir = exported[1]
    cfg = dflash_config(*inputs, **{INIT: str(drafter_dir), **changes})
    message = one_line_error(lambda: check_run(cfg))
    assert message == (
        f"{field}: the run's drafter has {ours}, but {INIT} {drafter_dir / 'config.json'} has {key} {theirs} "
        f"(fix: set {field}: {theirs} to start from that drafter, or remove {INIT})"
    )


def test_a_drafter_of_another_target_shape_is_refused(
    inputs: tuple[Path, Path], exported: tuple[Path, Path], tmp_path: Path
) -> None:
    """Width and vocabulary come from the target (the drafter shares its embedding and LM head)."""
    artifact, _ = inputs
    drafter_dir, config_file = exported[1], exported[1] / "config.json"
    vocab = open_artifact(artifact).vocab_size
    fix = f"(fix: set objective.dflash.target to the target that drafter was trained against, or remove {INIT})"
    for name, kwargs, key, ours, theirs in (
        ("wider", {"vocab_size": vocab, "hidden_size": 48}, "hidden_size", 48, 32),
        ("more-ids", {"vocab_size": vocab + 8}, "vocab_size", vocab + 8, vocab),
    ):
        target = export_target(tmp_path / name, tokenizer_dir=artifact, **kwargs)  # type: ignore[arg-type]
        message = one_line_error(lambda target=target: check_run(dflash_config(artifact, target, **{INIT: str(drafter_dir)})))
        assert message == (
            f"objective.dflash.target: {target} gives the drafter {key} {ours}, but {INIT} {config_file} has "
            f"{key} {theirs} {fix}"
        )


def test_refused_before_any_process_starts(
    inputs: tuple[Path, Path], exported: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``csbp config validate`` and ``csbp train`` say the same line; train writes no run directory."""
    config_file = tmp_path / "run.yaml"
    config_file.write_text(yaml.safe_dump(dflash_dict(*inputs, **{INIT: str(exported[1]), "objective.block_size": 8})))
    for argv in (["config", "validate", str(config_file)], ["train", str(config_file), "--run-dir", str(tmp_path / "r")]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "objective.block_size: the run's drafter has 8, but " in err and "has block_size 4" in err, err
    assert not (tmp_path / "r").exists()


def test_a_directory_without_safetensors_weights_is_refused(
    inputs: tuple[Path, Path], exported: tuple[Path, Path], tmp_path: Path
) -> None:
    drafter_dir = exported[1]

    def refusal(directory: Path) -> str:
        return one_line_error(lambda: check_run(dflash_config(*inputs, **{INIT: str(directory)})))

    missing = tmp_path / "missing"
    assert refusal(missing).startswith(f"{INIT}: {missing} does not exist (fix: ")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert refusal(empty).startswith(f"{INIT}: {empty} is not a DFlash drafter directory (no config.json) (fix: ")
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(drafter_dir / "config.json", no_weights / "config.json")
    assert refusal(no_weights).startswith(f"{INIT}: {no_weights} has no model.safetensors (fix: ")
    # pickle weights only: refused by name, never opened (these bytes would fail to unpickle)
    (no_weights / "pytorch_model.bin").write_bytes(b"not a pickle")
    assert refusal(no_weights) == (
        f"{INIT}: {no_weights} has no model.safetensors, only pytorch_model.bin, a pickle file, which csbp never "
        "unpickles (fix: convert the weights to model.safetensors with the code the drafter came with, outside csbp)"
    )
    # a damaged weights file, and a target directory passed by mistake, are named too
    (no_weights / "model.safetensors").write_bytes(b"\x00" * 16)
    assert refusal(no_weights).startswith(f"{INIT}: {no_weights / 'model.safetensors'}: not a readable safetensors file")
    message = refusal(inputs[1])
    assert message.startswith(f"{INIT}: {inputs[1] / 'config.json'}: architectures ") and "(fix: " in message


def test_model_init_from_points_a_dflash_run_at_objective_dflash_init_from(
    inputs: tuple[Path, Path], exported: tuple[Path, Path]
) -> None:
    message = one_line_error(lambda: dflash_config(*inputs, **{"model.init_from": str(exported[1])}))
    assert "init_from do not apply to a dflash drafter" in message
    assert message.endswith("; a drafter starts from a drafter directory with objective.dflash.init_from)")


def test_config_validate_notes_a_missing_init_from_directory(inputs: tuple[Path, Path], tmp_path: Path) -> None:
    """``csbp config validate`` notes a missing ``init_from`` as it notes a missing target."""
    cfg = dflash_config(*inputs, **{INIT: str(tmp_path / "gone")})
    assert f"{INIT} does not exist: {tmp_path / 'gone'}" in missing_path_notes(cfg)


def test_a_bfloat16_drafter_with_remote_code_fields_starts_upcast(
    inputs: tuple[Path, Path], exported: tuple[Path, Path], tmp_path: Path
) -> None:
    """As released drafters are stored: bfloat16 weights, and an ``auto_map`` naming a modeling file that is
    not there (it is never imported); the step-0 weights are the stored ones in float32."""
    artifact, target = inputs
    out = tmp_path / "bf16"
    assert main(["dflash", "export", "--drafter", str(exported[1]), "--target", str(target), "--out", str(out),
                 "--dtype", "bfloat16"]) == 0  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    config["auto_map"] = {"AutoModel": "dflash.DFlashDraftModel"}
    (out / "config.json").write_text(json.dumps(config))
    start, stored = step0_weights(dflash_config(artifact, target, **{INIT: str(out)})), stored_weights(out)
    assert all(t.dtype == torch.bfloat16 for t in stored.values())
    for name, tensor in stored.items():
        assert start[name].dtype == torch.float32 and torch.equal(start[name], tensor.float()), name


def _fused_run(rank: int, world: int, artifact: Path, target: Path, drafter_dir: Path, root: Path) -> float | None:
    layout = LAYOUTS["dp2_cp2_bp2"]
    summary = train(dflash_config(artifact, target, **ONE_STEP, **layout, **{INIT: str(drafter_dir)}), run_dir=root)
    return summary.first_loss if rank == 0 else None


def test_every_rank_of_a_fused_layout_starts_from_the_drafter(
    inputs: tuple[Path, Path], exported: tuple[Path, Path], tmp_path: Path
) -> None:
    """dp2 x cp2 x bp2 on 4 gloo processes takes the first step of one process from the same drafter."""
    artifact, target = inputs
    parallel = run_local(_fused_run, 4, (artifact, target, exported[1], tmp_path / "fused"), timeout_s=240)[0]
    single = train(dflash_config(artifact, target, **ONE_STEP, **ALL_ANCHORS, **{INIT: str(exported[1])}),
                   run_dir=tmp_path / "single")  # fmt: skip
    scratch = train(dflash_config(artifact, target, **ONE_STEP, **ALL_ANCHORS), run_dir=tmp_path / "scratch")
    assert parallel == pytest.approx(single.first_loss, abs=1e-5)
    assert abs(single.first_loss - scratch.first_loss) > 1e-3  # the drafter's loss, not a seeded one


def test_a_run_directory_or_a_drafter_under_the_working_directory_is_named(
    inputs: tuple[Path, Path], exported: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A dflash run directory names its final/; a relative init_from in a config in a subdirectory names the
    drafter at that path under the working directory (model.init_from's fix and note do; this one said only
    'point it at a csbp dflash export directory')."""
    run_dir, drafter_dir = exported
    message = one_line_error(lambda: check_run(dflash_config(*inputs, **{INIT: str(run_dir)})))
    assert message.endswith(f"(fix: it is a run directory: use its export, {run_dir / 'final'})")
    shutil.copytree(drafter_dir, tmp_path / "drafter")
    monkeypatch.chdir(tmp_path)
    written = tmp_path / "configs" / "drafter"  # what `init_from: drafter` in configs/run.yaml resolves to
    message = one_line_error(lambda: check_run(dflash_config(*inputs, **{INIT: str(written)})))
    assert message.endswith(f"set {INIT}: {tmp_path / 'drafter'})")
    notes = missing_path_notes(dflash_config(*inputs, **{INIT: str(written)}))
    assert f"{INIT} does not exist: {written} (but {tmp_path / 'drafter'} is a drafter directory" in notes[0]
