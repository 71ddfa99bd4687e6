"""``csbp export``: a training checkpoint as a Hugging Face model directory.

Examples::

    csbp export runs/demo/checkpoints/step_0000400 --out models/demo-400
    csbp export runs/demo --out models/demo-latest          # the checkpoint --resume would use
    csbp eval --model models/demo-400 --data artifacts/demo-4k-64

The directory is what the run's ``final/`` would hold at that step (weights in ``model.dtype``,
``config.json`` with the training record ``csbp generate`` and ``csbp eval`` read, the data's
tokenizer files with the chat template, :mod:`csbp.training.export_tokenizer`), written atomically;
see :mod:`csbp.training.export`. DFlash drafters: ``csbp dflash export``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from csbp.cli.options import path_option


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``export``."""
    parser = subparsers.add_parser(
        "export",
        help="export a training checkpoint (RUN/checkpoints/step_N) as a Hugging Face model directory",
        description="Write a training checkpoint's model as a HF checkpoint directory, as the run's final/ "
        "would hold it at that step (for csbp generate, csbp eval, transformers).",
    )
    parser.add_argument("checkpoint", type=path_option, help="RUN/checkpoints/step_N, or a run directory (its latest checkpoint)")
    parser.add_argument("--out", type=path_option, required=True, help="directory to write")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier export at --out")
    parser.add_argument(
        "--weights", choices=("ema", "raw"), default=None,
        help="ema: the weight average of optim.ema_decay; raw: the trained weights (default: ema when the "
        "checkpoint has one, as the run's final/)",
    )
    parser.set_defaults(func=run_export)


LIVE_RUN_TRIES = 3
"""Exports of a run directory's newest checkpoint tried while the live run prunes each one under it."""


def run_export(args: argparse.Namespace) -> int:
    from csbp.training.export import CheckpointVanished, export_checkpoint

    checkpoint: Path = args.checkpoint
    if not checkpoint.is_dir():
        raise ValueError(f"{checkpoint} is not a directory (fix: pass RUN/checkpoints/step_N or a run directory)")
    is_run = not (checkpoint / "trainer_state.json").is_file()
    for attempt in range(1, LIVE_RUN_TRIES + 1):
        chosen = _newest_checkpoint(checkpoint) if is_run else checkpoint
        try:
            out, cfg, step = export_checkpoint(
                chosen, args.out, overwrite=args.overwrite, warn=lambda line: print(line, file=sys.stderr),
                weights=args.weights,
            )
            break
        except CheckpointVanished:
            if not is_run or attempt == LIVE_RUN_TRIES:
                raise
            print(f"note: {chosen.name} was pruned by its run while it was read; exporting the newest again",
                  file=sys.stderr)
    print(f"exported {chosen} (run {cfg.run.name}, step {step}, {cfg.objective.name}) -> {out}")
    return 0


def _newest_checkpoint(run_or_checkpoints: Path) -> Path:
    """The checkpoint ``--resume`` would take in a run directory (or its ``checkpoints/``)."""
    from csbp.training.checkpoint_integrity import find_resume_checkpoint

    run_dir = run_or_checkpoints.parent if run_or_checkpoints.name == "checkpoints" else run_or_checkpoints
    latest = find_resume_checkpoint(
        run_dir, warn=lambda line: print(line, file=sys.stderr), caller="export",
        fix="restore the files, or export another run's checkpoint",
    )
    if latest is None:
        raise ValueError(
            f"{run_or_checkpoints} holds no training checkpoint (fix: pass RUN/checkpoints/step_N, or a run directory "
            "with checkpoints/)"
        )
    return latest
