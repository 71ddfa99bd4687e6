"""Checkpoint rules a mutation audit of ``csbp.training.checkpoint`` and ``checkpoint_integrity`` found
no test pinned, on checkpoints of a two-parameter model written by ``save_checkpoint`` itself (no
training run: each test takes well under a second).

* which checkpoint ``--resume`` takes: the one ``latest`` names when intact (even with a newer intact
  one beside it), else the newest intact one (not the oldest), and a pointer naming a directory
  outside ``checkpoints/`` is not followed; when none is intact, every damaged one is named;
* ordering by step number, not by name, once a run passes step 9,999,999 (8 digits);
* the durable write of ``latest`` and ``trainer_state.json``: written to a temporary sibling, flushed
  and fsynced before ``os.replace``, then the directory fsynced, so a crash or a failed write keeps the
  previous file; publishing a checkpoint fsyncs its parent directory too;
* a save replaces a crash's leftover staging directory and a damaged checkpoint of its own step, and
  prunes to exactly ``keep`` checkpoints, never the one it wrote;
* a save or load that failed on several ranks is told by the lowest rank's error;
* a checkpoint without ``trainer_state.json`` is damaged, and without checksums (an older csbp's) a
  data file one byte short of what its metadata needs (its furthest item's end, in whatever order the
  metadata lists them) is truncated.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from csbp.training import checkpoint as checkpoint_module
from csbp.training.checkpoint import TrainingState, prune_checkpoints, save_checkpoint
from csbp.training.checkpoint_integrity import find_resume_checkpoint, step_directories


def save_step(run_dir: Path, step: int, *, keep: int = 10) -> Path:
    """Checkpoint ``step`` of a two-parameter model (weights filled with ``step``) into ``run_dir``."""
    model = torch.nn.Linear(2, 1)
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(float(step))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrainingState(
        step=step, scheduler={}, loader={}, rng={}, data_fingerprint="f" * 64, param_shapes={}, topology={}, config_yaml=""
    )
    return save_checkpoint(run_dir, model=model, optimizer=optimizer, state=state, keep=keep)


def damage(checkpoint: Path) -> None:
    (checkpoint / ".metadata").unlink()


def point_latest_at(run_dir: Path, name: str) -> None:
    (run_dir / "checkpoints" / "latest").write_text(name + "\n", encoding="utf-8")


# ----------------------------------------------------------------------------- which checkpoint a resume takes


def test_a_damaged_latest_falls_back_to_the_newest_intact_checkpoint_not_the_oldest(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4):
        save_step(tmp_path, step)
    damage(tmp_path / "checkpoints" / "step_0000004")
    damage(tmp_path / "checkpoints" / "step_0000003")
    warnings: list[str] = []
    assert find_resume_checkpoint(tmp_path, warn=warnings.append) == tmp_path / "checkpoints" / "step_0000002"
    assert len(warnings) == 1
    assert warnings[0].startswith("warning: skipping damaged checkpoint(s): ")
    assert "step_0000004/.metadata is missing; " in warnings[0]  # every one skipped is named
    assert "step_0000003/.metadata is missing; " in warnings[0] and warnings[0].endswith("; resuming from step_0000002")


def test_the_checkpoint_latest_names_wins_over_a_newer_intact_one(tmp_path: Path) -> None:
    """A crash after a checkpoint was published but before ``latest`` moved leaves a newer complete
    directory; the resume continues from what ``latest`` names, silently (both are intact)."""
    for step in (1, 2, 3):
        save_step(tmp_path, step)
    point_latest_at(tmp_path, "step_0000002")
    warnings: list[str] = []
    assert find_resume_checkpoint(tmp_path, warn=warnings.append) == tmp_path / "checkpoints" / "step_0000002"
    assert warnings == []


def test_when_no_checkpoint_is_intact_each_damaged_one_is_named_in_one_line(tmp_path: Path) -> None:
    for step in (1, 2):
        damage(save_step(tmp_path, step))
    with pytest.raises(ValueError) as refused:
        find_resume_checkpoint(tmp_path)
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith(f"--resume: no intact checkpoint in {tmp_path / 'checkpoints'}: ")
    assert "step_0000002/.metadata is missing" in line and "step_0000001/.metadata is missing" in line
    assert line.endswith("(fix: restore the files, or start a new run directory)")


def test_a_latest_naming_a_directory_outside_the_checkpoints_is_not_followed(tmp_path: Path) -> None:
    """``latest`` holding ``../../other/checkpoints/step_0000009``: a path, not a checkpoint name."""
    save_step(tmp_path / "run", 1)
    save_step(tmp_path / "other", 9)
    point_latest_at(tmp_path / "run", "../../other/checkpoints/step_0000009")
    warnings: list[str] = []
    assert find_resume_checkpoint(tmp_path / "run", warn=warnings.append) == tmp_path / "run" / "checkpoints" / "step_0000001"
    assert warnings == [
        f"warning: {tmp_path / 'run' / 'checkpoints' / 'latest'} names '../../other/checkpoints/step_0000009', "
        "which is not a checkpoint directory here"
    ]
    point_latest_at(tmp_path / "run", "step_0000007")  # a name, but of no directory here: reported as such
    warnings.clear()
    assert find_resume_checkpoint(tmp_path / "run", warn=warnings.append) == tmp_path / "run" / "checkpoints" / "step_0000001"
    assert warnings == [
        f"warning: {tmp_path / 'run' / 'checkpoints' / 'latest'} names 'step_0000007', which is not a checkpoint directory here"
    ]


def test_steps_past_seven_digits_are_ordered_by_number(tmp_path: Path) -> None:
    """``step_10000000`` sorts before ``step_9999999`` as text: a resume fell back to, and pruning kept,
    the older one."""
    root = tmp_path / "checkpoints"
    for step in (9_999_998, 9_999_999, 10_000_000):
        (root / f"step_{step:07d}").mkdir(parents=True)
    assert [p.name for p in step_directories(root)] == ["step_10000000", "step_9999999", "step_9999998"]
    prune_checkpoints(root, keep=1, protect="step_10000000")
    assert sorted(p.name for p in root.iterdir()) == ["step_10000000"]


# ----------------------------------------------------------------------------- durable, atomic writes


def test_latest_is_replaced_whole_after_its_bytes_are_on_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The order a crash-safe replace needs: write a sibling, flush, fsync it, ``os.replace``, fsync the
    directory. Each step dropped survived the audit (a crash test cannot see a missing fsync)."""
    path = tmp_path / "latest"
    path.write_text("step_0000001\n", encoding="utf-8")
    events: list[tuple[str, str]] = []
    fsync, replace = os.fsync, os.replace

    def spy_fsync(fd: int) -> None:
        target = Path(os.readlink(f"/proc/self/fd/{fd}"))
        events.append(("fsync", target.name if target.is_dir() else f"{target.name}:{target.read_text()!r}"))
        fsync(fd)

    def spy_replace(src: os.PathLike[str], dst: os.PathLike[str]) -> None:
        events.append(("replace", f"{Path(src).name}->{Path(dst).name}"))
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", spy_fsync)
    monkeypatch.setattr(os, "replace", spy_replace)
    checkpoint_module._write_text_durably(path, "step_0000002\n")
    assert events == [
        ("fsync", "latest.writing:'step_0000002\\n'"),  # flushed before the fsync: the bytes are in the file
        ("replace", "latest.writing->latest"),
        ("fsync", tmp_path.name),
    ]
    assert path.read_text(encoding="utf-8") == "step_0000002\n"


