"""What each Hugging Face family's config class assumes and refuses, for ``csbp.models.hf_config``.

``csbp.models.hf_config`` translates a whole ``config.json`` (its module docstring has the family table);
this module holds the parts that differ by family: the attention shape a config means when
``num_key_value_heads`` or ``head_dim`` is absent or ``null`` (transformers' ``Qwen2Config``,
``Qwen3Config``, ``LlamaConfig`` and ``MistralConfig`` each have their own defaults), the layers
transformers would run with a sliding window (which csbp does not implement, so a config that has one
is refused), and the fixed layout each family's HF class builds, which an export must match
(:func:`check_exportable`). Field readers shared with the DFlash drafter reader (:func:`positive_int`,
:func:`flag`, the ``qwen_*`` helpers) live here too.

Mistral (``MistralConfig``, transformers 5): ``num_key_value_heads`` absent is 8 (refused unless the
attention heads are 8, as for Qwen's 32) and ``null`` is refused (its typed field is ``int``);
``head_dim`` absent or ``null`` is ``hidden_size // num_attention_heads``, which need not divide. Every
layer attends through ``sliding_window`` (absent: 4096; ``null``: none): the token at index ``i`` sees the
keys ``j`` with ``i - W < j <= i`` (``masking_utils.sliding_window_overlay``; flash attention windows only
when the keys outnumber ``W``), so a window changes nothing in a sequence of at most ``W`` tokens.
Accepted are therefore ``sliding_window: null`` and a window of at least ``max_position_embeddings``
(absent: 131072), the longest sequence the checkpoint declares; any other is refused naming both fields
(:func:`check_mistral_window`). ``attention_bias``/``mlp_bias`` are ignored, as ``MistralForCausalLM``
ignores them (it has no biases).
"""

from __future__ import annotations

from typing import Any

from csbp.models.config import DecoderConfig

QWEN_DEFAULT_KV_HEADS = 32
"""``num_key_value_heads`` of transformers' ``Qwen2Config``/``Qwen3Config`` when config.json has none."""
QWEN3_DEFAULT_HEAD_DIM = 128
"""``head_dim`` of transformers' ``Qwen3Config`` when config.json has none (Qwen2/Llama/Mistral derive it)."""
QWEN_DEFAULT_SLIDING_WINDOW = 4096
QWEN_DEFAULT_MAX_WINDOW_LAYERS = 28
"""``sliding_window`` / ``max_window_layers`` of transformers' Qwen configs when config.json has none."""
MISTRAL_DEFAULT_KV_HEADS = 8
MISTRAL_DEFAULT_SLIDING_WINDOW = 4096
MISTRAL_DEFAULT_MAX_POSITIONS = 131072
"""``num_key_value_heads`` / ``sliding_window`` / ``max_position_embeddings`` of transformers'
``MistralConfig`` when config.json has none."""
LAYER_TYPES = ("full_attention", "sliding_attention")


def positive_int(hf_config: dict[str, Any], field: str) -> int | None:
    """``hf_config[field]`` as transformers' typed configs take it, a positive JSON integer (a string or
    float is refused, never converted); None when absent or null."""
    value = hf_config.get(field)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"config.json {field} must be a positive integer, got {value!r}")
    return value


def flag(hf_config: dict[str, Any], field: str, default: bool = False) -> bool:
    """``hf_config[field]``, true or false (absent or null: ``default``); a string such as ``"false"`` is
    refused, never read as true."""
    value = hf_config.get(field)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"config.json {field} must be true or false, got {value!r}")
    return value


