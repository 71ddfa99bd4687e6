"""Atomic writes are durable, not only atomic: every file is flushed before the rename that
publishes it, and the directory holding the new name after it (a power cut, not only a killed
process, leaves the old or the new complete version)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import csbp.atomic
from csbp.atomic import write_directory_atomically, write_text_atomic

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/fd")


@pytest.fixture
def synced(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths ``os.fsync`` is called on, in order (as they were named at that moment)."""
    calls: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        calls.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(csbp.atomic.os, "fsync", fsync)
    return calls


OWNED = csbp.atomic.Ownership(what="export", marker="config.json", names=frozenset({"config.json", "model.safetensors"}))


def _fill(staging: Path) -> None:
    (staging / "config.json").write_text("{}")
    (staging / "model.safetensors").write_bytes(b"\0" * 64)


@pytest.mark.parametrize("overwrite", [False, True])
def test_a_published_directory_is_flushed_before_and_after_its_rename(
    tmp_path: Path, synced: list[str], overwrite: bool
) -> None:
    target = tmp_path / "export"
    if overwrite:
        target.mkdir()
        (target / "config.json").write_text("old")
    write_directory_atomically(target, _fill, overwrite=overwrite, owned=OWNED)
    staged = [Path(path) for path in synced[:-1]]
    assert {path.name for path in staged if path.parent.name.startswith(".export.tmp-")} == {
        "config.json", "model.safetensors"
    }, "the files were not flushed before the rename"
    assert any(path.name.startswith(".export.tmp-") for path in staged), "the staging directory was not flushed"
    assert synced[-1] == str(tmp_path), "the parent directory was not flushed after the rename"


def test_a_single_file_is_flushed_before_and_after_its_rename(tmp_path: Path, synced: list[str]) -> None:
    write_text_atomic(tmp_path / "config.yaml", "a: 1\n")
    assert len(synced) == 2 and Path(synced[0]).name.startswith(".config.yaml.tmp-") and synced[1] == str(tmp_path)
    assert (tmp_path / "config.yaml").read_text() == "a: 1\n"
