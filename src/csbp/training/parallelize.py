"""Data-parallel wrapping of the decoder (FSDP2) and the gradient reduction of one optimizer step.

The model code knows nothing about parallelism; this module applies it from outside.

Gradient reduction (csbp.md §13 rule 3): every one of the ``dp * local`` ranks computes a gradient
of its own scaled loss, and the gradients are averaged over all of them.

* Without FSDP: bucketed asynchronous all-reduces over the world group, launched from gradient
  hooks during the last backward of a step (:class:`csbp.engine.grad_buckets.OverlappedGradientSync`,
  :func:`gradient_sync_for`); afterwards every rank holds the same full gradient.
* With FSDP (``train.fsdp``): each decoder layer and the root are ``fully_shard``-ed over the
  data-parallel group (ranks with the same ``local_rank``); when ``local > 1`` the mesh is 2-D
  (replicate over the model-input group, i.e. the ranks of one sample, shard over dp), so FSDP2's
  own post-backward hooks reduce-scatter over ``dp`` and all-reduce over the ``local`` ranks of a
  sample layer by layer while backward continues: each rank ends with its dp shard of the world
  average, and nothing is left to do after backward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from csbp.engine.context import ParallelContext
from csbp.engine.grad_buckets import OverlappedGradientSync
from csbp.engine.grads import average_gradients, fill_missing_gradients
from csbp.models.config import DecoderConfig
from csbp.models.decoder import Decoder
from csbp.parallel.comm import Comm

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


def apply_fsdp(model: Decoder, ctx: ParallelContext, device: torch.device) -> None:
    """Shard every decoder layer, then the root (embedding, final norm, LM head), over the dp group;
    with ``local > 1`` on a 2-D mesh that also all-reduces over the model-input group (HSDP).

    Call on a model still on the ``meta`` device (:func:`csbp.training.model_factory.build_model`)."""
    from torch.distributed.fsdp import fully_shard

    if ctx.groups is None:
        raise ValueError("train.fsdp needs torch.distributed (fix: launch with dp >= 2 processes)")
    mesh = fsdp_mesh(ctx, device)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def fsdp_mesh(ctx: ParallelContext, device: torch.device) -> DeviceMesh:
    """The mesh FSDP2 shards over: 1-D over the dp group when ``local == 1``; else 2-D
    ``(replicate = model-input group, shard = dp group)``, so FSDP2 runs HSDP: its reduce-scatter over
    dp and its all-reduce over the ranks of one sample both run inside backward, per layer."""
    from torch.distributed.device_mesh import DeviceMesh

    assert ctx.groups is not None
    topology = ctx.topology
    if topology.local == 1:
        return DeviceMesh.from_group(ctx.groups.dp, device_type=device.type)
    ranks = torch.arange(topology.world_size).reshape(topology.dp, topology.local).T  # rank = dp_rank*local + l
    return DeviceMesh.from_group(
        [ctx.groups.model_input, ctx.groups.dp],
        device_type=device.type,
        mesh=ranks,
        mesh_dim_names=("replicate", "shard"),
    )


def gradient_sync_for(model: nn.Module, ctx: ParallelContext, *, fsdp: bool) -> OverlappedGradientSync | None:
    """Without FSDP: bucketed all-reduce over the world group, overlapped with the last backward of
    each step; with FSDP None (FSDP reduce-scatters in its own backward hooks)."""
    if fsdp:
        return None
    return OverlappedGradientSync(model.parameters(), ctx.world_comm("gradients"))


def synchronize_gradients(model: nn.Module, ctx: ParallelContext, *, fsdp: bool) -> None:
    """Finish this step's gradient average where no :class:`OverlappedGradientSync` ran: without FSDP
    one flat all-reduce over every rank; with FSDP (HSDP) the average already happened in backward,
    and parameters that got no gradient receive zeros."""
    if not fsdp:
        average_gradients(model.parameters(), ctx.world_comm("gradients"))
        return
    fill_missing_gradients(model.parameters())


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
