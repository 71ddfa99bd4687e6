"""One csbp process per run directory (:mod:`csbp.training.run_lock`): a second ``csbp train`` or
``csbp compare`` in a directory in use is refused with one line before it reads any data, in the
same process or another; the lock goes with its holder, and a killed holder's lock file blocks
nothing (resume and fresh runs accept it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from csbp.atomic import WRITE_PROBE_PREFIX
from csbp.compare import CompareOptions, run_compare
from csbp.compare import runner as compare_runner
from csbp.training import LaunchOptions, launch_training
from csbp.training import launcher as launcher_module
from csbp.training import worker as worker_module
from csbp.training.run_dir_checks import foreign_run_entry
from csbp.training.run_lock import LOCK_FILE, RunDirInUse, run_dir_lock
from test_training_run import config_dict, make_artifact, tiny_config

CSBP = [sys.executable, "-m", "csbp.cli.main"]


def in_use(path: Path, pid: int, flag: str = "--run-dir", what: str = "run directory") -> str:
    return f"{what} {path} is in use by another csbp process (pid {pid}) (fix: wait for it, or choose another {flag})"


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_artifact(tmp_path_factory.mktemp("data") / "art")


def test_a_second_holder_in_the_same_process_is_refused_with_one_line(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "cc"
    with run_dir_lock(run_dir):
        assert (run_dir / LOCK_FILE).read_text() == f"{os.getpid()}\n"
        with pytest.raises(RunDirInUse) as info, run_dir_lock(run_dir):
            pytest.fail("a second holder got the lock")
        assert str(info.value) == in_use(run_dir, os.getpid())
        assert (run_dir / LOCK_FILE).is_file()  # the refused one removed nothing
        assert foreign_run_entry(run_dir) is None  # the lock file is one of a run's own entries
        # every rank probes that it can write the run directory, now that the lock created it: a
        # rank's probe seen by another is not a foreign file (a 2-process run refused itself)
        (run_dir / f"{WRITE_PROBE_PREFIX}x1y2").write_text("")
        assert foreign_run_entry(run_dir) is None
        (run_dir / f"{WRITE_PROBE_PREFIX}x1y2").unlink()
    assert not (tmp_path / "runs").exists()  # released: lock file and the directories it created gone
    with run_dir_lock(run_dir):  # free again
        pass


def test_csbp_train_in_another_process_is_refused_before_it_reads_any_data(tmp_path: Path) -> None:
    run_dir = tmp_path / "runs" / "cc"
    config = tmp_path / "run.yaml"  # its data does not exist: reading it first would be another error
    config.write_text(yaml.safe_dump(config_dict(tmp_path / "no-artifact-here")), encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with run_dir_lock(run_dir):
        done = subprocess.run(
            [*CSBP, "train", str(config), "--run-dir", str(run_dir)],
            capture_output=True, text=True, env=env, timeout=600,
        )
        assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_FILE]
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [f"csbp: error: {in_use(run_dir, os.getpid())}"]


def test_the_lock_is_held_while_training_and_a_resume_after_the_run_works(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    cfg = tiny_config(artifact, **{"train.eval_every": 0})
    real_train = launcher_module.train
    refused = []

    def train_while_another_run_starts(*args: object, **kwargs: object) -> object:
        with pytest.raises(RunDirInUse) as info:
            launch_training(cfg, run_dir=run_dir, resume=True)
        refused.append(str(info.value))
        return real_train(*args, **kwargs)

    monkeypatch.setattr(launcher_module, "train", train_while_another_run_starts)
    launch_training(cfg, run_dir=run_dir, max_steps=2)
    assert refused == [in_use(run_dir, os.getpid())]
    monkeypatch.undo()
    assert not (run_dir / LOCK_FILE).exists()  # released and removed at the end
    (run_dir / LOCK_FILE).write_text("999999\n")  # what a SIGKILLed run leaves: a file nobody locks
    summary = launch_training(cfg, run_dir=run_dir, resume=True, max_steps=3)
    assert summary is not None and (summary.start_step, summary.end_step) == (2, 3)
    assert not (run_dir / LOCK_FILE).exists()


def test_a_refused_or_failed_start_leaves_nothing_behind(artifact: Path, tmp_path: Path) -> None:
    fresh = tmp_path / "new" / "run"
    with pytest.raises(ValueError, match="no checkpoint to resume"):
        launch_training(tiny_config(artifact), run_dir=fresh, resume=True)
    assert not (tmp_path / "new").exists()
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds 'notes.txt'"):  # refused before a lock file goes in
        launch_training(tiny_config(artifact), run_dir=tmp_path / "home")
    assert sorted(p.name for p in (tmp_path / "home").iterdir()) == ["notes.txt"]


@pytest.mark.parametrize(
    ("rank", "nnodes", "holds"),
    [(None, 1, True), (None, 2, False), ("0", 1, True), ("1", 1, False), ("0", 2, True)],
)
def test_which_process_holds_the_lock(
    monkeypatch: pytest.MonkeyPatch, rank: str | None, nnodes: int, holds: bool
) -> None:
    for name in launcher_module.TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)
    if rank is not None:  # under torchrun (or csbp's own multi-node workers): global rank 0
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("LOCAL_RANK", rank)
    assert launcher_module.holds_run_dir_lock(LaunchOptions(nnodes=nnodes)) is holds


def test_with_several_nodes_the_rank0_worker_is_refused_before_its_process_group(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = tmp_path / "run"
    monkeypatch.setattr(worker_module, "end_on_sigint", lambda: None)  # the worker's Ctrl-C setup
    monkeypatch.setattr(worker_module, "skip_teardown_at_exit", lambda: None)
    monkeypatch.setattr(worker_module, "train_in_process_group", lambda *a, **k: pytest.fail("trained"))
    monkeypatch.setenv("RANK", "0")
    with run_dir_lock(run_dir), pytest.raises(RunDirInUse, match="in use by another csbp process"):
        worker_module.elastic_worker(tiny_config(artifact), str(run_dir), False, None, True)
    monkeypatch.setenv("RANK", "1")  # other ranks never take it
    monkeypatch.setattr(worker_module, "train_in_process_group", lambda *a, **k: None)
    with run_dir_lock(run_dir):
        assert worker_module.elastic_worker(tiny_config(artifact), str(run_dir), False, None, True) is None


def test_a_second_comparison_is_refused_before_it_checks_or_removes_anything(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "compare"
    (out / "cp").mkdir(parents=True)  # an unfinished layout, which a comparison may remove
    monkeypatch.setattr(compare_runner, "plan_layouts", lambda *args: pytest.fail("planned under another's lock"))
    options = CompareOptions(layouts=("cp",), budget_s=1.0, nproc=1, out_dir=out, resume=True)
    with run_dir_lock(out, flag="--out", what="comparison directory"):
        with pytest.raises(RunDirInUse) as info:
            run_compare(tiny_config(artifact), options)
        assert str(info.value) == in_use(out, os.getpid(), "--out", "comparison directory")
    assert sorted(p.name for p in out.iterdir()) == ["cp"]


# ----------------------------------------------------------------------------- a direct train() call

_HOLDING_TRAIN = """
import sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from csbp.training import train
from test_training_run import tiny_config

