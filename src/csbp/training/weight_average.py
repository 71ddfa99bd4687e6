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
        for name, param in self._params.items():  # one tensor at a time: no second copy of the model
            held = param.detach().clone()
            param.copy_(self.shadow[name])
            self.shadow[name].copy_(held)
        _drop_gathered_weights(self._model)


def _drop_gathered_weights(model: nn.Module) -> None:
    """FSDP2 keeps the root's gathered weights after a forward without backward (validation): they would
    still hold the other set. Resharding frees them, so the next forward gathers the current shards."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
