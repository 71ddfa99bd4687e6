"""``SIGUSR1`` checkpoints a run after its current step and stops it (:mod:`csbp.training.stop_request`).

* In one process (a hook sends the signal to this process during step 3): the run stops after step 3,
  checkpoints there, writes no ``final/``, says how to continue; ``--resume`` then finishes with the
  uninterrupted run's losses, learning rates, gradient norms and validation losses bit for bit.
* ``csbp train --nproc 2`` given ``SIGUSR1`` while it trains: the launching process relays it, both
  workers stop after the same step, the command exits 75 with the checkpoint on record and no
  ``final/``, and ``--resume`` continues from it.
* The relay file, the summary line and the exit code's reading.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from csbp.training import train
from csbp.training.stop_request import STOP_FILE, STOPPED_EXIT_CODE, StopRequest, stopped_line
from test_training_run import config_dict, make_artifact, tiny_config, trajectory


class _SignalDuring:
    """A step hook that sends ``SIGUSR1`` to this process during step ``step`` (before the loop's check)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_start(self, loop: object, start_step: int) -> None:
        pass

    def after_step(self, loop: object, step: int, step_seconds: float) -> bool:
        if step == self.step:
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.05)  # the handler runs at the next bytecode of the main thread
        return False


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_artifact(tmp_path_factory.mktemp("data") / "art")


def test_sigusr1_checkpoints_after_the_step_and_resume_is_exact(artifact: Path, tmp_path: Path) -> None:
    changes = {"train.max_steps": 6, "train.save_every": 0, "train.eval_every": 2}
    whole = train(tiny_config(artifact, **changes), run_dir=tmp_path / "whole")
    stopped = train(tiny_config(artifact, **changes), run_dir=tmp_path / "run", hook=_SignalDuring(3))
    assert stopped.stopped_by_signal and stopped.end_step == 3 and stopped.final_dir is None
    assert stopped.checkpoint is not None and stopped.checkpoint.name == "step_0000003"
    assert not (tmp_path / "run" / "final").exists()
    assert "stopped     after step 3 on SIGUSR1, not finished (--resume continues it)" in stopped.format()
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL  # the handler is put back after the run
    resumed = train(tiny_config(artifact, **changes), run_dir=tmp_path / "run", resume=True)
    assert resumed.start_step == 3 and resumed.end_step == 6 and not resumed.stopped_by_signal
    assert resumed.final_dir is not None
    assert trajectory(tmp_path / "run") == trajectory(tmp_path / "whole")
    assert whole.end_step == 6


def test_the_relay_file_is_a_request_and_the_line_names_the_resume(tmp_path: Path, monkeypatch) -> None:
    from csbp.training.liveness import REPORT_DIR_ENV

    monkeypatch.setenv(REPORT_DIR_ENV, str(tmp_path))
    request = StopRequest()
    assert not request.noted()
    (tmp_path / STOP_FILE).touch()
    assert request.noted()
    line = stopped_line(7, tmp_path / "checkpoints" / "step_0000007", Path("runs/x"))
    assert line.startswith("stopped after step 7 on SIGUSR1 (checkpoint ")
    assert line.endswith("continue it with: csbp train CONFIG --run-dir runs/x --resume")
    assert STOPPED_EXIT_CODE == 75


