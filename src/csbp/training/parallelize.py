"""Data-parallel wrapping of the decoder (FSDP2) and the gradient reduction of one optimizer step.

The model code knows nothing about parallelism; this module applies it from outside.

Gradient reduction (csbp.md §13 rule 3): every one of the ``dp * local`` ranks computes a gradient
of its own scaled loss, and the gradients are averaged over all of them.

* Without FSDP: bucketed asynchronous all-reduces over the world group, launched from gradient
  hooks during the last backward of a step (:class:`csbp.engine.grad_buckets.OverlappedGradientSync`,
  :func:`gradient_sync_for`); afterwards every rank holds the same full gradient.
* With FSDP (``train.fsdp``): each decoder layer and the root are ``fully_shard``-ed over the
  data-parallel group (ranks with the same ``local_rank``). FSDP's reduce-scatter averages over
  ``dp`` and leaves each rank the shard its dp index owns; the ranks of one sample (the model-input
  group: same ``dp_rank``) own the same shard index, so an all-reduce of the local shards over that
  group divided by ``local`` completes the world average.
"""

from __future__ import annotations

import torch
from torch import nn

from csbp.engine.context import ParallelContext
from csbp.engine.grad_buckets import OverlappedGradientSync
from csbp.engine.grads import average_gradients, fill_missing_gradients
from csbp.models.config import DecoderConfig
from csbp.models.decoder import Decoder
from csbp.parallel.comm import Comm


def apply_fsdp(model: Decoder, ctx: ParallelContext, device: torch.device) -> None:
    """Shard every decoder layer, then the root (embedding, final norm, LM head), over the dp group."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    if ctx.groups is None:
        raise ValueError("train.fsdp needs torch.distributed (fix: launch with dp >= 2 processes)")
    mesh = DeviceMesh.from_group(ctx.groups.dp, device_type=device.type)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def gradient_sync_for(model: nn.Module, ctx: ParallelContext, *, fsdp: bool) -> OverlappedGradientSync | None:
    """Without FSDP: bucketed all-reduce over the world group, overlapped with the last backward of
    each step; with FSDP None (FSDP reduce-scatters in its own backward hooks)."""
    if fsdp:
        return None
    return OverlappedGradientSync(model.parameters(), ctx.world_comm("gradients"))


def synchronize_gradients(model: nn.Module, ctx: ParallelContext, *, fsdp: bool) -> None:
    """Average this step's gradients over every rank (see the module docstring)."""
    if not fsdp:
        average_gradients(model.parameters(), ctx.world_comm("gradients"))
        return
    params = fill_missing_gradients(model.parameters())
    if ctx.groups is None:
        return
    comm = Comm(ctx.groups.model_input, ctx.counter, "gradients")
    if comm.size == 1:
        return
    with torch.no_grad():
        shards = [param.grad.to_local() for param in params]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for shard in shards:
            by_dtype.setdefault(shard.dtype, []).append(shard)
        for group in by_dtype.values():
            flat = torch.cat([shard.reshape(-1) for shard in group])
            comm.all_reduce(flat).div_(comm.size)
            offset = 0
            for shard in group:
                shard.copy_(flat[offset : offset + shard.numel()].view_as(shard))
                offset += shard.numel()


def gradient_shard_comm(ctx: ParallelContext, *, fsdp: bool) -> Comm | None:
    """The group gradients are sharded over (for the clipping norm): FSDP's dp group, else None."""
    return ctx.dp_comm("gradients") if fsdp else None


def full_model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict on CPU, gathered from FSDP shards when sharded (call on every rank;
    with FSDP only rank 0 receives tensors)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def unwrapped_copy(state: dict[str, torch.Tensor], config: DecoderConfig) -> Decoder:
    """A plain CPU ``Decoder`` holding ``state`` (for export: no FSDP, no device)."""
    model = Decoder(config, device="meta")
    model.load_state_dict(
        {name: tensor.detach().cpu() for name, tensor in state.items()}, strict=True, assign=True
    )
    return model
