"""Fast-dLLM v2 release checkpoints (NVlabs' ``Efficient-Large-Model/Fast_dLLM_v2_1.5B`` / ``_7B``) read
as the Qwen2 family, without their remote code.

A release directory is a Qwen2/Qwen2.5 checkpoint whose ``config.json`` is patched to
``"model_type": "Fast_dLLM_Qwen"``, ``"architectures": ["Fast_dLLM_QwenForCausalLM"]``, an ``auto_map``
naming the release's own ``configuration.py`` / ``modeling.py`` and ``"bd_size"``, the block size it was
trained with; its weights carry transformers' ``Qwen2ForCausalLM`` tensor names, and its tokenizer adds
the mask token ``|<MASK>|`` (:data:`RELEASE_MASK_TOKEN`). csbp reads it as the Qwen2 family
(:func:`as_qwen2`; the ``auto_map`` is ignored: no file of the directory is imported or run) and as a
model trained with the ``fast_dllm_v2`` objective at block size ``bd_size``
(:func:`release_training_record`, which ``csbp generate`` / ``csbp eval`` read as they read a csbp
export's ``csbp_training``), its mask token the id of ``|<MASK>|`` in its ``tokenizer.json``
(:func:`release_mask_id`). A ``bd_size`` that is not a positive JSON integer, a ``layer_types`` entry
other than ``full_attention``, and a config that names the release's ``model_type`` or class but not
both are refused in one line naming the field. Export back to the release's layout is not provided
(its loader is the release's own modeling code); a run's export of it is a plain Qwen2 checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RELEASE_MODEL_TYPE = "Fast_dLLM_Qwen"
RELEASE_CLASS = "Fast_dLLM_QwenForCausalLM"
RELEASE_MASK_TOKEN = "|<MASK>|"
RELEASE_OBJECTIVE = "fast_dllm_v2"
_RELEASE_ONLY_FIELDS = ("auto_map", "bd_size")


def is_fast_dllm_release(hf_config: dict[str, Any]) -> bool:
    """Whether a ``config.json`` names the Fast-dLLM v2 release's ``model_type`` or class."""
    architectures = hf_config.get("architectures")
    named = isinstance(architectures, list) and RELEASE_CLASS in architectures
    return named or hf_config.get("model_type") == RELEASE_MODEL_TYPE


def release_block_size(hf_config: dict[str, Any], where: str = "config.json") -> int:
    """``bd_size``, the block size the release was trained with: a positive JSON integer, else a
    ``ValueError`` naming ``where`` (the file) and the field."""
    value = hf_config.get("bd_size")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{where} bd_size is {value!r}: a Fast-dLLM v2 release's bd_size is the block size it was trained with, a "
            "positive integer (fix: set bd_size to that block size, 32 for NVlabs' releases)"
        )
    return value


def check_release(hf_config: dict[str, Any], where: str = "config.json") -> int:
    """Refuse a release ``config.json`` csbp cannot read as a Qwen2 (module docstring); its ``bd_size``."""
    model_type, architectures = hf_config.get("model_type"), hf_config.get("architectures")
    if model_type != RELEASE_MODEL_TYPE or architectures != [RELEASE_CLASS]:
        raise ValueError(
            f"{where} model_type={model_type!r} with architectures={architectures!r}: a Fast-dLLM v2 release names "
            f"model_type {RELEASE_MODEL_TYPE!r} and architectures [{RELEASE_CLASS!r}], both (fix: set both, or "
            "model_type 'qwen2' with architectures ['Qwen2ForCausalLM'] for a plain Qwen2 checkpoint)"
        )
    layer_types = hf_config.get("layer_types")
    if layer_types is not None:
        others = layer_types if not isinstance(layer_types, list) else [t for t in layer_types if t != "full_attention"]
        if not isinstance(layer_types, list) or others:
            raise ValueError(
                f"{where} layer_types holds {others!r}: csbp reads a Fast-dLLM v2 release only when every layer is "
                "'full_attention' (fix: use a checkpoint whose layers all attend fully)"
            )
    return release_block_size(hf_config, where)


def as_qwen2(hf_config: dict[str, Any], where: str = "config.json") -> dict[str, Any]:
    """The release ``config.json`` as the Qwen2 ``config.json`` it patches (checked by :func:`check_release`):
    ``model_type`` ``qwen2``, ``architectures`` ``["Qwen2ForCausalLM"]``, without ``auto_map`` and ``bd_size``."""
    check_release(hf_config, where)
    plain = {key: value for key, value in hf_config.items() if key not in _RELEASE_ONLY_FIELDS}
    plain.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"])
    return plain


def release_training_record(hf_config: dict[str, Any], where: str = "config.json") -> dict[str, Any] | None:
    """What a release was trained with, in the shape of a csbp export's ``csbp_training`` record (objective
    ``fast_dllm_v2``, block size ``bd_size``); None for any other ``config.json``."""
    if not is_fast_dllm_release(hf_config):
        return None
    return {"objective": {"name": RELEASE_OBJECTIVE, "block_size": check_release(hf_config, where)}}


def release_mask_id(model_dir: Path) -> int | None:
    """The id of :data:`RELEASE_MASK_TOKEN` among the added tokens of ``model_dir/tokenizer.json``
    (None without the file or the token)."""
    try:
        tokenizer = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    added = tokenizer.get("added_tokens") if isinstance(tokenizer, dict) else None
    for token in added if isinstance(added, list) else []:
        if isinstance(token, dict) and token.get("content") == RELEASE_MASK_TOKEN and type(token.get("id")) is int:
            return int(token["id"])
    return None
