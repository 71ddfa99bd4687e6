"""Which target layers a DFlash drafter checkpoint was trained with, and the resume check on them.

A drafter's ``fc`` weights are fitted to the hidden states of ``objective.dflash.target_layer_ids``;
the same weights fed other layers decode garbage, silently (the shapes agree). When the config leaves
the ids unset they come from :func:`csbp.dflash.config.default_target_layer_ids`, and that default has
changed: csbp before commit 2967e9f (2026-12-03) rounded exact halves up, it now rounds them to even
as the public readers do, which picks another layer at some depths (38 target layers x 5 draft layers:
``27`` became ``26``; 7 x 3: ``[1, 3, 4]`` became ``[1, 2, 4]``). So:

* a checkpoint records the ids the run *resolved* (``trainer_state.json`` ``resolved_config``, keyed
  :data:`LAYER_IDS_FIELD`; :func:`resolved_config`);
* ``--resume`` compares those with the ids this run resolves and refuses a difference in one line
  naming both lists and the fix (:func:`check_resumed_layer_ids`; ``csbp.training.resume_config``
  leaves the configured value to this check, so a resume may spell the same ids out or drop them);
* a checkpoint written before the record (:func:`trained_layer_ids`): configured ids are the trained
  ones; unset ones are the default of its depth when both rules give the same ids, or the ids of the
  feature store it trained on (fingerprinted in the checkpoint, so the same store); otherwise
  unknown: both candidates are named and the resume (or ``csbp dflash export --checkpoint``) is
  refused until the config (or ``--layer-ids``) names one of them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from csbp.config.loading import read_yaml_text
from csbp.dflash.config import default_target_layer_ids
from csbp.dflash.features import recorded_layer_ids

if TYPE_CHECKING:
    from csbp.training.checkpoint import TrainingState
    from csbp.training.dflash_inputs import DFlashInputs

LAYER_IDS_FIELD = "objective.dflash.target_layer_ids"
FEATURES_FIELD = "objective.dflash.features"
ROUNDING_CHANGE = "csbp before commit 2967e9f (2026-12-03)"
"""When the default stopped rounding halves up; named when a checkpoint's ids are unknown."""


