"""An exponential moving average of the trained weights (``optim.ema_decay``).

Masked and block diffusion models are validated, sampled and released with an average of their
weights: MDLM and BD3-LM keep one (bd3lms' ``training.ema: 0.9999``) and swap it in for validation
and sampling. After every applied optimizer step (a step ``train.nan_policy: skip`` skipped is not
one) each averaged tensor moves towards its parameter,

    ema <- ema + (1 - d_n) (param - ema),   d_n = min(decay, (1 + n) / (10 + n)),

with ``n`` the updates so far, this one included: the warm-up of MDLM's ``ExponentialMovingAverage``
(``use_num_updates``), so an early average is not dominated by the initial weights.

Where it lives: one tensor per trained parameter, shaped, typed and placed as the parameter (an FSDP
shard under ``train.fsdp``, a replica otherwise), so an update is local to each rank with no
collective, and every rank holding a replica computes the same bits. Checkpoints store it as ``ema``
keyed by parameter name next to ``model`` (:mod:`csbp.training.checkpoint`), so it reshards across
topologies as the weights do; ``trainer_state.json`` holds ``n`` (``ema_updates``).

What uses it: validation (``val_loss``, ``val_nelbo``, the noise-window search), the final export
``RUN/final`` and the sample drawn after training, and ``csbp export`` of a checkpoint (``--weights
raw`` exports the trained weights instead). Such an export says which it holds in ``config.json``'s
``csbp_weights`` (:func:`weights_record`). Training itself never sees it:
:meth:`WeightAverage.swapped_in` exchanges the two in place and back, and makes FSDP gather afresh.
The exchange allocates one bounded scratch buffer before it moves anything, so running out of memory
there leaves the model as it was rather than half swapped.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

EMA_KEY = "ema"
"""The DCP state-dict entry of the average (``ema.<parameter name>``)."""
WEIGHTS_KEY = "csbp_weights"
"""The ``config.json`` entry of an export of a run that kept an average: which weights it holds."""


def weights_record(averaged: bool, decay: float, updates: int) -> dict[str, object]:
    """``{"kind": "ema" | "trained", "ema_decay", "ema_updates"}``: an export of a run with an average."""
    return {"kind": "ema" if averaged else "trained", "ema_decay": decay, "ema_updates": updates}


def warmed_decay(decay: float, updates: int) -> float:
    """``min(decay, (1 + n) / (10 + n))`` for the ``n``-th update (module docstring)."""
    return min(decay, (1.0 + updates) / (10.0 + updates))


class WeightAverage:
    """The average of ``model``'s trained parameters (those with ``requires_grad``), starting at their
    current values."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"optim.ema_decay={decay} must lie in (0, 1)")
        self.decay = decay
        self.updates = 0
        self._model = model
        self._params = {name: p for name, p in model.named_parameters() if p.requires_grad}
        self.shadow: dict[str, Tensor] = {name: p.detach().clone() for name, p in self._params.items()}

    @torch.no_grad()
    def update(self) -> None:
        """Move the average towards the parameters (call after each applied optimizer step)."""
        self.updates += 1
        weight = 1.0 - warmed_decay(self.decay, self.updates)
        names = list(self._params)  # one fused launch per dtype/device group, as torch's AveragedModel does
        torch._foreach_lerp_([self.shadow[n] for n in names], [self._params[n].detach() for n in names], weight)

    @torch.no_grad()
    def restart_from_model(self) -> None:
        """Start over from the current parameters (a resumed run that had no average)."""
        for name, param in self._params.items():
            self.shadow[name].copy_(param.detach())
        self.updates = 0

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The model computes with the averaged weights inside the block, with its own after (on every
        rank: each exchanges its own shards)."""
        self._exchange()
        try:
            yield
        finally:
            self._exchange()

    @torch.no_grad()
    def _exchange(self) -> None:
        """Swap every parameter with its average through one bounded scratch buffer per dtype and device,
        allocated before anything moves: running out of memory there leaves both sets as they were, and
        the exchange itself allocates nothing, so it cannot stop half done (a model half average, half
        trained weights). The scratch holds at most :data:`EXCHANGE_CHUNK` elements (or one row more)."""
        locals_ = [(_local(param), _local(self.shadow[name])) for name, param in self._params.items()]
        scratch = _scratch_buffers([param for param, _ in locals_])
        for param, shadow in locals_:
            buffer = scratch[(param.dtype, param.device)]
            for param_part, shadow_part in zip(_chunks(param), _chunks(shadow), strict=True):
                held = buffer[: param_part.numel()].view(param_part.shape)
                held.copy_(param_part)
                param_part.copy_(shadow_part)
                shadow_part.copy_(held)
        _drop_gathered_weights(self._model)


EXCHANGE_CHUNK = 1 << 24
"""Elements moved per copy by :meth:`WeightAverage._exchange` (64 MiB in float32)."""


def _local(tensor: Tensor) -> Tensor:
    """This rank's part of a parameter or its average (an FSDP shard's local tensor), as a plain tensor."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _rows_per_chunk(tensor: Tensor) -> int:
    row = max(1, tensor[0].numel()) if tensor.dim() > 0 and tensor.shape[0] > 0 else 1
    return max(1, EXCHANGE_CHUNK // row)


def _chunks(tensor: Tensor) -> tuple[Tensor, ...]:
    """Views of ``tensor`` along its first dimension of at most :data:`EXCHANGE_CHUNK` elements each (one
    row when a row is larger); a scalar is its own chunk."""
    if tensor.dim() == 0:
        return (tensor,)
    return tensor.split(_rows_per_chunk(tensor), dim=0)


def _scratch_buffers(params: list[Tensor]) -> dict[tuple[torch.dtype, torch.device], Tensor]:
    """One flat buffer per (dtype, device), as large as the largest chunk of those parameters."""
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    for param in params:
        largest = max((chunk.numel() for chunk in _chunks(param)), default=0)
        key = (param.dtype, param.device)
        sizes[key] = max(sizes.get(key, 0), largest)
    return {(dtype, device): torch.empty(size, dtype=dtype, device=device) for (dtype, device), size in sizes.items()}


def _drop_gathered_weights(model: nn.Module) -> None:
    """FSDP2 keeps the root's gathered weights after a forward without backward (validation): they would
    still hold the other set. Resharding frees them, so the next forward gathers the current shards."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