def attention_shape(arch: str, hf_config: dict[str, Any], sizes: dict[str, int], hf_class: str) -> tuple[int, int]:
    """``(num_kv_heads, head_dim)`` of a ``config.json`` of family ``arch`` (class ``hf_class``, named in
    messages) as its transformers config class reads them; ``sizes`` holds its required sizes. A config
    that makes transformers run any layer with a sliding window is a ``ValueError`` naming the fields."""
    hidden, num_heads = sizes["hidden_size"], sizes["num_attention_heads"]
    if arch in ("qwen3", "qwen2"):
        layer_types = qwen_layer_types(hf_config, sizes["num_hidden_layers"])
        sliding = [i for i, kind in enumerate(layer_types) if kind != LAYER_TYPES[0]]
        if sliding:
            raise ValueError(
                f"config.json makes layers {sliding} sliding-window layers (layer_types, or use_sliding_window=true "
                "with max_window_layers below num_hidden_layers: transformers slides layer i >= max_window_layers); "
                "csbp imports only checkpoints whose layers all attend fully (topology.window is a run's own choice, not "
                "read from checkpoints) (fix: use a checkpoint whose layers all use full attention)"
            )
        default_head_dim = QWEN3_DEFAULT_HEAD_DIM if arch == "qwen3" else hidden // num_heads
        return qwen_kv_heads(hf_config, num_heads, hf_class), qwen_head_dim(hf_config, default_head_dim)
    if arch == "mistral":
        check_mistral_window(hf_config)
        if "num_key_value_heads" in hf_config and hf_config["num_key_value_heads"] is None:
            raise ValueError(
                "config.json num_key_value_heads is null, which transformers' MistralConfig refuses "
                "(fix: set it to the checkpoint's KV heads, its k_proj rows / head_dim)"
            )
        num_kv_heads = kv_heads_or_default(hf_config, num_heads, hf_class, MISTRAL_DEFAULT_KV_HEADS)
        return num_kv_heads, positive_int(hf_config, "head_dim") or hidden // num_heads
    # LlamaConfig: a missing or null count or head_dim is derived from the heads
    check_llama_heads(hidden, num_heads, "config.json hidden_size", "num_attention_heads")
    return positive_int(hf_config, "num_key_value_heads") or num_heads, positive_int(hf_config, "head_dim") or (
        hidden // num_heads
    )


def kv_heads_or_default(hf_config: dict[str, Any], num_heads: int, what: str, default: int) -> int:
    """``num_key_value_heads`` of a config class ``what`` (named in the message) whose default is ``default``
    KV heads: absent is ``default``, refused unless the attention heads are that many (the usual cause is
    a config that meant its heads, and the k_proj shapes would be the first error); ``null`` is the
    attention heads."""
    if "num_key_value_heads" in hf_config and hf_config["num_key_value_heads"] is None:
        return num_heads
    count = positive_int(hf_config, "num_key_value_heads")
    if count is None and num_heads != default:
        raise ValueError(
            f"config.json has no num_key_value_heads: transformers reads a {what} config without it "
            f"as {default} KV heads, not the {num_heads} attention heads (fix: add "
            "num_key_value_heads, the checkpoint's k_proj rows / head_dim)"
        )
    return count or default


def qwen_kv_heads(hf_config: dict[str, Any], num_heads: int, what: str) -> int:
    """``num_key_value_heads`` as transformers' ``Qwen2Config``/``Qwen3Config`` read it: absent is
    :data:`QWEN_DEFAULT_KV_HEADS`, ``null`` the attention heads (:func:`kv_heads_or_default`)."""
    return kv_heads_or_default(hf_config, num_heads, what, QWEN_DEFAULT_KV_HEADS)


def qwen_head_dim(hf_config: dict[str, Any], default: int) -> int:
    """``head_dim`` of a Qwen config: absent is ``default`` (``Qwen3Config``: 128; Qwen2 derives it);
    ``null`` is refused (transformers 5 refuses it for Qwen3, and its Qwen2/Qwen3 attention would build
    ``heads x None`` projections)."""
    if "head_dim" in hf_config and hf_config["head_dim"] is None:
        raise ValueError(
            "config.json head_dim is null, which transformers' Qwen models cannot build "
            f"(fix: set it, or remove it for the default {default})"
        )
    return positive_int(hf_config, "head_dim") or default


def qwen_layer_types(hf_config: dict[str, Any], num_layers: int) -> list[str]:
    """Each layer's attention kind as transformers' ``Qwen2Config``/``Qwen3Config`` read it (5.x, and 4.x
    since it has ``layer_types``): ``layer_types`` when given (it must list ``num_layers`` known kinds), else
    layer ``i`` is ``sliding_attention`` when ``use_sliding_window`` is true, ``sliding_window`` is not null
    (absent: 4096) and ``i >= max_window_layers`` (absent: 28)."""
    given = hf_config.get("layer_types")
    if given is not None:
        if not isinstance(given, list) or len(given) != num_layers or any(t not in LAYER_TYPES for t in given):
            raise ValueError(
                f"config.json layer_types must list num_hidden_layers={num_layers} entries of {list(LAYER_TYPES)}, "
                f"got {given!r}"
            )
        return list(given)
    if qwen_sliding_window(hf_config) is None:
        return [LAYER_TYPES[0]] * num_layers
    first = hf_config.get("max_window_layers", QWEN_DEFAULT_MAX_WINDOW_LAYERS)
    if isinstance(first, bool) or not isinstance(first, int) or first < 0:
        raise ValueError(f"config.json max_window_layers must be an integer >= 0, got {first!r}")
    return [LAYER_TYPES[1] if i >= first else LAYER_TYPES[0] for i in range(num_layers)]


