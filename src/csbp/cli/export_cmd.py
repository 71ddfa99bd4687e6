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


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``export``."""
    parser = subparsers.add_parser(
        "export",
        help="export a training checkpoint (RUN/checkpoints/step_N) as a Hugging Face model directory",
        description="Write a training checkpoint's model as a HF checkpoint directory, as the run's final/ "
        "would hold it at that step (for csbp generate, csbp eval, transformers).",
    )
    parser.add_argument("checkpoint", type=Path, help="RUN/checkpoints/step_N, or a run directory (its latest checkpoint)")
    parser.add_argument("--out", type=Path, required=True, help="directory to write")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier export at --out")
    parser.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    from csbp.training.checkpoint_integrity import find_resume_checkpoint
    from csbp.training.export import export_checkpoint

    checkpoint: Path = args.checkpoint
    if not checkpoint.is_dir():
        raise ValueError(f"{checkpoint} is not a directory (fix: pass RUN/checkpoints/step_N or a run directory)")
    if not (checkpoint / "trainer_state.json").is_file():
        run_dir = checkpoint.parent if checkpoint.name == "checkpoints" else checkpoint
        latest = find_resume_checkpoint(
            run_dir, warn=lambda line: print(line, file=sys.stderr), caller="export",
            fix="restore the files, or export another run's checkpoint",
        )
        if latest is None:
            raise ValueError(
                f"{checkpoint} holds no training checkpoint (fix: pass RUN/checkpoints/step_N, or a run directory "
                "with checkpoints/)"
            )
        checkpoint = latest
    out, cfg, step = export_checkpoint(
        checkpoint, args.out, overwrite=args.overwrite, warn=lambda line: print(line, file=sys.stderr)
    )
    print(f"exported {checkpoint} (run {cfg.run.name}, step {step}, {cfg.objective.name}) -> {out}")
    return 0
