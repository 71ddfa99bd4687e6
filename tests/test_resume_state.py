"""What a checkpoint must carry so that ``--resume`` continues exactly: the ``train.nan_policy: skip``
streak, and a loader position that belongs to the split and artifact it is loaded into.

Runs train the tiny decoder of :mod:`test_training_run` on the CPU in float32.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from csbp.data.artifact import ArtifactSplit
from csbp.data.loader import PackedLoader
from csbp.training import checkpoint as checkpoint_module
from csbp.training import train
from csbp.training.checkpoint import STATE_FILE, TrainingState
from csbp.training.nan_policy import MAX_SKIPPED_STEPS, NonFiniteTraining, SkipStreak, latest_checkpoint_name
from csbp.training.step import StepRunner
from test_training_run import copy_run, make_artifact, run_at_step2, tiny_config, trajectory  # noqa: F401 - a fixture


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_artifact(tmp_path_factory.mktemp("data") / "art")


def poison_steps(monkeypatch: pytest.MonkeyPatch, bad_steps: set[int]) -> None:
    """Steps in ``bad_steps`` report a NaN loss and NaN gradients."""
    real = StepRunner.train_step

    def poisoned(self: StepRunner, batches: list, step: int):  # type: ignore[no-untyped-def]
        result = real(self, batches, step)
        if step not in bad_steps:
            return result
        for param in self.model.parameters():
            if param.grad is not None:
                param.grad.fill_(math.nan)
        return replace(result, loss=math.nan)

    monkeypatch.setattr(StepRunner, "train_step", poisoned)


def test_the_skip_streak_survives_a_resume(artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``nan_policy: skip`` stops after ``MAX_SKIPPED_STEPS`` skipped steps in a row. A run stopped inside
    such a streak and resumed stops at the same step as the uninterrupted run; before, the streak was
    not checkpointed, so the resumed run counted from 0 again and trained on past the step the
    uninterrupted run stopped at."""
    first_bad = 3
    bad = set(range(first_bad, first_bad + MAX_SKIPPED_STEPS + 1))  # one more than may be skipped
    stop = first_bad + MAX_SKIPPED_STEPS
    poison_steps(monkeypatch, bad)
    cfg = tiny_config(
        artifact, **{"train.nan_policy": "skip", "train.max_steps": stop + 2, "train.eval_every": 0, "train.save_every": 0}
    )
    with pytest.raises(NonFiniteTraining, match=rf"^step {stop}: loss nan") as stopped:
        train(cfg, run_dir=tmp_path / "full")
    # the fix no longer offers the setting that is already on
    assert f"after {MAX_SKIPPED_STEPS} skipped steps in a row" in str(stopped.value)
    assert "set train.nan_policy: skip" not in str(stopped.value)

    midway = first_bad + MAX_SKIPPED_STEPS // 2
    train(cfg, run_dir=tmp_path / "half", max_steps=midway)
    saved = json.loads((tmp_path / "half" / "checkpoints" / f"step_{midway:07d}" / STATE_FILE).read_text())
    assert saved["nan_skips_in_a_row"] == midway - first_bad + 1
    with pytest.raises(NonFiniteTraining, match=rf"^step {stop}: loss nan"):
        train(cfg, run_dir=tmp_path / "half", resume=True)
    assert trajectory(tmp_path / "half") == trajectory(tmp_path / "full")
    # every step before the stopping one is recorded; the skipped ones with a null loss
    rows = trajectory(tmp_path / "full")
    assert [row[0] for row in rows] == list(range(1, stop))
    assert [row[0] for row in rows if row[1] is None] == list(range(first_bad, stop))


