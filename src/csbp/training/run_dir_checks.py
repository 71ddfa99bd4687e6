"""The run directory checks of ``csbp train`` (and ``csbp compare``), before anything is written.

``--resume`` needs an intact checkpoint with steps left before the stop step; a fresh run must not
clobber a checkpoint and starts only in a directory that is absent, empty or holds nothing but what a
csbp run writes; the run's ``final/`` must be replaceable by its export at the end; the directory
must be creatable and writable. Every problem is a ``ValueError`` with one line and its fix.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from csbp.atomic import WRITE_PROBE_PREFIX, unwritable_reason
from csbp.config.schema import RunConfig
from csbp.models.hf_io import EXPORT_OWNERSHIP
from csbp.training.checkpoint import read_training_state
from csbp.training.checkpoint_integrity import find_resume_checkpoint, has_checkpoints, step_directories
from csbp.training.run_lock import LOCK_FILE


def check_run_dir(
    run_dir: Path, *, resume: bool, stop_step: int | None, warn: Callable[[str], None] | None = None
) -> Path | None:
    """``--resume`` needs an intact checkpoint in ``run_dir`` (before ``stop_step`` unless None:
    :func:`csbp.training.preflight.check_run` checks that after comparing the configs); a fresh run
    must not clobber one; the directory must be creatable and writable. Returns the checkpoint a
    resume starts from (damaged newer ones are reported through ``warn``). Model shape and data are
    checked by :func:`csbp.training.preflight.check_run`."""
    check_writable_directory(run_dir, "--run-dir")
    check_final_replaceable(run_dir)
    if not resume:
        check_new_run_dir(run_dir)
        existing = step_directories(Path(run_dir) / "checkpoints")
        if existing or has_checkpoints(run_dir):
            name = existing[0].name if existing else "checkpoints/latest"
            raise ValueError(
                f"run directory {run_dir} already holds checkpoint {name} (fix: pass --resume to continue it, "
                "or choose another --run-dir / run.name)"
            )
        return None
    latest = find_resume_checkpoint(run_dir, warn=warn)
    if latest is None:
        raise ValueError(
            f"--resume: {run_dir} has no checkpoint to resume from (fix: drop --resume, or pass the run "
            "directory of an earlier run with --run-dir)"
        )
    if stop_step is not None:
        check_steps_left(latest, read_training_state(latest).step, stop_step)
    return latest


def check_steps_left(checkpoint: Path, step: int, stop_step: int, cfg: RunConfig | None = None) -> None:
    """``ValueError`` when a resume from ``checkpoint`` (at ``step``) has nothing to train before
    ``stop_step``; when the run's ``final/`` is missing too (the run was stopped after its last
    checkpoint, while exporting), the fix names the command that writes it from that checkpoint."""
    if step < stop_step:
        return
    done = f"--resume: {checkpoint} is at step {step}, nothing is left to do before step {stop_step}"
    final = Path(checkpoint).parent.parent / "final"
    if os.path.lexists(final):
        raise ValueError(f"{done} (fix: raise --max-steps or train.max_steps)")
    dflash = cfg.objective.dflash if cfg is not None and cfg.objective.name == "dflash" else None
    export = (
        f"csbp export {final.parent} --out {final}"
        if dflash is None
        else f"csbp dflash export --checkpoint {checkpoint} --target {dflash.target} --out {final}"
    )
    raise ValueError(
        f"{done}, but {final} is missing: the run stopped after its last checkpoint, before its export was "
        f"written (fix: {export}; or raise --max-steps or train.max_steps to train longer)"
    )


RUN_DIR_ENTRIES = frozenset(
    {
        "config.yaml", "metrics.jsonl", "tb", "checkpoints", "final", "loss.png", LOCK_FILE,
        "budget_state.json", "result.json",
    }
)
"""What a run writes into its directory (``csbp compare`` adds the last two; ``.lock`` is left by a
killed run, :mod:`csbp.training.run_lock`)."""


def foreign_run_entry(run_dir: Path) -> str | None:
    """The first entry of ``run_dir`` that a csbp run does not write (temporary files of an
    interrupted write of one of them count as the run's, as does the write probe of another rank
    checking the directory the launcher's lock created), or None (also when ``run_dir`` is absent)."""
    if not Path(run_dir).is_dir():
        return None
    for entry in sorted(Path(run_dir).iterdir()):
        if entry.name.startswith(WRITE_PROBE_PREFIX):
            continue
        written = entry.name.lstrip(".").split(".tmp")[0].split(".old-")[0]
        if entry.name not in RUN_DIR_ENTRIES and written not in RUN_DIR_ENTRIES:
            return entry.name
    return None


def check_new_run_dir(run_dir: Path, flag: str = "--run-dir") -> None:
    """``ValueError`` unless a fresh run may write into ``run_dir``: it is absent, empty or holds only
    what a csbp run writes (so a data artifact, a model directory, a home directory are refused)."""
    foreign = foreign_run_entry(run_dir)
    if foreign is not None:
        raise ValueError(
            f"{flag} {run_dir}: holds '{foreign}', which a csbp run does not write; a new run starts in an "
            "empty directory or one an earlier run wrote (fix: choose another directory, e.g. a new one under runs/)"
        )


def check_final_replaceable(run_dir: Path) -> None:
    """``ValueError`` unless the run's export at its end may replace ``run_dir/final`` (absent, or
    a directory of csbp's export files): found before training, not after it."""
    final = Path(run_dir) / "final"
    if not os.path.lexists(final):
        return
    if final.is_symlink() or not final.is_dir():
        what = "a symbolic link" if final.is_symlink() else "not a directory"
    else:
        foreign = EXPORT_OWNERSHIP.foreign_entry(final)
        what = None if foreign is None else f"a directory csbp did not write (it has {foreign})"
    if what is not None:
        raise ValueError(
            f"--run-dir {run_dir}: {final} is {what}, which the run's export at the end would have to replace "
            "(fix: move it away, or choose another --run-dir)"
        )


def check_writable_directory(path: Path, flag: str) -> None:
    """``ValueError`` unless ``path`` is a directory, or can be created as one, that this user may
    write (nothing is left behind)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path}: exists and is not a directory (fix: choose another path)")
    problem = unwritable_reason(path)
    if problem is not None:
        raise ValueError(f"{flag} {path}: {problem} (fix: choose a directory you can write)")
