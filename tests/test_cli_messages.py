"""CLI messages that must name what the user ran and offer only fixes that work: the damaged
checkpoint of ``csbp export``, the document-mask hint of ``csbp config validate``."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from csbp.cli.config_cmd import document_mask_text
from csbp.cli.main import main
from csbp.config import ConfigError
from csbp.recipes import list_recipes, load_run_config
from csbp.training.checkpoint_integrity import find_resume_checkpoint


def damaged_run(root: Path) -> Path:
    """A run directory whose only checkpoint lacks its ``.metadata``."""
    step = root / "run" / "checkpoints" / "step_0000006"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text(json.dumps({"step": 6}), encoding="utf-8")
    return root / "run"


def test_export_of_a_damaged_run_names_export_not_resume(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = damaged_run(tmp_path)
    assert main(["export", str(run), "--out", str(tmp_path / "out")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        f"csbp: error: export: no intact checkpoint in {run / 'checkpoints'}: "
        f"{run / 'checkpoints' / 'step_0000006' / '.metadata'}: missing (the checkpoint is incomplete) "
        "(fix: restore the files, or export another run's checkpoint)"
    )
    assert "--resume" not in line


def test_no_intact_checkpoint_names_every_damaged_one(tmp_path: Path) -> None:
    """It named only the newest damaged checkpoint, though the older one was damaged too."""
    run = damaged_run(tmp_path)
    older = run / "checkpoints" / "step_0000003"
    older.mkdir()
    (older / "trainer_state.json").write_text(json.dumps({"step": 3}), encoding="utf-8")
    with pytest.raises(ValueError) as info:
        find_resume_checkpoint(run)
    assert "step_0000006" in str(info.value) and "step_0000003" in str(info.value)
    assert len(str(info.value).splitlines()) == 1


def test_the_caller_names_itself_in_the_damaged_checkpoint_error(tmp_path: Path) -> None:
    run = damaged_run(tmp_path)
    with pytest.raises(ValueError, match=r"^--resume: no intact checkpoint .* \(fix: restore the files, or start a new run"):
        find_resume_checkpoint(run)  # --resume keeps its message
    with pytest.raises(ValueError, match=r"^--run-dir: no intact checkpoint .* \(fix: pass --drafter\)$"):
        find_resume_checkpoint(run, caller="--run-dir", fix="pass --drafter")


@pytest.mark.parametrize("name", list_recipes())
def test_the_document_mask_hint_offers_only_a_change_the_config_accepts(name: str) -> None:
    cfg = load_run_config(name)
    text = document_mask_text(cfg)
    offer = re.search(r"set data\.document_mask: (true|false) to change it", text)
    refusal = re.search(r"refuses data\.document_mask: (true|false)", text)
    if cfg.data.document_mask is not None:
        assert offer is None and refusal is None  # set in the recipe: no default to explain
        return
    assert (offer is None) != (refusal is None)
    value = (offer or refusal).group(1)
    assert value == str(not cfg.document_mask).lower()
    if offer is not None:
        assert load_run_config(name, [f"data.document_mask={value}"]).document_mask is (value == "true")
    else:
        with pytest.raises(ConfigError, match="data.document_mask"):
            load_run_config(name, [f"data.document_mask={value}"])


def test_dflash_validate_does_not_offer_the_refused_document_mask(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "validate", "dflash-demo"]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.lstrip().startswith("documents")]
    assert "set data.document_mask" not in line
    assert line.endswith("(default for dflash: a DFlash context always stops at the anchor's document start; "
                         "dflash refuses data.document_mask: false)")


def test_the_document_mask_hint_names_the_fields_that_must_change_with_it() -> None:
    cfg = load_run_config("demo", ["objective.name=fast_dllm_v2", "data.reset_positions=true"])
    assert cfg.data.document_mask is None  # the default, explained
    assert "set data.document_mask: false (with data.reset_positions changed) to change it" in document_mask_text(cfg)
