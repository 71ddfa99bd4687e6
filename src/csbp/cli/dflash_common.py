"""What the ``csbp dflash`` commands share: the model dtypes they accept, how they load the frozen
target, the check that an artifact was tokenized with the target's tokenizer, and the note printed for
a drafter trained with inclusive context."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from csbp.data.artifact import Artifact
    from csbp.models.decoder import Decoder

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
INCLUSIVE_NOTE = (
    "note: drafter {drafter} was trained with objective.dflash.context: inclusive (context up to and including "
    "the anchor); csbp dflash eval and every DFlash serving loop draft with context strictly before the anchor, "
    "so its acceptance carries that train/serve mismatch (its config.json records it under csbp_training)"
)


def load_target(path: Path, args: argparse.Namespace, *, device: str | None = None) -> Decoder:
    """The target of ``--target`` in ``args.model_dtype`` (auto: as stored) on ``device``, else ``args.device``,
    else cuda when available (``ValueError`` when ``path`` is no directory)."""
    from csbp.models.hf_io import load_hf_checkpoint

    if not path.is_dir():
        raise ValueError(f"--target {path} is not a directory; pass a HF checkpoint directory")
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
