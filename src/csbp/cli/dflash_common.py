"""What the ``csbp dflash`` commands share: the model dtypes they accept, how they read and load the
frozen target (refusing a run directory or a drafter in its place), the check that an artifact was
tokenized with the target's tokenizer, and the note printed for a drafter trained with inclusive context."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from csbp.data.artifact import Artifact
    from csbp.models.decoder import Decoder, DecoderConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
INCLUSIVE_NOTE = (
    "note: drafter {drafter} was trained with objective.dflash.context: inclusive (context up to and including "
    "the anchor); csbp dflash eval and every DFlash serving loop draft with context strictly before the anchor, "
    "so its acceptance carries that train/serve mismatch (its config.json records it under csbp_training)"
)


def read_target_config(path: Path) -> DecoderConfig:
    """``--target``'s config (no weights read), refusing in one line with its fix the two likely slips: a
    run directory (its export is ``RUN/final``) and a drafter export passed as the target (the two swapped)."""
    from csbp.dflash.export import ARCHITECTURES
    from csbp.models.hf_io import read_hf_config, read_json_object
    from csbp.training.input_hints import checkpoint_directory_fix

    if not path.is_dir():
        raise ValueError(f"--target {path} is not a directory; pass a HF checkpoint directory")
    if not (path / "config.json").is_file():
        fix = checkpoint_directory_fix(path, "pass the target model's HF checkpoint directory")
        raise ValueError(f"--target {path} is not a HF checkpoint directory: config.json not found (fix: {fix})")
    architectures = read_json_object(path / "config.json").get("architectures")
    if isinstance(architectures, list) and any(name in ARCHITECTURES for name in architectures):
        raise ValueError(
            f"--target {path} is a DFlash drafter ({', '.join(map(str, architectures))}), not the model it drafts "
            "for (fix: pass it as --drafter, and its target's HF checkpoint directory as --target)"
        )
    try:
        return read_hf_config(path)
    except ValueError as exc:
        raise ValueError(f"--target {path}: {exc}") from None


def require_drafter_directory(path: Path) -> None:
    """``ValueError`` unless ``--drafter`` is a directory holding a ``config.json``; a training run's directory
    (or one of its checkpoints) gets the fix naming its export."""
    if not path.is_dir():
        raise ValueError(f"--drafter {path} is not a directory; pass a csbp dflash export directory")
    if (path / "config.json").is_file():
        return
    if (path / "final" / "config.json").is_file():
        fix = f"it is a run directory: pass its export, --drafter {path / 'final'}"
    elif (path / "checkpoints").is_dir():
        fix = f"it is a run directory without final/: export it first, csbp dflash export --run-dir {path} --out DIR"
    elif (path / "trainer_state.json").is_file():
        fix = f"it is a training checkpoint: export it first, csbp dflash export --checkpoint {path} --out DIR"
    else:
        fix = "pass a csbp dflash export directory, such as a dflash run's RUN/final"
    raise ValueError(f"--drafter {path} is not a DFlash drafter directory: config.json not found (fix: {fix})")


def load_target(path: Path, args: argparse.Namespace, *, device: str | None = None) -> Decoder:
    """The target of ``--target`` in ``args.model_dtype`` (auto: as stored) on ``device``, else ``args.device``,
    else cuda when available (``ValueError``, from ``read_target_config``, when ``path`` holds no target)."""
    from csbp.models.hf_io import load_hf_checkpoint

    read_target_config(path)
    dtype = None if getattr(args, "model_dtype", "auto") == "auto" else DTYPES[args.model_dtype]
    device = device or getattr(args, "device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
    target, _ = load_hf_checkpoint(path, dtype=dtype, device=device)
    return target.eval()


def require_target_tokenizer(target_dir: Path, artifact: Artifact) -> None:
    """As ``csbp train`` checks a dflash run's data: ``--data`` must be tokenized with ``--target``'s
    ``tokenizer.json`` (when it ships one), or its prompts and features are other tokens."""
    from csbp.training.dflash_inputs import check_target_tokenizer

    try:
        check_target_tokenizer(target_dir, artifact)
    except ValueError as exc:
        raise ValueError(
            f"--data: {exc} (fix: pass the artifact prepared with the target's tokenizer, or prepare it with "
            f"csbp data prepare --tokenizer {target_dir})"
        ) from None
