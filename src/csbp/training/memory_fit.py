"""Refuse a run whose weights and optimizer state cannot fit in memory, before any rank starts.

``--set model.hidden_size=1000000000000`` is a valid config (every field is a positive integer),
but each rank would then ask the allocator for petabytes, and ``model.num_layers`` at 10^12 spins
building layers until killed. :func:`check_state_fits` compares a lower bound of what every rank
holds before its first step with the memory it has, and names the config field responsible.

The bound counts only what no layout avoids, so it never refuses a run that could have fitted:

* the trained parameters in the master dtype (float32; float64 under ``train.precision: fp64``),
  their gradients and AdamW's two moments: 4 copies (5 with the weight average of
  ``optim.ema_decay``), divided over the data-parallel ranks under ``train.fsdp``;
* for ``dflash``, the frozen target's weights in the master dtype (every rank loads it whole), and
  of the drafter only its fused-feature projection and draft layers.

Activations, gathered K/V and the logits chunk come on top (``csbp plan`` models them).
The memory of a rank is its GPU's on CUDA; on the CPU, the machine's RAM and swap shared by the
processes this node starts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from csbp.config.schema import RunConfig
from csbp.models.config import DecoderConfig
from csbp.plan.hardware import meminfo_kib
from csbp.training.preflight import RunInputs
from csbp.wording import counted, size

STATE_COPIES = 4
"""Weights, gradients and AdamW's first and second moments, each one value per parameter."""

SMALLEST_SHAPE: dict[str, Callable[[DecoderConfig], dict[str, int]]] = {
    "vocab_size": lambda c: {"vocab_size": 1},
    "hidden_size": lambda c: {"hidden_size": 1},
    "intermediate_size": lambda c: {"intermediate_size": 1},
    "num_layers": lambda c: {"num_layers": 1},
    "num_heads": lambda c: {"num_heads": c.num_kv_heads},  # a multiple of the K/V heads
    "num_kv_heads": lambda c: {"num_kv_heads": 1, "num_heads": c.num_heads // c.num_kv_heads},  # same groups
    "head_dim": lambda c: {"head_dim": 2},  # even, for RoPE
}
"""Each shape field of :class:`DecoderConfig` at its smallest valid value (with what that implies)."""


def state_bytes(inputs: RunInputs, *, fp64: bool, shards: int, averaged: bool = False) -> int:
    """A lower bound on the bytes one rank holds before its first step (see the module docstring), with
    float64 master weights or not, the trained state split in ``shards`` (FSDP's dp ranks; else 1), and
    a weight average (``optim.ema_decay``) or not."""
    master = 8 if fp64 else 4
    copies = STATE_COPIES + (1 if averaged else 0)
    if inputs.dflash is not None:
        drafter = inputs.dflash.drafter_config
        trained = drafter.decoder_config().num_parameters(include_embeddings=False)
        trained += drafter.feature_width * drafter.hidden_size
        frozen = inputs.decoder_config.num_parameters()
        return copies * master * trained // shards + master * frozen
    return copies * master * inputs.decoder_config.num_parameters() // shards


def rank_memory_bytes(local_ranks: int) -> int | None:
    """Memory of one rank: its GPU's on CUDA, else this machine's RAM and swap over ``local_ranks``
    (None where ``/proc/meminfo`` cannot be read: nothing is refused on a guess)."""
    if torch.cuda.is_available():  # the GPUs the node's ranks use: cuda:0 .. cuda:<local_ranks - 1>
        used = range(max(min(local_ranks, torch.cuda.device_count()), 1))
        return min(torch.cuda.get_device_properties(i).total_memory for i in used)
    counts = meminfo_kib()
    kib = counts.get("MemTotal", 0) + counts.get("SwapTotal", 0)
    return kib * 1024 // max(local_ranks, 1) if counts.get("MemTotal") else None


def check_state_fits(cfg: RunConfig, inputs: RunInputs, *, local_ranks: int, memory: int | None = None) -> None:
    """``ValueError`` (one line naming the field) when :func:`state_bytes` exceeds the memory of a rank
    (``memory``; default :func:`rank_memory_bytes` of ``local_ranks`` processes on this node)."""
    fp64, dp, averaged = cfg.train.precision == "fp64", cfg.topology.dp, cfg.optim.ema_decay is not None
    need = state_bytes(inputs, fp64=fp64, shards=dp if cfg.train.fsdp else 1, averaged=averaged)
    have = rank_memory_bytes(local_ranks) if memory is None else memory
    if have is None or need <= have:
        return
    on_gpu = memory is None and torch.cuda.is_available()
    where = "its GPU" if on_gpu else f"this machine's RAM and swap shared by {counted(local_ranks, 'rank')}"
    field, fix = _responsible_field(cfg, inputs)
    if inputs.dflash is None and not cfg.train.fsdp and dp > 1 and state_bytes(
        inputs, fp64=fp64, shards=dp, averaged=averaged
    ) <= have:
        fix += f", or train.fsdp: true (shards it over the dp={dp} ranks)"
    if averaged and state_bytes(inputs, fp64=fp64, shards=dp if cfg.train.fsdp else 1) <= have:
        fix += ", or optim.ema_decay: null (drops the weight average's copy)"
    held = "weights, gradients, AdamW state and the weight average" if averaged else "weights, gradients and AdamW state"
    raise ValueError(
        f"{field}: training holds at least {size(need)} per rank of {held}, "
        f"more than the {size(have)} of {where} (fix: {fix}; `csbp plan` estimates the whole memory of a layout)"
    )


def _responsible_field(cfg: RunConfig, inputs: RunInputs) -> tuple[str, str]:
    """The config field whose smallest valid value would shrink the bound most, and its fix."""
    if inputs.dflash is not None:
        drafter = inputs.dflash.drafter_config
        trained = drafter.decoder_config().num_parameters(include_embeddings=False)
        if inputs.decoder_config.num_parameters() >= STATE_COPIES * trained:
            return "objective.dflash.target", "a smaller target (every rank loads it whole), or more memory per rank"
        return "objective.dflash", (
            f"fewer or narrower draft layers: num_draft_layers (now {drafter.num_layers}), intermediate_size "
            f"(now {drafter.intermediate_size})"
        )
    if cfg.model.init_from is not None:
        return "model.init_from", "a smaller checkpoint, or more memory per rank"
    config = inputs.decoder_config
    remaining = {
        name: dataclasses.replace(config, **smallest(config)).num_parameters()
        for name, smallest in SMALLEST_SHAPE.items()
    }
    name = min(remaining, key=lambda n: remaining[n])
    return f"model.{name}", f"a smaller model.{name} (now {getattr(config, name)})"
