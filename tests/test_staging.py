"""Staging directories: a killed writer's is removed by the next write of the same output, a live
writer's never is, and one without a lock file (an older csbp's) is left alone."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from csbp.atomic import Ownership, write_directory_atomically
from csbp.staging import LOCK_SUFFIX, remove_abandoned_staging, staging_directory

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="flock")

_WRITER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from csbp.staging import staging_directory
    with staging_directory(Path(sys.argv[1])) as staging:
        (staging / "tokens.bin").write_bytes(b"x" * 4096)
        print(staging, flush=True)
        time.sleep(600)
    """
)


def _start_writer(target: Path) -> tuple[subprocess.Popen, Path]:
    """A process half-way through writing ``target`` (it sleeps inside its staging directory)."""
    writer = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(target)], stdout=subprocess.PIPE, text=True, env=os.environ.copy()
    )
    assert writer.stdout is not None
    staging = Path(writer.stdout.readline().strip())
    assert staging.is_dir() and (staging / "tokens.bin").is_file()
    return writer, staging


def _fill(directory: Path) -> None:
    (directory / "config.json").write_text(json.dumps({"ok": True}))


def test_a_killed_writers_staging_is_removed_by_the_next_write(tmp_path, capsys) -> None:
    target = tmp_path / "export"
    writer, staging = _start_writer(target)
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    assert staging.is_dir() and Path(f"{staging}{LOCK_SUFFIX}").is_file()  # what a kill leaves
    write_directory_atomically(target, _fill, overwrite=False)
    assert not staging.exists() and not Path(f"{staging}{LOCK_SUFFIX}").exists()
    assert "removed 1 staging directory that interrupted writes of" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]  # nothing else left either


def test_a_live_writers_staging_is_left_alone(tmp_path) -> None:
    target = tmp_path / "export"
    writer, staging = _start_writer(target)
    try:
        assert remove_abandoned_staging(target) == []
        write_directory_atomically(target, _fill, overwrite=False)  # a concurrent write of the same name
        assert (staging / "tokens.bin").is_file()
    finally:
        writer.kill()
        writer.wait()
    assert remove_abandoned_staging(target) == [staging]


def test_staging_without_a_lock_file_is_never_removed(tmp_path) -> None:
    target = tmp_path / "art"
    old = tmp_path / ".art.tmp-olderversion"  # an older csbp's leftover: nothing says its writer is dead
    old.mkdir()
    (old / "tokens.bin").write_bytes(b"x")
    unrelated = tmp_path / ".other.tmp-abc"  # another output's, even with a free lock
    unrelated.mkdir()
    Path(f"{unrelated}{LOCK_SUFFIX}").write_text("")
    write_directory_atomically(target, _fill, overwrite=False)
    assert (old / "tokens.bin").is_file() and unrelated.is_dir()


def test_a_finished_or_failed_write_leaves_only_its_output(tmp_path) -> None:
    target = tmp_path / "out"
    with pytest.raises(RuntimeError, match="disk full"), staging_directory(target) as staging:
        assert Path(f"{staging}{LOCK_SUFFIX}").is_file()
        raise RuntimeError("disk full")
    assert list(tmp_path.iterdir()) == []
    write_directory_atomically(target, _fill, overwrite=False)
    owned = Ownership(what="test output", marker="config.json", names=frozenset({"config.json"}))
    write_directory_atomically(target, _fill, overwrite=True, owned=owned)  # the old one swapped out, removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def _dead_staging(target: Path, progress: str | None) -> Path:
    """A staging directory of ``target`` whose writer died (free lock), holding ``progress``."""
    staging = target.parent / f".{target.name}.tmp-{(progress or 'none').replace(' ', '-')}"
    staging.mkdir()
    Path(f"{staging}{LOCK_SUFFIX}").write_text("")
    if progress is not None:
        (staging / "progress").write_text(progress)
    return staging


def _resume(staging: Path) -> int | None:
    """What a resumable writer answers: its committed count, refusing another write's progress."""
    path = staging / "progress"
    if not path.is_file():
        return None
    if not path.read_text().isdigit():
        raise ValueError(f"{staging} holds another write's progress")
    return int(path.read_text())


def test_a_resumable_write_adopts_the_dead_staging_with_most_progress(tmp_path, capsys) -> None:
    target = tmp_path / "feats"
    empty, less, more = (_dead_staging(target, p) for p in (None, "3", "7"))
    with staging_directory(target, resume=_resume) as staging:
        assert staging == more and Path(f"{more}{LOCK_SUFFIX}").is_file()
        assert remove_abandoned_staging(target) == []  # held: a concurrent write leaves it alone
    assert not empty.exists() and not less.exists() and not more.exists()
    assert "removed 2 staging directories" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_failed_resumable_write_keeps_its_progress_and_other_progress_is_not_discarded(tmp_path, capsys) -> None:
    target = tmp_path / "feats"
    with pytest.raises(KeyboardInterrupt), staging_directory(target, resume=_resume) as staging:
        (staging / "progress").write_text("2")
        raise KeyboardInterrupt
    assert (staging / "progress").is_file() and Path(f"{staging}{LOCK_SUFFIX}").is_file()
    assert "kept the interrupted write" in capsys.readouterr().err
    with staging_directory(target, resume=_resume) as again:  # the next write continues it
        assert again == staging
    assert not staging.exists()
    other = _dead_staging(target, "other settings")
    with pytest.raises(ValueError, match="another write's progress"), staging_directory(target, resume=_resume):
        pass
    assert (other / "progress").is_file()  # refused before anything was removed
    with staging_directory(target) as plain:  # a write that cannot resume removes it, as before
        assert plain != other
    assert not other.exists()


def test_the_launcher_removes_the_final_export_a_stopped_worker_was_writing(tmp_path, capsys) -> None:
    """Workers end at once on Ctrl-C: one stopped while it wrote ``RUN/final`` left ``.final.tmp-*`` and its
    lock in the run directory, which the launcher's cleanup of half-written checkpoints did not know."""
    from csbp.training.launcher import remove_staging_leftovers

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    writer, staging = _start_writer(run_dir / "final")
    remove_staging_leftovers(run_dir)  # a live writer's (a run still finishing) stays
    assert staging.is_dir()
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    remove_staging_leftovers(run_dir)
    assert list(run_dir.iterdir()) == [] and capsys.readouterr().err == ""  # its own leftovers: said nothing
