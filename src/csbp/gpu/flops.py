"""Model FLOPs of a BD3 training step, GPU bf16 peaks and model FLOP utilisation (MFU).

Accounting (the usual "model FLOPs", not hardware FLOPs: activation checkpointing's recompute is
*not* counted, so checkpointing lowers MFU for the same step time):

* dense matmuls: ``6 · P_layers`` per processed row (forward 2, backward 4), where ``P_layers`` are
  the weights of the attention and MLP projections; BD3 processes ``2L`` rows per sample
  (``[x_t ; x_0]``);
* LM head: ``6 · V · D`` per noisy row (the ``L`` rows a loss may score; the clean rows are never
  scored). csbp's losses run the head only on the rows they score (the masked ones), so this counts
  a little more than runs: the MFU it gives is an upper bound by the head's unscored share;
* attention: ``12 · d`` per allowed (query, key) pair and query head (forward ``QKᵀ`` and ``PV``:
  ``4·d``; backward ``dV, dP, dQ, dK``: ``8·d``). BD3 with full attention, block ``B``: a noisy row
  of block ``b`` sees its ``B`` noisy rows and the ``b·B`` clean rows before its block, a clean row
  of block ``b`` sees ``(b+1)·B`` clean rows, ``L·B + L²`` pairs in all.

Peaks are dense bf16 tensor-core TFLOP/s from the vendors' data sheets (no sparsity).

Usage::

    flops = bd3_step_flops(QWEN3_0_6B, seq_len=32768, block_size=16)
    mfu = model_flop_utilisation(flops, step_time_s=2.0, peak_tflops=gpu_bf16_peak_tflops("NVIDIA H200"))
"""

from __future__ import annotations

import re

from csbp.models.config import DecoderConfig
from csbp.plan.hardware import PRESETS

QWEN3_0_6B = DecoderConfig(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_layers=28,
    num_heads=16,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    qk_norm=True,
    tie_embeddings=True,
)
"""Qwen3-0.6B's dimensions (``config.json`` of the public checkpoint); csbp trains it from random
weights in the device check, so no download is needed."""

BF16_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", PRESETS["h200"].peak_tflops),
    ("H200 NVL", 835.0),
    ("H200", PRESETS["h200"].peak_tflops),
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", PRESETS["h100"].peak_tflops),
    ("H800 PCIe", 756.0),
    ("H800", PRESETS["h100"].peak_tflops),
    ("B200", 2250.0),
    ("A100", PRESETS["a100"].peak_tflops),
    ("A800", PRESETS["a100"].peak_tflops),
    ("L40S", 362.0),
    ("L40", 181.0),
    ("L4", 121.0),
    ("A10", 125.0),
)
"""(model name in ``torch.cuda.get_device_name()``, dense bf16 TFLOP/s), first match wins; a name
matches as a whole word (``L4`` is not the ``L40``, ``A10`` not the ``A10G``: an unknown part reports no
MFU rather than another part's). The H100/H200/A100 values are ``csbp plan``'s presets
(``csbp.plan.hardware``: the SXM parts), the others the vendors' data sheets (PCIe and NVL cards run
lower clocks)."""


def gpu_bf16_peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU by name, or None when unknown (MFU is then not reported)."""
    for key, peak in BF16_PEAK_TFLOPS:
        if re.search(rf"(?<![A-Z0-9]){re.escape(key.upper())}(?![A-Z0-9])", device_name.upper()):
            return peak
    return None


def layer_matmul_params(config: DecoderConfig) -> int:
    """Weights of one layer's q/k/v/o and gate/up/down projections."""
    q_width = config.num_heads * config.head_dim
    kv_width = config.num_kv_heads * config.head_dim
    attention = config.hidden_size * (2 * q_width + 2 * kv_width)
    return attention + 3 * config.hidden_size * config.intermediate_size


def bd3_attention_pairs(seq_len: int, block_size: int) -> int:
    """Allowed (query, key) pairs of one BD3 sample with full attention: ``L·B + L²``."""
    if seq_len % block_size != 0:
        raise ValueError(f"seq_len={seq_len} must be a multiple of block_size={block_size}")
    return seq_len * block_size + seq_len * seq_len


def attention_training_flops(pairs: int, *, num_heads: int, head_dim: int) -> int:
    """Forward and backward attention FLOPs over ``pairs`` allowed pairs: ``12·d`` per pair and head."""
    return 12 * head_dim * num_heads * pairs


def bd3_step_flops(config: DecoderConfig, *, seq_len: int, block_size: int, samples: int = 1) -> int:
    """Model FLOPs of one BD3 training step (forward and backward) of ``samples`` sequences."""
    rows = 2 * seq_len
    dense = 6 * layer_matmul_params(config) * config.num_layers * rows
    head = 6 * config.vocab_size * config.hidden_size * seq_len
    pairs = bd3_attention_pairs(seq_len, block_size) * config.num_layers
    attention = attention_training_flops(pairs, num_heads=config.num_heads, head_dim=config.head_dim)
    return samples * (dense + head + attention)


def model_flop_utilisation(flops: int, *, step_time_s: float, peak_tflops: float | None) -> float | None:
    """Achieved FLOP/s over the peak, in ``[0, 1]`` for a sane measurement; None without a peak."""
    if peak_tflops is None or step_time_s <= 0:
        return None
    return flops / step_time_s / (peak_tflops * 1e12)
