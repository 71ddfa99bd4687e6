"""``csbp eval`` on rows longer than the model trained on: scored, with one stderr line saying so (as
``csbp generate`` says it), and none when ``data.reset_positions`` restarts every document at position 0."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from csbp.cli.main import main
from test_evaluation import trained

__all__ = ["trained"]  # the 2-step run, a fixture shared with test_evaluation.py


def test_csbp_eval_notes_rows_longer_than_the_model_trained_on(
    trained: tuple[Path, Path, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, artifact, _ = trained
    shorter = tmp_path / "run"  # the same model, recorded as trained on rows of 16 tokens; the data's are 32
    shutil.copytree(run_dir / "final", shorter / "final")
    (shorter / "config.yaml").write_text((run_dir / "config.yaml").read_text().replace("seq_len: 32", "seq_len: 16"))
    args = ["eval", "--data", str(artifact), "--samples", "1", "--max-batches", "1", "--no-ltr"]
    assert main([*args, "--model", str(shorter / "final")]) == 0
    assert capsys.readouterr().err.strip() == (
        f"csbp eval: runs the model at positions up to 31, past the 16-token rows it was trained on "
        f"({shorter / 'config.yaml'}): it never attended that far, so quality may drop there (data prepared with "
        "--seq-len 16 stays inside)"
    )
    assert main([*args, "--model", str(run_dir / "final")]) == 0
    assert capsys.readouterr().err == ""
    # with data.reset_positions every document restarts at position 0: the row length bounds nothing
    text = (shorter / "config.yaml").read_text()
    (shorter / "config.yaml").write_text(text.replace("reset_positions: false", "reset_positions: true"))
    assert "reset_positions: true" in (shorter / "config.yaml").read_text()
    assert main([*args, "--model", str(shorter / "final")]) == 0
    assert "past the 16-token rows" not in capsys.readouterr().err
