"""Everything ``csbp train`` checks before any process starts or any weight is built.

:func:`check_run` opens the data artifacts (manifests and file sizes only), resolves the decoder
shape and the objective, and checks what the config schema cannot see on its own:

* the artifact's ``seq_len`` equals ``data.seq_len``; a configured tokenizer has the artifact's
  fingerprint; a validation artifact matches the training one;
* every token id of the data is an embedding row (the largest id the manifest records, vouched for
  by the content fingerprint that :func:`verify_data` recomputes before a launch); the
  mask token is a vocabulary id, no other special token of the data, and not at a supervised
  position (:mod:`csbp.training.mask_data`);
* the objective runs on the topology (``mdlm``/``ar`` are single-stream: ``cp = bp = 1``) and its
  options map onto the objective; ``dflash`` runs are checked against their target and data by
  :mod:`csbp.training.dflash_inputs`;
* under YaRN (the run's, its checkpoint's or a dflash target's), ``factor x original`` is a whole
  number of at least ``data.seq_len``, the ``max_position_embeddings`` the export writes
  (:func:`csbp.training.model_factory.check_yarn_context`); without YaRN, a dflash target whose
  ``max_position_embeddings`` is below ``data.seq_len`` is refused, an ``init_from`` checkpoint's
  warned about (:func:`csbp.training.model_factory.check_position_limit`);
* there are enough rows for one global batch, and validation rows when ``eval_every > 0``;
* FSDP has a data-parallel group to shard over;
* the run directory: it can be created and written; ``--resume`` needs an intact checkpoint there
  (damaged newer ones are skipped with a warning), written for the same model shape and data, under
  a config that differs only where a resume may differ (:mod:`csbp.training.resume_config`) and, for
  dflash, the target layers it trained with (:mod:`csbp.training.dflash_layers`); a fresh run must not overwrite one, and starts only in an empty directory or one holding nothing but
  what a csbp run writes (never a data artifact, a model or the working directory with other files).
  Nothing is written into it here.

Every problem is a ``ValueError`` with one line ``field: message (fix: ...)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from csbp.attention.backends import check_backend_trains_on
from csbp.attention.flex_backward import resolve_flex_backward
from csbp.config.schema import ObjectiveSection, RunConfig
from csbp.data.artifact import SPLITS, Artifact, ArtifactSplit, max_token_id, open_artifact
from csbp.models.config import DecoderConfig
from csbp.models.decoder import Decoder
from csbp.objectives import build_objective
from csbp.objectives.base import Objective
from csbp.training.checkpoint import (
    check_compatible,
    param_shapes,
    read_training_state,
)
from csbp.training.dflash_inputs import DFlashInputs, check_dflash_inputs
from csbp.training.dflash_layers import check_resumed_layer_ids
from csbp.training.export_tokenizer import ExportTokenizer, check_data_tokenizer, export_tokenizer_for_run
from csbp.training.input_hints import is_artifact, missing_artifact_problem
from csbp.training.mask_data import check_mask_token_data, run_mask_token
from csbp.training.model_factory import check_position_limit, check_yarn_context, decoder_config_for_run
from csbp.training.resume_config import resume_changes, resume_restart_for
from csbp.training.run_dir_checks import check_run_dir, check_steps_left

NOISE_SCHEMES = {"rotated": "rotated_lattice", "stratified": "stratified"}
TRAINABLE_OBJECTIVES = ("bd3", "fast_dllm_v2", "mdlm", "ar", "dflash")


@dataclass(frozen=True)
class RunInputs:
    """What a validated run resolves to.

    Attributes:
        artifact: the training artifact (memory-maps open lazily).
        val_split: rows used for validation, or None when there are none.
        decoder_config: the model shape (dflash: the frozen target's).
        mask_token_id: the ``[MASK]`` id (config, else the artifact's manifest); None for ``ar``.
        objective_name, objective_options: ``build_objective(name, **options)`` arguments (empty
            for dflash, whose objective is ``dflash.objective``).
        tokenizer: the tokenizer files exports carry (:mod:`csbp.training.export_tokenizer`).
        dflash: target, drafter and loss of a dflash run; None otherwise.
    """

    artifact: Artifact
    val_split: ArtifactSplit | None
    decoder_config: DecoderConfig
    mask_token_id: int | None
    objective_name: str
    objective_options: dict[str, Any]
    tokenizer: ExportTokenizer
    dflash: DFlashInputs | None = None

    def build_objective(self) -> Objective:
        return build_objective(self.objective_name, **self.objective_options)

    def param_shapes(self) -> dict[str, list[int]]:
        """Shape of every trained parameter by name (the drafter's for dflash)."""
        if self.dflash is not None:
            return self.dflash.param_shapes()
        return param_shapes(Decoder(self.decoder_config, device="meta"))


def check_run(
    cfg: RunConfig,
    *,
    run_dir: Path | None = None,
    resume: bool = False,
    stop_step: int | None = None,
    warn: Callable[[str], None] | None = None,
    check_device: bool = True,
    resume_restart: str | None = None,
) -> RunInputs:
    """Validate ``cfg`` against its data (and ``run_dir`` when given: ``resume`` and the step this
    invocation stops after, default ``train.max_steps``); see the module docstring. ``warn``
    receives non-fatal findings (a damaged newest checkpoint that a resume skips). ``check_device``:
    also refuse an attention backend that cannot train on this machine (off for offline validation).
    ``resume_restart``: the alternative a refused resume's fix offers (:func:`resume_changes`; None:
    ``csbp train``'s)."""
    _check_objective_layout(cfg)
    if check_device:
        backend = check_backend_trains_on(
            cfg.attention.backend, "cuda" if torch.cuda.is_available() else "cpu", float64=cfg.train.precision == "fp64"
        )
        if backend == "flex":
            resolve_flex_backward(cfg.attention.flex_backward)  # direct on a torch that cannot trace it: refused
    artifact = _open_checked(cfg.data.train, "data.train", cfg.data.seq_len)
    if cfg.data.tokenizer is not None:
        check_data_tokenizer(Path(cfg.data.tokenizer), artifact)
    val_split = _val_split(cfg, artifact, warn)
    if cfg.objective.name == "dflash":
        _reject_unread_noise_options(cfg.objective)
        dflash = check_dflash_inputs(cfg, artifact, val_split)
        inputs = RunInputs(
            artifact=artifact,
            val_split=val_split,
            decoder_config=dflash.target_config,
            mask_token_id=dflash.drafter_config.mask_token_id,
            objective_name="dflash",
            objective_options={},
            tokenizer=export_tokenizer_for_run(cfg, artifact, dflash.drafter_config.mask_token_id, warn),
            dflash=dflash,
        )
    else:
        decoder_config = decoder_config_for_run(cfg, artifact)
        mask_token_id = _mask_token_id(cfg, artifact, decoder_config)
        inputs = RunInputs(
            artifact=artifact,
            val_split=val_split,
            decoder_config=decoder_config,
            mask_token_id=mask_token_id,
            objective_name=cfg.objective.name,
            objective_options=_objective_options(cfg, mask_token_id),
            tokenizer=export_tokenizer_for_run(cfg, artifact, mask_token_id, warn),
        )
        inputs.build_objective()  # the objective's own option checks
    target = str(inputs.dflash.target_dir) if inputs.dflash else None
    check_yarn_context(cfg, inputs.decoder_config, target=target)
    check_position_limit(cfg, inputs.decoder_config, target=target, warn=warn)
    _check_token_ids(cfg, inputs)
    check_mask_token_data(cfg, inputs.mask_token_id)
    _check_batches(cfg, inputs, warn)
    if run_dir is not None:
        latest = check_run_dir(run_dir, resume=resume, stop_step=None, warn=warn)
        if resume and latest is not None:
            state = read_training_state(latest)
            # what the config changed first: "nothing left to do" hid a refused change until max_steps rose;
            # its notes are said once every check has passed (a refused resume is one line)
            notes = resume_changes(
                state.config_yaml, cfg, latest, state.step, state.input_fingerprints, restart=resume_restart
            )
            if inputs.dflash is not None:  # the target layers its fc weights were fitted to, as resolved
                restart = resume_restart_for(cfg, resume_restart)
                check_resumed_layer_ids(state, latest, inputs.dflash, restart=restart, warn=notes.append)
            check_compatible(
                state,
                latest,
                shapes=inputs.param_shapes(),
                data_fingerprint=artifact.fingerprint,
            )
            check_steps_left(latest, state.step, stop_step or cfg.train.max_steps, cfg)
            for note in notes if warn is not None else ():
                warn(note)
    return inputs


def _check_objective_layout(cfg: RunConfig) -> None:
    obj, topo = cfg.objective, cfg.topology
    if obj.name not in TRAINABLE_OBJECTIVES:
        raise ValueError(
            f"objective.name: {obj.name} is not trained by csbp train (fix: use one of "
            f"{', '.join(TRAINABLE_OBJECTIVES)})"
        )
    if obj.name in ("mdlm", "ar") and (topo.cp > 1 or topo.bp > 1):
        raise ValueError(
            f"topology: {obj.name} is a single-stream objective with no clean stream to shard, got "
            f"cp={topo.cp} bp={topo.bp} (fix: set cp: 1 and bp: 1 and scale with dp)"
        )


def _open_checked(directory: str, field: str, seq_len: int) -> Artifact:
    path = Path(directory)
    if not is_artifact(path):
        raise ValueError(missing_artifact_problem(path, field))
    artifact = open_artifact(path)
    if artifact.seq_len != seq_len:
        raise ValueError(
            f"data.seq_len: {seq_len} but {field} {path} was packed with seq_len={artifact.seq_len} "
            f"(fix: set data.seq_len: {artifact.seq_len}, or re-run csbp data prepare --seq-len {seq_len})"
        )
    return artifact


def _val_split(cfg: RunConfig, artifact: Artifact, warn: Callable[[str], None] | None = None) -> ArtifactSplit | None:
    """``data.val``'s val split (its train split when the val split is empty), else the train
    artifact's val split; None when there are no rows. ``warn`` hears when that train split is the
    training data itself (``data.val`` naming ``data.train``'s artifact, or a copy of it)."""
    if cfg.data.val is None:
        split = artifact.split("val")
    else:
        val_artifact = _open_checked(cfg.data.val, "data.val", cfg.data.seq_len)
        if val_artifact.tokenizer_fingerprint != artifact.tokenizer_fingerprint:
            raise ValueError(
                f"data.val: {cfg.data.val} was prepared with another tokenizer than data.train "
                "(fix: prepare both with the same tokenizer)"
            )
        split = val_artifact.split("val")
        if split.num_rows == 0:
            split = val_artifact.split("train")
            if warn is not None and val_artifact.fingerprint == artifact.fingerprint:
                warn(
                    f"note: data.val {cfg.data.val} has no val split, so validation scores its train split, which "
                    "is data.train's: the validation loss is measured on the rows it trains on (fix: prepare the "
                    "data with --val-fraction above 0 and drop data.val, or name held-out data)"
                )
    return split if split.num_rows > 0 else None


def _mask_token_id(cfg: RunConfig, artifact: Artifact, decoder_config: DecoderConfig) -> int | None:
    if cfg.objective.name == "ar":
        return None
    mask_id, source = run_mask_token(cfg, artifact)
    if mask_id >= decoder_config.vocab_size:
        raise ValueError(
            f"objective.mask_token_id: {source} is {mask_id}, outside the model vocabulary "
            f"(vocab_size={decoder_config.vocab_size}) (fix: use an id below {decoder_config.vocab_size})"
        )
    return int(mask_id)


# The noise options each objective reads (mdlm's t_max is checked separately: it must be 1).
_NOISE_OPTIONS = ("noise", "t_min", "t_max", "eps")
_READS_NOISE_OPTIONS = {
    "bd3": {"noise", "t_min", "t_max"},
    "mdlm": {"noise", "t_min", "t_max"},
    "fast_dllm_v2": {"eps"},
}


def _reject_unread_noise_options(obj: ObjectiveSection) -> None:
    """A noise option moved off its default for an objective that never reads it fails (it was ignored:
    ``fast_dllm_v2`` with ``t_min``/``t_max``/``noise``, ``bd3``/``mdlm`` with ``eps``, ``ar``/``dflash``)."""
    reads = _READS_NOISE_OPTIONS.get(obj.name, set())
    for name in _NOISE_OPTIONS:
        if name not in reads and getattr(obj, name) != ObjectiveSection.model_fields[name].default:
            uses = ", ".join(sorted(reads)) or "none"
            _reject_unless(False, name, f"{obj.name} never reads it (its noise options: {uses})")


def _objective_options(cfg: RunConfig, mask_token_id: int | None) -> dict[str, Any]:
    """``build_objective`` keywords for ``cfg.objective`` (fail closed on options it cannot honour)."""
    obj = cfg.objective
    _reject_unread_noise_options(obj)
    if obj.name == "ar":
        _reject_unless(obj.denominator == "supervised_tokens", "denominator", "ar normalises by its targets")
        return {}
    if obj.name == "fast_dllm_v2":
        _reject_unless(obj.loss_weight == "unit", "loss_weight", "fast_dllm_v2 uses unit weights")
        _reject_unless(
            obj.denominator == "supervised_tokens",
            "denominator",
            "fast_dllm_v2 normalises by its labelled rows",
        )
        return {"mask_token_id": mask_token_id, "block_size": obj.block_size, "eps": obj.eps}
    common = {
        "mask_token_id": mask_token_id,
        "noise_scheme": NOISE_SCHEMES[obj.noise],
        "loss_weight": obj.loss_weight,
        "denominator": obj.denominator,
    }
    if obj.name == "mdlm":
        _reject_unless(obj.t_max == 1.0, "t_max", "mdlm draws t in [t_min, 1]")
        return {**common, "eps": obj.t_min}
    return {**common, "block_size": obj.block_size, "t_min": obj.t_min, "t_max": obj.t_max, "resample": obj.resample}


def _reject_unless(ok: bool, field: str, reason: str) -> None:
    if not ok:  # its default too: `--set objective.t_min=null` cannot remove a key, and is refused
        default = ObjectiveSection.model_fields[field].default
        default = "null" if default is None else str(default).lower() if isinstance(default, bool) else default
        raise ValueError(
            f"objective.{field}: not supported here, {reason} (fix: remove objective.{field}, or set its default: "
            f"--set objective.{field}={default})"
        )


def _check_token_ids(cfg: RunConfig, inputs: RunInputs) -> None:
    """Every token id of the data (train and validation) is an embedding row of the model."""
    vocab = inputs.decoder_config.vocab_size
    artifacts = [("data.train", inputs.artifact)]
    if cfg.data.val is not None:
        artifacts.append(("data.val", open_artifact(Path(cfg.data.val))))
    for field, artifact in artifacts:
        largest = artifact.max_token_id()
        if largest >= vocab:
            raise ValueError(
                f"{field}: {artifact.directory} holds token id {largest}, outside the model vocabulary "
                f"[0, {vocab}) (fix: re-run csbp data prepare with the model's tokenizer, or raise model.vocab_size)"
            )


def verify_data(cfg: RunConfig, inputs: RunInputs) -> None:
    """Read every data file once: each manifest's ``content_fingerprint`` must match the files, the
    largest token id actually stored must be an embedding row, and the mask token must not be at a
    supervised position where no manifest record says so (``csbp train`` does this before
    launching; :func:`check_run` on each rank only reads the recorded largest id)."""
    vocab = inputs.decoder_config.vocab_size
    for field, directory in (("data.train", cfg.data.train), ("data.val", cfg.data.val)):
        if directory is None:
            continue
        artifact = open_artifact(Path(directory))
        artifact.verify_fingerprint()
        artifact.verify_tokenizer()  # the model's vocabulary is sized from the manifest
        largest = max(max_token_id(artifact.directory, split) for split in SPLITS)
        if largest >= vocab:
            raise ValueError(
                f"{field}: {artifact.directory} holds token id {largest}, outside the model vocabulary "
                f"[0, {vocab}) (fix: re-run csbp data prepare with the model's tokenizer)"
            )
    check_mask_token_data(cfg, inputs.mask_token_id, read_files=True)  # what no manifest vouches for


def _check_batches(cfg: RunConfig, inputs: RunInputs, warn: Callable[[str], None] | None = None) -> None:
    global_batch = cfg.train.micro_batch_size * cfg.topology.dp
    rows = inputs.artifact.split("train").num_rows
    if rows < global_batch:
        raise ValueError(
            f"train.micro_batch_size: {cfg.train.micro_batch_size} x topology.dp {cfg.topology.dp} = "
            f"{global_batch} sequences per micro-step, but {cfg.data.train} has only {rows} training rows "
            "(fix: lower micro_batch_size or dp, or prepare more data)"
        )
    per_step = global_batch * cfg.train.grad_accum
    if per_step > rows and warn is not None:  # legitimate (few long rows, many ranks), but rarely meant
        warn(
            f"note: train.grad_accum {cfg.train.grad_accum} x {global_batch} sequences = {per_step} rows per optimizer "
            f"step, more than the {rows} training rows of {cfg.data.train}: each step reads the split "
            f"{per_step / rows:.3g} times (train.grad_accum <= {rows // global_batch} reads each row at most once)"
        )
    if cfg.objective.clip_search_widths and cfg.train.eval_every == 0:
        raise ValueError(
            "objective.clip_search_widths: the noise window is searched at validation, but train.eval_every is 0 "
            "(fix: set train.eval_every > 0, or remove objective.clip_search_widths)"
        )
    if cfg.train.eval_every > 0 and inputs.val_split is None:
        raise ValueError(
            f"train.eval_every: {cfg.train.eval_every} but there are no validation rows "
            "(fix: prepare the data with --val-fraction, set data.val, or set train.eval_every: 0)"
        )
    if cfg.train.eval_every > 0 and inputs.val_split is not None:
        check_validation_rows(cfg, inputs.val_split.num_rows)


def check_validation_rows(cfg: RunConfig, val_rows: int) -> None:
    """A validation pass reads ``eval_batches`` global batches of the unshuffled val split; past its
    end the loader wraps around, so some rows would be scored twice and the others once: refused
    (also by ``csbp compare``, which validates with ``train.eval_every`` off)."""
    global_batch = cfg.train.micro_batch_size * cfg.topology.dp
    per_pass = cfg.train.eval_batches * global_batch
    if per_pass <= val_rows:
        return
    fits = val_rows // global_batch
    fix = (
        f"set train.eval_batches <= {fits}"
        if fits
        else "lower train.micro_batch_size or topology.dp, give validation more rows (data.val, or csbp data "
        "prepare --val-fraction), or set train.eval_every: 0"
    )
    raise ValueError(
        f"train.eval_batches: {cfg.train.eval_batches} x micro_batch_size {cfg.train.micro_batch_size} x "
        f"topology.dp {cfg.topology.dp} = {per_pass} validation rows per pass, but the val split has only "
        f"{val_rows}: rows would be scored more than once and weigh more than the others (fix: {fix})"
    )