def test_a_failed_write_of_latest_keeps_the_previous_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "latest"
    path.write_text("step_0000001\n", encoding="utf-8")

    def full_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space left"):
        checkpoint_module._write_text_durably(path, "step_0000002\n")
    assert path.read_text(encoding="utf-8") == "step_0000001\n"


def test_publishing_a_checkpoint_fsyncs_the_checkpoints_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rename of ``step_N.tmp`` to ``step_N`` is durable only once its directory is fsynced."""
    synced: list[str] = []
    fsync = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    staging, final = tmp_path / "step_0000001.tmp", tmp_path / "step_0000001"
    staging.mkdir()
    monkeypatch.setattr(os, "fsync", spy)
    checkpoint_module._publish(staging, final)
    assert final.is_dir() and not staging.exists()
    assert synced == [str(tmp_path)]


# ----------------------------------------------------------------------------- what a save replaces


def test_a_save_replaces_a_crashs_staging_leftover(tmp_path: Path) -> None:
    stale = tmp_path / "checkpoints" / "step_0000001.tmp"
    stale.mkdir(parents=True)
    (stale / "__0_0.distcp").write_bytes(b"half written")
    (stale / "stray").write_bytes(b"x")
    final = save_step(tmp_path, 1)
    assert not stale.exists() and not (final / "stray").exists()
    assert find_resume_checkpoint(tmp_path) == final


def test_a_save_replaces_a_damaged_checkpoint_of_its_own_step(tmp_path: Path) -> None:
    """After a resume skipped a damaged step_2, the run saves step 2 again over it."""
    save_step(tmp_path, 1)
    damage(save_step(tmp_path, 2))
    (tmp_path / "checkpoints" / "step_0000002" / "stray").write_bytes(b"x")
    final = save_step(tmp_path, 2)
    assert not (final / "stray").exists()
    assert find_resume_checkpoint(tmp_path) == final


def test_a_save_keeps_the_newest_keep_checkpoints_and_never_the_one_it_wrote(tmp_path: Path) -> None:
    """``keep`` is exact, and a step saved below a newer (damaged, skipped) directory survives its own
    prune: ``latest`` names it (mutation audit: keep + 1, and an empty ``protect``, each survived)."""
    for step in (1, 2, 3):
        save_step(tmp_path, step, keep=2)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_0000002", "step_0000003"]
    damage(save_step(tmp_path, 9, keep=2))
    resumed = find_resume_checkpoint(tmp_path)
    assert resumed == root / "step_0000003"
    save_step(tmp_path, 4, keep=1)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_0000004", "step_0000009"]
    assert find_resume_checkpoint(tmp_path) == root / "step_0000004"


# ----------------------------------------------------------------------------- which rank's failure is told


def wrapped(exc: Exception) -> tuple[Exception, object]:
    """A failure as DCP's ``CheckpointException`` records it: the exception and its traceback."""
    return (exc, None)


