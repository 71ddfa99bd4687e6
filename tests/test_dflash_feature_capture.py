"""The feature store's target-weights fingerprint and its resumable capture: a store captured from
other weights of the same config is refused, and a capture stopped part-way (an exception after some
committed chunks, a ``SIGKILL``) is continued by running it again, ending byte-identical to an
uninterrupted capture; a rerun with other settings is refused in one line."""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import csbp.dflash.feature_writer as writer
import csbp.dflash.target_fingerprint as fingerprints
from csbp.data.artifact import ArtifactSplit
from csbp.dflash.feature_writer import PROGRESS_FILE, prepare_features
from csbp.dflash.features import open_features, recorded_target
from csbp.dflash.target_fingerprint import checkpoint_fingerprint, checkpoint_identity, module_fingerprint
from csbp.dflash.verify import TARGET_CONFIG, DFlashVerifyCase, build_models, make_batch
from csbp.models.hf_io import export_hf_checkpoint
from csbp.staging import LOCK_SUFFIX

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="flock")


def _split(rows: int = 5, seq_len: int = 16) -> ArtifactSplit:
    batch = make_batch(rows, seq_len)
    return ArtifactSplit(
        name="train",
        seq_len=seq_len,
        tokens=batch.input_ids.numpy().astype(np.uint32),
        loss_mask=batch.loss_mask.numpy().astype(np.uint8),
        doc_ids=batch.doc_ids.numpy().astype(np.int32),
        fingerprint="test",
    )


