"""Hugging Face checkpoint import and export for the csbp decoder (Qwen3, Qwen2, Llama and Mistral families).

A HF checkpoint directory holds ``config.json`` and ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``). Tensors are read with ``safetensors`` only: pickled weights
(``*.bin``) are never loaded. HF parameter names are the decoder's own names with a ``model.``
prefix (``lm_head.weight`` has none).

Usage::

    model, config = load_hf_checkpoint("/ckpt/Qwen3-0.6B", dtype=torch.bfloat16)
    export_hf_checkpoint(model, config, "/out/step_1000", tokenizer_dir="/ckpt/Qwen3-0.6B",
                         extra_config=hf_passthrough_config("/ckpt/Qwen3-0.6B"),
                         generation_config=read_generation_config("/ckpt/Qwen3-0.6B"))

The ``config.json`` translation (families, RoPE scaling ``linear``/``llama3``/``yarn``, what is
rejected) lives in ``csbp.models.hf_config``; this module reads and writes the files.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from csbp.atomic import Ownership, write_directory_atomically
from csbp.models.config import DecoderConfig
from csbp.models.decoder import Decoder
from csbp.models.hf_config import (
    ARCH_BY_HF_CLASS,
    HF_CLASS_BY_ARCH,
    PASSTHROUGH_FIELDS,
    decoder_config_from_hf,
    hf_config_from_decoder,
)
from csbp.models.hf_config import DTYPE_NAMES as _DTYPE_NAMES

__all__ = [
    "ARCH_BY_HF_CLASS",
    "EXPORT_OWNERSHIP",
    "HF_CLASS_BY_ARCH",
    "PASSTHROUGH_FIELDS",
    "TOKENIZER_FILES",
    "check_tokenizer_file_names",
    "decoder_config_from_hf",
    "export_hf_checkpoint",
    "hf_config_from_decoder",
    "hf_passthrough_config",
    "load_hf_checkpoint",
    "read_generation_config",
    "read_hf_config",
    "read_hf_weights",
    "read_json_object",
    "read_safetensors_file",
    "tokenizer_files_in",
    "without_auto_map",
    "write_tokenizer_files",
]

# Stored tensors HF derives at load time; harmless to skip.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
GENERATION_CONFIG = "generation_config.json"
EXPORT_OWNERSHIP = Ownership(
    what="model export (config.json, model.safetensors, generation_config.json, tokenizer files)",
    marker="config.json",
    names=frozenset({"config.json", "model.safetensors", GENERATION_CONFIG, *TOKENIZER_FILES}),
)
"""What ``--overwrite`` may replace: a directory holding only files an HF or DFlash export writes."""


# ----------------------------------------------------------------------------- config fields


def hf_passthrough_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``config.json`` fields of a checkpoint that ``DecoderConfig`` does not carry but an export
    should keep (special token ids, ``max_position_embeddings``); pass them as ``extra_config``."""
    hf_config = read_json_object(Path(path) / "config.json")
    return {key: hf_config[key] for key in PASSTHROUGH_FIELDS if key in hf_config}


