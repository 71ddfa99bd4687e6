"""The mask token against the training data, checked before a run starts.

Every masking objective (``bd3``, ``mdlm``, ``fast_dllm_v2``) takes an ``[M]`` in the data for a
masked position, and under SUBS (``bd3``, ``mdlm``) a supervised ``[M]`` has infinite loss: the
objective refuses the batch mid-run (``objectives.base.check_no_mask_token_supervised``). So the
mask id must be no other special token of the artifact (EOS, pad, a chat role marker: EOS ends, and
is supervised in, every document) and must not occur at a supervised position.

``csbp data prepare`` refuses both and records ``splits.<s>.supervised_mask_tokens`` in the
manifest. :func:`check_mask_token_data` (``check_run``: manifests only) refuses a mask id that is
another special id or that the manifest records at supervised positions. An artifact prepared before
that field, or an ``objective.mask_token_id`` other than the artifact's mask token, has no record to
trust: with ``read_files`` (``verify_data``, which reads every data file before a launch anyway) the
token files are scanned instead.
"""

from __future__ import annotations

from pathlib import Path

from csbp.config.schema import RunConfig
from csbp.data.artifact import MANIFEST_NAME, Artifact, open_artifact

MASKING_OBJECTIVES = ("bd3", "mdlm", "fast_dllm_v2")
DEFAULT_MASK_TOKEN = "<|mask|>"


def run_mask_token(cfg: RunConfig, artifact: Artifact) -> tuple[int, str]:
    """``(mask id, where it came from)``: ``objective.mask_token_id``, else the mask token of the
    training data ``artifact``."""
    if cfg.objective.mask_token_id is None:
        return artifact.mask_token_id, f"the mask token of {artifact.directory}"
    return cfg.objective.mask_token_id, "objective.mask_token_id"


def check_mask_token_data(cfg: RunConfig, mask_token_id: int | None, *, read_files: bool = False) -> None:
    """``ValueError`` (one line, with the fix) if ``mask_token_id`` is another special token of
    ``data.train``/``data.val`` or occurs at a supervised position of them (see the module docstring)."""
    if cfg.objective.name not in MASKING_OBJECTIVES or mask_token_id is None:
        return
    configured = cfg.objective.mask_token_id is not None
    for field, directory in (("data.train", cfg.data.train), ("data.val", cfg.data.val)):
        if directory is None:
            continue
        artifact = open_artifact(Path(directory))
        _check_special_ids(field, artifact, mask_token_id, configured)
        found, where = _supervised_mask_tokens(artifact, mask_token_id, read_files)
        if found:
            raise ValueError(
                f"{field}: {artifact.directory} holds the mask token id {mask_token_id} at {found} supervised "
                f"positions ({where}); training would fail at the first batch holding one "
                f"(fix: {_fix(configured)})"
            )


def _check_special_ids(field: str, artifact: Artifact, mask_token_id: int, configured: bool) -> None:
    names = artifact.manifest["tokenizer"].get("special_names", {})
    for special, token_id in artifact.special_ids.items():
        if special == "mask" or token_id != mask_token_id:
            continue
        which = f"objective.mask_token_id {mask_token_id}" if configured else f"the mask token (id {mask_token_id})"
        raise ValueError(
            f"{field}: {which} of {artifact.directory} is also its {special} token {names.get(special, '?')!r}; "
            f"training takes every {special} token for a masked position and fails on a supervised one "
            f"(fix: {_fix(configured)})"
        )


def _supervised_mask_tokens(artifact: Artifact, mask_token_id: int, read_files: bool) -> tuple[int, str]:
    """``(count, where it comes from)``; ``(0, "")`` when nothing is recorded and ``read_files`` is off."""
    recorded = artifact.recorded_supervised_mask_tokens()
    if recorded is not None and mask_token_id == artifact.mask_token_id:
        return recorded, f"{MANIFEST_NAME} splits.*.supervised_mask_tokens"
    if read_files:
        return artifact.count_supervised(mask_token_id), "read from its token files"
    return 0, ""


def _fix(configured: bool) -> str:
    if configured:
        return "remove objective.mask_token_id to use the artifact's mask token, or set an id the data never holds"
    return (
        f"re-run csbp data prepare with --mask-token naming a token the data never holds, such as the "
        f"default {DEFAULT_MASK_TOKEN}"
    )
