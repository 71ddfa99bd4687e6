"""The decoder model (attention supplied from outside), RoPE, simple attention callables and
Hugging Face checkpoint import/export.

Importing this package does not import ``transformers``; only ``safetensors`` is needed for HF I/O.
"""

from csbp.models.attention_fns import CausalAttention, DenseMaskAttention, masked_attention
from csbp.models.config import DecoderConfig
from csbp.models.decoder import MLP, Attention, AttentionFn, Decoder, DecoderLayer, RMSNorm
from csbp.models.hf_io import (
    decoder_config_from_hf,
    export_hf_checkpoint,
    hf_config_from_decoder,
    hf_passthrough_config,
    load_hf_checkpoint,
)
from csbp.models.rope import RopeScaling, RotaryTables, rotary_tables

__all__ = [
    "MLP",
    "Attention",
    "AttentionFn",
    "CausalAttention",
    "Decoder",
    "DecoderConfig",
    "DecoderLayer",
    "DenseMaskAttention",
    "RMSNorm",
    "RopeScaling",
    "RotaryTables",
    "decoder_config_from_hf",
    "export_hf_checkpoint",
    "hf_config_from_decoder",
    "hf_passthrough_config",
    "load_hf_checkpoint",
    "masked_attention",
    "rotary_tables",
]
