"""A checkpoint that cannot be written (a full disk) stops the run with one line and keeps the last
one; Ctrl-C or SIGTERM during a save is an interruption.

DCP wraps a rank's write error in ``CheckpointException``, a ``BaseException``: it used to escape
``csbp train`` as a traceback (one process; on a full disk drawing ``loss.png`` then failed too and
hid it behind "No space left on device (OSError) (fix: check the path)"), and under torch elastic
as "exited with code 1 (killed or crashed without a Python error)". Now every rank raises
``CheckpointSaveFailed`` naming the checkpoint, the cause, the free space and the checkpoint
``latest`` still names.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import json
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import yaml
from torch.distributed.checkpoint.filesystem import FileSystemWriter

import csbp.training.metrics as metrics_module
from csbp.cli.main import main
from csbp.interrupts import Interrupted
from csbp.parallel.launch import run_local
from csbp.training.checkpoint import CheckpointSaveFailed, TrainingState, save_checkpoint
from csbp.training.checkpoint_integrity import SafeFileSystemReader, checkpoint_problem
from test_training_run import config_dict, make_artifact

NO_SPACE = OSError(errno.ENOSPC, "No space left on device")


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_artifact(tmp_path_factory.mktemp("data") / "art")


def fail_writes_after(monkeypatch: pytest.MonkeyPatch, saves: int, error: BaseException = NO_SPACE) -> None:
    """DCP's file writes raise ``error`` (default: disk full) from save ``saves + 1`` on."""
    real = FileSystemWriter._write_data
    calls = {"n": 0}

    def write_data(self: FileSystemWriter, *args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] > saves:
            raise error
        return real(self, *args, **kwargs)

    monkeypatch.setattr(FileSystemWriter, "_write_data", write_data)


def test_a_full_disk_during_a_save_stops_the_run_in_one_line(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(config_dict(artifact, **{"train.save_every": 1, "train.eval_every": 0})), encoding="utf-8"
    )
    run_dir = tmp_path / "run"
    fail_writes_after(monkeypatch, saves=1)

    def no_plot(*args: Any) -> None:  # the disk is full for loss.png too
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(metrics_module, "plot_loss_curve", no_plot)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["train", str(config), "--run-dir", str(run_dir)])
    lines = [line for line in err.getvalue().replace("\r", "\n").splitlines() if line.startswith("csbp")]
    assert code == 2, err.getvalue()[-2000:]
    assert len(lines) == 1, lines
    assert lines[0].startswith("csbp: error: checkpoint step_0000002 could not be written in "), lines
    assert "OSError: [Errno 28] No space left on device" in lines[0] and "MiB free there" in lines[0]
    assert "still names step_0000001" in lines[0] and "--resume" in lines[0]
    root = run_dir / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_0000001"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_0000001"]  # the partial save is gone
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]


@pytest.mark.parametrize(
    ("interrupt", "code"), [(KeyboardInterrupt(), 130), (Interrupted(signal.SIGTERM), 143)], ids=["ctrl-c", "sigterm"]
)
def test_ctrl_c_or_sigterm_during_a_save_is_an_interruption(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, interrupt: BaseException, code: int
) -> None:
    """DCP catches every ``BaseException`` of a rank's write and wraps it: Ctrl-C (or SIGTERM, which
    ``csbp`` raises as ``Interrupted``) in a one-process run's save used to escape as a
    ``CheckpointException`` traceback instead of ``csbp: interrupted``."""
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(config_dict(artifact, **{"train.save_every": 1, "train.eval_every": 0})), encoding="utf-8"
    )
    run_dir = tmp_path / "run"
    fail_writes_after(monkeypatch, saves=1, error=interrupt)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert main(["train", str(config), "--run-dir", str(run_dir)]) == code
    assert [line for line in err.getvalue().splitlines() if line.startswith("csbp")] == ["csbp: interrupted"]
    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_0000001"]
    assert (root / "latest").read_text().strip() == "step_0000001"


def _save_on_a_full_disk(rank: int, world: int, root: Path) -> str:
    """Save step 1 on two gloo ranks, then step 2 with rank 1's disk full; return rank's error."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optimizer = torch.optim.AdamW(model.parameters())
    state = TrainingState(
        step=1, scheduler={}, loader={}, rng={}, data_fingerprint="", param_shapes={}, topology={}, config_yaml=""
    )
    save_checkpoint(root, model=model, optimizer=optimizer, state=state, keep=2)
    if rank == 1:
        def full(*args: Any, **kwargs: Any) -> Any:
            raise NO_SPACE

        FileSystemWriter._write_data = full  # type: ignore[method-assign]
    try:
        save_checkpoint(root, model=model, optimizer=optimizer, state=dataclasses.replace(state, step=2), keep=2)
    except CheckpointSaveFailed as exc:
        dist.barrier()
        return str(exc)
    return "saved"


def test_a_full_disk_on_one_rank_fails_the_save_on_every_rank(tmp_path: Path) -> None:
    messages = run_local(_save_on_a_full_disk, 2, (tmp_path,), timeout_s=60)
    for message in messages:
        assert message.startswith("checkpoint step_0000002 could not be written"), message
        assert "No space left on device" in message and "still names step_0000001" in message
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text().strip() == "step_0000001"
    assert checkpoint_problem(root / "step_0000001") is None


def test_ctrl_c_while_a_resume_loads_its_checkpoint_is_an_interruption(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same wrapping on load: Ctrl-C while ``--resume`` read the checkpoint used to end with
    ``csbp: error: checkpoint ... could not be loaded: rank 0: `` (exit 2)."""
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(config_dict(artifact, **{"train.eval_every": 0})), encoding="utf-8")
    run_dir = tmp_path / "run"
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        assert main(["train", str(config), "--run-dir", str(run_dir), "--max-steps", "2"]) == 0

    def interrupted(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(SafeFileSystemReader, "read_data", interrupted)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert main(["train", str(config), "--run-dir", str(run_dir), "--resume"]) == 130
    assert [line for line in err.getvalue().splitlines() if line.startswith("csbp")] == ["csbp: interrupted"]
