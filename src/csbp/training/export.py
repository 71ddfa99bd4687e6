"""Hugging Face exports of a trained decoder: the run's ``final/`` and any training checkpoint.

:func:`export_decoder` writes what ``RUN/final`` holds (``config.json`` with the checkpoint's
passthrough fields, the special token ids and the ``csbp_training`` record that ``csbp generate`` /
``csbp eval`` read, and a ``max_position_embeddings`` of at least ``data.seq_len``, the positions the
run trained at, which ``csbp generate`` and ``csbp dflash eval`` stay within (under YaRN it is ``factor x
original``, the extended context, so a rule that does not cover ``data.seq_len`` is refused:
:func:`csbp.training.model_factory.check_yarn_context`); ``model.safetensors`` in ``model.dtype``; ``generation_config.json``; the
tokenizer files). ``generation_config.json`` is the ``model.init_from`` checkpoint's (its sampling
defaults kept) with the run's ``bos``/``eos``/``pad`` ids (an ``eos_token_id`` list there that holds
the run's EOS, a chat model's end-of-turn id with it, is kept), and with the ``eos_token`` of the
exported ``tokenizer_config.json`` added to ``eos_token_id`` when it is another token: ``config.json``'s
``eos_token_id`` is the data's EOS (the document separator the model learnt to end documents with),
while a chat tokenizer keeps its own ``eos_token`` (``<|im_end|>``, what chat pipelines stop a turn
at), so ``generate`` stops at either, as it did for the ``model.init_from`` checkpoint. Plus for the block-diffusion
objectives how ``csbp generate`` samples the model (``csbp_block_diffusion``,
:func:`csbp.generation.run_settings.sampling_record_of`). The tokenizer files are those
:mod:`csbp.training.export_tokenizer` resolved with the run's inputs: the data's ``tokenizer.json``
with the ``tokenizer_config.json``, special-token map and chat template of the directory that holds
it, so that ``AutoTokenizer.from_pretrained`` on the export is the data's tokenizer.

:func:`export_checkpoint` does the same for a checkpoint directory ``RUN/checkpoints/step_N`` (``csbp
export``), so an intermediate step can be sampled, scored or shared: the run config comes from the
checkpoint's ``trainer_state.json``, the model shape is re-derived from it and its data artifact
(checked as ``csbp train`` checks them), and only the model's tensors are read from the DCP files
(through the restricted reader of :mod:`csbp.training.checkpoint_integrity`: nothing is unpickled
beyond DCP's metadata classes). It runs in one process whatever topology or FSDP sharding wrote the
checkpoint. DFlash drafters have their own format: ``csbp dflash export --checkpoint``.

Neither writes into the run's ``checkpoints/``, nor any run's (:func:`check_out_outside_checkpoints`): a directory
there named like a step would be taken for the newest checkpoint (damaged: a warning on every
``--resume``) and counted by checkpoint pruning, which would then delete a real checkpoint in its
place.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from csbp.config import ConfigError, config_from_dict
from csbp.config.loading import read_yaml_text
from csbp.config.schema import RunConfig
from csbp.generation.run_settings import EXPORT_KEY, SAMPLING_KEY, sampling_record_of, training_record_of
from csbp.models.decoder import Decoder
from csbp.models.hf_config import DEFAULT_MAX_POSITIONS
from csbp.models.hf_io import export_hf_checkpoint, hf_passthrough_config, read_generation_config
from csbp.training.checkpoint import read_training_state
from csbp.training.checkpoint_integrity import checkpoint_problem, read_metadata, safe_dcp_load
from csbp.training.model_factory import check_yarn_context, export_dtype
from csbp.training.preflight import RunInputs, check_run
from csbp.training.weight_average import EMA_KEY, WEIGHTS_KEY, weights_record


def export_decoder(
    cfg: RunConfig, inputs: RunInputs, model: Decoder, out: Path, *, overwrite: bool, weights: dict | None = None
) -> Path:
    """Write ``model`` (a plain CPU decoder) as a HF checkpoint directory ``out`` (see the module); ``weights``:
    which weights of a run with a weight average it holds (:func:`csbp.training.weight_average.weights_record`)."""
    check_yarn_context(cfg, inputs.decoder_config)  # a run from before the check: its export is refused
    extra = hf_passthrough_config(cfg.model.init_from) if cfg.model.init_from is not None else {}
    limit = extra.get("max_position_embeddings")
    if (limit if type(limit) is int else DEFAULT_MAX_POSITIONS) < cfg.data.seq_len:  # trained there: admit it
        extra["max_position_embeddings"] = cfg.data.seq_len
    special = inputs.artifact.special_ids
    extra.update(eos_token_id=special["eos"], pad_token_id=special["pad"])
    if inputs.mask_token_id is not None:
        extra["mask_token_id"] = inputs.mask_token_id
    extra[EXPORT_KEY] = training_record_of(cfg, inputs.mask_token_id, eos_token_id=special["eos"])
    if weights is not None:
        extra[WEIGHTS_KEY] = weights
    return export_hf_checkpoint(
        model,
        inputs.decoder_config,
        out,
        dtype=export_dtype(cfg),
        extra_config=extra,
        tokenizer_files=inputs.tokenizer.files,
        generation_config=generation_config_of(cfg, inputs, extra),
        overwrite=overwrite,
    )


def generation_config_of(cfg: RunConfig, inputs: RunInputs, hf_config: dict[str, Any]) -> dict[str, Any]:
    """The export's ``generation_config.json`` (module docstring); ``hf_config``: its ``config.json``
    token-id fields."""
    base = read_generation_config(cfg.model.init_from) if cfg.model.init_from is not None else None
    generation = {key: value for key, value in (base or {}).items() if key != "transformers_version"}
    eos = hf_config["eos_token_id"]
    listed = generation.get("eos_token_id")
    stops = list(listed) if isinstance(listed, list) and eos in listed else [eos]
    turn_end = inputs.tokenizer.eos_id  # the exported tokenizer's eos_token (a chat model's <|im_end|>)
    if turn_end is not None and turn_end not in stops:
        stops.append(turn_end)
    keep_list = isinstance(listed, list) or len(stops) > 1
    generation.update(eos_token_id=stops if keep_list else eos, pad_token_id=hf_config["pad_token_id"])
    if hf_config.get("bos_token_id") is not None:
        generation["bos_token_id"] = hf_config["bos_token_id"]
    sampling = sampling_record_of(cfg, inputs.mask_token_id)
    if sampling is not None:
        generation[SAMPLING_KEY] = sampling
    return generation


def checkpoint_config(checkpoint: Path) -> RunConfig:
    """The run config recorded in checkpoint directory ``checkpoint`` (one-line ``ValueError``)."""
    state_file = checkpoint / "trainer_state.json"
    if not state_file.is_file():
        raise ValueError(
            f"{checkpoint} is not a training checkpoint (no trainer_state.json) "
            "(fix: pass RUN/checkpoints/step_N, or a run directory)"
        )
    problem = checkpoint_problem(checkpoint)
    if problem is not None:
        raise ValueError(
            f"{problem}; the checkpoint is damaged (fix: restore its files, or export another checkpoint; "
            "csbp export RUN takes the run's newest intact one)"
        )
    text = read_training_state(checkpoint).config_yaml
    try:
        loaded = read_yaml_text(text, source=str(state_file)) if text else None
    except ConfigError:
        loaded = None
    if not isinstance(loaded, dict):
        raise ValueError(f"{state_file}: no run config recorded (config_yaml); the checkpoint is damaged")
    try:
        return config_from_dict(loaded, source=str(state_file))
    except ConfigError as exc:
        raise ValueError(f"{exc.lines[0]} (written by another csbp version?)") from None


def export_checkpoint(
    checkpoint: Path,
    out: Path,
    *,
    overwrite: bool = False,
    warn: Callable[[str], None] | None = None,
    weights: str | None = None,
) -> tuple[Path, RunConfig, int]:
    """Export the decoder of training checkpoint ``checkpoint`` to ``out``; returns ``(out, run
    config, step)``. Everything is checked before ``out`` is written; ``warn`` receives what the
    export lacks (a tokenizer directory that is gone: :mod:`csbp.training.export_tokenizer`).
    ``weights``: ``ema`` (the weight average of ``optim.ema_decay``) or ``raw`` (the trained weights);
    None: the average when the checkpoint has one, as the run's ``final/`` does."""
    check_out_outside_checkpoints(out, checkpoints_dir_of(checkpoint))
    try:
        return _export_checkpoint(checkpoint, out, overwrite=overwrite, warn=warn, weights=weights)
    except (ValueError, OSError) as exc:
        if checkpoint.is_dir():
            raise
        raise CheckpointVanished(
            f"{checkpoint} was deleted while it was read: its run pruned it (train.keep_checkpoints) "
            "(fix: export a checkpoint the run keeps, or export RUN: its newest)"
        ) from exc


