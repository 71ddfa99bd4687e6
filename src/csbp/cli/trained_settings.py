"""Refuse ``--objective`` / ``--block-size`` flags that differ from what a run trained with.

``csbp generate`` and ``csbp eval`` default to the objective and block size of the run's
``config.yaml`` (next to a ``RUN/final`` export). A flag that names another value would otherwise
silently use the model off its training distribution (another block grid, another attention
pattern or label alignment), so both commands refuse it with one line naming the trained value
and the fix, unless the matching ``--allow-...-change`` flag marks it as a deliberate experiment
(e.g. scoring a bd3-trained model as mdlm, or sampling it with another block size); the command
then notes the change on stderr (:func:`print_notes`, once every other check has passed, so a
refused command still prints one line). A Fast-dLLM v2 release compares against its ``bd_size``
(``csbp.models.hf_release``); other checkpoints without a run config have nothing to compare against.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: (verb, gerund) each command uses in its messages
VERBS = {"generate": ("sample", "sampling"), "eval": ("evaluate", "evaluating")}


def add_override_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """Add ``--allow-objective-change`` and ``--allow-block-size-change`` to ``command``'s parser."""
    verb = VERBS[command][0]
    parser.add_argument(
        "--allow-objective-change",
        action="store_true",
        help=f"{verb} with an --objective other than the one the run trained with (an experiment)",
    )
    parser.add_argument(
        "--allow-block-size-change",
        action="store_true",
        help=f"{verb} with a --block-size other than the one the run trained with (an experiment)",
    )


def check_trained_overrides(
    command: str, args: argparse.Namespace, model_dir: Path, trained: Mapping[str, Any]
) -> list[str]:
    """Refuse ``args.objective`` / ``args.block_size`` other than ``trained``'s unless allowed; the
    notes of the allowed changes, for :func:`print_notes`.

    ``trained`` is the run's settings (``objective``, ``block_size``; empty without a run config).
    """
    config_file = trained.get("source", model_dir.parent / "config.yaml")
    notes = [
        _check_one(command, config_file, "objective", args.objective, trained.get("objective"), args.allow_objective_change),
        _check_one(
            command, config_file, "block size", args.block_size, trained.get("block_size"), args.allow_block_size_change
        ),
    ]
    return [note for note in notes if note is not None]


def print_notes(notes: list[str]) -> None:
    """The allowed changes, one stderr line each."""
    for note in notes:
        print(note, file=sys.stderr)


def _check_one(
    command: str, config_file: Path, what: str, requested: object, trained: object, allowed: bool
) -> str | None:
    if requested is None or trained is None or requested == trained:
        return None
    name = what.replace(" ", "-")
    verb, gerund = VERBS[command]
    if not allowed:
        raise ValueError(
            f"--{name} {requested}: the model was trained with {what} {trained} ({config_file}) "
            f"(fix: drop --{name}, or add --allow-{name}-change to {verb} with another {what})"
        )
    return f"csbp {command}: {gerund} with {what} {requested}, not the trained {trained} ({config_file}; --allow-{name}-change)"
