"""Shape and numerics configuration of the Qwen3/Qwen2/Llama/Mistral-family decoder (``csbp.models.decoder``).

One frozen dataclass, validated on construction, shared by the decoder, the HF importer/exporter
and anything that needs to size a model (memory estimates, optimizer groups).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from csbp.models.rope import RopeScaling

SUPPORTED_ARCHS: tuple[str, ...] = ("qwen3", "qwen2", "llama", "mistral")


@dataclass(frozen=True)
class DecoderConfig:
    """Decoder hyper-parameters.

    Attributes:
        vocab_size: number of token ids (rows of the embedding and of the LM head).
        hidden_size: residual stream width ``D``.
        intermediate_size: SwiGLU inner width of the MLP.
        num_layers: number of decoder layers.
        num_heads: query heads ``Hq``.
        num_kv_heads: key/value heads ``Hkv`` (grouped-query attention; ``Hq % Hkv == 0``).
        head_dim: per-head width ``d`` (need not equal ``hidden_size // num_heads``).
        rope_theta: RoPE base wavelength.
        rope_scaling: RoPE scaling rule (``linear``, ``llama3``, ``yarn``); None: plain RoPE.
        rms_norm_eps: epsilon of every RMSNorm.
        qk_norm: per-head RMSNorm of queries and keys before RoPE (Qwen3); False for Llama and Mistral.
        tie_embeddings: the LM head reuses the token embedding matrix.
        arch: Hugging Face family used on export (``qwen3`` needs ``qk_norm=True`` and
            ``mlp_bias=False``; ``llama`` needs ``qk_norm=False``; ``qwen2`` needs ``qkv_bias=True``
            and no q/k norm, o bias or MLP bias; ``mistral`` needs no q/k norm and no biases).
        attention_bias: biases on the q/k/v/o projections (HF Llama/Qwen3 ``attention_bias``).
        qkv_bias: biases on the q/k/v projections only, none on o (Qwen2); exclusive with
            ``attention_bias``.
        mlp_bias: biases on the gate/up/down projections.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    qk_norm: bool = True
    tie_embeddings: bool = False
    arch: Literal["qwen3", "qwen2", "llama", "mistral"] = "qwen3"
    attention_bias: bool = False
    mlp_bias: bool = False
    qkv_bias: bool = False
    rope_scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"DecoderConfig.{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"DecoderConfig.num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(f"DecoderConfig.head_dim must be even for RoPE, got {self.head_dim}")
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"DecoderConfig.{name} must be a number, got {value!r}")
            object.__setattr__(self, name, float(value))
        if not 0.0 < self.rope_theta < math.inf:  # inf: every pair but the first never rotates
            raise ValueError(f"DecoderConfig.rope_theta must be positive and finite, got {self.rope_theta!r}")
        if not 0.0 < self.rms_norm_eps < math.inf:
            raise ValueError(f"DecoderConfig.rms_norm_eps must be positive and finite, got {self.rms_norm_eps!r}")
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"DecoderConfig.arch must be one of {SUPPORTED_ARCHS}, got {self.arch!r}")
        for name in ("qk_norm", "tie_embeddings", "attention_bias", "mlp_bias", "qkv_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"DecoderConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.attention_bias and self.qkv_bias:
            raise ValueError(
                "DecoderConfig: attention_bias (q/k/v/o biases) already includes qkv_bias; set only one"
            )
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(
                f"DecoderConfig.rope_scaling must be a RopeScaling or None, got {type(self.rope_scaling).__name__}"
            )

    @property
    def has_qkv_bias(self) -> bool:
        """Biases on the q/k/v projections (``attention_bias`` or ``qkv_bias``)."""
        return self.attention_bias or self.qkv_bias

    def num_parameters(self, *, include_embeddings: bool = True) -> int:
        """Exact number of trainable parameters of ``Decoder(self)``.

        With ``include_embeddings=False`` the token embedding (and an untied LM head) are left out,
        which is the count that usually enters FLOP estimates.
        """
        d_model, d_head = self.hidden_size, self.head_dim
        q_width, kv_width = self.num_heads * d_head, self.num_kv_heads * d_head
        attention = d_model * q_width + 2 * d_model * kv_width + q_width * d_model
        if self.has_qkv_bias:
            attention += q_width + 2 * kv_width
        if self.attention_bias:
            attention += d_model
        if self.qk_norm:
            attention += 2 * d_head
        mlp = 3 * d_model * self.intermediate_size
        if self.mlp_bias:
            mlp += 2 * self.intermediate_size + d_model
        layer = attention + mlp + 2 * d_model  # two RMSNorm weights
        total = self.num_layers * layer + d_model  # final norm
        if include_embeddings:
            total += self.vocab_size * d_model
            if not self.tie_embeddings:
                total += self.vocab_size * d_model
        return total