def legacy_default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...] | None:
    """The default of :data:`ROUNDING_CHANGE`: ``floor(1 + i·(L−4)/(K−1) + 0.5)`` (halves up);
    None where that rule gave no valid ids (that csbp refused to train such a drafter)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    ids = tuple(
        math.floor(1 + i * (num_target_layers - 4) / (num_draft_layers - 1) + 0.5) for i in range(num_draft_layers)
    )
    return ids if num_target_layers >= 4 and len(set(ids)) == len(ids) else None


def resolved_config(dflash: DFlashInputs | None) -> dict[str, Any]:
    """What a checkpoint records under ``resolved_config``: the drafter's resolved layer ids (empty for
    a run of another objective)."""
    if dflash is None:
        return {}
    return {LAYER_IDS_FIELD: list(dflash.drafter_config.target_layer_ids or ())}


def _ids(value: Any, what: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not value or any(type(i) is not int for i in value):
        raise ValueError(f"{what} is {value!r}, not a list of layer ids; the checkpoint is damaged")
    return tuple(value)


def trained_layer_ids(
    recorded: dict[str, Any], configured: Any, num_target_layers: int, num_draft_layers: int, *, source: str
) -> tuple[tuple[int, ...], ...]:
    """The ids a checkpoint trained with: one tuple when known; two candidates (the old rule's, then
    the current one's) when it records none, its config left them unset and the rules disagree for
    ``num_target_layers`` x ``num_draft_layers``. ``recorded``: its ``resolved_config``; ``configured``:
    its run config's ``target_layer_ids``; ``source``: the file named if either is damaged."""
    if LAYER_IDS_FIELD in recorded:
        return (_ids(recorded[LAYER_IDS_FIELD], f"{source} resolved_config {LAYER_IDS_FIELD}"),)
    if configured is not None:
        return (_ids(configured, f"{source} config_yaml {LAYER_IDS_FIELD}"),)
    current = default_target_layer_ids(num_target_layers, num_draft_layers)
    legacy = legacy_default_target_layer_ids(num_target_layers, num_draft_layers)
    return (current,) if legacy in (None, current) else (legacy, current)


def unknown_ids_reason(candidates: tuple[tuple[int, ...], ...], num_target_layers: int, num_draft_layers: int) -> str:
    """Why ``candidates`` (old rule, current rule) leave a checkpoint's ids unknown, for its error line."""
    legacy, current = candidates
    return (
        f"it records no resolved target_layer_ids (written by an older csbp) and its config left them unset, "
        f"and the default for {num_target_layers} target layers x {num_draft_layers} draft layers is {_text(legacy)} "
        f"(halves rounded up, {ROUNDING_CHANGE}) or {_text(current)} (halves to even, since)"
    )


def check_resumed_layer_ids(
    state: TrainingState,
    checkpoint: Path,
    dflash: DFlashInputs,
    *,
    restart: str,
    warn: Callable[[str], None] | None = None,
) -> None:
    """``ValueError`` (one line) unless this run's resolved ``target_layer_ids`` are those checkpoint
    ``state`` trained with (module docstring); an older checkpoint whose ids are unknown resumes only
    with ids the config names explicitly, one of the two candidates (a note to ``warn``)."""
    source = f"{checkpoint}/trainer_state.json"
    loaded = read_yaml_text(state.config_yaml, source=f"{source} config_yaml") if state.config_yaml else None
    objective = loaded.get("objective") if isinstance(loaded, dict) else None
    section = objective.get("dflash") if isinstance(objective, dict) else None
    configured_then = section.get("target_layer_ids") if isinstance(section, dict) else None
    config = dflash.drafter_config
    resolved = tuple(config.target_layer_ids or ())
    num_target, num_draft = config.num_target_layers, config.num_layers
    candidates = trained_layer_ids(
        state.resolved_config, configured_then, num_target, num_draft, source=source
    )
    if len(candidates) > 1:
        candidates = _store_decides(state, dflash, candidates)
    explicit = dflash.layer_ids_configured
    if candidates == (resolved,):
        return
    head = f"{LAYER_IDS_FIELD}: checkpoint {checkpoint} (step {state.step})"
    if len(candidates) == 1:
        how = "as configured" if explicit else f"the default for {num_target} target layers x {num_draft} draft layers"
        raise ValueError(
            f"{head} was trained with target_layer_ids {_text(candidates[0])}, this run resolves {_text(resolved)} "
            f"({how}); the drafter's fc weights would read other target layers (fix: set {LAYER_IDS_FIELD}: "
            f"{_text(candidates[0])} to resume, or {restart})"
        )
    legacy, current = candidates
    if explicit and resolved in candidates:
        if warn is not None:
            warn(
                f"resume: checkpoint {checkpoint} (step {state.step}) records no resolved {LAYER_IDS_FIELD}; "
                f"continuing with the configured {_text(resolved)}"
            )
        return
    raise ValueError(
        f"{head}: {unknown_ids_reason(candidates, num_target, num_draft)}; which one it trained with is unknown "
        f"(fix: set {LAYER_IDS_FIELD} to the ids the run started with: {_text(legacy)} if it started under "
        f"{ROUNDING_CHANGE}, else {_text(current)}; or {restart})"
    )


def _store_decides(
    state: TrainingState, dflash: DFlashInputs, candidates: tuple[tuple[int, ...], ...]
) -> tuple[tuple[int, ...], ...]:
    """The one candidate a feature store decides, else ``candidates``: a run on a store trained with the
    store's ids (``open_features`` refuses others), and a checkpoint that fingerprinted its store
    (``input_fingerprints``, manifest included) resumes only on that store (``resume_config``, run first)."""
    if dflash.features_dir is None or FEATURES_FIELD not in state.input_fingerprints:
        return candidates
    stored = recorded_layer_ids(dflash.features_dir)
    return (tuple(stored),) if stored is not None and tuple(stored) in candidates else candidates


def _text(ids: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(i) for i in ids) + "]"
