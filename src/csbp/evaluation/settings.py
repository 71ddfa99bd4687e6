"""What ``csbp eval`` evaluates: the model's objective, block grid and mask token, checked against
the data before any forward pass.

Defaults come from the run that wrote the checkpoint: a run's ``final/`` export sits next to the
run's ``config.yaml`` (the same file ``csbp generate`` reads, via
:func:`csbp.generation.run_settings.run_objective_settings`), which gives ``objective.name``,
``block_size``, ``mask_token_id``, ``topology.window`` and ``data.document_mask`` /
``reset_positions``. ``--objective`` / ``--block-size`` other than the run's are refused before this
runs unless ``--allow-objective-change`` / ``--allow-block-size-change`` (``csbp.cli.trained_settings``,
shared with ``csbp generate``); a Fast-dLLM v2 release is ``fast_dllm_v2`` at its ``bd_size``
(``csbp.models.hf_release``); any other checkpoint without a run config needs ``--objective`` and
``--block-size``. The mask token is the one the model was trained with
(:func:`csbp.generation.run_settings.trained_mask_token`, as ``csbp generate`` takes it: the export's
``csbp_training`` record, then the run config, then ``config.json``'s ``mask_token_id``; records that
disagree are refused), else the artifact's. The document mask is the run's, else the
objective's training default (``data.document_mask`` unset: on for ``fast_dllm_v2``, off for ``bd3``
and ``mdlm``); ``--[no-]document-mask`` sets it for a checkpoint without a record and is refused when
it contradicts one.

Every check fails with one line naming the flag or file and the fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from csbp.data.artifact import Artifact
from csbp.generation.run_settings import (
    NotBlockDiffusionError,
    run_objective_settings,
    trained_mask_token,
    training_record,
)
from csbp.models.config import DecoderConfig
from csbp.objectives import build_objective
from csbp.objectives.base import Objective

EVAL_OBJECTIVES = ("bd3", "mdlm", "fast_dllm_v2")


@dataclass(frozen=True)
class EvalSettings:
    """The objective and layout a model is evaluated with.

    Attributes:
        objective: ``bd3``, ``mdlm`` or ``fast_dllm_v2``.
        block_size: diffusion block size ``B`` (``seq_len`` for mdlm).
        mask_token_id: id of ``[M]``.
        window: sliding attention window the model was trained with, or None.
        document_mask: attend within packed documents only (as in training).
        reset_positions: restart RoPE positions at each document.
    """

    objective: str
    block_size: int
    mask_token_id: int
    window: int | None = None
    document_mask: bool = False
    reset_positions: bool = False

    @property
    def token_shift(self) -> bool:
        return self.objective == "fast_dllm_v2"

    @property
    def uses_clean_stream(self) -> bool:
        return self.objective != "mdlm"

    def build_objective(self) -> Objective:
        """The trained objective (its clip range and noise scheme are irrelevant: the NELBO replaces
        them, :func:`csbp.evaluation.nelbo.nelbo_objective`)."""
        options: dict[str, Any] = {"mask_token_id": self.mask_token_id}
        if self.objective != "mdlm":
            options["block_size"] = self.block_size
        return build_objective(self.objective, **options)


def run_config_settings(model_dir: Path) -> dict[str, Any]:
    """The run's settings when ``model_dir`` is ``RUN/final`` (empty for any other directory)."""
    try:
        settings = run_objective_settings(model_dir)
    except NotBlockDiffusionError as error:
        raise ValueError(
            f"{error}, which csbp eval scores (fix: --model the export of a block-diffusion run; an ar run's val_loss "
            "is already its exact NLL)"
        ) from None
    found = training_record(model_dir)
    if not settings or found is None:
        return {}
    loaded = found[0]
    data = loaded.get("data") if isinstance(loaded.get("data"), dict) else {}  # a damaged record: none
    if data.get("document_mask") is not None:
        settings["document_mask"] = bool(data["document_mask"])
    elif settings["objective"] in EVAL_OBJECTIVES:
        from csbp.config.schema import DOCUMENT_MASK_DEFAULTS

        settings["document_mask"] = DOCUMENT_MASK_DEFAULTS[settings["objective"]][0]
    settings["reset_positions"] = bool(data.get("reset_positions", False))
    return settings


