"""What ``--resume`` may change: the run config of a checkpoint against the config resuming it.

A checkpoint's ``trainer_state.json`` holds the run config it was written under (``config_yaml``).
``csbp train --resume`` compares it with the config it is given, field by field, before any
process starts (:func:`resume_changes`):

* **layout and bookkeeping** (every ``topology`` field but ``window``, ``attention``, process
  counts, FSDP, activation checkpointing, logging/evaluation/checkpoint cadence, timeouts, the run's
  name and directory, where the data and tokenizer files live (their contents are fingerprinted),
  where ``model.init_from``, the DFlash target, feature store and ``init_from`` drafter live when the moved directory
  has the fingerprint the checkpoint recorded (:mod:`csbp.training.input_identity`; the same path
  is fingerprinted too, so a directory overwritten in place is refused),
  ``data.val``, ``model.dtype`` of the export): free. A layout change is exact (every layout
  computes the one-process loss and gradients);
* **the optimisation from here on** (``optim``, ``train.max_steps``, the global batch
  ``train.micro_batch_size`` x ``topology.dp`` x ``train.grad_accum``, ``train.precision`` between
  ``fp32`` and ``bf16``): applied from the resumed step, one note line each, because lowering the
  learning rate after a loss spike or extending a run is what a resume is for
  (:func:`csbp.training.optim.apply_optim_config` puts the new values into the restored optimizer
  and schedule; the loader continues from the same global cursor);
* **what defines the trained model** (``model`` shape and RoPE, ``objective``, ``data.seq_len``,
  the document mask, ``run.seed``, ``topology.window``, ``fp64``): refused with one line naming the
  field, both values and the fix. ``objective.dflash.target_layer_ids`` is compared as resolved (the
  default filled in) by :mod:`csbp.training.dflash_layers`, not here: an unset value may resolve to
  other ids than it did, and spelling the trained ids out is no change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from csbp.config.loading import read_yaml_text
from csbp.config.schema import DOCUMENT_MASK_DEFAULTS, RunConfig
from csbp.training.input_identity import IDENTIFIED_BY_CONTENT, directory_fingerprint

#: fields (dotted) or sections (ending in ".") that a resume may change freely
FREE = (
    "run.name",
    "run.run_dir",
    "topology.",
    "attention.",
    "train.nproc",
    "train.fsdp",
    "train.activation_checkpointing",
    "train.compile",
    "train.log_every",
    "train.eval_every",
    "train.eval_batches",
    "train.save_every",
    "train.keep_checkpoints",
    "train.collective_timeout_s",
    "train.generate_after",
    "train.nan_policy",
    "data.train",
    "data.val",
    "data.tokenizer",
    "model.dtype",
    # what computes the same training another way, or only measures it: the LM-head loss's chunking (a memory
    # knob: lowering it rescues a resume that ran out of memory), the DFlash target's capture under CP
    # (sharded or replicated: equal to round-off) and the speculative-decoding validation's size
    "objective.ce_chunk_rows",
    "objective.dflash.target_capture",
    "objective.dflash.eval_prompts",
    "objective.dflash.eval_new_tokens",
)
#: fields applied from the resumed step on (a note line each)
APPLIED = (
    "optim.",
    "train.max_steps",
    "train.micro_batch_size",
    "train.grad_accum",
    "topology.dp",
    "train.precision",
)
#: the fix's alternative to undoing a refused change, for ``csbp train --resume``
TRAIN_RESTART = (
    "start a new run directory from an export of it: csbp export RUN --out DIR, then model.init_from: DIR"
)
#: the same for a dflash run, whose drafter starts from an export through objective.dflash.init_from
DFLASH_TRAIN_RESTART = (
    "start a new run directory, from scratch or, for the same drafter architecture, from an export of this one: "
    "csbp dflash export --run-dir RUN --out DIR, then objective.dflash.init_from: DIR"
)

#: fields compared as the run resolves them, not as configured (unset: a default that may have changed)
COMPARED_RESOLVED = ("objective.dflash.target_layer_ids",)  # csbp.training.dflash_layers
#: mappings compared (and named) as one value
LEAF_MAPPINGS = ("rope_scaling",)
#: free-section fields that change what the model computes
REFUSED_INSIDE_FREE = ("topology.window",)
#: fields added after runs were recorded, with the value that trained those runs: a config recorded before a
#: field existed reads as that value (else every older checkpoint would be refused for a ``null``)
ADDED_FIELDS: dict[str, Any] = {
    "objective.clip_search_widths": [], "objective.clip_search_delta": 0.05, "objective.resample": False,
    "optim.ema_decay": None,
}


def with_added_fields(flat: dict[str, Any]) -> dict[str, Any]:
    """A recorded :func:`flat_config` with each of :data:`ADDED_FIELDS` it lacks set to how it trained."""
    return {**ADDED_FIELDS, **flat}


def flat_config(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"optim.lr": 0.001, ...}``: a nested config mapping as dotted leaves (lists stay leaves)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and key not in LEAF_MAPPINGS:
            out.update(flat_config(value, name + "."))
        else:
            out[name] = value
    return out


def _effective(flat: dict[str, Any]) -> dict[str, Any]:
    """``data.document_mask`` resolved to the objective's default when unset (an explicit value
    equal to the default is no change), and the :data:`ADDED_FIELDS` an older config lacks filled in."""
    out = with_added_fields(flat)
    if out.get("data.document_mask") is None and out.get("objective.name") in DOCUMENT_MASK_DEFAULTS:
        out["data.document_mask"] = DOCUMENT_MASK_DEFAULTS[out["objective.name"]][0]
    return out


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(name == p or (p.endswith(".") and name.startswith(p)) for p in patterns)


def resume_changes(
    saved_yaml: str,
    cfg: RunConfig,
    checkpoint: Path,
    step: int,
    fingerprints: dict[str, str] | None = None,
    restart: str | None = None,
) -> list[str]:
    """The note lines for the applied changes between the checkpoint's config (``saved_yaml``) and
    ``cfg``; ``ValueError`` (one line) naming the first refused change. ``fingerprints`` are the
    checkpoint's recorded ``input_fingerprints``: a directory field naming a copy with the same
    contents is no change. ``restart``: the fix's other way out, for the command resuming (a new
    ``--out`` for ``csbp compare``; None: ``csbp train``'s new run directory, :data:`TRAIN_RESTART` or
    for a dflash run :data:`DFLASH_TRAIN_RESTART`)."""
    restart = resume_restart_for(cfg, restart)
    loaded = read_yaml_text(saved_yaml, source=f"{checkpoint}/trainer_state.json config_yaml") if saved_yaml else None
    if not isinstance(loaded, dict):
        return []  # nothing recorded to compare against
    before = _effective(flat_config(loaded))
    after = _effective(flat_config(cfg.model_dump(mode="json")))
    if before.get("model.init_from") is not None and after.get("model.init_from") is not None:
        # the checkpoint gives the architecture (model.arch is never read) and init_from is compared by contents
        before.pop("model.arch", None)
        after.pop("model.arch", None)
    notes: list[str] = []
    # the objective first: other fields' defaults follow it (loss weights, the document mask)
    order = {"objective.name": 0, "data.document_mask": 2}
    for name in sorted(set(before) | set(after), key=lambda n: (order.get(n, 1), n)):
        if name in COMPARED_RESOLVED:
            continue
        old, new = before.get(name), after.get(name)
        recorded = (fingerprints or {}).get(name)
        if old == new and recorded is not None and isinstance(new, str):
            # the same path: its directory may have been overwritten in place since the checkpoint
            if directory_fingerprint(Path(new)) != recorded:
                raise ValueError(
                    f"{name}: {new} has changed since checkpoint {checkpoint} (step {step}) was trained on it "
                    f"(its contents differ from the recorded fingerprint); a resume continues the same training "
                    f"(fix: restore the directory the run was trained with, or {restart})"
                )
            continue
        if old == new or (isinstance(old, list) and isinstance(new, (list, tuple)) and list(old) == list(new)):
            continue
        if recorded is not None and isinstance(new, str) and directory_fingerprint(Path(new)) == recorded:
            continue  # the same directory, moved or copied
        if _refused(name, old, new):
            contents = ""
            if name in IDENTIFIED_BY_CONTENT and isinstance(new, str):
                contents = " (its contents differ)" if recorded else " (no content fingerprint recorded)"
            raise ValueError(
                f"{name}: checkpoint {checkpoint} (step {step}) was trained with {name}={_text(old)}, the config "
                f"sets {_text(new)}{contents}; a resume continues the same training (fix: set {name}: {_text(old)} to "
                f"resume, or {restart})"
            )
        if _matches(name, APPLIED):
            notes.append(f"resume: {name} {_text(old)} -> {_text(new)} from step {step} on")
    return notes


def resume_restart_for(cfg: RunConfig, restart: str | None) -> str:
    """``restart``, else the default way out of a refused resume for ``cfg``'s objective."""
    if restart is not None:
        return restart
    return DFLASH_TRAIN_RESTART if cfg.objective.name == "dflash" else TRAIN_RESTART


def _refused(name: str, old: Any, new: Any) -> bool:
    if name == "train.precision":
        return "fp64" in (old, new)  # the master weights' dtype
    if _matches(name, REFUSED_INSIDE_FREE):
        return True
    return not (_matches(name, FREE) or _matches(name, APPLIED))


def _text(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_text(v)}" for k, v in value.items() if v is not None) + "}"
    return str(value)
