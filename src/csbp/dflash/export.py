"""Export and load drafters in the public DFlash checkpoint format (objectives.md §8).

``config.json``: ``architectures: ["DFlashDraftModel"]`` (``"DFlash2DraftModel"`` when a DFlash2
module is enabled), ``model_type: "qwen3"``, ``block_size``, top-level ``num_target_layers``,
``dflash_config: {target_layer_ids, mask_token_id}``, the Qwen3 shape fields, ``rope_theta`` both
top-level and in ``rope_parameters`` (with the target's RoPE scaling there and in ``rope_scaling``; for YaRN
also ``max_position_embeddings = factor x original``, as a target export writes, refused when below the
``data.seq_len`` the drafter was trained at; without YaRN the larger of that ``data.seq_len`` and the target's
``max_position_embeddings``, the context it is served at), ``layer_types``/``sliding_window``,
``tie_word_embeddings: false`` and the target's ``vocab_size``; sliding layers that are not causal
in the block (``sliding_window_causal: false``) also write ``is_causal: false``, which the public
reader needs to leave them bidirectional (it makes sliding layers causal by default). That reader
also windows the block itself, csbp only the context, so a ``sliding_window`` below ``block_size``
serves there otherwise than trained (:func:`public_reader_window_note`; ``csbp dflash export`` prints it). DFlash2 adds
``conv_kernel_size``, ``conv_group_size``, ``selector_rank`` and ``selector_top_k``; the loader also
reads these and ``block_size`` from ``dflash_config``, where released DFlash2 configs keep them (the
public reader looks there first), and refuses the released options csbp lacks
(``output_multiplier``, ``final_logit_softcapping``, ``input_embedding_scale``), a ``hidden_act``
other than ``silu`` and ``attention_bias: true``. The public reader builds a transformers ``Qwen3Config``
from the file, so its defaults are read here too (:mod:`csbp.models.hf_config`): no ``head_dim`` is
128, no ``num_key_value_heads`` is 32 (refused unless the heads are 32), no ``layer_types`` is derived
from ``use_sliding_window``/``max_window_layers``, and ``sliding_attention`` layers without
``use_sliding_window: true`` are refused (``Qwen3Config`` drops ``sliding_window`` then, and the public
reader runs them windowless); sizes must be JSON integers (never truncated).

``model.safetensors`` holds the drafter's own weights with **no** ``model.`` prefix (``fc.weight``,
``hidden_norm.weight``, ``norm.weight``, ``layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
``layers.{i}.self_attn.{q,k}_norm.weight``, ``layers.{i}.mlp.{gate,up,down}_proj.weight``, the two
layer norms) and never the shared ``embed_tokens`` / ``lm_head``. DFlash2 tensors carry the released
DFlash2 names: ``layers.{i}.{attention,mlp}_conv.base_kernel`` ``[2, T, H]`` and
``.kernel_projection.weight``, ``candidate_selector.{predecessor,successor}_codebook`` ``[V, r]`` and
``candidate_selector.hidden_projection.weight`` (csbp's ``attn_conv.base``, ``kernel_proj``,
``selector.pred_embed``/``cand_embed``/``hidden_proj``, which compute the same thing; exports with
those names still load). The directory is written atomically.

The context convention a drafter was trained with (``objective.dflash.context``, objectives.md
§5.5) has no field in the public format, whose readers (z-lab's loop, SGLang, vLLM, and
``csbp dflash eval``) all serve context strictly before the anchor: the anchor's target hidden state
does not exist yet when its block is drafted. A csbp export records the convention in a csbp-namespaced
top-level field, ``csbp_training: {objective: {name: dflash, dflash: {context: ...}}}`` (the run
config's shape; :func:`drafter_context` reads it; public readers ignore it), so a drafter trained
``inclusive`` (to reproduce early SpecForge drafters) is marked as one that those loops serve with
a train/serve mismatch. A drafter whose origin is unknown (a released one) records nothing.

Usage::

    export_dflash(drafter, "/out/drafter")
    drafter = load_dflash("/out/drafter", target)
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from csbp.atomic import write_directory_atomically
from csbp.dflash.config import DFlashConfig, validate_drafter_target
from csbp.dflash.drafter import DFlashDrafter
from csbp.models.config import DecoderConfig
from csbp.models.decoder import Decoder
from csbp.models.hf_config import (
    DTYPE_NAMES,
    hf_shape_fields,
    rms_norm_eps,
    rope_from_hf,
    yarn_context_problem,
    yarn_max_positions,
)
from csbp.models.hf_families import (
    LAYER_TYPES,
    QWEN3_DEFAULT_HEAD_DIM,
    flag,
    positive_int,
    qwen_head_dim,
    qwen_kv_heads,
    qwen_layer_types,
    qwen_sliding_window,
)
from csbp.models.hf_io import (
    EXPORT_OWNERSHIP,
    check_tokenizer_file_names,
    read_json_object,
    read_safetensors_file,
    without_auto_map,
    write_tokenizer_files,
)

ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")
TRAINING_KEY = "csbp_training"
TARGET_RECORD_KEY = "csbp_target"
"""The target a drafter was trained against (:mod:`csbp.dflash.target_record`), kept by re-exports."""
"""The ``config.json`` field of a csbp export recording how the drafter was trained (module docstring)."""
CONTEXTS = ("strict", "inclusive")
# csbp's DFlash2 parameter names -> those of the released DFlash2 checkpoints (z-lab ``DFlash2DraftModel``,
# whose modules compute what csbp's do); older csbp exports with csbp's own names still load.
_RELEASED_SELECTOR_NAMES = {
    "selector.pred_embed": "candidate_selector.predecessor_codebook",
    "selector.cand_embed": "candidate_selector.successor_codebook",
    "selector.hidden_proj.weight": "candidate_selector.hidden_projection.weight",
}
_RELEASED_CONV_SUFFIXES = {
    f".{ours}_conv.{leaf}": f".{theirs}_conv.{released_leaf}"
    for ours, theirs in (("attn", "attention"), ("mlp", "mlp"))
    for leaf, released_leaf in (("base", "base_kernel"), ("kernel_proj.weight", "kernel_projection.weight"))
}
# Released DFlash2 options csbp does not implement, with the value that means "off".
_UNSUPPORTED_DRAFT_OPTIONS = {"output_multiplier": 1.0, "final_logit_softcapping": None, "input_embedding_scale": 1.0}


def released_name(name: str) -> str:
    """The released DFlash2 checkpoint name of drafter parameter ``name`` (unchanged for DFlash names)."""
    if name in _RELEASED_SELECTOR_NAMES:
        return _RELEASED_SELECTOR_NAMES[name]
    for ours, theirs in _RELEASED_CONV_SUFFIXES.items():
        if name.endswith(ours):
            return name[: -len(ours)] + theirs
    return name


def csbp_name(name: str) -> str:
    """Inverse of ``released_name`` (a csbp name is returned unchanged)."""
    for ours, theirs in _RELEASED_SELECTOR_NAMES.items():
        if name == theirs:
            return ours
    for ours, theirs in _RELEASED_CONV_SUFFIXES.items():
        if name.endswith(theirs):
            return name[: -len(theirs)] + ours
    return name


def _draft_value(hf: dict[str, Any], key: str, default: Any = None) -> Any:
    """``dflash_config[key]``, else the top-level ``key`` (the public reader's lookup order)."""
    value = hf["dflash_config"].get(key)
    return value if value is not None else hf.get(key, default)


def dflash_hf_config(config: DFlashConfig, *, dtype: torch.dtype, positions: int | None = None) -> dict[str, Any]:
    """The ``config.json`` dict of a drafter (module docstring); ``positions``: the
    ``max_position_embeddings`` written without YaRN (None: none written)."""
    sliding = "sliding_attention" in (config.layer_types or ())
    hf: dict[str, Any] = {
        "architectures": [ARCHITECTURES[1] if config.is_dflash2 else ARCHITECTURES[0]],
        "model_type": "qwen3",
        "block_size": config.block_size,
        "num_target_layers": config.num_target_layers,
        "dflash_config": {
            "target_layer_ids": list(config.target_layer_ids or ()),
            "mask_token_id": config.mask_token_id,
            "sliding_window_causal": config.sliding_window_causal,
        },
        **hf_shape_fields(config),
        "layer_types": list(config.layer_types or ()),
        "use_sliding_window": sliding,
        "sliding_window": config.sliding_window if sliding else None,
        "max_window_layers": config.num_layers,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "torch_dtype": DTYPE_NAMES[dtype],
        "dtype": DTYPE_NAMES[dtype],
    }
    extended = yarn_max_positions(config.rope_scaling)
    if extended is not None:  # as a target export: older readers derive YaRN's factor from it (else 32768)
        hf["max_position_embeddings"] = extended
    elif positions is not None:  # else readers take Qwen3Config's 32768, whatever the drafter serves
        hf["max_position_embeddings"] = positions
    if sliding and not config.sliding_window_causal:
        hf["is_causal"] = False  # the public reader makes sliding layers causal unless told otherwise
    if config.is_dflash2:
        hf.update(
            conv_kernel_size=config.conv_kernel_size,
            conv_group_size=config.conv_group_size,
            selector_rank=config.selector_rank,
            selector_top_k=config.selector_top_k,
        )
    return hf


def dflash_config_from_hf(hf: dict[str, Any]) -> DFlashConfig:
    """Parse a drafter ``config.json`` (one-line ``ValueError`` for anything missing or foreign)."""
    architectures = hf.get("architectures") or []
    if len(architectures) != 1 or architectures[0] not in ARCHITECTURES:
        raise ValueError(f"architectures {architectures!r} is not a DFlash drafter's (one of {list(ARCHITECTURES)})")
    if not isinstance(hf.get("dflash_config"), dict):
        raise ValueError("drafter config.json is missing required field 'dflash_config'")
    for key, off in _UNSUPPORTED_DRAFT_OPTIONS.items():
        value = _draft_value(hf, key)
        if value is not None and value != off and not (off is None and value == 0):
            raise ValueError(
                f"drafter config.json {key}={value} is not supported; csbp drafters have none "
                "(fix: load this drafter with the code it was released with)"
            )
    if hf.get("hidden_act", "silu") != "silu":  # the public reader applies it; csbp's MLPs are SwiGLU
        raise ValueError(f"drafter config.json hidden_act={hf['hidden_act']!r} is not supported; csbp implements 'silu'")
    if flag(hf, "attention_bias"):  # the public reader would add q/k/v/o biases that csbp's drafter has not
        raise ValueError("drafter config.json attention_bias=true is not supported; csbp drafters have no attention biases")
    if _draft_value(hf, "block_size") is None:
        raise ValueError("drafter config.json is missing required field 'block_size'")
    sizes: dict[str, int] = {}
    for key in (
        "num_target_layers",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
    ):
        size = positive_int(hf, key)
        if size is None:
            raise ValueError(f"drafter config.json is missing required field '{key}'")
        sizes[key] = size
    dflash = hf["dflash_config"]
    if dflash.get("mask_token_id") is None:
        raise ValueError("drafter config.json dflash_config has no mask_token_id; set the [M] token id")
    rope_theta, rope_scaling = rope_from_hf(hf)
    num_heads = sizes["num_attention_heads"]
    # the public reader builds a transformers Qwen3Config (model_type qwen3): its defaults, not csbp's
    layer_types = qwen_layer_types(hf, sizes["num_hidden_layers"])
    sliding = LAYER_TYPES[1] in layer_types
    window = qwen_sliding_window(hf)
    if sliding and window is None:
        raise ValueError(
            "drafter config.json lists sliding_attention layers, but transformers' Qwen3Config drops "
            "sliding_window unless use_sliding_window is true, so the public reader runs them without a window "
            "(fix: set use_sliding_window: true and sliding_window)"
        )
    return DFlashConfig(
        vocab_size=sizes["vocab_size"],
        hidden_size=sizes["hidden_size"],
        intermediate_size=sizes["intermediate_size"],
        num_layers=sizes["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=qwen_kv_heads(hf, num_heads, "Qwen3Config (the public drafter's)"),
        head_dim=qwen_head_dim(hf, QWEN3_DEFAULT_HEAD_DIM),
        num_target_layers=sizes["num_target_layers"],
        mask_token_id=_json_int(dflash["mask_token_id"], "dflash_config.mask_token_id", minimum=0),
        block_size=_json_int(_draft_value(hf, "block_size"), "block_size"),
        target_layer_ids=_target_layer_ids(dflash),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rms_norm_eps=rms_norm_eps(hf),
        layer_types=tuple(layer_types),
        sliding_window=window if sliding else None,
        sliding_window_causal=_sliding_window_causal(hf, layer_types),
        conv_kernel_size=_json_int(_draft_value(hf, "conv_kernel_size", 0), "conv_kernel_size", minimum=0),
        conv_group_size=_json_int(_draft_value(hf, "conv_group_size", 16), "conv_group_size"),
        selector_rank=_json_int(_draft_value(hf, "selector_rank", 0), "selector_rank", minimum=0),
        selector_top_k=_json_int(_draft_value(hf, "selector_top_k", 16), "selector_top_k"),
    )


def _target_layer_ids(dflash: dict[str, Any]) -> tuple[int, ...] | None:
    """``dflash_config.target_layer_ids`` (absent or empty: None, csbp's default), a list of integers."""
    ids = dflash.get("target_layer_ids")
    if not ids:
        return None
    if not isinstance(ids, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise ValueError(f"drafter config.json dflash_config.target_layer_ids must be a list of integers, got {ids!r}")
    return tuple(ids)


def _json_int(value: Any, where: str, *, minimum: int = 1) -> int:
    """``value`` of config field ``where`` as a JSON integer ``>= minimum``; a string, float or boolean is
    refused, never converted (``int(2.5)`` would have drafted with 2)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"drafter config.json {where} must be an integer >= {minimum}, got {value!r}")
    return value


def _sliding_window_causal(hf: dict[str, Any], layer_types: Any) -> bool:
    """Whether sliding layers are causal in the block: the public reader's top-level ``is_causal``
    (unset: sliding layers causal, full layers not; ``false``: no layer causal; ``true``: every layer
    causal), agreeing with csbp's own ``dflash_config.sliding_window_causal`` when both are given."""
    ours = hf["dflash_config"].get("sliding_window_causal")
    theirs = hf.get("is_causal")
    if theirs is None:
        return bool(ours) if ours is not None else True
    if theirs and any(t != "sliding_attention" for t in (layer_types or ("full_attention",))):
        raise ValueError(
            "drafter config.json is_causal=true makes full-attention draft layers causal in the block; csbp's "
            "full-attention layers see the whole block (fix: remove is_causal)"
        )
    if ours is not None and bool(ours) != bool(theirs):
        raise ValueError(
            f"drafter config.json is_causal={theirs} contradicts dflash_config.sliding_window_causal={ours} "
            "(fix: keep one of them)"
        )
    return bool(theirs)


def export_dflash(
    drafter: DFlashDrafter,
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    tokenizer_files: Mapping[str, bytes] | None = None,
    context: str | None = None,
    seq_len: int | None = None,
    target_positions: int | None = None,
    target: Mapping[str, str] | None = None,
) -> Path:
    """Write ``config.json`` and ``model.safetensors`` of ``drafter`` (module docstring), plus
    ``tokenizer_files`` (name -> contents; a run's: :mod:`csbp.training.export_tokenizer`; an ``auto_map``
    in their ``tokenizer_config.json`` is dropped: :func:`csbp.models.hf_io.without_auto_map`), all in
    one atomic directory write. ``context``: the
    ``objective.dflash.context`` it was trained with, recorded under ``csbp_training`` (None: not
    known, nothing recorded). ``seq_len``: the ``data.seq_len`` it was trained at, when known: under
    the target's YaRN, ``factor x original`` (the ``max_position_embeddings`` written) must be a whole
    number of at least that (:func:`csbp.models.hf_config.yarn_context_problem`; ``ValueError``).
    Without YaRN the ``max_position_embeddings`` written is the larger of ``seq_len`` and
    ``target_positions`` (the target's ``max_position_embeddings``), those known, as released drafters
    record their target's context: serving stacks run the drafter at the target's context and size its
    RoPE from this field (SGLang refuses a shorter one unless ``SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN``
    is set; vLLM's V1 runner stops drafting past it; docs/dflash.md). ``target``: the ``csbp_target``
    record of the target it was trained against (:mod:`csbp.dflash.target_record`; None: not known)."""
    gap = yarn_context_problem(drafter.config.rope_scaling, seq_len) if seq_len is not None else None
    if gap is not None:
        raise ValueError(
            f"drafter rope_scaling (its target's): {gap.why} (fix: "
            + (f"train at data.seq_len {gap.longest} or less, or " if gap.longest is not None else "")
            + "with a target whose yarn rule covers the training length)"
        )
    store_dtype = dtype if dtype is not None else drafter.fc.weight.dtype
    if store_dtype not in DTYPE_NAMES:
        raise ValueError(f"export dtype must be float64, float32 or bfloat16, got {store_dtype}")
    if context is not None and context not in CONTEXTS:
        raise ValueError(f"export_dflash: context must be one of {CONTEXTS} or None, got {context!r}")
    tokenizer = dict(tokenizer_files or {})
    check_tokenizer_file_names(tokenizer)
    tokenizer, _ = without_auto_map(tokenizer)  # a released drafter's remote-code pointer is not passed on
    known = [n for n in (seq_len, target_positions) if n is not None]
    config = dflash_hf_config(drafter.config, dtype=store_dtype, positions=max(known) if known else None)
    if context is not None:
        config[TRAINING_KEY] = {"objective": {"name": "dflash", "dflash": {"context": context}}}
    if target is not None:
        config[TARGET_RECORD_KEY] = dict(target)
    tensors = {
        released_name(name): t.detach().to(device="cpu", dtype=store_dtype).contiguous().clone()
        for name, t in drafter.state_dict().items()
    }

    def fill(staging: Path) -> None:
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "model.safetensors").chmod(0o644)  # safetensors writes 0600; the other files are 0644
        (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        write_tokenizer_files(staging, tokenizer)

    return write_directory_atomically(path, fill, overwrite=overwrite, owned=EXPORT_OWNERSHIP)


def public_reader_window_note(config: DFlashConfig, where: object) -> str | None:
    """A one-line note when the public z-lab reader would run ``config``'s sliding layers otherwise than
    csbp trained them, else None. That reader also limits the keys of the block itself to the window
    (slot ``j`` sees slot ``j'`` only when ``|j - j'| < W``; causal layers: ``0 <= j - j' < W``), which
    csbp's mask (objectives.md §5.5: the window limits the context only) does not: the two agree exactly
    when ``sliding_window >= block_size``. ``where`` names the drafter in the note."""
    window = config.sliding_window
    if "sliding_attention" not in (config.layer_types or ()) or window is None or window >= config.block_size:
        return None
    return (
        f"note: drafter {where} has sliding_window {window} < block_size {config.block_size}; the public DFlash "
        "reader (z-lab dflash/model.py) also applies the window inside the block, csbp does not, so served "
        "there its sliding layers see fewer block slots than in training (csbp dflash eval matches training)"
    )


def drafter_context(path: str | os.PathLike[str]) -> str | None:
    """The context convention drafter export ``path`` records (``strict``/``inclusive``), None when
    it records none; a record csbp cannot read is a one-line ``ValueError`` naming the file."""
    config_file = Path(path) / "config.json"
    record = read_json_object(config_file).get(TRAINING_KEY)
    if record is None:
        return None
    objective = record.get("objective") if isinstance(record, dict) else None
    dflash = objective.get("dflash") if isinstance(objective, dict) else None
    context = dflash.get("context") if isinstance(dflash, dict) else None
    if context not in CONTEXTS:
        raise ValueError(
            f"{config_file}: {TRAINING_KEY}.objective.dflash.context is {context!r}, not one of {list(CONTEXTS)} "
            f"(fix: restore the file, or remove {TRAINING_KEY} if the training convention is unknown)"
        )
    return str(context)


def read_drafter_config(directory: Path, target_config: DecoderConfig) -> DFlashConfig:
    """The drafter config of an exported ``directory``, checked against the target's config (no weights
    read: commands run it before loading either model)."""
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{directory} is not a DFlash drafter directory: config.json not found")
    try:
        config = dflash_config_from_hf(read_json_object(config_file))
    except ValueError as exc:  # say which file; a target passed as --drafter is the usual cause
        fix = "" if "(fix:" in str(exc) else " (fix: pass a `csbp dflash export` directory)"
        raise ValueError(f"{config_file}: {exc}{fix}") from None
    try:
        validate_drafter_target(config, target_config)
    except ValueError as exc:  # the drafter was trained for another target
        raise ValueError(
            f"drafter {directory}: {exc} (fix: pass the target it was trained against, the "
            "objective.dflash.target of its run)"
        ) from None
    return config


def drafter_tensors(stored: Mapping[str, Any], config: DFlashConfig, directory: Path) -> dict[str, Any]:
    """``stored`` (name -> tensor, or anything with a ``shape``: a safetensors header) under csbp's names,
    checked to be exactly the parameters of a ``config`` drafter, shape for shape (one-line ``ValueError``)."""
    tensors = {csbp_name(name): t for name, t in stored.items()}
    if len(tensors) != len(stored):
        raise ValueError(f"drafter checkpoint {directory} stores some DFlash2 tensors under two names")
    expected = {name: tuple(t.shape) for name, t in DFlashDrafter(config, device="meta").state_dict().items()}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"drafter checkpoint {directory} does not match its config: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}"
        )
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(
                f"drafter tensor '{name}' has shape {tuple(tensors[name].shape)}, config implies {shape}"
            )
    return tensors


def load_dflash(
    path: str | os.PathLike[str],
    target: Decoder,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> DFlashDrafter:
    """Load an exported drafter and attach ``target`` (validated against the drafter)."""
    directory = Path(path)
    config = read_drafter_config(directory, target.config)
    weights_file = directory / "model.safetensors"
    if not weights_file.is_file():
        raise ValueError(f"{directory} has no model.safetensors")
    tensors = drafter_tensors(read_safetensors_file(weights_file), config, directory)
    drafter = DFlashDrafter(config, device="meta")
    load_dtype = dtype if dtype is not None else tensors["fc.weight"].dtype
    if load_dtype not in DTYPE_NAMES:  # as load_hf_checkpoint: csbp computes in float64, float32 or bfloat16
        what = "stores" if dtype is None else "was asked for"
        raise ValueError(
            f"drafter {directory} {what} {load_dtype} weights, a dtype csbp does not compute in (fix: load it as "
            "bfloat16 or float32: --dtype bfloat16, dtype=torch.bfloat16 in Python)"
        )
    drafter.load_state_dict(
        {n: t.to(device=device, dtype=load_dtype) for n, t in tensors.items()}, assign=True
    )
    drafter.attach_target(target)
    return drafter


def recorded_max_positions(directory: str | Path) -> int | None:
    """``max_position_embeddings`` of a checkpoint's ``config.json`` (an int), None when it records none."""
    limit = read_json_object(Path(directory) / "config.json").get("max_position_embeddings")
    return limit if type(limit) is int else None
