"""``csbp export`` of a run that is still training: the run prunes the checkpoint being read.

A pruned checkpoint goes in one rename before its files are deleted, so the export finds it whole
or gone, never half-deleted (it blamed damage: "__0_0.distcp is missing", "not a training
checkpoint"); a run directory's export then takes the newest checkpoint again, and nothing is
published from a checkpoint that vanished (it once published ``--out`` and then failed, exit 2).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import csbp.training.export as export_module
from csbp.cli.main import main
from csbp.training.checkpoint import prune_checkpoints
from test_training_run import artifact, copy_run, run_at_step2  # noqa: F401 - fixtures


def _pruned_on_first_read(monkeypatch: pytest.MonkeyPatch, root: Path, new: str) -> list[Path]:
    """Make the first checkpoint read the moment the run saves ``new`` (a copy of step 2) and prunes the rest."""
    real, read = export_module.safe_dcp_load, []

    def load(state: object, path: Path, **kwargs: object) -> None:
        read.append(path)
        if len(read) == 1:
            shutil.copytree(root / "step_0000002", root / new)
            prune_checkpoints(root, keep=1, protect=new)
        real(state, path, **kwargs)

    monkeypatch.setattr(export_module, "safe_dcp_load", load)
    return read


def test_a_run_directory_export_takes_the_newest_again(
    run_at_step2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]  # noqa: F811
) -> None:
    run_dir = copy_run(run_at_step2, tmp_path)
    root = run_dir / "checkpoints"
    read = _pruned_on_first_read(monkeypatch, root, "step_0000006")
    assert main(["export", str(run_dir), "--out", str(tmp_path / "out")]) == 0
    out, err = capsys.readouterr()
    assert [p.name for p in read] == ["step_0000002", "step_0000006"]
    assert "note: step_0000002 was pruned by its run while it was read; exporting the newest again" in err
    assert f"exported {root / 'step_0000006'} " in out and (tmp_path / "out" / "model.safetensors").is_file()
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_0000006"]  # nothing half-deleted left


def test_a_named_checkpoint_pruned_under_the_export_is_said_so_and_nothing_is_published(
    run_at_step2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]  # noqa: F811
) -> None:
    run_dir = copy_run(run_at_step2, tmp_path)
    root = run_dir / "checkpoints"
    _pruned_on_first_read(monkeypatch, root, "step_0000006")
    assert main(["export", str(root / "step_0000002"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"csbp: error: {root / 'step_0000002'} was deleted while it was read: its run pruned it")
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
