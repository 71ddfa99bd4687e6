"""The end of a run: ``RUN/final`` (a Hugging Face checkpoint with the tokenizer, or the public DFlash
drafter format) and, with ``train.generate_after``, one sample; both on rank 0, after every rank
took part in gathering an FSDP-sharded model."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from csbp.config.schema import RunConfig
from csbp.dflash.drafter import DFlashDrafter
from csbp.training.drafter import export_drafter
from csbp.training.export import export_decoder
from csbp.training.parallelize import full_model_state, unwrapped_copy
from csbp.training.preflight import RunInputs
from csbp.training.sample import sample_after_training

FINAL_DIR = "final"


def finish_on_rank0(
    cfg: RunConfig, inputs: RunInputs, model: torch.nn.Module, run_dir: Path, *, is_rank0: bool,
    weights: dict | None = None,
) -> tuple[Path | None, str | None]:
    """Export ``<run_dir>/final/`` (HF config, safetensors, tokenizer; dflash: the public drafter
    format) and, with ``train.generate_after``, draw a sample; both on rank 0. Call on every rank
    (FSDP gathers)."""
    path: Path | None = None
    sample: str | None = None
    if inputs.dflash is not None:
        assert isinstance(model, DFlashDrafter)
        if is_rank0:
            path = export_drafter(cfg, inputs.dflash, model, run_dir / FINAL_DIR, tokenizer=inputs.tokenizer)
        if dist.is_initialized():
            dist.barrier()
        return path, None
    state = full_model_state(model)
    if is_rank0:
        cpu_model = unwrapped_copy(state, inputs.decoder_config)
        path = export_decoder(cfg, inputs, cpu_model, run_dir / FINAL_DIR, overwrite=True, weights=weights)
        if cfg.train.generate_after:
            sample = sample_after_training(cfg, inputs, cpu_model, path)
    if dist.is_initialized():
        dist.barrier()
    return path, sample
