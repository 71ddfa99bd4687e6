"""AdamW with weight-decay parameter groups, and global-norm gradient clipping.

Parameter groups: decoupled weight decay applies to the weight *matrices* of the projections
(q/k/v/o, the MLP and an untied LM head). It does not apply to

* norm weights (RMSNorm scales: decaying them pulls the scale towards 0, not towards identity),
* biases (1-D, no interaction with the input scale),
* the token embedding (rows of rare tokens would be shrunk between their rare updates); when the
  LM head is tied it *is* the embedding, so it is not decayed either.

Gradient clipping uses the global L2 norm over every parameter of the model. Without FSDP,
:func:`csbp.engine.grads.average_gradients` leaves identical full gradients on every rank, so the
norm computed locally *is* the global norm and every rank clips by the same factor (no collective
needed). With FSDP each rank holds a disjoint shard of every gradient inside its data-parallel
group, so the squared local norms are all-reduced over that group first.

Gradient accumulation needs nothing here: backward passes of the micro-steps sum into ``.grad``
and the loss of each micro-step is already divided by the step's global denominator.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.optim.lr_scheduler import LRScheduler

from csbp.config.schema import OptimSection
from csbp.parallel.comm import Comm

EMBEDDING_PARAMETER_NAMES = ("embed_tokens.weight",)


def uses_weight_decay(name: str, param: Tensor) -> bool:
    """True for weight matrices other than the token embedding (see the module docstring)."""
    if param.dim() < 2:
        return False  # norm scales and biases
    return not name.endswith(EMBEDDING_PARAMETER_NAMES)


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: decayed matrices, then everything else with ``weight_decay = 0``.

    Tied parameters appear once (``named_parameters`` de-duplicates them).
    """
    decayed: list[nn.Parameter] = []
    not_decayed: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (decayed if uses_weight_decay(name, param) else not_decayed).append(param)
    return [
        {"params": decayed, "weight_decay": weight_decay},
        {"params": not_decayed, "weight_decay": 0.0},
    ]


def build_optimizer(
    model: nn.Module, optim: OptimSection, device: torch.device | str = "cpu"
) -> torch.optim.AdamW:
    """AdamW over :func:`parameter_groups` with the config's peak lr, betas and epsilon.

    On CUDA the fused implementation (one kernel for all parameters, as ``make gpu-check``'s training
    table times it); elsewhere torch's default. Both compute AdamW's update, equal to round-off.
    Build it after the model has been sharded (FSDP) so it holds the sharded parameters.
    """
    return torch.optim.AdamW(
        parameter_groups(model, optim.weight_decay),
        lr=optim.lr,
        betas=(float(optim.betas[0]), float(optim.betas[1])),
        eps=optim.eps,
        fused=True if torch.device(device).type == "cuda" else None,
    )


def _local_tensor(grad: Tensor) -> Tensor:
    """The locally stored part of a gradient (the shard of an FSDP ``DTensor``, else itself)."""
    to_local = getattr(grad, "to_local", None)
    return to_local() if callable(to_local) else grad


def clip_gradients(
    params: list[nn.Parameter], max_norm: float | None, *, shard_comm: Comm | None = None
) -> float:
    """Clip gradients to global L2 norm ``max_norm`` (``None``: measure only); return the norm before
    clipping.

    ``shard_comm`` is the group over which gradients are *sharded* (FSDP's data-parallel group):
    the squared norms of the local shards are summed over it. Leave it ``None`` when every rank
    holds full, identical gradients (see the module docstring). The sum of squares is accumulated in
    float64 so the norm does not depend on the order of parameters at float32 precision.
    """
    grads = [_local_tensor(p.grad) for p in params if p.grad is not None]
    # a rank holding no gradient still joins the all-reduce, on the group's device (NCCL: not the CPU)
    device = grads[0].device if grads else (shard_comm.device if shard_comm is not None else None) or "cpu"
    squared = torch.zeros(1, dtype=torch.float64, device=device)
    for grad in grads:
        squared += grad.detach().to(torch.float64).pow(2).sum()
    if shard_comm is not None and shard_comm.size > 1:
        squared = shard_comm.all_reduce(squared)
    total_norm = math.sqrt(float(squared.item()))
    if max_norm is not None and total_norm > max_norm:
        scale = max_norm / (total_norm + 1e-6)
        for grad in grads:
            grad.mul_(scale)
    return total_norm


def apply_optim_config(optimizer: torch.optim.Optimizer, scheduler: LRScheduler, optim: OptimSection) -> None:
    """After a resume: the config's peak lr, betas, epsilon and weight decay replace the values the
    checkpoint restored (``optimizer.load_state_dict`` and the scheduler's ``base_lrs`` would keep the
    old ones), and each group's current lr is the schedule's value at the resumed step. With an
    unchanged config this recomputes the restored values exactly."""
    step = scheduler.last_epoch
    scheduler.base_lrs = [float(optim.lr)] * len(optimizer.param_groups)
    for index, (group, multiplier) in enumerate(zip(optimizer.param_groups, scheduler.lr_lambdas, strict=True)):
        group["initial_lr"] = float(optim.lr)
        group["lr"] = float(optim.lr) * multiplier(step)
        group["betas"] = (float(optim.betas[0]), float(optim.betas[1]))
        group["eps"] = float(optim.eps)
        group["weight_decay"] = float(optim.weight_decay) if index == 0 else 0.0
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() reports
