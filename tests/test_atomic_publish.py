"""Publishing a finished directory re-checks its target: a directory another process created there
while the output was being built is never replaced without ``overwrite``, and with it only when it
still is a directory csbp wrote. The race is simulated deterministically: ``fill`` (or a step of
``csbp data prepare``) creates the target between the start-up check and the publish."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

import csbp.atomic
from csbp.atomic import OutputExistsError, Ownership, move_without_replacing, write_directory_atomically
from csbp.cli.main import USER_ERROR_EXIT_CODE, main
from csbp.data import prepare as prepare_module

OWNED = Ownership(what="test output", marker="manifest.json", names=frozenset({"manifest.json", "data.bin"}))


def _output(staging: Path) -> None:
    (staging / "manifest.json").write_text("{}")
    (staging / "data.bin").write_bytes(b"new")


def _racing(make_target: Callable[[], None]) -> Callable[[Path], None]:
    """A ``fill`` that writes the output, then lets ``make_target`` play the other process."""

    def fill(staging: Path) -> None:
        _output(staging)
        make_target()

    return fill


def _entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.fixture(params=["renameat2", "mkdir-claim"])
def publish_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run each race on Linux's ``renameat2`` and on the portable fallback (claim with mkdir, rename)."""
    if request.param == "renameat2" and not sys.platform.startswith("linux"):
        pytest.skip("renameat2 is Linux-only")
    if request.param == "mkdir-claim":
        monkeypatch.setattr(csbp.atomic, "_renameat2", lambda first, second, flags: None)
    return str(request.param)


def test_a_directory_created_during_the_write_is_kept_and_the_output_discarded(tmp_path: Path, publish_mode: str) -> None:
    target = tmp_path / "victim"

    def someone_writes_notes() -> None:
        target.mkdir()
        (target / "precious.txt").write_text("notes")

    with pytest.raises(OutputExistsError) as info:
        write_directory_atomically(target, _racing(someone_writes_notes), overwrite=False, owned=OWNED)
    message = str(info.value)
    assert "\n" not in message and str(target) in message and "--overwrite" in message
    assert _entries(tmp_path) == ["victim"]  # the finished staging directory is gone
    assert _entries(target) == ["precious.txt"] and (target / "precious.txt").read_text() == "notes"


@pytest.mark.parametrize("what", ["empty directory", "file", "dangling link"])
def test_nothing_that_appeared_at_the_target_is_replaced_without_overwrite(
    tmp_path: Path, publish_mode: str, what: str
) -> None:
    target = tmp_path / "out"
    make = {
        "empty directory": target.mkdir,
        "file": lambda: target.write_text("theirs"),
        "dangling link": lambda: target.symlink_to(tmp_path / "nowhere"),
    }[what]
    with pytest.raises(OutputExistsError, match="created by someone else"):
        write_directory_atomically(target, _racing(make), overwrite=False, owned=OWNED)
    assert _entries(tmp_path) == ["out"]
    if what == "empty directory":
        assert target.is_dir() and not target.is_symlink() and _entries(target) == []
    elif what == "file":
        assert target.read_text() == "theirs"
    else:
        assert target.is_symlink()


def test_overwrite_refuses_a_target_that_stopped_being_csbps_during_the_write(tmp_path: Path, publish_mode: str) -> None:
    target = tmp_path / "out"
    write_directory_atomically(target, _output, overwrite=False, owned=OWNED)
    with pytest.raises(ValueError, match="has 'precious.txt'"):  # checked before the exchange
        write_directory_atomically(
            target, _racing(lambda: (target / "precious.txt").write_text("notes")), overwrite=True, owned=OWNED
        )
    assert _entries(tmp_path) == ["out"] and _entries(target) == ["data.bin", "manifest.json", "precious.txt"]
    assert (target / "data.bin").read_bytes() == b"new"  # the old output, not this run's half


def test_overwrite_refuses_a_foreign_directory_that_appeared_at_a_free_target(tmp_path: Path, publish_mode: str) -> None:
    target = tmp_path / "out"

    def someone_writes_notes() -> None:
        target.mkdir()
        (target / "precious.txt").write_text("notes")

    with pytest.raises(ValueError, match="has no manifest.json"):
        write_directory_atomically(target, _racing(someone_writes_notes), overwrite=True, owned=OWNED)
    assert _entries(tmp_path) == ["out"] and _entries(target) == ["precious.txt"]


def test_overwrite_still_replaces_its_own_kind_of_output(tmp_path: Path, publish_mode: str) -> None:
    target = tmp_path / "out"
    target.mkdir()
    (target / "manifest.json").write_text("old")
    write_directory_atomically(target, _output, overwrite=True, owned=OWNED)
    assert _entries(tmp_path) == ["out"] and (target / "data.bin").read_bytes() == b"new"
    write_directory_atomically(tmp_path / "fresh", _output, overwrite=True, owned=OWNED)  # absent: plain move
    assert _entries(tmp_path / "fresh") == ["data.bin", "manifest.json"]


def test_the_fallback_keeps_a_claim_someone_filled_and_never_replaces_a_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(csbp.atomic, "_renameat2", lambda first, second, flags: None)
    source, target = tmp_path / "built", tmp_path / "target"
    source.mkdir()
    (source / "new").write_text("new")
    real_rename = csbp.atomic.os.rename

    def rename_after_someone_fills_the_claim(first: object, second: object) -> None:
        (target / "theirs").write_text("theirs")  # between our mkdir and our rename
        real_rename(first, second)

    monkeypatch.setattr(csbp.atomic.os, "rename", rename_after_someone_fills_the_claim)
    assert move_without_replacing(source, target) is False
    assert _entries(target) == ["theirs"] and _entries(source) == ["new"]


def test_data_prepare_reports_a_directory_created_during_the_run_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"hello world {i}"}) + "\n" for i in range(20)))
    victim = tmp_path / "victim"
    real_write_manifest = prepare_module.write_manifest

    def write_manifest_while_someone_mkdirs(directory: Path, manifest: dict) -> None:
        victim.mkdir()
        (victim / "precious.txt").write_text("notes")
        real_write_manifest(directory, manifest)

    monkeypatch.setattr(prepare_module, "write_manifest", write_manifest_while_someone_mkdirs)
    argv = ["data", "prepare", str(corpus), "--out", str(victim), "--seq-len", "8"]
    code = main([*argv, "--train-tokenizer", "--vocab-size", "300"])
    out, err = capsys.readouterr()
    assert code == USER_ERROR_EXIT_CODE and "wrote" not in out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"csbp: error: --out {victim}: was created by someone else")
    assert "(fix: choose another --out, or pass --overwrite)" in lines[0]
    assert _entries(victim) == ["precious.txt"] and _entries(tmp_path) == ["docs.jsonl", "victim"]