def _files(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


def _capture(out: Path, **options) -> Path:
    target, _ = build_models(DFlashVerifyCase())
    defaults = {"layer_ids": (0, 2), "with_last_hidden": True, "dtype": "float32", "target_weights": "w"}
    return prepare_features(target, _split(), out, **{**defaults, **options})


def test_checkpoint_fingerprint_follows_the_weight_bytes(tmp_path: Path) -> None:
    target, _ = build_models(DFlashVerifyCase(), dtype=torch.float32)
    base = export_hf_checkpoint(target, TARGET_CONFIG, tmp_path / "base")
    first = checkpoint_fingerprint(base)
    assert first.startswith("safetensors-sha256:") and len(first) == len("safetensors-sha256:") + 64
    fingerprints._cache.clear()
    assert checkpoint_fingerprint(base) == first  # recomputed, not only cached
    tuned = tmp_path / "tuned"
    shutil.copytree(base, tuned)
    tensors = load_file(str(tuned / "model.safetensors"))
    tensors["model.layers.1.mlp.down_proj.weight"][0, 0] += 1e-3  # a fine-tune: same config.json
    save_file(tensors, str(tuned / "model.safetensors"), metadata={"format": "pt"})
    assert (tuned / "config.json").read_bytes() == (base / "config.json").read_bytes()
    assert checkpoint_fingerprint(tuned) != first
    with pytest.raises(ValueError, match="needs model.safetensors"):
        checkpoint_fingerprint(tmp_path)
    moved = module_fingerprint(target)
    assert moved.startswith("tensors-sha256:") and moved != module_fingerprint(target.to(torch.float64))


def test_unchanged_weight_files_are_not_read_again_and_changed_ones_are(tmp_path: Path) -> None:
    target, _ = build_models(DFlashVerifyCase(), dtype=torch.float32)
    base = export_hf_checkpoint(target, TARGET_CONFIG, tmp_path / "base")
    fingerprint, files = checkpoint_identity(base)
    assert files == [["model.safetensors", (base / "model.safetensors").stat().st_size,
                      (base / "model.safetensors").stat().st_mtime_ns]]
    out = _capture(tmp_path / "f", target_weights=fingerprint, target_files=files)
    assert recorded_target(out) == (fingerprint, files)
    fingerprints._cache.clear()
    planted = "safetensors-sha256:" + "0" * 64  # what only a skipped read can return
    assert checkpoint_fingerprint(base, known=(planted, files)) == planted
    assert checkpoint_fingerprint(base, known=("tensors-sha256:" + "0" * 64, files)) == fingerprint
    copied = tmp_path / "copied"
    shutil.copytree(base, copied)  # copy2 keeps sizes and times: the same bytes, no read needed
    assert checkpoint_fingerprint(copied, known=recorded_target(out)) == fingerprint
    stat = (base / "model.safetensors").stat()
    os.utime(base / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # touched: read again
    assert checkpoint_fingerprint(base, known=(planted, files)) == fingerprint
    tensors = load_file(str(copied / "model.safetensors"))
    tensors["model.layers.1.mlp.down_proj.weight"][0, 0] += 1e-3  # a fine-tune written over the copy
    save_file(tensors, str(copied / "model.safetensors"), metadata={"format": "pt"})
    assert checkpoint_fingerprint(copied, known=recorded_target(out)) != fingerprint


def test_a_resume_accepts_the_same_weights_with_other_file_times(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "f"
    _fail_after(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        _capture(out, commit_seconds=0, target_files=[["model.safetensors", 10, 1]])
    monkeypatch.undo()
    _capture(out, commit_seconds=0, target_files=[["model.safetensors", 10, 2]])  # e.g. copied without times
    assert recorded_target(out) == ("w", [["model.safetensors", 10, 2]])


def test_a_store_from_an_older_csbp_is_refused_in_one_line(tmp_path: Path) -> None:
    out = _capture(tmp_path / "f")
    manifest = (out / "manifest.json").read_text().replace('"format_version": 2', '"format_version": 1')
    (out / "manifest.json").write_text(manifest)
    with pytest.raises(ValueError, match="older csbp, without a fingerprint of the target's weights"):
        open_features(out, target_config=TARGET_CONFIG, target_weights="w", split=_split(), layer_ids=(0, 2))


def _fail_after(monkeypatch: pytest.MonkeyPatch, calls: int) -> None:
    """Make the capture raise (as Ctrl-C would) on its ``calls``-th batch."""
    real, count = writer.capture_target_features, [0]

    def capture(*args, **kwargs):
        count[0] += 1
        if count[0] == calls:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(writer, "capture_target_features", capture)


def test_an_interrupted_capture_resumes_byte_identical(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    whole = _files(_capture(tmp_path / "whole" / "f"))
    out = tmp_path / "f"
    _fail_after(monkeypatch, 4)  # rows 0, 1, 2 captured and committed, then stopped
    with pytest.raises(KeyboardInterrupt):
        _capture(out, rows_per_batch=1, commit_seconds=0)
    (staging,) = [p for p in tmp_path.iterdir() if p.name.startswith(".f.tmp-") and p.is_dir()]
    assert Path(f"{staging}{LOCK_SUFFIX}").is_file() and not out.exists()
    assert '"rows_done": 3' in (staging / PROGRESS_FILE).read_text()
    assert "kept the interrupted write" in capsys.readouterr().err
    monkeypatch.undo()
    _capture(out, rows_per_batch=2, commit_seconds=0)  # another batch size: each row is captured alone
    assert f"resuming the interrupted capture in {staging} at row 3 of 5" in capsys.readouterr().err
    assert _files(out) == whole and PROGRESS_FILE not in whole
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f", "whole"]  # the staging directory was published


def test_a_capture_stopped_before_its_first_commit_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fail_after(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        _capture(tmp_path / "f")  # the default commit interval (60 s) is never reached
    assert list(tmp_path.iterdir()) == []


def test_a_rerun_with_other_settings_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "f"
    _fail_after(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        _capture(out, commit_seconds=0)
    monkeypatch.undo()
    (staging,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    changes = (({"layer_ids": (1, 2)}, "layer_ids (--layer-ids)"), ({"target_weights": "v"}, "target_weights"),
               ({"dtype": "float16"}, "dtype (--feature-dtype) 'float32' there, 'float16' now"))
    for change, field in changes:
        with pytest.raises(ValueError) as caught:
            _capture(out, **change)
        message = str(caught.value)
        assert len(message.splitlines()) == 1 and f"({field}" in message
        assert f"or delete {staging} to start over" in message and (staging / PROGRESS_FILE).is_file()
    shutil.rmtree(staging)
    assert _files(_capture(out, layer_ids=(1, 2))).keys() == {"features.npy", "last_hidden.npy", "manifest.json"}


_KILLED = textwrap.dedent(
    """
    import sys, time
    import numpy as np
    import csbp.dflash.feature_writer as writer
    from csbp.data.artifact import ArtifactSplit
    from csbp.dflash.verify import DFlashVerifyCase, build_models, make_batch

    real = writer.capture_target_features
    def slow(*args, **kwargs):
        time.sleep(0.3)
        return real(*args, **kwargs)
    writer.capture_target_features = slow
    batch = make_batch(5, 16)
    split = ArtifactSplit(name="train", seq_len=16, tokens=batch.input_ids.numpy().astype(np.uint32),
                          loss_mask=batch.loss_mask.numpy().astype(np.uint8),
                          doc_ids=batch.doc_ids.numpy().astype(np.int32), fingerprint="test")
    target, _ = build_models(DFlashVerifyCase())
    writer.prepare_features(target, split, sys.argv[1], layer_ids=(0, 2), with_last_hidden=True, dtype="float32",
                            target_weights="w", commit_seconds=0)
    """
)


def test_a_killed_capture_resumes_byte_identical(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "f"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-c", _KILLED, str(out)], env=env)
    deadline = time.monotonic() + 120
    progress: list[Path] = []
    while not progress and process.poll() is None and time.monotonic() < deadline:
        progress = [p for p in tmp_path.glob(f".f.tmp-*/{PROGRESS_FILE}") if '"rows_done": 2' in p.read_text()]
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert progress and not out.exists(), "the capture was not killed part-way"
    _capture(out, commit_seconds=0)
    assert re.search(r"resuming the interrupted capture in .* at row [23] of 5", capsys.readouterr().err)
    assert _files(out) == _files(_capture(tmp_path / "whole"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f", "whole"]


def test_a_full_filesystem_is_one_line_before_any_row_is_captured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The arrays are memory-mapped: a write to a page a full filesystem cannot back killed the capture
    # with SIGBUS (exit 135, no message), possibly hours in. Their blocks are now reserved up front.
    calls = []

    def full(fd: int, offset: int, length: int) -> None:
        calls.append(length)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full, raising=False)
    monkeypatch.setattr(writer, "capture_target_features", None)  # never reached
    with pytest.raises(ValueError) as caught:
        _capture(tmp_path / "f")
    message = str(caught.value)
    assert len(message.splitlines()) == 1 and calls
    assert message.startswith("--out: features.npy needs ") and "free (fix: free some space" in message
    assert list(tmp_path.iterdir()) == []