@pytest.mark.multiprocess
@pytest.mark.slow
def test_csbp_train_on_two_processes_stops_on_sigusr1_and_resumes(artifact: Path, tmp_path: Path) -> None:
    data = config_dict(artifact, **{"train.max_steps": 100000, "train.save_every": 0, "train.eval_every": 0,
                                    "train.log_every": 1, "topology.dp": 2, "train.generate_after": False})
    config = tmp_path / "run.json"
    config.write_text(json.dumps(data), encoding="utf-8")
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "csbp.cli.main", "train", str(config), "--run-dir", str(run_dir), "--nproc", "2"]
    launcher = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 240
        metrics = run_dir / "metrics.jsonl"
        while time.monotonic() < deadline and launcher.poll() is None:
            if metrics.exists() and len(metrics.read_text(encoding="utf-8").splitlines()) >= 2:
                break
            time.sleep(0.2)
        assert launcher.poll() is None, launcher.communicate()
        launcher.send_signal(signal.SIGUSR1)
        out, err = launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == STOPPED_EXIT_CODE, (out, err)
    assert "csbp: SIGUSR1: the workers checkpoint after their current step and stop" in err
    latest = (run_dir / "checkpoints" / "latest").read_text(encoding="utf-8").strip()
    step = int(latest.rsplit("_", 1)[1])
    assert 2 <= step < 100000 and not (run_dir / "final").exists()
    assert f"stopped after step {step} on SIGUSR1" in out + err
    resumed = subprocess.run([*command, "--resume", "--max-steps", str(step + 1)], capture_output=True, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=240)
    assert resumed.returncode == 0, resumed.stderr
    assert f"steps       {step} -> {step + 1} of 100000" in resumed.stdout


def test_sigusr1_during_the_last_step_finishes_the_run(artifact: Path, tmp_path: Path) -> None:
    # nothing is left to resume after the last step: a stop there would refuse its own --resume
    summary = train(tiny_config(artifact, **{"train.max_steps": 3, "train.save_every": 0, "train.eval_every": 0}),
                    run_dir=tmp_path / "run", hook=_SignalDuring(3))
    assert not summary.stopped_by_signal and summary.end_step == 3
    assert summary.final_dir is not None and (tmp_path / "run" / "final").is_dir()


def test_a_rank_under_your_own_torchrun_exits_75_after_a_stop(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torchrun rank registers an exit hook against gloo's teardown abort; it forced status 0, so
    torchrun reported a SIGUSR1 stop as a finished run (exit 0) and a job script did not requeue it."""
    from types import SimpleNamespace

    from csbp.cli import train_cmd
    from csbp.cli.main import main
    from csbp.training.launcher import TORCHRUN_ENV

    config = tmp_path / "run.json"
    config.write_text(json.dumps(config_dict(artifact)), encoding="utf-8")
    codes: list[int] = []
    stopped = SimpleNamespace(stopped_by_signal=True, format=lambda: "stopped")
    monkeypatch.setattr(train_cmd, "launch_training", lambda cfg, **kwargs: stopped)
    monkeypatch.setattr(train_cmd, "skip_teardown_at_exit", lambda code=0: codes.append(code))
    for name in TORCHRUN_ENV:
        monkeypatch.setenv(name, "0" if "RANK" in name else "1")
    assert main(["train", str(config), "--run-dir", str(tmp_path / "r")]) == STOPPED_EXIT_CODE
    assert codes == [STOPPED_EXIT_CODE]
    code = f"from csbp.training.worker import skip_teardown_at_exit\nskip_teardown_at_exit({STOPPED_EXIT_CODE})\n"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == STOPPED_EXIT_CODE


def test_sigusr1_during_start_up_or_the_export_does_not_end_the_process(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outside the step loop SIGUSR1 had its default action: the process died silently (status 138), at
    start-up (a resume's load) or during the final export, which it left unwritten."""
    from csbp.training import trainer

    def signalled(function):
        def wrapper(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.05)
            return function(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(trainer, "finish_on_rank0", signalled(trainer.finish_on_rank0))
    changes = {"train.max_steps": 2, "train.save_every": 0, "train.eval_every": 0}
    finished = train(tiny_config(artifact, **changes), run_dir=tmp_path / "run")
    assert not finished.stopped_by_signal and finished.final_dir is not None  # the export was written
    monkeypatch.setattr(trainer, "check_run", signalled(trainer.check_run))
    stopped = train(tiny_config(artifact, **{**changes, "train.max_steps": 4}), run_dir=tmp_path / "run", resume=True)
    assert stopped.stopped_by_signal and stopped.end_step == 3  # the first step after the resume, checkpointed
    assert stopped.checkpoint is not None and stopped.checkpoint.name == "step_0000003"
