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