def test_a_finite_step_after_the_resume_ends_the_streak(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The restored streak is reset by the first good step, as it is without a resume: the resumed
    run then trains to its end with the same losses as the uninterrupted one."""
    poison_steps(monkeypatch, {2, 3})
    cfg = tiny_config(artifact, **{"train.nan_policy": "skip", "train.max_steps": 5, "train.eval_every": 0})
    full = train(cfg, run_dir=tmp_path / "full")
    train(cfg, run_dir=tmp_path / "half", max_steps=3)
    resumed = train(cfg, run_dir=tmp_path / "half", resume=True)
    assert resumed.losses == full.losses[1:] and len(full.losses) == 3
    assert trajectory(tmp_path / "half") == trajectory(tmp_path / "full")
    weights = "final/model.safetensors"
    assert (tmp_path / "half" / weights).read_bytes() == (tmp_path / "full" / weights).read_bytes()


def test_skip_allows_ten_non_finite_steps_in_a_row_and_a_finite_one_starts_over() -> None:
    """docs/config.md: "at most 10 skips in a row, then stop"; a finite step ends the streak. The
    messages name both numbers and the last good checkpoint ("none" before the first)."""
    streak = SkipStreak("skip")
    for step in range(1, 11):
        line = streak.non_finite(step, math.nan, 1.5, kept=None)
        assert line == f"warning: step {step}: loss nan and grad_norm 1.5: not finite, update skipped (train.nan_policy: skip)"
    with pytest.raises(NonFiniteTraining, match=r"^step 11: .* after 10 skipped steps in a row .*checkpoint: none\)"):
        streak.non_finite(11, math.nan, 1.5, kept=None)
    streak = SkipStreak("skip", in_a_row=10)
    streak.finite()
    assert streak.in_a_row == 0
    streak.non_finite(12, 2.0, math.inf, kept="step_0000010")
    with pytest.raises(NonFiniteTraining, match=r"grad_norm inf: not finite; .*checkpoint: step_0000010\) .*nan_policy: skip\)$"):
        SkipStreak("stop").non_finite(3, 2.0, math.inf, kept="step_0000010")


def test_the_latest_pointer_is_read_without_its_line_end(tmp_path: Path) -> None:
    assert latest_checkpoint_name(tmp_path) is None
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "latest").write_text("step_0000004\n", encoding="utf-8")
    assert latest_checkpoint_name(tmp_path) == "step_0000004"


# ----------------------------------------------------------------------------- the loader's split


def split_named(name: str, num_rows: int = 6) -> ArtifactSplit:
    tokens = np.arange(num_rows * 3, dtype=np.uint32).reshape(num_rows, 3)
    return ArtifactSplit(name, 3, tokens, (tokens % 2).astype(np.uint8), (tokens // 5).astype(np.int32), "f" * 64)


def test_a_loader_state_of_another_split_is_refused() -> None:
    """Both splits of an artifact carry the artifact's fingerprint, so a val loader's state (same row
    count) used to load into the train loader and continue from a position that was never trained."""
    val = PackedLoader(split_named("val"), batch_size=3, seed=0)
    next(val)
    state = val.state_dict()
    assert state["split"] == "val"
    with pytest.raises(ValueError, match=r"^loader state field 'split' is 'val', this loader reads 'train' \(fix: "):
        PackedLoader(split_named("train"), batch_size=3, seed=0).load_state_dict(state)


def test_a_loader_state_without_a_split_is_a_train_position() -> None:
    """Checkpoints written before the split was recorded hold the train loader's position (the only one
    the trainer saves): they resume, into a train loader only."""
    loader = PackedLoader(split_named("train"), batch_size=3, seed=0)
    next(loader)
    old = {k: v for k, v in loader.state_dict().items() if k != "split"}
    resumed = PackedLoader(split_named("train"), batch_size=3, seed=0)
    resumed.load_state_dict(old)
    assert resumed.cursor == 3
    with pytest.raises(ValueError, match="loader state field 'split' is 'train', this loader reads 'val'"):
        PackedLoader(split_named("val"), batch_size=3, seed=0).load_state_dict(old)


# ----------------------------------------------------------------------------- trainer_state.json


def test_a_checkpoint_without_the_streak_reads_as_none_and_a_bad_streak_is_refused(tmp_path: Path) -> None:
    """Checkpoints written before the streak was recorded resume with none; a value that is not a count
    marks the checkpoint damaged instead of steering the nan policy."""
    state = TrainingState(
        step=2, scheduler={}, loader={}, rng={}, data_fingerprint="f", param_shapes={}, topology={}, config_yaml=""
    ).to_json()
    source = tmp_path / STATE_FILE
    older = {key: value for key, value in state.items() if key != "nan_skips_in_a_row"}
    assert TrainingState.from_json(older, source).nan_skips_in_a_row == 0
    assert TrainingState.from_json({**state, "nan_skips_in_a_row": 3}, source).nan_skips_in_a_row == 3
    for bad in (-1, "3", 2.0, None, True):
        with pytest.raises(ValueError, match=r"nan_skips_in_a_row is .*, not a count; the checkpoint is corrupt"):
            TrainingState.from_json({**state, "nan_skips_in_a_row": bad}, source)


def test_a_checkpoint_of_other_data_or_another_format_is_refused(tmp_path: Path) -> None:
    """Before any tensor is read, a checkpoint trained on another artifact (its fingerprint) or written
    in another format version is refused with the reason; the same data and shapes pass."""
    state = TrainingState(
        step=2, scheduler={}, loader={}, rng={}, data_fingerprint="a" * 64, param_shapes={"w": [2, 3]},
        topology={}, config_yaml="",
    )
    source = tmp_path / STATE_FILE
    checkpoint_module.check_compatible(state, source, shapes={"w": [2, 3]}, data_fingerprint="a" * 64)
    with pytest.raises(ValueError, match=r"data\.train: .* fingerprint aaaaaaaaaaaa\.\.\., .* bbbbbbbbbbbb\.\.\."):
        checkpoint_module.check_compatible(state, source, shapes={"w": [2, 3]}, data_fingerprint="b" * 64)
    data = state.to_json()
    assert TrainingState.from_json(data, source) == state
    for version in (data["format_version"] + 1, None):
        with pytest.raises(ValueError, match="checkpoint format"):
            TrainingState.from_json({**data, "format_version": version}, source)


def test_the_global_rngs_survive_json_and_resume_restores_them(
    run_at_step2: Path, artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    """csbp draws from its own generators, so a resume that dropped the global RNGs still matched step for
    step: nothing held the save/restore, which is for code (a user's dropout) drawing from them."""
    import random

    import numpy as np

    def draws() -> list[Any]:
        return [torch.rand(3).tolist(), np.random.rand(3).tolist(), np.random.normal(), [random.random() for _ in range(3)]]

    torch.manual_seed(1), np.random.seed(2), random.seed(3), np.random.normal()  # numpy caches a gaussian
    state = json.loads(json.dumps(checkpoint_module.rng_state()))  # as trainer_state.json holds it
    first = draws()
    torch.manual_seed(9), np.random.seed(9), random.seed(9)
    checkpoint_module.restore_rng_state(state)
    assert draws() == first

    run_dir = copy_run(run_at_step2, tmp_path)
    saved = json.loads((run_dir / "checkpoints" / "step_0000002" / checkpoint_module.STATE_FILE).read_text())["rng"]
    restored: list[dict[str, Any]] = []
    restore = checkpoint_module.restore_rng_state
    monkeypatch.setattr(checkpoint_module, "restore_rng_state", lambda s: restored.append(s) or restore(s))
    train(tiny_config(artifact), run_dir=run_dir, resume=True)
    assert restored == [saved]