class CheckpointVanished(ValueError):
    """The checkpoint being exported was deleted under the export (a live run's pruning)."""


def _export_checkpoint(
    checkpoint: Path, out: Path, *, overwrite: bool, warn: Callable[[str], None] | None, weights: str | None
) -> tuple[Path, RunConfig, int]:
    cfg = checkpoint_config(checkpoint)
    state = read_training_state(checkpoint)  # before anything is published: the checkpoint may go
    step, averaged = state.step, state.ema_updates is not None
    if cfg.objective.name == "dflash":
        raise ValueError(
            f"{checkpoint} is a DFlash drafter checkpoint (fix: csbp dflash export --checkpoint {checkpoint} "
            f"--target {cfg.objective.dflash.target if cfg.objective.dflash else 'TARGET'} --out DIR)"
        )
    if weights not in (None, "ema", "raw"):
        raise ValueError(f"--weights {weights}: not one of ema, raw")
    if weights == "ema" and not averaged:
        raise ValueError(f"--weights ema: {checkpoint} has no weight average (its run had no optim.ema_decay) "
                         "(fix: drop --weights, or pass --weights raw)")
    _check_inputs_exist(cfg)
    inputs = check_run(cfg, check_device=False, warn=warn)
    model = Decoder(inputs.decoder_config, device="meta")
    metadata = read_metadata(checkpoint).state_dict_metadata
    entries = model.state_dict(keep_vars=True)
    loaded = {"model": _template(checkpoint, metadata, "model", entries)}
    parameters = dict(model.named_parameters())  # a tied LM head is named once, as the embedding
    if weights != "raw" and averaged:  # the average replaces every trained parameter
        loaded[EMA_KEY] = _template(checkpoint, metadata, EMA_KEY, parameters)
    safe_dcp_load(loaded, checkpoint, no_dist=True)
    if EMA_KEY in loaded:  # every state-dict entry of an averaged parameter, a tied head's alias too
        owner = {id(param): name for name, param in parameters.items()}
        loaded["model"].update({key: loaded[EMA_KEY][owner[id(entry)]] for key, entry in entries.items()
                                if id(entry) in owner})
    model.load_state_dict(loaded["model"], strict=True, assign=True)
    record = None
    if state.ema_updates is not None and cfg.optim.ema_decay is not None:
        record = weights_record(EMA_KEY in loaded, cfg.optim.ema_decay, state.ema_updates)
    path = export_decoder(cfg, inputs, model, out, overwrite=overwrite, weights=record)
    return path, cfg, step