def read_generation_config(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The ``generation_config.json`` of a checkpoint directory (its sampling defaults and the token
    ids ``generate`` stops at), None when it has none; a malformed one is a ``ValueError`` naming it."""
    file = Path(path) / GENERATION_CONFIG
    return read_json_object(file) if file.is_file() else None


def generation_stop_ids(path: str | os.PathLike[str], vocab_size: int, *, mask_token_id: int | None = None) -> list[int]:
    """Every ``eos_token_id`` (one id or a list) of a checkpoint's ``generation_config.json``, where a
    chat model lists its end of turn (``<|im_end|>``) beside the end of text: the ids Hugging Face
    ``generate`` stops at; none without the file. An id outside ``[0, vocab_size)`` or equal to
    ``mask_token_id`` (never generated) is a ``ValueError`` naming the file."""
    file = Path(path) / GENERATION_CONFIG
    listed = (read_generation_config(path) or {}).get("eos_token_id")
    ids = listed if isinstance(listed, list) else [] if listed is None else [listed]
    for token_id in ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < vocab_size:
            raise ValueError(
                f"{file}: eos_token_id {token_id!r} is not a token id of the model vocabulary [0, {vocab_size}) "
                "(fix: list its tokenizer's end-of-text/turn ids there)"
            )
        if token_id == mask_token_id:
            raise ValueError(
                f"{file}: eos_token_id {token_id} is the mask token, which is never generated "
                "(fix: remove it from eos_token_id)"
            )
    return ids


def stop_token_ids(model_dir: Path, eos_id: int | None, vocab_size: int, mask_token_id: int) -> list[int]:
    """The ids that end a completion (``csbp generate``'s, and the sample a run prints when it ends):
    the tokenizer's EOS and every ``eos_token_id`` of the model's ``generation_config.json`` (where a
    chat export lists its end of turn, ``<|im_end|>``), as Hugging Face ``generate`` stops; an id there
    outside the vocabulary or equal to the mask token is refused naming the file."""
    stops = [] if eos_id is None else [eos_id]
    return stops + [t for t in generation_stop_ids(model_dir, vocab_size, mask_token_id=mask_token_id) if t not in stops]


# ----------------------------------------------------------------------------- loading


def load_hf_checkpoint(
    path: str | os.PathLike[str], *, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> tuple[Decoder, DecoderConfig]:
    """Load a local HF Qwen3/Qwen2/Llama/Mistral checkpoint directory into a ``Decoder``.

    Args:
        path: directory with ``config.json`` and safetensors weights.
        dtype: parameter dtype; None keeps the dtype of the stored embedding matrix.
        device: where the parameters end up.
    """
    model = Decoder(read_hf_config(path), device="meta")
    state = read_hf_weights(path, model, dtype=dtype)
    state = {name: tensor.to(device=device) for name, tensor in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model, model.config


def read_hf_config(path: str | os.PathLike[str]) -> DecoderConfig:
    """The ``DecoderConfig`` of a local HF checkpoint directory (``ValueError`` without config.json)."""
    directory = Path(path)
    config_file = directory / "config.json"
    if not config_file.is_file():
        raise ValueError(f"{directory} is not a HF checkpoint directory: config.json not found")
    return decoder_config_from_hf(read_json_object(config_file))


def read_hf_weights(
    path: str | os.PathLike[str], model: Decoder, *, dtype: torch.dtype | None = None
) -> dict[str, Tensor]:
    """The checkpoint's tensors on the CPU keyed by ``model``'s parameter names, checked against its
    shapes (``model`` may live on the ``meta`` device or be sharded: only names and shapes are read);
    ``dtype`` None keeps the stored embedding's dtype."""
    directory = Path(path)
    config = model.config
    tensors = _read_safetensors(directory)
    expected = {_hf_name(name): tuple(t.shape) for name, t in model.state_dict().items()}
    pair_fix = (
        "(fix: keep each model.safetensors with the config.json it was saved with: copy or point at the whole "
        "export directory)"
    )
    for key, shape in expected.items():
        if key not in tensors:
            raise ValueError(f"checkpoint {directory} is missing tensor '{key}' (expected shape {shape}) {pair_fix}")
        if tuple(tensors[key].shape) != shape:
            actual = tuple(tensors[key].shape)
            raise ValueError(
                f"checkpoint {directory}: tensor '{key}' has shape {actual}, config.json implies {shape} {pair_fix}"
            )
    # A tied checkpoint may still store lm_head.weight, a copy of the embedding; one that differs is read
    # two ways: transformers 4 ties it to the embedding, transformers 5 leaves the two untied (with a warning).
    ignorable = {"lm_head.weight"} if config.tie_embeddings else set()
    stored_head = tensors.get("lm_head.weight") if config.tie_embeddings else None
    embedding = tensors.get("model.embed_tokens.weight")
    if stored_head is not None and embedding is not None and not torch.equal(stored_head, embedding):
        raise ValueError(
            f"checkpoint {directory}: config.json has tie_word_embeddings=true but it stores an lm_head.weight that "
            "differs from model.embed_tokens.weight (transformers 5 uses it untied, transformers 4 ties it to the "
            "embedding) (fix: set tie_word_embeddings to false to use the stored head, or delete lm_head.weight to tie)"
        )
    unexpected = sorted(
        k for k in tensors if k not in expected and k not in ignorable and not k.endswith(_IGNORED_SUFFIXES)
    )
    if unexpected:
        raise ValueError(
            f"checkpoint {directory} has tensors the config does not explain, e.g. '{unexpected[0]}' "
            f"({len(unexpected)} in all) {pair_fix}"
        )

    target_dtype = dtype if dtype is not None else tensors["model.embed_tokens.weight"].dtype
    if target_dtype not in _DTYPE_NAMES:
        what = "stores" if dtype is None else "was asked for"
        raise ValueError(
            f"checkpoint {directory} {what} {target_dtype} weights, a dtype csbp does not compute in (fix: load it "
            "as bfloat16 or float32: --dtype bfloat16, dtype=torch.bfloat16 in Python)"
        )
    return {name: tensors[_hf_name(name)].to(dtype=target_dtype) for name in model.state_dict()}


def weight_files(directory: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files a checkpoint's weights are read from, sorted, and the index's
    ``weight_map`` (None for a single file); ``ValueError`` naming what is wrong or missing."""
    index_file = directory / "model.safetensors.index.json"
    if index_file.is_file() and (directory / "model.safetensors").is_file():  # transformers would read the latter
        raise ValueError(
            f"{directory} has both model.safetensors and model.safetensors.index.json, which may hold different "
            "weights (fix: delete the one left over from an earlier save)"
        )
    if index_file.is_file():
        index = read_json_object(index_file)
        weight_map = index.get("weight_map") or {}
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_file} has no weight_map")
        shards = sorted({str(name) for name in weight_map.values()})
        for shard in shards:
            if Path(shard).name != shard or shard in ("", ".", "..") or not shard.endswith(".safetensors"):
                raise ValueError(
                    f"{index_file}: shard name '{shard}' is not a .safetensors file inside {directory} "
                    "(shards must be plain file names in the checkpoint directory)"
                )
            if not (directory / shard).is_file():
                raise ValueError(f"shard '{shard}' listed in {index_file.name} is missing from {directory}")
        return [directory / shard for shard in shards], weight_map
    files = sorted(directory.glob("*.safetensors"))
    if len(files) != 1:
        raise ValueError(
            f"{directory} needs model.safetensors or model.safetensors.index.json; found {len(files)} "
            "*.safetensors files and no index; pickled *.bin weights are never loaded (fix: pass the directory "
            "that holds its weights as safetensors, e.g. RUN/final)"
        )
    return files, None


def _read_safetensors(directory: Path) -> dict[str, Tensor]:
    """All tensors of a single-file or sharded safetensors checkpoint (CPU)."""
    files, weight_map = weight_files(directory)
    if weight_map is None:
        return read_safetensors_file(files[0])
    tensors: dict[str, Tensor] = {}
    for shard_file in files:
        shard = shard_file.name
        for name, tensor in read_safetensors_file(shard_file).items():
            # readers differ on which copy of a tensor wins: each must be in the one shard the index names
            listed = weight_map.get(name)
            if (listed is not None and listed != shard) or name in tensors:
                where = f"the index names {listed}" if listed is not None else "it is in another shard too"
                raise ValueError(
                    f"tensor '{name}' is in shard {shard} of {directory} but {where} "
                    "(fix: re-save the checkpoint so that each tensor is in the one shard its index names)"
                )
            tensors[name] = tensor
    listed_not_found = sorted(set(weight_map) - set(tensors))
    if listed_not_found:
        raise ValueError(
            f"tensor '{listed_not_found[0]}' listed in model.safetensors.index.json is not in its shard"
        )
    return tensors


def read_safetensors_file(path: Path) -> dict[str, Tensor]:
    """The tensors of one safetensors file; a truncated or malformed file is a ``ValueError`` naming it."""
    try:
        return load_file(str(path))
    except SafetensorError as exc:
        raise ValueError(f"{path}: not a readable safetensors file ({exc}) (fix: re-export or re-download it)") from None


def read_json_object(path: Path) -> dict[str, Any]:
    """``path`` parsed as a JSON object; ``ValueError`` naming the file otherwise."""
    try:
        loaded = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: malformed JSON ({exc.msg} at line {exc.lineno}) (fix: restore the file)") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text; expected a JSON object (fix: restore the file)") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"{path}: expected a JSON object, found {type(loaded).__name__} (fix: restore the file)")
    return loaded


def _hf_name(name: str) -> str:
    return name if name.startswith("lm_head.") else f"model.{name}"


# ----------------------------------------------------------------------------- export


def tensors_to_store(state: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``state`` under HF names, on the CPU in ``dtype``, without a second copy of the weights: a
    tensor already in that form is stored as it is (an 8B float32 model would otherwise hold 32 GB
    more while exporting); only one that shares memory with another (tied weights) or is a view into
    a larger buffer is copied, as safetensors writes each tensor from its own whole storage."""
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()
    for name, tensor in state.items():
        out = tensor.detach().to(device="cpu", dtype=dtype).contiguous()
        storage = out.untyped_storage()
        if storage.data_ptr() in storages or storage.nbytes() != out.nbytes:
            out = out.clone()
        storages.add(out.untyped_storage().data_ptr())
        tensors[_hf_name(name)] = out
    return tensors


def export_hf_checkpoint(
    model: Decoder,
    config: DecoderConfig,
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    extra_config: dict[str, Any] | None = None,
    tokenizer_dir: str | os.PathLike[str] | None = None,
    tokenizer_files: Mapping[str, bytes] | None = None,
    generation_config: dict[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (+ ``generation_config.json``, tokenizer files)
    loadable by ``AutoModelForCausalLM.from_pretrained(path)``.

    The directory is assembled in a temporary sibling and moved into place with ``os.replace``, so
    ``path`` is never half-written. An existing ``path`` is replaced only with ``overwrite=True``.

    Args:
        dtype: dtype of the stored tensors; None keeps the model's dtype.
        extra_config: additional ``config.json`` fields (``eos_token_id``, ``max_position_embeddings``,
            ...); fields derived from ``config`` cannot be overridden.
        tokenizer_dir: copy the tokenizer files found there (``tokenizer.json``, ...); an ``auto_map``
            (remote code) of its ``tokenizer_config.json`` is dropped (:func:`without_auto_map`).
        tokenizer_files: or write these tokenizer files (name -> contents; a run's exports:
            :mod:`csbp.training.export_tokenizer`).
        generation_config: the ``generation_config.json`` to write (e.g. :func:`read_generation_config`
            of the source checkpoint); None writes none.
    """
    if model.config != config:
        raise ValueError(
            "export_hf_checkpoint: config differs from model.config; pass the model's own config"
        )
    store_dtype = dtype if dtype is not None else model.embed_tokens.weight.dtype
    if store_dtype not in _DTYPE_NAMES:
        raise ValueError(f"export dtype must be float64, float32 or bfloat16, got {store_dtype}")
    hf_config = hf_config_from_decoder(config, dtype=store_dtype, extra_config=extra_config)
    if tokenizer_dir is not None and tokenizer_files is not None:
        raise ValueError("export_hf_checkpoint: pass tokenizer_dir or tokenizer_files, not both")
    tokenizer = dict(tokenizer_files or {})
    if tokenizer_dir is not None:
        tokenizer = tokenizer_files_in(Path(tokenizer_dir))
        if not tokenizer:
            raise ValueError(
                f"tokenizer_dir {tokenizer_dir} has none of the tokenizer files {list(TOKENIZER_FILES)}"
            )
    check_tokenizer_file_names(tokenizer)
    tokenizer, _ = without_auto_map(tokenizer)
    tensors = tensors_to_store(model.state_dict(), store_dtype)

    def fill(staging: Path) -> None:
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "model.safetensors").chmod(0o644)  # safetensors writes 0600; the other files are 0644
        (staging / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
        if generation_config is not None:
            (staging / GENERATION_CONFIG).write_text(json.dumps(generation_config, indent=2, sort_keys=True) + "\n")
        write_tokenizer_files(staging, tokenizer)

    return write_directory_atomically(path, fill, overwrite=overwrite, owned=EXPORT_OWNERSHIP)


def without_auto_map(files: Mapping[str, bytes]) -> tuple[dict[str, bytes], bool]:
    """``files`` with the ``auto_map`` of their ``tokenizer_config.json`` removed, and whether it had one.

    ``auto_map`` points ``AutoTokenizer(trust_remote_code=True)`` at Python code (a file of the source
    directory, which an export never holds, or a Hub repository, which it would fetch and run); csbp ran
    none (it reads ``tokenizer.json``), so an export does not pass the pointer on to its users, as
    :mod:`csbp.training.export_tokenizer` does for a run's exports. A ``tokenizer_config.json`` naming one
    that is not a JSON object is a ``ValueError``."""
    out = dict(files)
    data = out.get("tokenizer_config.json")
    if data is None or b"auto_map" not in data:
        return out, False
    try:
        config = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        config = None
    if not isinstance(config, dict):
        raise ValueError("tokenizer_config.json is not a JSON object (fix: restore it in the tokenizer directory)")
    if "auto_map" not in config:
        return out, False
    del config["auto_map"]
    out["tokenizer_config.json"] = (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    return out, True


def check_tokenizer_file_names(files: Mapping[str, bytes]) -> None:
    """``ValueError`` unless every name is one of :data:`TOKENIZER_FILES` (what ``--overwrite`` may replace)."""
    foreign = sorted(set(files) - set(TOKENIZER_FILES))
    if foreign:
        raise ValueError(f"tokenizer file names {foreign} are not among {list(TOKENIZER_FILES)}")


def write_tokenizer_files(directory: Path, files: Mapping[str, bytes]) -> None:
    """Write ``files`` (name -> contents) into ``directory`` (an export's staging directory)."""
    for name, data in files.items():
        (directory / name).write_bytes(data)
        (directory / name).chmod(0o644)


def tokenizer_files_in(directory: Path) -> dict[str, bytes]:
    """The :data:`TOKENIZER_FILES` ``directory`` holds (name -> contents; empty when none)."""
    return {name: (directory / name).read_bytes() for name in TOKENIZER_FILES if (directory / name).is_file()}
