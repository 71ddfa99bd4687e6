"""Hugging Face checkpoint import and export for the csbp decoder (Qwen3 and Llama families).

A HF checkpoint directory holds ``config.json`` and ``model.safetensors`` (or shards listed in
``model.safetensors.index.json``). Tensors are read with ``safetensors`` only: pickled weights
(``*.bin``) are never loaded. HF parameter names are the decoder's own names with a ``model.``
prefix (``lm_head.weight`` has none).

Usage::

    model, config = load_hf_checkpoint("/ckpt/Qwen3-0.6B", dtype=torch.bfloat16)
    export_hf_checkpoint(model, config, "/out/step_1000", tokenizer_dir="/ckpt/Qwen3-0.6B",
                         extra_config=hf_passthrough_config("/ckpt/Qwen3-0.6B"))

Only the default RoPE is implemented; checkpoints with RoPE scaling (``llama3``, ``yarn``, ...),
sliding-window layers or a non-SiLU activation are rejected with a ``ValueError``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from csbp.atomic import Ownership, write_directory_atomically
from csbp.models.config import DecoderConfig
from csbp.models.decoder import Decoder

HF_CLASS_BY_ARCH: dict[str, str] = {"qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
ARCH_BY_HF_CLASS: dict[str, str] = {cls: arch for arch, cls in HF_CLASS_BY_ARCH.items()}

_DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "float64",
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
}
# Stored tensors HF derives at load time; harmless to skip.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
PASSTHROUGH_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")
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
EXPORT_OWNERSHIP = Ownership(
    what="model export (config.json, model.safetensors, tokenizer files)",
    marker="config.json",
    names=frozenset({"config.json", "model.safetensors", "generation_config.json", *TOKENIZER_FILES}),
)
"""What ``--overwrite`` may replace: a directory holding only files an HF or DFlash export writes."""


# ----------------------------------------------------------------------------- config mapping


def decoder_config_from_hf(hf_config: dict[str, Any]) -> DecoderConfig:
    """Map a HF ``config.json`` dict onto ``DecoderConfig``; unsupported features raise ``ValueError``."""
    architectures = hf_config.get("architectures") or []
    if len(architectures) != 1 or architectures[0] not in ARCH_BY_HF_CLASS:
        raise ValueError(
            f"unsupported architectures {architectures!r} in config.json; csbp loads "
            f"{sorted(ARCH_BY_HF_CLASS)}"
        )
    arch = ARCH_BY_HF_CLASS[architectures[0]]
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
    ):
        if hf_config.get(field) is None:
            raise ValueError(f"config.json is missing required field '{field}'")
    hidden_act = hf_config.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"config.json hidden_act={hidden_act!r} is not supported; csbp implements 'silu'")
    if arch == "qwen3":
        if hf_config.get("use_sliding_window", False):
            raise ValueError(
                "config.json use_sliding_window=true is not supported; csbp has no sliding-window layers"
            )
        layer_types = hf_config.get("layer_types") or []
        if any(t != "full_attention" for t in layer_types):
            raise ValueError(
                f"config.json layer_types {sorted(set(layer_types))} are not supported; only 'full_attention'"
            )
    num_heads = int(hf_config["num_attention_heads"])
    head_dim = hf_config.get("head_dim")
    if head_dim is None:  # HF defaults: Qwen3Config.head_dim = 128, Llama derives it
        head_dim = 128 if arch == "qwen3" else int(hf_config["hidden_size"]) // num_heads
    return DecoderConfig(
        vocab_size=int(hf_config["vocab_size"]),
        hidden_size=int(hf_config["hidden_size"]),
        intermediate_size=int(hf_config["intermediate_size"]),
        num_layers=int(hf_config["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(hf_config.get("num_key_value_heads") or num_heads),
        head_dim=int(head_dim),
        rope_theta=_rope_theta_from_hf(hf_config),
        rms_norm_eps=float(hf_config.get("rms_norm_eps", 1e-6)),
        qk_norm=arch == "qwen3",
        tie_embeddings=bool(hf_config.get("tie_word_embeddings", False)),
        arch=arch,  # type: ignore[arg-type]
        attention_bias=bool(hf_config.get("attention_bias", False)),
        mlp_bias=bool(hf_config.get("mlp_bias", False)) if arch == "llama" else False,
    )


def _rope_theta_from_hf(hf_config: dict[str, Any]) -> float:
    """RoPE theta with HF's precedence: ``rope_parameters`` > ``rope_scaling`` > top-level ``rope_theta``."""
    theta = hf_config.get("rope_theta")
    for field in ("rope_scaling", "rope_parameters"):  # later fields take precedence
        params = hf_config.get(field)
        if params is None:
            continue
        if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
            raise ValueError(
                f"config.json {field} must be one flat dict; per-layer-type RoPE is not supported"
            )
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise ValueError(
                f"config.json {field} has rope_type={rope_type!r}; csbp implements only the default RoPE "
                "(no scaling)"
            )
        if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
            raise ValueError(f"config.json {field}.partial_rotary_factor is not supported (must be 1.0)")
        if params.get("rope_theta") is not None:
            theta = params["rope_theta"]
    if float(hf_config.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("config.json partial_rotary_factor is not supported (must be 1.0)")
    return float(theta) if theta is not None else 10000.0


def hf_config_from_decoder(
    config: DecoderConfig, *, dtype: torch.dtype, extra_config: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The ``config.json`` dict for ``config`` (readable by transformers 4.5x and 5.x)."""
    if config.arch == "qwen3" and (not config.qk_norm or config.mlp_bias):
        raise ValueError("arch='qwen3' export needs qk_norm=True and mlp_bias=False (HF Qwen3 layout)")
    if config.arch == "llama" and config.qk_norm:
        raise ValueError("arch='llama' export needs qk_norm=False (HF Llama has no q/k norm)")
    dtype_name = _DTYPE_NAMES[dtype]
    hf: dict[str, Any] = {
        "architectures": [HF_CLASS_BY_ARCH[config.arch]],
        "model_type": config.arch,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "tie_word_embeddings": config.tie_embeddings,
        "attention_bias": config.attention_bias,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
    }
    if config.arch == "qwen3":
        hf.update(
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=config.num_layers,
            layer_types=["full_attention"] * config.num_layers,
        )
    else:
        hf.update(mlp_bias=config.mlp_bias, pretraining_tp=1)
    extra = dict(extra_config or {})
    clashes = sorted(set(extra) & set(hf))
    if clashes:
        raise ValueError(
            f"extra_config must not override model-defining fields {clashes}; change DecoderConfig"
        )
    # Defaults for fields DecoderConfig does not carry (HF Llama would otherwise assume bos=1, eos=2).
    hf.update(max_position_embeddings=32768, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    hf.update(extra)
    return hf


def hf_passthrough_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``config.json`` fields of a checkpoint that ``DecoderConfig`` does not carry but an export
    should keep (special token ids, ``max_position_embeddings``); pass them as ``extra_config``."""
    hf_config = read_json_object(Path(path) / "config.json")
    return {key: hf_config[key] for key in PASSTHROUGH_FIELDS if key in hf_config}


# ----------------------------------------------------------------------------- loading


def load_hf_checkpoint(
    path: str | os.PathLike[str], *, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> tuple[Decoder, DecoderConfig]:
    """Load a local HF Qwen3/Llama checkpoint directory into a ``Decoder``.

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
    for key, shape in expected.items():
        if key not in tensors:
            raise ValueError(f"checkpoint {directory} is missing tensor '{key}' (expected shape {shape})")
        if tuple(tensors[key].shape) != shape:
            actual = tuple(tensors[key].shape)
            raise ValueError(f"checkpoint tensor '{key}' has shape {actual}, config.json implies {shape}")
    # A tied checkpoint may still store lm_head.weight; HF ignores it in favour of the embedding.
    ignorable = {"lm_head.weight"} if config.tie_embeddings else set()
    unexpected = sorted(
        k for k in tensors if k not in expected and k not in ignorable and not k.endswith(_IGNORED_SUFFIXES)
    )
    if unexpected:
        raise ValueError(
            f"checkpoint {directory} has tensors the config does not explain, e.g. '{unexpected[0]}' "
            f"({len(unexpected)} in all)"
        )

    target_dtype = dtype if dtype is not None else tensors["model.embed_tokens.weight"].dtype
    if target_dtype not in _DTYPE_NAMES:
        raise ValueError(
            f"checkpoint dtype {target_dtype} is not supported; pass dtype=torch.bfloat16 or float32"
        )
    return {name: tensors[_hf_name(name)].to(dtype=target_dtype) for name in model.state_dict()}


def _read_safetensors(directory: Path) -> dict[str, Tensor]:
    """All tensors of a single-file or sharded safetensors checkpoint (CPU)."""
    index_file = directory / "model.safetensors.index.json"
    if index_file.is_file():
        index = read_json_object(index_file)
        weight_map = index.get("weight_map") or {}
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_file} has no weight_map")
        tensors: dict[str, Tensor] = {}
        for shard in sorted({str(name) for name in weight_map.values()}):
            if Path(shard).name != shard or shard in ("", ".", "..") or not shard.endswith(".safetensors"):
                raise ValueError(
                    f"{index_file}: shard name '{shard}' is not a .safetensors file inside {directory} "
                    "(shards must be plain file names in the checkpoint directory)"
                )
            shard_file = directory / shard
            if not shard_file.is_file():
                raise ValueError(f"shard '{shard}' listed in {index_file.name} is missing from {directory}")
            tensors.update(read_safetensors_file(shard_file))
        listed_not_found = sorted(set(weight_map) - set(tensors))
        if listed_not_found:
            raise ValueError(
                f"tensor '{listed_not_found[0]}' listed in {index_file.name} is not in its shard"
            )
        return tensors
    files = sorted(directory.glob("*.safetensors"))
    if len(files) != 1:
        raise ValueError(
            f"{directory} needs model.safetensors or model.safetensors.index.json; found {len(files)} "
            "*.safetensors files and no index (pickled *.bin weights are never loaded)"
        )
    return read_safetensors_file(files[0])


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


def export_hf_checkpoint(
    model: Decoder,
    config: DecoderConfig,
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    extra_config: dict[str, Any] | None = None,
    tokenizer_dir: str | os.PathLike[str] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (+ tokenizer files) loadable by
    ``AutoModelForCausalLM.from_pretrained(path)``.

    The directory is assembled in a temporary sibling and moved into place with ``os.replace``, so
    ``path`` is never half-written. An existing ``path`` is replaced only with ``overwrite=True``.

    Args:
        dtype: dtype of the stored tensors; None keeps the model's dtype.
        extra_config: additional ``config.json`` fields (``eos_token_id``, ``max_position_embeddings``,
            ...); fields derived from ``config`` cannot be overridden.
        tokenizer_dir: copy the tokenizer files found there (``tokenizer.json``, ...).
    """
    if model.config != config:
        raise ValueError(
            "export_hf_checkpoint: config differs from model.config; pass the model's own config"
        )
    store_dtype = dtype if dtype is not None else model.embed_tokens.weight.dtype
    if store_dtype not in _DTYPE_NAMES:
        raise ValueError(f"export dtype must be float64, float32 or bfloat16, got {store_dtype}")
    hf_config = hf_config_from_decoder(config, dtype=store_dtype, extra_config=extra_config)
    tokenizer_files = _tokenizer_files(Path(tokenizer_dir)) if tokenizer_dir is not None else []
    tensors = {
        _hf_name(name): t.detach().to(device="cpu", dtype=store_dtype).contiguous().clone()
        for name, t in model.state_dict().items()
    }


    def fill(staging: Path) -> None:
        save_file(tensors, str(staging / "model.safetensors"), metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
        for file in tokenizer_files:
            shutil.copy2(file, staging / file.name)

    return write_directory_atomically(path, fill, overwrite=overwrite, owned=EXPORT_OWNERSHIP)


def _tokenizer_files(tokenizer_dir: Path) -> list[Path]:
    files = [tokenizer_dir / name for name in TOKENIZER_FILES if (tokenizer_dir / name).is_file()]
    if not files:
        raise ValueError(
            f"tokenizer_dir {tokenizer_dir} has none of the tokenizer files {list(TOKENIZER_FILES)}"
        )
    return files
