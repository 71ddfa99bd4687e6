"""The model a dflash run trains: a DFlash drafter on its frozen target, and its ``final/`` export.

The target is loaded from its local checkpoint directory (``load_hf_checkpoint``; safetensors only)
in the run's master dtype and frozen; the drafter holds it by reference, so the drafter's
``parameters()`` (what AdamW, gradient averaging and the checkpoints see) are the drafter's own.
The drafter's weights are drawn by ``DFlashDrafter(..., seed=run.seed)``, or, with
``objective.dflash.init_from``, are that drafter directory's (:mod:`csbp.training.dflash_init`; a resume
then restores its checkpoint's over them).

``final/`` is the public DFlash drafter format (``export_dflash``: ``config.json`` with
``architectures: ["DFlashDraftModel"]`` and the run's context convention under ``csbp_training``,
``model.safetensors`` without the shared embedding and LM head) plus the tokenizer files of the
data (:mod:`csbp.training.export_tokenizer`: the target's directory supplies them when it holds the
data's tokenizer).
"""

from __future__ import annotations

from pathlib import Path

import torch

from csbp.config.schema import RunConfig
from csbp.dflash.drafter import DFlashDrafter
from csbp.dflash.export import export_dflash, recorded_max_positions
from csbp.dflash.target_record import target_record
from csbp.models.hf_io import load_hf_checkpoint
from csbp.training.dflash_init import load_init_weights
from csbp.training.dflash_inputs import DFlashInputs
from csbp.training.export_tokenizer import ExportTokenizer
from csbp.training.model_factory import export_dtype, master_dtype


def build_drafter(
    cfg: RunConfig, inputs: DFlashInputs, *, device: torch.device, resume: bool = False
) -> DFlashDrafter:
    """The seeded drafter in its master dtype on ``device``, attached to the frozen target; with
    ``objective.dflash.init_from`` (and not ``resume``, whose checkpoint replaces them) its weights."""
    dtype = master_dtype(cfg)
    target, loaded = load_hf_checkpoint(inputs.target_dir, dtype=dtype, device=device)
    if loaded != inputs.target_config:
        raise ValueError(
            f"objective.dflash.target: {inputs.target_dir} changed while the run was starting "
            "(fix: do not modify the target during training)"
        )
    target.eval()
    drafter = DFlashDrafter(inputs.drafter_config, target=target, dtype=dtype, device=device, seed=cfg.run.seed)
    if inputs.init_dir is not None and not resume:
        load_init_weights(drafter, inputs.init_dir)
    return drafter


def export_drafter(
    cfg: RunConfig, inputs: DFlashInputs, drafter: DFlashDrafter, path: Path, *, tokenizer: ExportTokenizer
) -> Path:
    """Write ``path`` in the public DFlash format (``model.dtype``) with ``tokenizer``'s files."""
    return export_dflash(
        drafter,
        path,
        dtype=export_dtype(cfg),
        overwrite=True,
        tokenizer_files=tokenizer.files,
        context=inputs.objective.context,
        seq_len=cfg.data.seq_len,
        target_positions=recorded_max_positions(inputs.target_dir),
        target=target_record(inputs.target_dir),
    )


def dflash_eval_hint(cfg: RunConfig, run_dir: Path) -> str:
    """How to measure the exported drafter's acceptance length (printed instead of a sample)."""
    target = cfg.objective.dflash.target if cfg.objective.dflash is not None else "TARGET"
    return (
        f"measure the drafter with `csbp dflash eval --target {target} --drafter {run_dir / 'final'} "
        f"--data {cfg.data.train}`"
    )
