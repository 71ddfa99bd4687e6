"""A run ends by replacing ``RUN/final`` with its export: a ``final`` that export may not replace is
refused before training starts (it used to fail after the whole run, at the export)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from csbp.training.run_dir_checks import check_run_dir


@pytest.mark.parametrize(
    ("kind", "what"),
    [("link", "a symbolic link"), ("file", "not a directory"), ("foreign", "a directory csbp did not write")],
)
def test_a_final_the_export_may_not_replace_is_refused_before_training(tmp_path: Path, kind: str, what: str) -> None:
    run_dir, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run_dir.mkdir()
    elsewhere.mkdir()
    (elsewhere / "notes.txt").write_text("precious")
    final = run_dir / "final"
    if kind == "link":
        final.symlink_to(elsewhere, target_is_directory=True)
    elif kind == "file":
        final.write_text("x")
    else:
        final.mkdir()
        (final / "notes.txt").write_text("precious")
    for resume in (False, True):
        with pytest.raises(ValueError, match=f"final is {what}.*, which the run's export at the end"):
            check_run_dir(run_dir, resume=resume, stop_step=10)
    assert (elsewhere / "notes.txt").read_text() == "precious"


def test_an_earlier_export_in_final_is_accepted(tmp_path: Path) -> None:
    final = tmp_path / "run" / "final"
    final.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (final / name).write_text("{}")
    assert check_run_dir(tmp_path / "run", resume=False, stop_step=10) is None


def test_nothing_left_to_train_with_final_missing_names_the_export_that_writes_it(tmp_path: Path) -> None:
    """A run stopped after its last checkpoint, before ``final/`` was written: the fix names the
    export of that checkpoint (``csbp dflash export`` for a drafter), not only a longer schedule."""
    from csbp.config import config_from_dict
    from csbp.training.run_dir_checks import check_steps_left
    from test_config import dflash_changes, with_changes

    checkpoint = tmp_path / "run" / "checkpoints" / "step_0000010"
    checkpoint.mkdir(parents=True)
    final = tmp_path / "run" / "final"
    with pytest.raises(ValueError, match=re.escape(f"but {final} is missing: the run stopped")):
        check_steps_left(checkpoint, 10, 10)
    with pytest.raises(ValueError, match=re.escape(f"(fix: csbp export {tmp_path / 'run'} --out {final};")):
        check_steps_left(checkpoint, 10, 10)
    cfg = config_from_dict(with_changes(dflash_changes()))
    assert cfg.objective.dflash is not None
    target = cfg.objective.dflash.target
    with pytest.raises(ValueError, match=re.escape(f"(fix: csbp dflash export --checkpoint {checkpoint} --target {target} --out {final};")):
        check_steps_left(checkpoint, 10, 10, cfg)
    final.mkdir()
    with pytest.raises(ValueError, match=r"nothing is left to do before step 10 \(fix: raise --max-steps or train\.max_steps\)$"):
        check_steps_left(checkpoint, 10, 10, cfg)
    check_steps_left(checkpoint, 9, 10)
