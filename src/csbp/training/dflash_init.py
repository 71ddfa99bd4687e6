"""``objective.dflash.init_from``: a dflash run whose drafter starts from a drafter directory.

The directory is one in the public DFlash format (:mod:`csbp.dflash.export`): a ``csbp dflash export``
(a run's ``final/``) or a published DFlash / DFlash2 drafter such as z-lab's. Its ``config.json`` is
read as ``csbp dflash eval`` reads it (:func:`csbp.dflash.export.dflash_config_from_hf`; an ``auto_map``
is ignored: no code is ever run) and its weights from ``model.safetensors`` only (released DFlash2
names mapped back to csbp's); a pickle file is never opened.

:func:`check_init_drafter` runs in the pre-flight (:mod:`csbp.training.dflash_inputs`), before any
process starts or any weight loads, and refuses in one line naming the field, the file, both values and
the fix: a directory without ``config.json`` or ``model.safetensors`` (one with only pickle weights
says so), a drafter whose architecture is not the one the run configures (the target's width, heads,
vocabulary, depth and RoPE; ``objective.dflash.num_draft_layers``, ``objective.block_size``,
``target_layer_ids``, ``intermediate_size``, ``objective.mask_token_id``, ``layer_types`` and the
sliding window, the DFlash2 convolution and selector) and a weights file whose tensor names and shapes
(read from its header) are not that drafter's. :func:`load_init_weights` then copies the weights into
the run's drafter at step 0 (a resume takes the checkpoint's instead).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from csbp.config.schema import RunConfig
from csbp.dflash.config import DFlashConfig, describe_rope, same_rope
from csbp.dflash.drafter import DFlashDrafter
from csbp.dflash.export import dflash_config_from_hf, drafter_tensors
from csbp.models.hf_io import read_json_object, read_safetensors_file
from csbp.training.input_hints import checkpoint_directory_fix

FIELD = "objective.dflash.init_from"
WEIGHTS = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
_FIX = (
    "point objective.dflash.init_from at a `csbp dflash export` directory or a published DFlash drafter, "
    "with config.json and model.safetensors"
)
_FLOAT_DTYPES = ("F64", "F32", "BF16", "F16")
# DFlashConfig attribute -> config.json key, for what the drafter takes from the target
_FROM_TARGET = (
    ("hidden_size", "hidden_size"),
    ("vocab_size", "vocab_size"),
    ("num_target_layers", "num_target_layers"),
    ("num_heads", "num_attention_heads"),
    ("num_kv_heads", "num_key_value_heads"),
    ("head_dim", "head_dim"),
    ("rms_norm_eps", "rms_norm_eps"),
)
# DFlashConfig attribute -> (the run config's field, config.json key, what an unset field resolves to)
_CONFIGURED = (
    ("num_layers", "objective.dflash.num_draft_layers", "num_hidden_layers", None),
    ("block_size", "objective.block_size", "block_size", None),
    ("target_layer_ids", "objective.dflash.target_layer_ids", "dflash_config.target_layer_ids", "the default"),
    ("intermediate_size", "objective.dflash.intermediate_size", "intermediate_size", "the target's"),
    ("mask_token_id", "objective.mask_token_id", "dflash_config.mask_token_id", "the data's mask token"),
    ("layer_types", "objective.dflash.layer_types", "layer_types", "all full_attention"),
    ("sliding_window", "objective.dflash.sliding_window", "sliding_window", None),
    ("sliding_window_causal", "objective.dflash.sliding_window_causal", "dflash_config.sliding_window_causal", None),
    ("conv_kernel_size", "objective.dflash.conv_kernel_size", "conv_kernel_size", None),
    ("conv_group_size", "objective.dflash.conv_group_size", "conv_group_size", None),
    ("selector_rank", "objective.dflash.selector_rank", "selector_rank", None),
    ("selector_top_k", "objective.dflash.selector_top_k", "selector_top_k", None),
)


def check_init_drafter(cfg: RunConfig, run: DFlashConfig, target_dir: Path) -> Path | None:
    """The ``objective.dflash.init_from`` directory of ``cfg``, checked against ``run`` (the drafter the
    run configures, resolved) and readable without loading a weight; None when unset (module docstring)."""
    section = cfg.objective.dflash
    if section is None or section.init_from is None:
        return None
    directory = Path(section.init_from)
    config_file = directory / "config.json"
    # the fix names a run's final/ or a drafter at the same relative path under the working directory
    # (a config in a subdirectory), as model.init_from's does
    if not directory.is_dir():
        raise ValueError(f"{FIELD}: {directory} does not exist (fix: {checkpoint_directory_fix(directory, _FIX, FIELD)})")
    if not config_file.is_file():
        raise ValueError(f"{FIELD}: {directory} is not a DFlash drafter directory (no config.json) "
                         f"(fix: {checkpoint_directory_fix(directory, _FIX, FIELD)})")
    try:
        drafter = dflash_config_from_hf(read_json_object(config_file))
    except ValueError as exc:
        message = str(exc) if str(exc).startswith(str(config_file)) else f"{config_file}: {exc}"
        raise ValueError(f"{FIELD}: {message}" + ("" if "(fix:" in message else f" (fix: {_FIX})")) from None
    mismatch = architecture_mismatch(cfg, run, drafter, config_file, target_dir)
    if mismatch is not None:
        raise ValueError(mismatch)
    _check_weights_header(directory, drafter)
    return directory


def architecture_mismatch(
    cfg: RunConfig, run: DFlashConfig, drafter: DFlashConfig, config_file: Path, target_dir: Path
) -> str | None:
    """The one-line refusal for the first field where the ``init_from`` drafter (``drafter``, read from
    ``config_file``) differs from the drafter the run configures (``run``), or None when they agree."""
    fix_target = f"set objective.dflash.target to the target that drafter was trained against, or remove {FIELD}"
    for attr, key in _FROM_TARGET:
        ours, theirs = getattr(run, attr), getattr(drafter, attr)
        if ours != theirs:
            return (
                f"objective.dflash.target: {target_dir} gives the drafter {key} {_text(ours)}, but {FIELD} "
                f"{config_file} has {key} {_text(theirs)} (fix: {fix_target})"
            )
    if not same_rope(run.head_dim, (run.rope_theta, run.rope_scaling), (drafter.rope_theta, drafter.rope_scaling)):
        return (
            f"objective.dflash.target: {target_dir} gives the drafter RoPE {describe_rope(run.rope_theta, run.rope_scaling)}, "
            f"but {FIELD} {config_file} has RoPE {describe_rope(drafter.rope_theta, drafter.rope_scaling)} "
            f"(fix: {fix_target})"
        )
    section = cfg.objective.dflash
    unset = {
        "target_layer_ids": section is not None and section.target_layer_ids is None,
        "intermediate_size": section is not None and section.intermediate_size is None,
        "mask_token_id": cfg.objective.mask_token_id is None,
        "layer_types": section is not None and section.layer_types is None,
    }
    for attr, field, key, default in _CONFIGURED:
        if not _compared(attr, run, drafter):
            continue
        ours, theirs = getattr(run, attr), getattr(drafter, attr)
        if ours != theirs:
            note = f" (unset: {default})" if default is not None and unset.get(attr) else ""
            return (
                f"{field}: the run's drafter has {_text(ours)}{note}, but {FIELD} {config_file} has {key} "
                f"{_text(theirs)} (fix: set {field}: {_text(theirs)} to start from that drafter, or remove {FIELD})"
            )
    return None


def _compared(attr: str, run: DFlashConfig, drafter: DFlashConfig) -> bool:
    """Whether ``attr`` shapes both drafters: a DFlash2 module's options only when both have the module,
    the window only when both have sliding layers (an unused option is no difference)."""
    if attr == "conv_group_size":
        return run.conv_kernel_size > 0 and drafter.conv_kernel_size > 0
    if attr == "selector_top_k":
        return run.selector_rank > 0 and drafter.selector_rank > 0
    if attr in ("sliding_window", "sliding_window_causal"):
        return all("sliding_attention" in (c.layer_types or ()) for c in (run, drafter))
    return True


def _check_weights_header(directory: Path, config: DFlashConfig) -> None:
    """``model.safetensors`` exists and its header lists exactly ``config``'s tensors, floating point;
    no weight is read (a pickle file beside it is never opened)."""
    weights_file = directory / WEIGHTS
    if not weights_file.is_file():
        pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise ValueError(
                f"{FIELD}: {directory} has no {WEIGHTS}, only {pickles[0]}, a pickle file, which csbp never unpickles "
                f"(fix: convert the weights to {WEIGHTS} with the code the drafter came with, outside csbp)"
            )
        sharded = " (a sharded drafter: merge its shards into one file)" if any(directory.glob("*.safetensors")) else ""
        raise ValueError(f"{FIELD}: {directory} has no {WEIGHTS}{sharded} (fix: {_FIX})")
    try:
        with safe_open(str(weights_file), framework="pt") as handle:
            header = {name: handle.get_slice(name) for name in handle.keys()}  # noqa: SIM118 (not a dict)
            shapes = {name: torch.empty(tuple(s.get_shape()), device="meta") for name, s in header.items()}
            dtypes = {name: s.get_dtype() for name, s in header.items()}
    except (SafetensorError, OSError) as exc:
        raise ValueError(
            f"{FIELD}: {weights_file}: not a readable safetensors file ({exc}) (fix: re-export or re-download it)"
        ) from None
    try:
        drafter_tensors(shapes, config, directory)
    except ValueError as exc:
        raise ValueError(f"{FIELD}: {exc} (fix: re-export the drafter, or restore {weights_file})") from None
    odd = sorted(name for name, dtype in dtypes.items() if dtype not in _FLOAT_DTYPES)
    if odd:
        raise ValueError(
            f"{FIELD}: {weights_file} stores tensor '{odd[0]}' as {dtypes[odd[0]]}, not floating point "
            "(fix: re-export the drafter in float32 or bfloat16)"
        )


def load_init_weights(drafter: DFlashDrafter, directory: Path) -> None:
    """Copy the ``init_from`` weights of ``directory`` into ``drafter`` (in its dtype and on its device);
    the header was checked by :func:`check_init_drafter`, which this repeats on the tensors read."""
    tensors = drafter_tensors(read_safetensors_file(directory / WEIGHTS), drafter.config, directory)
    drafter.load_state_dict(tensors, strict=True)


def _text(value: Any) -> str:
    """``value`` as the config (YAML) spells it."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, Sequence) and not isinstance(value, str):
        return "[" + ", ".join(_text(v) for v in value) + "]"
    return str(value)