def resolve_settings(
    model_dir: Path,
    model_config: DecoderConfig,
    artifact: Artifact,
    *,
    objective: str | None = None,
    block_size: int | None = None,
    document_mask: bool | None = None,
) -> EvalSettings:
    """Flags over the run's settings, checked against the model and the artifact (module docstring)."""
    run = run_config_settings(model_dir)
    recorded = run.get("document_mask")
    if document_mask is not None and recorded is not None and document_mask != recorded:
        flag = "--document-mask" if document_mask else "--no-document-mask"
        raise ValueError(
            f"{flag}: the model was trained with data.document_mask {str(recorded).lower()} ({run['source']}), which "
            "csbp eval evaluates with (fix: drop the flag; it is for checkpoints that record no training settings)"
        )
    name = objective or run.get("objective")
    if name is None:
        raise ValueError(
            f"--model {model_dir}: no run config.yaml next to it and no csbp_training record in its config.json "
            "to read the objective from "
            f"(fix: pass --objective {{{','.join(EVAL_OBJECTIVES)}}} and --block-size)"
        )
    seq_len = artifact.seq_len
    if name == "mdlm":
        if block_size not in (None, seq_len):
            raise ValueError(
                f"--block-size {block_size}: mdlm is one block of the whole row ({seq_len} tokens) (fix: drop --block-size)"
            )
        size = seq_len
    else:
        # the block size the model was trained with, also under another blockwise objective (bd3 <-> fast_dllm_v2)
        size = block_size or (run.get("block_size") if run.get("objective") != "mdlm" else None)
        if size is None:
            raise ValueError(f"--block-size: the {name} model's block size is unknown (fix: pass --block-size B)")
    if size < 1 or seq_len % size:
        raise ValueError(
            f"--block-size {size} does not divide the sequence length {seq_len} of {artifact.directory} "
            "(fix: pass the block size the model was trained with, on data of a multiple of it)"
        )
    if document_mask is None:  # a checkpoint without a record: as training runs the objective by default
        from csbp.config.schema import DOCUMENT_MASK_DEFAULTS

        document_mask = recorded if recorded is not None else DOCUMENT_MASK_DEFAULTS[name][0]
    recorded_mask = trained_mask_token(model_dir)
    mask_token_id = recorded_mask[0] if recorded_mask is not None else artifact.mask_token_id
    _check_vocabulary(model_dir, model_config, artifact, mask_token_id)
    return EvalSettings(
        objective=name,
        block_size=size,
        mask_token_id=mask_token_id,
        window=run.get("window"),
        document_mask=document_mask,
        reset_positions=bool(run.get("reset_positions", False)),
    )


def _check_vocabulary(model_dir: Path, config: DecoderConfig, artifact: Artifact, mask_token_id: int) -> None:
    """Every id the data uses (its mask token included) must be an embedding row, and the model's
    tokenizer (if it has one) must give each of its tokens the data's id: as training takes a
    ``model.init_from`` checkpoint, the data's tokenizer may add tokens (the ``<|mask|>`` the docs say
    to add) after the model's ids but not renumber them."""
    from csbp.training.model_factory import check_checkpoint_tokenizer, mask_past_embedding  # noqa: PLC0415

    vocab = config.vocab_size
    largest = artifact.max_token_id()
    if largest >= vocab or artifact.vocab_size > vocab:
        past = mask_past_embedding("--model", model_dir, vocab, artifact) if largest < vocab else None
        if past is not None:
            raise ValueError(past)
        raise ValueError(
            f"--data {artifact.directory}: its tokenizer has {artifact.vocab_size} ids (largest stored {largest}) "
            f"but the model {model_dir} embeds {vocab} (fix: evaluate on data prepared with the model's tokenizer)"
        )
    if not 0 <= mask_token_id < vocab:
        raise ValueError(
            f"mask token id {mask_token_id} is outside the model vocabulary [0, {vocab}) of {model_dir} (fix: evaluate "
            "on data prepared with the model's tokenizer, or a checkpoint whose recorded mask_token_id it embeds)"
        )
    check_checkpoint_tokenizer(model_dir, artifact, label="--model")