def _template(checkpoint: Path, metadata: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Empty tensors to load ``prefix.<name>`` into, each checked against the checkpoint's metadata."""
    template: dict[str, torch.Tensor] = {}
    for name, param in tensors.items():
        stored = metadata.get(f"{prefix}.{name}")
        size = getattr(stored, "size", None)
        if size is None or tuple(size) != tuple(param.shape):
            raise ValueError(
                f"{checkpoint}: tensor '{prefix}.{name}' is {'missing' if size is None else f'of shape {list(size)}'}, "
                f"the run config implies {list(param.shape)} (the checkpoint does not match its trainer_state.json)"
            )
        template[name] = torch.empty(tuple(size), dtype=stored.properties.dtype)
    return template


def _check_inputs_exist(cfg: RunConfig) -> None:
    """One line naming a recorded input that is gone: the export reads the data artifact (tokenizer files,
    special and mask ids) and ``model.init_from`` (config fields, generation config), and no export flag
    can point it elsewhere (``csbp train``'s own line names fixes for a config)."""
    needed = (
        ("model.init_from", cfg.model.init_from, "trained from", "its config.json fields and generation_config.json"),
        ("data.train", cfg.data.train, "trained on", "the tokenizer and special token ids of its data"),
        ("data.val", cfg.data.val, "validated on", "the validation split it checks with the run's other inputs"),
        ("data.tokenizer", cfg.data.tokenizer, "tokenized with", "the tokenizer files it ships"),
    )
    for field, path, verb, what in needed:
        if path is not None and not Path(path).exists():
            raise ValueError(
                f"{field}: {path}, which the run was {verb}, is gone; csbp export reads {what} from it "
                f"(fix: restore it at {path} (a copy with the same contents will do), then export again)"
            )


def checkpoints_dir_of(checkpoint: Path) -> Path:
    """The directory whose checkpoints ``checkpoint`` is one of (``RUN/checkpoints``), else itself."""
    return checkpoint.parent if checkpoint.parent.name == "checkpoints" else checkpoint


def check_out_outside_checkpoints(out: Path, root: Path | None = None) -> None:
    """One-line ``ValueError`` when export directory ``out`` is ``root`` (the exported run's
    ``checkpoints/``) or inside it, or inside any run's ``checkpoints/`` (a directory of that name
    holding a ``latest`` pointer) (module docstring); checked on the resolved paths before any work."""
    resolved = Path(os.path.realpath(out))
    roots = [Path(os.path.realpath(root))] if root is not None else []
    roots += [a for a in resolved.parents if a.name == "checkpoints" and (a / "latest").is_file()]
    for inside in roots:
        if resolved == inside or inside in resolved.parents:
            raise ValueError(
                f"--out {out}: is inside {inside}, which holds a run's checkpoints; an export there would be taken "
                f"for a (damaged) checkpoint and checkpoint pruning could delete a real one in its place (fix: "
                f"choose a directory outside {inside}, e.g. {inside.parent / 'exports' / out.name})"
            )