def test_a_failed_save_and_a_failed_load_name_the_lowest_ranks_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank reports the same one line, the lowest failed rank's (mutation audit: taking the highest
    rank's survived; only the multi-rank tests failed on more than one rank, and on one cause)."""
    from torch.distributed.checkpoint.api import CheckpointException

    from csbp.training import checkpoint_integrity

    failures = {3: wrapped(OSError(28, "rank three's disk")), 1: wrapped(OSError(5, "rank one's disk"))}
    cause = checkpoint_module._first_failure(CheckpointException("save", failures))
    assert isinstance(cause, OSError) and "rank one's disk" in str(cause)

    final = save_step(tmp_path, 1)

    def failing_load(*args: object, **kwargs: object) -> None:
        raise CheckpointException("load", {2: wrapped(ValueError("two")), 1: wrapped(ValueError("one"))})

    monkeypatch.setattr(checkpoint_integrity.dcp, "load", failing_load)
    with pytest.raises(ValueError, match=r"could not be loaded: rank 1: one$"):
        checkpoint_integrity.safe_dcp_load({}, final, no_dist=True)


# ----------------------------------------------------------------------------- what makes a checkpoint damaged


def test_a_checkpoint_without_its_trainer_state_is_damaged(tmp_path: Path) -> None:
    """Intact DCP files alone are not a checkpoint: the step, schedule and loader position are in
    ``trainer_state.json`` (mutation audit: ignoring the state file's problem survived)."""
    from csbp.training.checkpoint_integrity import checkpoint_problem

    final = save_step(tmp_path, 1)
    (final / "trainer_state.json").unlink()
    assert checkpoint_problem(final) == f"{final / 'trainer_state.json'} is missing"


