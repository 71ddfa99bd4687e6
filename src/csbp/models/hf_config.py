"""Translation between a Hugging Face ``config.json`` and ``DecoderConfig`` (Qwen3, Qwen2, Llama, Mistral).

Families and what each implies:

========  ======================  ==========  ===================  ====================  ==============
arch      HF class                q/k norm    attention biases     default ``head_dim``  default KV
                                                                                         heads
========  ======================  ==========  ===================  ====================  ==============
qwen3     ``Qwen3ForCausalLM``    yes         q/k/v/o if           128                   32
                                              ``attention_bias``
qwen2     ``Qwen2ForCausalLM``    no          q/k/v always, no o   hidden / heads        32
llama     ``LlamaForCausalLM``    no          q/k/v/o if           hidden / heads        heads
                                              ``attention_bias``
mistral   ``MistralForCausalLM``  no          none                 hidden / heads        8
========  ======================  ==========  ===================  ====================  ==============

RoPE is read as transformers reads it: the legacy ``rope_scaling`` dict wins over
``rope_parameters`` (transformers 4 ignores the latter); ``rope_theta`` comes from that dict,
else the top-level field, else 10000. When both dicts are present, a ``rope_parameters`` with a
different ``rope_theta`` or a different scaling rule is a ``ValueError``: transformers 5 would
silently drop its theta (a Qwen3 config saved by transformers 5 with Qwen's documented yarn
``rope_scaling`` added by hand loads with theta 10000 there). For
``llama3``/``yarn`` a missing ``original_max_position_embeddings`` is ``max_position_embeddings``
(a top-level ``original_max_position_embeddings`` wins, as in HF); a yarn ``factor: null`` is
``max_position_embeddings / original``. Export writes the rule both as ``rope_parameters``
(transformers 5) and ``rope_scaling`` (transformers 4), and for yarn sets
``max_position_embeddings = factor x original`` so readers that derive YaRN's factor from that
ratio (older transformers releases, transformers#38224) agree and none warns. That is also YaRN's
convention (``max_position_embeddings`` the extended context, ``original_max_position_embeddings`` the
pre-training one), so a model trained at ``seq_len`` positions under YaRN has a consistent export only
when ``factor x original`` is a whole number of at least ``seq_len`` (:func:`yarn_context_problem`):
otherwise the export would claim fewer positions than trained, or older readers would compute another
factor than the one trained with.

A ``model_type`` other than the family's (``llama`` with ``LlamaForCausalLM``, ...) is a
``ValueError``: ``AutoModelForCausalLM`` builds its class from ``model_type`` (a ``mistral`` one with
``LlamaForCausalLM`` runs as Mistral, sliding window included), so csbp would load another model; the one
exception is a Fast-dLLM v2 release (``Fast_dLLM_Qwen``), read as the Qwen2 it patches (``hf_release``).
Sliding-window layers, non-SiLU activations, partial rotary embeddings, per-layer-type RoPE and a
``quantization_config`` are rejected with a ``ValueError`` naming the field. Which Qwen layers slide is
read as transformers' ``Qwen2Config``/``Qwen3Config`` read it (``hf_families.qwen_layer_types``): ``layer_types``
when given, else layer ``i`` slides when ``use_sliding_window`` is true, ``sliding_window`` is set and
``i >= max_window_layers`` (default 28); so ``use_sliding_window: true`` with ``max_window_layers`` covering
every layer loads (no layer slides), and ``sliding_window``/``max_window_layers`` are ignored when
``use_sliding_window`` is false. Every Mistral layer slides by ``sliding_window`` (absent: ``MistralConfig``'s
4096), and a window of ``W`` changes nothing in a sequence of at most ``W`` tokens: a Mistral config loads
with ``sliding_window: null`` (Mistral-7B-v0.2/v0.3, Nemo) or a window of at least ``max_position_embeddings``
(absent: 131072), and any other is refused naming both fields (so Mistral-7B-v0.1, 4096 within 32768, is);
exports write ``sliding_window: null``. Missing sizes take transformers' defaults, which differ by family
(table; ``csbp.models.hf_families`` has the details): a Qwen config without ``num_key_value_heads`` has 32 KV
heads (``null``: the attention heads), refused unless its attention heads are 32, a Mistral one 8 (refused
unless its heads are 8; ``null``, which ``MistralConfig`` refuses, too); ``head_dim`` absent is 128 for Qwen3
and ``hidden / heads`` otherwise, ``null`` (which transformers refuses or fails on for Qwen) is refused for
Qwen and ``hidden / heads`` for Llama and Mistral. Sizes that are not positive JSON
integers and flags that are not JSON booleans are refused (transformers' typed configs refuse them too; a
``"false"`` read as Python truth would have tied the embeddings).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from csbp.models.config import DecoderConfig
from csbp.models.hf_families import attention_shape, check_exportable, flag, positive_int
from csbp.models.hf_release import as_qwen2, is_fast_dllm_release
from csbp.models.rope import RopeScaling

HF_CLASS_BY_ARCH: dict[str, str] = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
}
ARCH_BY_HF_CLASS: dict[str, str] = {cls: arch for arch, cls in HF_CLASS_BY_ARCH.items()}
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "float64",
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
}
DEFAULT_MAX_POSITIONS = 32768
"""``max_position_embeddings`` of an export that is given none."""
PASSTHROUGH_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id", "max_position_embeddings")
_REQUIRED_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_ROPE_KEYS_ELSEWHERE = ("rope_theta", "partial_rotary_factor")


def decoder_config_from_hf(hf_config: dict[str, Any]) -> DecoderConfig:
    """Map a HF ``config.json`` dict onto ``DecoderConfig``; unsupported features raise ``ValueError``.
    A Fast-dLLM v2 release's is read as the Qwen2 one it patches (``csbp.models.hf_release``)."""
    if is_fast_dllm_release(hf_config):
        hf_config = as_qwen2(hf_config)
    architectures = hf_config.get("architectures") or []
    if (
        not isinstance(architectures, list) or len(architectures) != 1 or not isinstance(architectures[0], str)
        or architectures[0] not in ARCH_BY_HF_CLASS
    ):
        raise ValueError(
            f"unsupported architectures {architectures!r} in config.json; csbp loads "
            f"{sorted(ARCH_BY_HF_CLASS)}"
        )
    arch = ARCH_BY_HF_CLASS[architectures[0]]
    model_type = hf_config.get("model_type")
    if model_type is not None and model_type != arch:  # AutoModelForCausalLM builds the model_type's class
        raise ValueError(
            f"config.json model_type={model_type!r} does not match architectures {architectures!r} "
            f"(transformers builds a {model_type!r} model from it; csbp would load it as {arch!r}) "
            f"(fix: set model_type to {arch!r} if the checkpoint is a {architectures[0]})"
        )
    if hf_config.get("quantization_config"):  # its tensors are not the weights themselves (scales, packed ints)
        raise ValueError(
            "config.json quantization_config is not supported; csbp loads unquantized float32/bfloat16 weights "
            "(fix: use the unquantized checkpoint)"
        )
    for field in _REQUIRED_SIZES:
        if hf_config.get(field) is None:
            raise ValueError(f"config.json is missing required field '{field}'")
    hidden_act = hf_config.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"config.json hidden_act={hidden_act!r} is not supported; csbp implements 'silu'")
    sizes = {field: positive_int(hf_config, field) for field in _REQUIRED_SIZES}
    num_kv_heads, head_dim = attention_shape(arch, hf_config, sizes, architectures[0])
    rope_theta, rope_scaling = rope_from_hf(hf_config)
    return DecoderConfig(
        vocab_size=sizes["vocab_size"],
        hidden_size=sizes["hidden_size"],
        intermediate_size=sizes["intermediate_size"],
        num_layers=sizes["num_hidden_layers"],
        num_heads=sizes["num_attention_heads"],
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rms_norm_eps=rms_norm_eps(hf_config),
        qk_norm=arch == "qwen3",
        tie_embeddings=flag(hf_config, "tie_word_embeddings"),
        arch=arch,  # type: ignore[arg-type]
        # HF Qwen2 has q/k/v biases whatever attention_bias says, HF Mistral none (both ignore the flags)
        attention_bias=flag(hf_config, "attention_bias") if arch in ("qwen3", "llama") else False,
        qkv_bias=arch == "qwen2",
        mlp_bias=flag(hf_config, "mlp_bias") if arch == "llama" else False,
    )