class Pause:  # stops after the first step until the test lets it go on
    def on_start(self, loop, start_step):
        pass
    def after_step(self, loop, step, step_seconds):
        if step == 1:
            Path({started!r}).write_text("1")
            while not Path({go!r}).exists():
                time.sleep(0.05)
        return False

summary = train(tiny_config(Path({artifact!r}), **{{"train.eval_every": 0}}), run_dir={run_dir!r}, hook=Pause())
print("END", summary.end_step)
"""


def test_a_second_library_train_in_another_process_is_refused_and_the_first_finishes(
    artifact: Path, tmp_path: Path
) -> None:
    """``train()`` called by a program (not ``csbp train``) locks its run directory too: a second
    process's ``train()`` into it is refused at once with one line naming the first's pid, and the
    first run ends intact (before, both trained: their checkpoints and metrics.jsonl interleaved)."""
    run_dir, started, go = tmp_path / "run", tmp_path / "started", tmp_path / "go"
    script = _HOLDING_TRAIN.format(
        tests=str(Path(__file__).parent), started=str(started), go=str(go), artifact=str(artifact), run_dir=str(run_dir)
    )
    first = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        for _ in range(1200):
            if started.exists() or first.poll() is not None:
                break
            subprocess.run(["sleep", "0.1"], check=True)
        assert started.exists(), first.communicate()[1]
        before = sorted(p.name for p in run_dir.iterdir())
        with pytest.raises(RunDirInUse) as info:
            from csbp.training import train

            train(tiny_config(artifact, **{"train.eval_every": 0}), run_dir=run_dir)
        assert str(info.value) == in_use(run_dir, first.pid, flag="run_dir")
        assert sorted(p.name for p in run_dir.iterdir()) == before  # the refused run wrote nothing
    finally:
        go.write_text("1")
        out, err = first.communicate(timeout=600)
    assert first.returncode == 0, err
    assert "END 4" in out
    assert not (run_dir / LOCK_FILE).exists()


def _train_two_ranks(rank: int, world: int, artifact: str, run_dir: str) -> str:
    from csbp.training import train

    try:
        train(tiny_config(Path(artifact), **{"topology.dp": 2, "train.micro_batch_size": 1}), run_dir=run_dir)
    except ValueError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "trained"


def test_every_rank_of_a_library_train_fails_at_once_when_rank0_cannot_lock(artifact: Path, tmp_path: Path) -> None:
    """With a process group only global rank 0 takes the lock; the others learn it was refused (they
    used to wait in the next collective until its timeout)."""
    from csbp.parallel.launch import run_local

    run_dir = tmp_path / "run"
    with run_dir_lock(run_dir):
        results = run_local(_train_two_ranks, 2, (str(artifact), str(run_dir)), timeout_s=60, join_timeout_s=120)
    assert results == [
        f"RunDirInUse: {in_use(run_dir, os.getpid(), flag='run_dir')}",
        f"ValueError: run_dir {run_dir}: global rank 0 could not start the run there (see its error)",
    ]
