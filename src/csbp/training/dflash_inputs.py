"""What ``csbp train`` checks and resolves for ``objective.name: dflash`` before any weight is built.

A dflash run trains a drafter (``csbp.dflash``) against a frozen target, a local Hugging Face
checkpoint directory (``objective.dflash.target``; never a hub). :func:`check_dflash_inputs` reads the
target's ``config.json`` only (no weights) and checks, with one-line ``ValueError``s:

* the target directory exists and is a checkpoint; its vocabulary embeds every token id of the
  data; when it ships a ``tokenizer.json``, that is the tokenizer the data was prepared with;
* the ``[M]`` id (``objective.mask_token_id``, else the artifact's mask token) is a target row;
* the drafter (``DFlashConfig.from_target``: ``objective.block_size``, ``objective.dflash``) and the
  target agree (``validate_drafter_target``), and the loss options form a ``DFlashObjectiveConfig``;
* a drafter to start from (``objective.dflash.init_from``) has that drafter's architecture and readable
  safetensors weights (:mod:`csbp.training.dflash_init`);
* every row of the training (and validation) split has a valid anchor (``validate_anchor_coverage``);
* an offline feature store (``objective.dflash.features``) belongs to this target (its config and
  the fingerprint of its weight files, read in full once per process), these layers and the
  training split (``open_features``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from csbp.config.schema import DFlashSection, RunConfig
from csbp.data.artifact import Artifact, ArtifactSplit
from csbp.data.tokenizer import fingerprint_bytes
from csbp.dflash.anchors import validate_anchor_coverage
from csbp.dflash.config import DFlashConfig, DFlashObjectiveConfig, validate_drafter_target
from csbp.dflash.drafter import DFlashDrafter
from csbp.dflash.features import FeatureStore, open_features, recorded_layer_ids, recorded_target
from csbp.dflash.target_fingerprint import checkpoint_fingerprint
from csbp.models.config import DecoderConfig
from csbp.models.hf_io import decoder_config_from_hf, read_json_object
from csbp.training.dflash_init import check_init_drafter
from csbp.training.input_hints import checkpoint_directory_fix
from csbp.training.mask_data import run_mask_token

T = TypeVar("T")
_TARGET_FIX = (
    "train the target first (e.g. `csbp train dflash-target`) and point objective.dflash.target at its "
    "final/ directory"
)


@dataclass(frozen=True)
class DFlashInputs:
    """What a validated dflash run resolves to.

    Attributes:
        target_dir: the frozen target's checkpoint directory.
        target_config: the target's shape (from its ``config.json``).
        drafter_config: the drafter's architecture.
        objective: the DFlash loss options.
        features_dir: the offline feature store of the training split, or None (online capture).
        init_dir: the drafter directory the weights start from (``objective.dflash.init_from``), or None
            (a seeded random drafter).
        layer_ids_configured: the config names ``target_layer_ids`` (False: the drafter's are the default).
    """

    target_dir: Path
    target_config: DecoderConfig
    drafter_config: DFlashConfig
    objective: DFlashObjectiveConfig
    features_dir: Path | None
    layer_ids_configured: bool = False
    init_dir: Path | None = None

    def feature_store(self, train_split: ArtifactSplit) -> FeatureStore | None:
        """The opened, validated feature store of ``train_split`` (None without one)."""
        if self.features_dir is None:
            return None
        layer_ids = list(self.drafter_config.target_layer_ids or ())
        fix = "re-run `csbp dflash prepare-features` for this target, data and drafter, or remove it"
        stored = recorded_layer_ids(self.features_dir)
        if stored is not None and stored != layer_ids and not self.layer_ids_configured:
            fix = (  # e.g. a store captured for the default before its rounding changed
                f"set objective.dflash.target_layer_ids: {stored} (the layers the store holds; the default here is "
                f"{layer_ids}), or re-run `csbp dflash prepare-features` with --layer-ids {' '.join(map(str, layer_ids))}"
            )
        return _field(
            "objective.dflash.features",
            lambda: open_features(
                self.features_dir,  # type: ignore[arg-type]
                target_config=self.target_config,
                target_weights=checkpoint_fingerprint(self.target_dir, known=recorded_target(self.features_dir)),
                split=train_split,
                layer_ids=layer_ids,
                need_last_hidden=self.objective.loss == "kl",
            ),
            fix,
        )

    def param_shapes(self) -> dict[str, list[int]]:
        """Shape of every trained (drafter) parameter by name."""
        drafter = DFlashDrafter(self.drafter_config, device="meta")
        return {name: list(param.shape) for name, param in drafter.named_parameters()}


def check_dflash_inputs(
    cfg: RunConfig,
    artifact: Artifact,
    val_split: ArtifactSplit | None,
) -> DFlashInputs:
    """Validate a dflash run against its target and data (see the module docstring)."""
    section = cfg.objective.dflash
    if section is None or cfg.objective.block_size is None:  # the schema requires both for dflash
        raise ValueError("objective.dflash: required for objective dflash (fix: add objective.dflash.target)")
    target_dir = Path(section.target)
    target_config = read_target_config(target_dir)
    if artifact.vocab_size > target_config.vocab_size:
        raise ValueError(
            f"objective.dflash.target: {target_dir} embeds {target_config.vocab_size} ids but the data "
            f"{artifact.directory} has token ids up to {artifact.vocab_size - 1} (fix: train the target on "
            "this data's tokenizer)"
        )
    _field("objective.dflash.target", lambda: check_target_tokenizer(target_dir, artifact),
           "prepare the data with the target's tokenizer")
    mask_token_id, source = run_mask_token(cfg, artifact)
    if mask_token_id >= target_config.vocab_size:
        raise ValueError(
            f"objective.mask_token_id: {source} is {mask_token_id}, outside the target vocabulary "
            f"({target_config.vocab_size}) (fix: use an unused embedding row of the target)"
        )
    if section.num_draft_layers > target_config.num_layers:  # before a layer list of that length is built
        raise ValueError(
            f"objective.dflash.num_draft_layers: {section.num_draft_layers} draft layers, more than the "
            f"{target_config.num_layers} of the target {target_dir}: a drafter that costs more than its target "
            f"drafts nothing worth verifying (fix: objective.dflash.num_draft_layers: {target_config.num_layers} "
            "or fewer; DFlash drafters use 1 to 8)"
        )
    drafter_config = _field(
        "objective.dflash",
        lambda: drafter_config_for(section, target_config, cfg.objective.block_size or 0, mask_token_id),
        "change objective.dflash (num_draft_layers, target_layer_ids, layer_types, conv_group_size, ...)",
    )
    _field(
        "objective.dflash.target",
        lambda: validate_drafter_target(drafter_config, target_config),
        "train the drafter against the target it was configured for",
    )
    init_dir = check_init_drafter(cfg, drafter_config, target_dir)
    objective = _field(
        "objective.dflash",
        lambda: objective_config_for(section, cfg.objective.ce_chunk_rows),
        "change the objective.dflash loss options",
    )
    splits = [("data.train", artifact.split("train")), ("data.val", val_split)]
    for field, split in splits:
        if split is not None and split.num_rows > 0:
            _field(
                field,
                lambda split=split: check_split_anchor_coverage(split),
                "re-prepare the data with a longer --seq-len, so that no row lies wholly inside a prompt or chat "
                "history, or drop records whose unsupervised part is longer than a row",
            )
    inputs = DFlashInputs(
        target_dir=target_dir,
        target_config=target_config,
        drafter_config=drafter_config,
        objective=objective,
        features_dir=Path(section.features) if section.features is not None else None,
        layer_ids_configured=section.target_layer_ids is not None,
        init_dir=init_dir,
    )
    inputs.feature_store(artifact.split("train"))
    return inputs


_COVERAGE_CHUNK_TOKENS = 1 << 22
"""Tokens of a split read at a time by :func:`check_split_anchor_coverage` (its memory is about 20
bytes a token: the whole split of a long-context corpus would not fit)."""


def check_split_anchor_coverage(split: ArtifactSplit, *, chunk_tokens: int = _COVERAGE_CHUNK_TOKENS) -> None:
    """``validate_anchor_coverage`` over the memory-mapped ``split`` a few rows at a time."""
    rows_per_chunk = max(1, chunk_tokens // max(1, split.seq_len))
    for start in range(0, split.num_rows, rows_per_chunk):
        stop = min(split.num_rows, start + rows_per_chunk)
        validate_anchor_coverage(
            np.asarray(split.loss_mask[start:stop]), np.asarray(split.doc_ids[start:stop]), first_row=start
        )


def check_target_tokenizer(target_dir: Path, artifact: Artifact) -> None:
    """``ValueError`` when ``target_dir`` ships a ``tokenizer.json`` other than the one ``artifact`` was
    prepared with: the target would read the data's ids as other tokens (same vocabulary size or not).
    Also run by ``csbp dflash eval --data`` and ``prepare-features``."""
    tokenizer_file = target_dir / "tokenizer.json"
    if tokenizer_file.is_file() and fingerprint_bytes(tokenizer_file.read_bytes()) != artifact.tokenizer_fingerprint:
        raise ValueError(
            f"the tokenizer of {target_dir} is not the one {artifact.directory} was prepared with (fingerprints "
            "differ)"
        )


def read_target_config(target_dir: Path) -> DecoderConfig:
    """The target's ``DecoderConfig`` from its ``config.json`` (``ValueError`` naming the field)."""
    config_file = target_dir / "config.json"
    if not target_dir.is_dir():
        raise ValueError(f"objective.dflash.target: {target_dir} does not exist (fix: {_TARGET_FIX})")
    if not config_file.is_file():
        raise ValueError(
            f"objective.dflash.target: {target_dir} is not a HF checkpoint directory (no config.json) "
            f"(fix: {checkpoint_directory_fix(target_dir, _TARGET_FIX)})"
        )
    hf_config = read_json_object(config_file)  # a damaged file is named
    return _field(
        "objective.dflash.target",
        lambda: decoder_config_from_hf(hf_config),
        "use a Qwen3, Qwen2, Llama or Mistral checkpoint directory",
    )


def drafter_config_for(
    section: DFlashSection, target: DecoderConfig, block_size: int, mask_token_id: int
) -> DFlashConfig:
    """``DFlashConfig.from_target`` with the config's drafter fields."""
    return DFlashConfig.from_target(
        target,
        num_layers=section.num_draft_layers,
        block_size=block_size,
        mask_token_id=mask_token_id,
        intermediate_size=section.intermediate_size,
        target_layer_ids=tuple(section.target_layer_ids) if section.target_layer_ids is not None else None,
        layer_types=tuple(section.layer_types) if section.layer_types is not None else None,
        sliding_window=section.sliding_window,
        sliding_window_causal=section.sliding_window_causal,
        conv_kernel_size=section.conv_kernel_size,
        conv_group_size=section.conv_group_size,
        selector_rank=section.selector_rank,
        selector_top_k=section.selector_top_k,
    )


def objective_config_for(section: DFlashSection, ce_chunk_rows: int) -> DFlashObjectiveConfig:
    """The ``DFlashObjectiveConfig`` of the config's loss fields."""
    return DFlashObjectiveConfig(
        max_anchors=section.max_anchors,
        anchor_sampling=section.anchor_sampling,
        context=section.context,
        gamma=section.gamma,
        loss=section.loss,
        weighting=section.weighting,
        dpace_alpha=section.dpace_alpha,
        lk_loss_type=section.lk_loss_type,
        kl_scale=section.kl_scale,
        kl_decay=section.kl_decay,
        selector_alpha=section.selector_alpha,
        selector_warmup_ratio=section.selector_warmup_ratio,
        selector_ramp_ratio=section.selector_ramp_ratio,
        selector_stop_gradient=section.selector_stop_gradient,
        ce_chunk_rows=ce_chunk_rows,
        target_capture=section.target_capture,
    )


def _field(field: str, action: Callable[[], T], fix: str) -> T:
    """Run ``action``; a ``ValueError`` becomes one line ``field: message (fix: fix)``."""
    try:
        return action()
    except ValueError as exc:
        message = (str(exc).splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"{field}: {message} (fix: {fix})") from None