def _number(value: Any, field: str, default: float) -> float:
    """``value`` as a float (absent or null: ``default``); a JSON number only: a string, list or object
    is refused in one line naming ``config.json`` ``field``, never converted or left to ``float()``."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"config.json {field} must be a number, got {value!r}")
    if not math.isfinite(value):  # json reads Infinity and NaN
        raise ValueError(f"config.json {field} must be finite, got {value!r}")
    return float(value)


def rms_norm_eps(hf_config: dict[str, Any]) -> float:
    """``rms_norm_eps`` (absent: 1e-6, the Qwen/Llama default); a JSON number."""
    eps = hf_config.get("rms_norm_eps", 1e-6)
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < math.inf:
        raise ValueError(f"config.json rms_norm_eps must be a positive number, got {eps!r}")
    return float(eps)


def rope_from_hf(hf_config: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """``(rope_theta, rope_scaling)`` of a HF ``config.json`` with HF's precedence (module docstring)."""
    if _number(hf_config.get("partial_rotary_factor"), "partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("config.json partial_rotary_factor is not supported (must be 1.0)")
    given = {f: hf_config[f] for f in ("rope_scaling", "rope_parameters") if hf_config.get(f)}
    for field, params in given.items():
        if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
            raise ValueError(f"config.json {field} must be one flat dict; per-layer-type RoPE is not supported")
        if _number(params.get("partial_rotary_factor"), f"{field}.partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"config.json {field}.partial_rotary_factor is not supported (must be 1.0)")
    field = "rope_scaling" if "rope_scaling" in given else "rope_parameters"
    params = given.get(field, {})
    where = f"{field}.rope_theta" if params.get("rope_theta") is not None else "rope_theta"
    theta = _number(params.get("rope_theta", hf_config.get("rope_theta")), where, 10000.0)
    scaling = _scaling_from(params, hf_config, field)
    if len(given) == 2:  # both written (csbp exports do, and hand-edited configs): they must agree
        other_theta = given["rope_parameters"].get("rope_theta")
        if other_theta is not None and _number(other_theta, "rope_parameters.rope_theta", theta) != theta:
            raise ValueError(
                f"config.json rope_parameters.rope_theta={other_theta} differs from the rope_theta={theta} that "
                "goes with rope_scaling (transformers uses the latter) (fix: set the top-level rope_theta)"
            )
        other = _scaling_from(given["rope_parameters"], hf_config, "rope_parameters")
        if other is not None and other != scaling:
            raise ValueError(
                "config.json rope_scaling and rope_parameters describe different RoPE scaling "
                "(fix: keep one of them)"
            )
    return theta, scaling


def _scaling_from(params: dict[str, Any], hf_config: dict[str, Any], field: str) -> RopeScaling | None:
    """The ``RopeScaling`` of one RoPE dict, with HF's fallbacks for the context lengths."""
    params = {k: v for k, v in params.items() if k not in _ROPE_KEYS_ELSEWHERE}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type in ("llama3", "yarn"):
        _fill_original_length(params, hf_config, field)
    if rope_type == "yarn" and "factor" in params and params["factor"] is None:  # DeepSeek-style
        longest = positive_int(hf_config, "max_position_embeddings")
        if longest is None:
            raise ValueError(f"config.json {field}.factor is null and max_position_embeddings is unset")
        original = params["original_max_position_embeddings"]
        if isinstance(original, bool) or not isinstance(original, int) or original < 1:
            raise ValueError(f"config.json original_max_position_embeddings must be a positive integer, got {original!r}")
        params["factor"] = longest / original
    return RopeScaling.from_dict(params, where=f"config.json {field}")


def _fill_original_length(params: dict[str, Any], hf_config: dict[str, Any], field: str) -> None:
    """HF's ``original_max_position_embeddings``: top-level field, else the dict's, else ``max_position_embeddings``."""
    if hf_config.get("original_max_position_embeddings") is not None:
        params["original_max_position_embeddings"] = hf_config["original_max_position_embeddings"]
    elif params.get("original_max_position_embeddings") is None:
        if hf_config.get("max_position_embeddings") is None:
            raise ValueError(
                f"config.json {field} needs original_max_position_embeddings (or max_position_embeddings) "
                "for rope_type llama3/yarn"
            )
        params["original_max_position_embeddings"] = hf_config["max_position_embeddings"]


def hf_rope_fields(theta: float, scaling: RopeScaling | None) -> dict[str, Any]:
    """``rope_theta``, ``rope_parameters`` and (with scaling) ``rope_scaling`` for a ``config.json``."""
    rule = scaling.to_dict() if scaling is not None else {"rope_type": "default"}
    fields: dict[str, Any] = {"rope_theta": theta, "rope_parameters": {**rule, "rope_theta": theta}}
    if scaling is not None:
        fields["rope_scaling"] = rule
    return fields



def hf_shape_fields(config: Any) -> dict[str, Any]:
    """The HF ``config.json`` fields every Qwen/Llama-style decoder shares (sizes, norm, RoPE), for a
    csbp decoder or DFlash drafter config (both name these attributes alike)."""
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": config.rms_norm_eps,
        **hf_rope_fields(config.rope_theta, config.rope_scaling),
    }


def hf_config_from_decoder(
    config: DecoderConfig, *, dtype: torch.dtype, extra_config: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The ``config.json`` dict for ``config`` (readable by transformers 4.5x and 5.x)."""
    check_exportable(config)
    dtype_name = DTYPE_NAMES[dtype]
    hf: dict[str, Any] = {
        "architectures": [HF_CLASS_BY_ARCH[config.arch]],
        "model_type": config.arch,
        **hf_shape_fields(config),
        "tie_word_embeddings": config.tie_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
    }
    if config.arch in ("qwen3", "qwen2"):
        hf.update(
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=config.num_layers,
            layer_types=["full_attention"] * config.num_layers,
        )
    if config.arch == "mistral":  # MistralConfig's absent window is 4096; csbp attends fully: none
        hf["sliding_window"] = None
    if config.arch in ("qwen3", "llama"):  # HF Qwen2 has q/k/v biases only, HF Mistral none, whatever it says
        hf["attention_bias"] = config.attention_bias
    if config.arch == "llama":
        hf.update(mlp_bias=config.mlp_bias, pretraining_tp=1)
    extra = dict(extra_config or {})
    clashes = sorted(set(extra) & set(hf))
    if clashes:
        raise ValueError(
            f"extra_config must not override model-defining fields {clashes}; change DecoderConfig"
        )
    # Defaults for fields DecoderConfig does not carry (HF Llama would otherwise assume bos=1, eos=2).
    hf.update(max_position_embeddings=DEFAULT_MAX_POSITIONS, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    hf.update(extra)
    extended = yarn_max_positions(config.rope_scaling)
    if extended is not None:
        hf["max_position_embeddings"] = extended
    return hf


def yarn_max_positions(scaling: RopeScaling | None) -> int | None:
    """``factor x original_max_position_embeddings`` of a YaRN rule (when a whole number), the
    ``max_position_embeddings`` an export writes so that readers deriving YaRN's factor from that ratio
    (transformers before #40320, transformers#38224) agree; None for other rules."""
    if scaling is None or scaling.rope_type != "yarn":
        return None
    assert scaling.original_max_position_embeddings is not None
    extended = scaling.factor * scaling.original_max_position_embeddings
    return int(extended) if extended == int(extended) else None


@dataclass(frozen=True)
class YarnGap:
    """Why no ``max_position_embeddings`` is consistent with a YaRN rule and a training length:
    ``factor``, the smallest whole factor that would cover it; ``longest``, the longest training
    length the rule covers (None when ``factor x original`` is no whole number)."""

    why: str
    factor: int
    longest: int | None


def yarn_context_problem(scaling: RopeScaling | None, seq_len: int) -> YarnGap | None:
    """The :class:`YarnGap` of a YaRN rule for a model trained at ``seq_len`` positions (module
    docstring): ``factor x original`` is no whole number, or is below ``seq_len``; None otherwise
    (and for other rules)."""
    if scaling is None or scaling.rope_type != "yarn":
        return None
    original = scaling.original_max_position_embeddings
    assert original is not None
    extended = scaling.factor * original
    factor = max(math.ceil(scaling.factor), math.ceil(seq_len / original))
    if extended != int(extended):
        why = (
            f"yarn factor {scaling.factor:g} x original_max_position_embeddings {original} = {extended:g} is no whole "
            "number of positions, so no max_position_embeddings carries that factor to readers that derive it from "
            "their ratio"
        )
        return YarnGap(why, factor, None)
    if extended < seq_len:
        why = (
            f"yarn extends original_max_position_embeddings {original} by factor {scaling.factor:g} to {int(extended)} "
            f"positions, fewer than data.seq_len {seq_len}: the export writes max_position_embeddings = factor x "
            "original (YaRN's extended context, as transformers reads it) and would claim fewer positions than trained"
        )
        return YarnGap(why, factor, int(extended))
    return None
