"""Faults during a run: a stalled rank, Ctrl-C and SIGTERM, SIGKILL during a checkpoint save or of the
launcher while its workers start, planted pickles, damaged checkpoints, non-finite steps,
``--overwrite`` of directories csbp did not write, and what a run leaves behind.

The multi-process tests launch ``csbp train`` as a subprocess (its own session, ``TMPDIR`` pointing
into the test's directory) on 2 gloo processes with a tiny model, and use a short
``train.collective_timeout_s``.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from csbp.cli.main import main
from csbp.data.prepare import PrepareConfig, prepare_artifact
from csbp.training import launch_training, train
from csbp.training.checkpoint_integrity import checkpoint_problem, read_metadata, safe_dcp_load
from csbp.training.step import StepRunner
from csbp.training.trainer import NonFiniteTraining
from test_security import listening_addresses, not_loopback
from test_training_run import config_dict, make_artifact, tiny_config

CSBP = [sys.executable, "-m", "csbp.cli.main"]
TIMEOUT_S = 8  # short, yet above the scheduling noise of a loaded 2-core CI machine


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_artifact(tmp_path_factory.mktemp("data") / "art")


class Planted:
    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.sentinel}",))


# ----------------------------------------------------------------------------- subprocess launches


def start_run(artifact: Path, root: Path, run_dir: Path, *extra: str) -> subprocess.Popen[str]:
    config = root / "run.yaml"
    if not config.exists():
        changes = {
            "topology.dp": 2,
            "train.max_steps": 10_000,
            "train.save_every": 1,
            "train.eval_every": 0,
            "train.collective_timeout_s": TIMEOUT_S,
        }
        config.write_text(yaml.safe_dump(config_dict(artifact, **changes)), encoding="utf-8")
    tmp = root / "tmp"
    tmp.mkdir(exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp)}
    return subprocess.Popen(
        [*CSBP, "train", str(config), "--run-dir", str(run_dir), *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )


def wait_for_checkpoint(process: subprocess.Popen[str], run_dir: Path, *, limit_s: float = 240) -> None:
    started = time.monotonic()
    while not (run_dir / "checkpoints" / "latest").exists():
        if process.poll() is not None:
            pytest.fail(f"the run ended early: {process.communicate()[1][-2000:]}")
        if time.monotonic() - started > limit_s:
            os.killpg(process.pid, signal.SIGKILL)
            pytest.fail("no checkpoint in time")
        time.sleep(0.2)


def latest_step(run_dir: Path) -> int:
    root = run_dir / "checkpoints"
    try:
        return int(json.loads((root / (root / "latest").read_text().strip() / "trainer_state.json").read_text())["step"])
    except (OSError, ValueError):
        return -1


def worker_pids(launcher_pid: int) -> list[int]:
    """The spawned worker processes of a ``csbp train`` launch, in start (local rank) order."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue
        if parent == launcher_pid and b"spawn_main" in command:
            pids.append(int(entry.name))
    return sorted(pids)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def leftovers(tmp: Path) -> list[str]:
    """What a launch left in its temp directory (torch's compile cache is a cache, not a leftover)."""
    return sorted(p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_"))


def error_lines(stderr: str) -> list[str]:
    """stderr without the progress bar (tqdm redraws with carriage returns)."""
    lines = []
    for line in stderr.replace("\r", "\n").splitlines():
        if line.lstrip().startswith("train:"):  # a bar a killed worker left unterminated
            line = line[line.index("csbp:") :] if "csbp:" in line else ""
        if line.strip():
            lines.append(line)
    return lines


def finish(process: subprocess.Popen[str], limit_s: float) -> tuple[int, str]:
    try:
        _, err = process.communicate(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        pytest.fail(f"csbp train still running {limit_s} s later")
    return process.returncode, err


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_stalled_rank_ends_the_run_within_the_timeout_and_is_named(artifact: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    process = start_run(artifact, tmp_path, run_dir)
    wait_for_checkpoint(process, run_dir)
    workers = worker_pids(process.pid)
    assert len(workers) == 2
    os.kill(workers[1], signal.SIGSTOP)  # rank 1 freezes mid-run
    stopped = time.monotonic()
    try:
        code, err = finish(process, TIMEOUT_S + 60)
        elapsed = time.monotonic() - stopped
    finally:
        if alive(workers[1]):
            os.kill(workers[1], signal.SIGKILL)
    lines = error_lines(err)
    assert code == 1 and "Traceback" not in err
    assert len(lines) == 1 and "rank 1" in lines[0] and "stopped responding" in lines[0], lines
    # gloo's timeout, then the report: well below torch elastic's 30 s wait for a stopped process
    assert elapsed < TIMEOUT_S + 20, elapsed
    assert not alive(workers[0]) and not alive(workers[1])
    assert not leftovers(tmp_path / "tmp"), "the launch left files in the temp directory"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_ctrl_c_and_sigterm_end_with_one_line_and_the_run_resumes(artifact: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    process = start_run(artifact, tmp_path, run_dir)
    wait_for_checkpoint(process, run_dir)
    workers = worker_pids(process.pid)
    os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    code, err = finish(process, 60)
    assert (code, error_lines(err)) == (130, ["csbp: interrupted"]), err
    time.sleep(0.5)
    assert not any(alive(pid) for pid in workers)
    assert not list((run_dir / "checkpoints").glob("*.tmp")), "a half-written checkpoint was left"
    step = latest_step(run_dir)

    process = start_run(artifact, tmp_path, run_dir, "--resume")  # the interrupted run resumes ...
    deadline = time.monotonic() + 240
    while process.poll() is None and latest_step(run_dir) <= step:
        assert time.monotonic() < deadline, "the resumed run made no progress"
        time.sleep(0.2)
    assert process.poll() is None, process.communicate()[1][-2000:]
    workers = worker_pids(process.pid)
    process.send_signal(signal.SIGTERM)  # ... and SIGTERM to the launcher alone ends it too
    code, err = finish(process, 60)
    assert (code, error_lines(err)) == (143, ["csbp: interrupted"]), err
    time.sleep(0.5)
    assert not any(alive(pid) for pid in workers)
    assert not leftovers(tmp_path / "tmp"), "the launch left files in the temp directory"


def torch_loaded(pid: int) -> bool:
    """Whether process ``pid`` has mapped torch's C extension (it is importing torch, or has)."""
    try:
        return "torch/_C" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.multiprocess
@pytest.mark.parametrize("moment", ["workers started", "workers import torch"])
def test_ctrl_c_while_the_workers_start_is_one_line(artifact: Path, tmp_path: Path, moment: str) -> None:
    """Ctrl-C in the seconds the workers import torch printed one KeyboardInterrupt traceback per
    worker (interleaved) before ``csbp: interrupted``; it is the same one line as later on."""
    run_dir = tmp_path / "run"
    process = start_run(artifact, tmp_path, run_dir)
    workers: list[int] = []
    deadline = time.monotonic() + 120
    while process.poll() is None and time.monotonic() < deadline:
        workers = worker_pids(process.pid)
        if len(workers) == 2 and (moment == "workers started" or any(torch_loaded(pid) for pid in workers)):
            break
        time.sleep(0.005)
    assert len(workers) == 2, "the workers did not start"
    os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    code, err = finish(process, 60)
    assert "Traceback" not in err, err
    assert (code, error_lines(err)) == (130, ["csbp: interrupted"]), err
    assert not [pid for pid in workers if alive(pid)], "workers outlived the interrupted launch"
    assert not run_dir.exists(), "the interrupted launch left its run directory"
    assert not leftovers(tmp_path / "tmp"), "the launch left files in the temp directory"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sigkill_during_a_checkpoint_save_keeps_the_last_one_and_the_run_resumes(artifact: Path, tmp_path: Path) -> None:
    """A real 2-process ``csbp train`` saving every step is SIGKILLed (launcher and workers at once)
    while a ``step_N.tmp`` staging directory exists; ``latest`` still names an intact checkpoint, a
    torn ``metrics.jsonl`` line is tolerated, and ``--resume`` continues one trajectory. The live
    run's sockets also show the single-node stores listening on loopback only."""
    run_dir = tmp_path / "run"
    root = run_dir / "checkpoints"
    process = start_run(artifact, tmp_path, run_dir)
    killed_mid_save = False
    try:
        wait_for_checkpoint(process, run_dir)
        addresses = listening_addresses([process.pid, *worker_pids(process.pid)])
        assert addresses and not_loopback(addresses) == [], addresses
        deadline = time.monotonic() + 120
        while not killed_mid_save and time.monotonic() < deadline and process.poll() is None:
            if any(name.endswith(".tmp") for name in os.listdir(root)):
                os.killpg(process.pid, signal.SIGKILL)
                killed_mid_save = True
            time.sleep(0.001)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
    assert killed_mid_save, "no checkpoint save was seen in progress"
    named = root / (root / "latest").read_text().strip()
    assert checkpoint_problem(named) is None
    step = latest_step(run_dir)
    with open(run_dir / "metrics.jsonl", "a", encoding="utf-8") as handle:
        handle.write('{"step": 99999, "loss": 1.')  # what a kill during the append leaves

    process = start_run(artifact, tmp_path, run_dir, "--resume", "--max-steps", str(step + 1))
    code, err = finish(process, 240)
    assert code == 0, err[-2000:]
    assert latest_step(run_dir) == step + 1
    assert not list(root.glob("*.tmp")), "the interrupted save's staging directory was left"
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [record["step"] for record in records]
    assert steps == list(range(steps[0], step + 2)), steps  # one trajectory, the torn line gone


@pytest.mark.multiprocess
@pytest.mark.slow
def test_workers_end_with_a_launcher_killed_while_they_start(artifact: Path, tmp_path: Path) -> None:
    """``SIGKILL`` of the launcher alone while its workers still import torch: they used to wait for
    the dead launcher's rendezvous store for minutes (more than 7 measured), holding the caller's
    output pipes open, with the run directory's lock already released."""
    process = start_run(artifact, tmp_path, tmp_path / "run")
    workers: list[int] = []
    deadline = time.monotonic() + 120
    while len(workers) < 2 and time.monotonic() < deadline and process.poll() is None:
        workers = worker_pids(process.pid)
        time.sleep(0.01)
    assert len(workers) == 2, "the workers did not start"
    os.kill(process.pid, signal.SIGKILL)
    deadline = time.monotonic() + 90
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for pid in workers if alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    process.communicate(timeout=30)
    assert not left, "workers outlived their killed launcher"


# ----------------------------------------------------------------------------- checkpoints


def test_planted_pickles_are_refused_without_running_code(tmp_path: Path) -> None:
    sentinel = tmp_path / "PWNED"
    checkpoint = tmp_path / "ck"
    checkpoint.mkdir()
    (checkpoint / ".metadata").write_bytes(pickle.dumps(Planted(sentinel)))
    with pytest.raises(ValueError, match=r"\.metadata: not a checkpoint metadata file csbp accepts"):
        read_metadata(checkpoint)
    # a genuine DCP checkpoint whose non-tensor item is a pickle that runs code
    import torch.distributed.checkpoint as dcp

    planted = tmp_path / "planted"
    dcp.save({"w": torch.ones(2), "extra": Planted(sentinel)}, checkpoint_id=planted, no_dist=True)
    assert read_metadata(planted).state_dict_metadata  # the metadata itself is fine
    with pytest.raises(ValueError, match="holds a pickle csbp does not load"):
        safe_dcp_load({"w": torch.zeros(2), "extra": None}, planted, no_dist=True)
    assert not sentinel.exists(), "a planted pickle ran code"


def test_resume_skips_a_damaged_newest_checkpoint(
    artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    cfg = tiny_config(artifact, **{"train.save_every": 1, "train.eval_every": 0, "train.max_steps": 4})
    launch_training(cfg, run_dir=run_dir, max_steps=3)
    damaged = run_dir / "checkpoints" / "step_0000003"
    for file in damaged.glob("*.distcp"):
        file.write_bytes(file.read_bytes()[:100])
    capsys.readouterr()
    summary = launch_training(cfg, run_dir=run_dir, resume=True)
    assert summary is not None and summary.start_step == 2 and summary.end_step == 4
    err = capsys.readouterr().err
    assert "step_0000003" in err and "truncated" in err and "resuming from step_0000002" in err


def test_staging_leftovers_are_removed_after_a_run(artifact: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = tiny_config(artifact, **{"train.eval_every": 0})
    launch_training(cfg, run_dir=run_dir, max_steps=2)
    (run_dir / "checkpoints" / "step_0000009.tmp").mkdir()  # as a crash during a save leaves it
    launch_training(cfg, run_dir=run_dir, resume=True, max_steps=3)
    assert not list((run_dir / "checkpoints").glob("*.tmp"))


# ----------------------------------------------------------------------------- non-finite steps


def nan_at_step(monkeypatch: pytest.MonkeyPatch, bad_step: int) -> None:
    real = StepRunner.train_step

    def poisoned(self: StepRunner, batches: list, step: int):  # type: ignore[no-untyped-def]
        result = real(self, batches, step)
        if step == bad_step:
            for param in self.model.parameters():
                if param.grad is not None:
                    param.grad.fill_(math.nan)
            return type(result)(**{**result.__dict__, "loss": math.nan})
        return result

    monkeypatch.setattr(StepRunner, "train_step", poisoned)


def test_a_non_finite_step_stops_the_run_and_keeps_the_last_good_checkpoint(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nan_at_step(monkeypatch, 3)
    run_dir = tmp_path / "run"
    cfg = tiny_config(artifact, **{"train.save_every": 1, "train.eval_every": 0})
    with pytest.raises(NonFiniteTraining, match=r"step 3: loss nan .*last good checkpoint: .*step_0000002"):
        train(cfg, run_dir=run_dir)
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_0000002"
    assert not (run_dir / "final").exists()


def test_nan_policy_skip_skips_the_update(artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nan_at_step(monkeypatch, 2)
    cfg = tiny_config(artifact, **{"train.nan_policy": "skip", "train.eval_every": 1})
    summary = train(cfg, run_dir=tmp_path / "run")
    assert summary.end_step == 4 and all(math.isfinite(v) for v in summary.losses)
    assert all(math.isfinite(p.float().sum()) for p in _final_weights(tmp_path / "run"))
    # the skipped step is in metrics.jsonl with its validation (it was left out, a gap in the val curve);
    # its non-finite numbers are JSON null, which strict readers accept, not NaN
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in metrics.jsonl")) for line in lines]
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4]
    skipped = records[2]
    assert skipped["skipped"] is True and skipped["loss"] is None and skipped["grad_norm"] is None
    assert math.isfinite(skipped["val_loss"]) and all("skipped" not in r for r in records[:2] + records[3:])


def _final_weights(run_dir: Path) -> list[torch.Tensor]:
    from safetensors.torch import load_file

    return list(load_file(str(run_dir / "final" / "model.safetensors")).values())


# ----------------------------------------------------------------------------- --overwrite


def test_overwrite_replaces_only_what_csbp_wrote(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    source = artifact.parent / f"{artifact.name}.jsonl"
    prepare = PrepareConfig(inputs=(source,), out_dir=tmp_path / "art", seq_len=16, tokenizer_path=artifact)
    prepare_artifact(prepare)
    again = PrepareConfig(**{**prepare.__dict__, "seq_len": 8, "overwrite": True})
    assert prepare_artifact(again)["seq_len"] == 8  # an artifact csbp wrote is replaced

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    argv = ["data", "prepare", str(source), "--seq-len", "8", "--tokenizer", str(artifact), "--overwrite"]
    assert main([*argv, "--out", str(mine)]) == 2
    assert (mine / "thesis.tex").read_text() == "years of work"
    assert "--overwrite replaces only" in capsys.readouterr().err

    monkeypatch.chdir(mine)
    assert main([*argv, "--out", "."]) == 2
    assert "working directory" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art", "mine"]  # no ..old-* / .tmp-* left
    assert sorted(p.name for p in mine.iterdir()) == ["thesis.tex"]
