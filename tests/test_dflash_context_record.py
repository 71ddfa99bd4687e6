"""The context convention a drafter was trained with (``objective.dflash.context``, objectives.md §5.5)
travels with its export: the public DFlash format has no field for it and every reader serves
context strictly before the anchor, so an ``inclusive`` drafter used to be exported unmarked and
served with a train/serve mismatch nobody could see. csbp records it under ``csbp_training``,
carries it through re-exports, and says so when it evaluates such a drafter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from safetensors.torch import load_file

from csbp.dflash.export import TRAINING_KEY, drafter_context, export_dflash, load_dflash
from csbp.dflash.verify import DFlashVerifyCase, build_models
from test_dflash_cli import _drafter, _target_config, run_cli, workspace  # noqa: F401  (workspace: fixture)

INCLUSIVE = {"objective": {"name": "dflash", "dflash": {"context": "inclusive"}}}


def test_export_records_the_context_and_the_loader_reads_it(tmp_path: Path) -> None:
    target, drafter = build_models(DFlashVerifyCase())
    marked = export_dflash(drafter, tmp_path / "inclusive", context="inclusive")
    assert json.loads((marked / "config.json").read_text())[TRAINING_KEY] == INCLUSIVE
    assert drafter_context(marked) == "inclusive"
    loaded = load_dflash(marked, target)  # the record does not disturb the public fields
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), drafter.state_dict().values()))
    unknown = export_dflash(drafter, tmp_path / "unknown")  # e.g. a released drafter re-exported
    assert TRAINING_KEY not in json.loads((unknown / "config.json").read_text())
    assert drafter_context(unknown) is None
    with pytest.raises(ValueError, match="context must be one of"):
        export_dflash(drafter, tmp_path / "bad", context="loose")
    config = json.loads((marked / "config.json").read_text())
    config[TRAINING_KEY]["objective"]["dflash"]["context"] = "loose"
    (marked / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json: csbp_training\.objective\.dflash\.context is 'loose'"):
        drafter_context(marked)


def test_re_exports_keep_the_context_and_eval_says_what_it_measures(
    workspace: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]  # noqa: F811
) -> None:
    target = str(workspace["target"])
    source = tmp_path / "inclusive"
    public = json.loads((workspace["drafter"] / "config.json").read_text())
    export_dflash(_drafter(_target_config(public["vocab_size"]), public["dflash_config"]["mask_token_id"]),
                  source, context="inclusive")  # fmt: skip
    again = tmp_path / "again"
    assert run_cli(["dflash", "export", "--drafter", str(source), "--target", target, "--out", str(again)]) == 0
    printed = capsys.readouterr()
    assert "context inclusive" in printed.out and "trained with objective.dflash.context: inclusive" in printed.err
    assert drafter_context(again) == "inclusive"

    evaluate = ["dflash", "eval", "--target", target, "--prompts", str(workspace["prompts"]), "--num-prompts", "1",
                "--max-new-tokens", "4", "--no-check-lossless"]  # fmt: skip
    assert run_cli([*evaluate, "--drafter", str(again)]) == 0
    note = capsys.readouterr().err
    assert note.count("\n") == 1 and note.startswith(f"note: drafter {again} was trained with objective.dflash.context")
    assert run_cli([*evaluate, "--drafter", str(workspace["drafter"])]) == 0
    assert "inclusive" not in capsys.readouterr().err


def test_a_checkpoint_export_records_its_runs_context(
    workspace: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]  # noqa: F811
) -> None:
    vocab = json.loads((workspace["drafter"] / "config.json").read_text())["vocab_size"]
    drafter = _drafter(_target_config(vocab), 11)
    step_dir = tmp_path / "run" / "checkpoints" / "step_0000010"
    dcp.save({"model": drafter.state_dict(), "optim": {}}, checkpoint_id=str(step_dir), no_dist=True)
    for context, recorded in (("inclusive", "inclusive"), (None, "strict")):  # unset: the schema's strict
        dflash = {"target_layer_ids": [0, 2], **({"context": context} if context else {})}
        run_config = {"objective": {"name": "dflash", "block_size": 4, "mask_token_id": 1, "dflash": dflash}}
        (step_dir / "trainer_state.json").write_text(json.dumps({"step": 10, "config_yaml": yaml.safe_dump(run_config)}))
        out = tmp_path / f"out-{recorded}"
        argv = ["dflash", "export", "--checkpoint", str(step_dir), "--target", str(workspace["target"]), "--out", str(out)]
        assert run_cli(argv) == 0
        capsys.readouterr()
        assert drafter_context(out) == recorded
        assert load_file(str(out / "model.safetensors")).keys() == drafter.state_dict().keys()
