"""A drafter export records the target it was trained against (``csbp_target``), and ``csbp dflash eval``
refuses another target of the same shape before loading either model: it ran, and reported an
acceptance length of 1.000, for a drafter paired with a target trained from another seed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import csbp.cli.dflash_eval_cmd as eval_cmd
from csbp.cli.dflash_checkpoint import check_checkpoint_target
from csbp.data.artifact import open_artifact
from csbp.dflash.export import export_dflash
from csbp.dflash.target_record import target_record, weights_sample_fingerprint
from csbp.models.decoder import Decoder
from csbp.models.hf_io import export_hf_checkpoint, load_hf_checkpoint
from csbp.training.input_identity import directory_fingerprint
from test_dflash_cli import _drafter, _target_config, build_workspace, run_cli


@pytest.fixture(scope="module")
def paired(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The ``test_dflash_cli`` workspace, a drafter export recording its target and another target of the
    same shape (seed 2)."""
    ws = build_workspace(tmp_path_factory.mktemp("target_record"))
    tokenizer = open_artifact(ws["artifact"]).load_tokenizer()
    config = _target_config(tokenizer.vocab_size)
    ws["paired"] = export_dflash(_drafter(config, tokenizer.mask_token_id), ws["root"] / "paired",
                                 target=target_record(ws["target"]))
    ws["other"] = export_hf_checkpoint(Decoder(config, seed=2), config, ws["root"] / "other", tokenizer_dir=ws["artifact"])
    return ws


def _eval(ws: dict[str, Path], target: Path, drafter: Path, *extra: str) -> list[str]:
    return ["dflash", "eval", "--target", str(target), "--drafter", str(drafter), "--data", str(ws["artifact"]),
            "--num-prompts", "1", "--prompt-len", "8", "--max-new-tokens", "4", *extra]


def test_eval_refuses_another_target_of_the_same_shape_before_loading_it(
    paired: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert run_cli(_eval(paired, paired["target"], paired["paired"])) == 0
    copy = tmp_path / "copy"
    shutil.copytree(paired["target"], copy)  # a moved or copied target is the same target
    assert run_cli(_eval(paired, copy, paired["paired"])) == 0
    capsys.readouterr()
    loaded: list[Path] = []
    monkeypatch.setattr(eval_cmd, "load_target", lambda path, args: loaded.append(path) or load_hf_checkpoint(path)[0])
    assert run_cli(_eval(paired, paired["other"], paired["paired"])) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"csbp: error: --drafter {paired['paired']} was trained against a target with other weights "
                          f"than --target {paired['other']} (same shapes; ") and len(err.splitlines()) == 1
    assert "--any-target" in err and loaded == []  # refused before any weight is read
    assert run_cli(_eval(paired, paired["other"], paired["paired"], "--any-target")) == 0
    assert "is not the target drafter" in capsys.readouterr().err
    # a drafter that records no target (a released one, an older export) is measured as before
    assert run_cli(_eval(paired, paired["other"], paired["drafter"])) == 0


def test_a_re_export_keeps_the_record_and_a_checkpoint_export_checks_its_target(
    paired: dict[str, Path], tmp_path: Path
) -> None:
    assert run_cli(["dflash", "export", "--drafter", str(paired["paired"]), "--target", str(paired["other"]),
                    "--out", str(tmp_path / "re")]) == 0  # --target only checks shapes here: the record is kept
    record = json.loads((tmp_path / "re" / "config.json").read_text())["csbp_target"]
    assert record == {"weights": weights_sample_fingerprint(paired["target"])} != target_record(paired["other"])
    checkpoint = tmp_path / "step_0000004"
    checkpoint.mkdir()
    state = {"input_fingerprints": {"objective.dflash.target": directory_fingerprint(paired["target"])}}
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))
    check_checkpoint_target(checkpoint, paired["target"])
    with pytest.raises(ValueError, match=r"^--target .*other is not the target checkpoint .* was trained against"):
        check_checkpoint_target(checkpoint, paired["other"])
    (checkpoint / "trainer_state.json").write_text(json.dumps({}))  # nothing recorded: nothing to check
    check_checkpoint_target(checkpoint, paired["other"])