def test_a_data_file_one_byte_short_is_truncated_without_checksums(tmp_path: Path) -> None:
    """A checkpoint of an older csbp (no checksums) is checked on sizes alone, to the byte."""
    from csbp.training.checkpoint_integrity import checkpoint_problem

    final = save_step(tmp_path, 1)
    without_checksums(final)
    data = final / "__0_0.distcp"
    size = data.stat().st_size
    with open(data, "r+b") as handle:
        handle.truncate(size - 1)
    assert checkpoint_problem(final) == f"{data} is truncated ({size - 1} bytes, the metadata needs {size})"


def without_checksums(checkpoint: Path) -> None:
    """Make ``checkpoint`` look like an older csbp's: no ``checksums`` in its ``trainer_state.json``."""
    import json

    state = json.loads((checkpoint / "trainer_state.json").read_text())
    del state["checksums"]
    (checkpoint / "trainer_state.json").write_text(json.dumps(state))


def test_a_file_must_hold_its_furthest_item_whatever_the_metadata_order(tmp_path: Path) -> None:
    """DCP lists a file's items in the order it wrote them, but nothing in ``.metadata`` requires it: with
    the item ending furthest into ``__0_0.distcp`` listed first, a file one byte short of it is still
    truncated (mutation audit: keeping the last item's end instead of the largest survived, and accepted
    this checkpoint, whose first items end well before the file does)."""
    import dataclasses
    import pickle

    from csbp.training.checkpoint_integrity import checkpoint_problem, read_metadata

    final = save_step(tmp_path, 1)
    without_checksums(final)
    genuine = read_metadata(final)
    entries = sorted(genuine.storage_data.items(), key=lambda entry: entry[1].offset + entry[1].length, reverse=True)
    assert {info.relative_path for _, info in entries} == {"__0_0.distcp"} and len(entries) >= 2
    furthest, last = (info.offset + info.length for _, info in (entries[0], entries[-1]))
    assert last < furthest == (final / "__0_0.distcp").stat().st_size
    (final / ".metadata").write_bytes(pickle.dumps(dataclasses.replace(genuine, storage_data=dict(entries))))
    assert checkpoint_problem(final) is None  # reordered, the metadata is still intact
    with open(final / "__0_0.distcp", "r+b") as handle:
        handle.truncate(furthest - 1)
    data = final / "__0_0.distcp"
    assert checkpoint_problem(final) == f"{data} is truncated ({furthest - 1} bytes, the metadata needs {furthest})"


def test_every_recorded_file_is_verified_even_one_no_item_names_and_a_stray_one_is_not(tmp_path: Path) -> None:
    """The checksum record lists the files the checkpoint was saved with, including a data file no item
    names (DCP writes one for a rank that saved only replicated tensors): missing or changed, the
    checkpoint is damaged (a partial copy), even though a load would not read it. A DCP file neither the
    record nor the metadata names was never part of it and is ignored (mutation audit: verifying only the
    files the metadata names survived)."""
    import json

    from csbp.training.checkpoint_checksums import checksum_entries
    from csbp.training.checkpoint_integrity import checkpoint_problem

    final = save_step(tmp_path, 1)
    unnamed = final / "__1_0.distcp"
    unnamed.write_bytes(b"rank 1 saved no item of its own")
    state = json.loads((final / "trainer_state.json").read_text())
    state["checksums"]["files"].update(checksum_entries(final, [unnamed.name]))
    (final / "trainer_state.json").write_text(json.dumps(state))
    assert checkpoint_problem(final) is None
    (final / "__2_0.distcp").write_bytes(b"copied in later")  # a stray: no part of the checkpoint
    assert checkpoint_problem(final) is None

    unnamed.write_bytes(b"rank 1 saved no item of its owN")  # the same size
    problem = checkpoint_problem(final) or ""
    assert problem.startswith(f"{unnamed} does not match the checksum recorded when it was saved"), problem
    unnamed.unlink()
    assert checkpoint_problem(final) == f"{unnamed} is missing"