def qwen_sliding_window(hf_config: dict[str, Any]) -> int | None:
    """``sliding_window`` as transformers' Qwen configs keep it: None unless ``use_sliding_window`` is
    true (absent: 4096)."""
    if not flag(hf_config, "use_sliding_window"):
        return None
    if "sliding_window" not in hf_config:
        return QWEN_DEFAULT_SLIDING_WINDOW
    return positive_int(hf_config, "sliding_window")


def check_mistral_window(hf_config: dict[str, Any]) -> None:
    """Refuse a Mistral ``sliding_window`` that restricts attention within ``max_position_embeddings``
    (module docstring): accepted are ``null`` and a window of at least ``max_position_embeddings``; an absent
    window is ``MistralConfig``'s 4096 and an absent ``max_position_embeddings`` its 131072."""
    absent = "sliding_window" not in hf_config
    window = MISTRAL_DEFAULT_SLIDING_WINDOW if absent else positive_int(hf_config, "sliding_window")
    if window is None:
        return
    given_longest = positive_int(hf_config, "max_position_embeddings")
    longest = given_longest or MISTRAL_DEFAULT_MAX_POSITIONS
    if window >= longest:
        return
    raise ValueError(
        f"config.json sliding_window={window}{' (absent: MistralConfig default)' if absent else ''} is below "
        f"max_position_embeddings={longest}{'' if given_longest else ' (absent: MistralConfig default)'}: "
        f"transformers' Mistral attends only to the last {window} tokens of a longer sequence, and csbp imports "
        "only checkpoints that attend fully (topology.window is a run's own choice, not read from checkpoints) (fix: set sliding_window: null if the checkpoint attends fully, as "
        f"Mistral-7B-v0.2 and later do, or max_position_embeddings: {window} to use it only where the window "
        "changes nothing)"
    )


def check_llama_heads(hidden_size: int, num_heads: int, hidden: str, heads: str) -> None:
    """transformers 5's ``LlamaConfig`` refuses a ``hidden_size`` that ``num_attention_heads`` does not
    divide, even with an explicit ``head_dim``."""
    if hidden_size % num_heads:
        raise ValueError(
            f"{hidden}={hidden_size} is not a multiple of {heads}={num_heads}, which transformers' LlamaConfig "
            "refuses even with head_dim set (fix: use arch qwen3 or mistral, or sizes that divide)"
        )


def check_exportable(config: DecoderConfig) -> None:
    """Each family's fixed layout (the HF class would build different modules otherwise), and the sizes
    its transformers config accepts."""
    if config.arch == "qwen3" and (not config.qk_norm or config.mlp_bias or config.qkv_bias):
        raise ValueError(
            "arch='qwen3' export needs qk_norm=True, mlp_bias=False and qkv_bias=False (HF Qwen3 layout)"
        )
    if config.arch == "llama" and (config.qk_norm or config.qkv_bias):
        raise ValueError("arch='llama' export needs qk_norm=False and qkv_bias=False (HF Llama layout)")
    if config.arch == "llama":
        check_llama_heads(config.hidden_size, config.num_heads, "arch='llama' export: hidden_size", "num_heads")
    if config.arch == "qwen2" and (
        config.qk_norm or config.mlp_bias or config.attention_bias or not config.qkv_bias
    ):
        raise ValueError(
            "arch='qwen2' export needs qkv_bias=True, attention_bias=False, qk_norm=False and mlp_bias=False "
            "(HF Qwen2 has q/k/v biases only)"
        )
    if config.arch == "mistral" and (
        config.qk_norm or config.mlp_bias or config.attention_bias or config.qkv_bias
    ):
        raise ValueError(
            "arch='mistral' export needs qk_norm=False, attention_bias=False, qkv_bias=False and mlp_bias=False "
            "(HF Mistral has no biases and no q/k norms)"
        )
