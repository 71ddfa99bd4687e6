"""Activation checkpointing (``train.activation_checkpointing: full | selective``), applied from outside
the model.

With ``full`` every decoder layer (``Decoder.layers``) and every drafter layer
(``DFlashDrafter.layers``) keeps only its input during the forward; its backward first re-runs the
layer's forward to rebuild the activations it needs. With ``selective`` the layer also keeps what its
attention's backward needs (output, log-sum-exp, received K/V: :mod:`csbp.attention.kept_forwards`),
and the re-run replays them: it recomputes the norms, projections, RoPE and MLP, not the attention
and not its collectives. It holds more than ``full`` (per layer, the attention output in the
compute dtype, its fp32 log-sum-exp and the clean K/V the transport gathered) and far less than
``none`` (no MLP intermediates, norms or projections). This uses torch's composable, non-reentrant
checkpoint (``torch.distributed._composable.checkpoint``): it hooks the layer modules, so
parameter names, state dicts and FSDP2 wrapping (applied after it) are unchanged.

Exactness: the recompute is the same computation on the same inputs and weights (no dropout, no
randomness in a layer), so losses and gradients are bit-identical to a plain step; the test suite
checks that in float64 on several ranks.

Communication: under ``full`` the recomputed forward repeats the layer's attention collectives (the
clean K/V all-gather, ring steps, ...). They are issued on every rank in the same order (the backward
visits layers in the same order everywhere) and are counted under ``recompute.<category>`` by the
rank's ``TrafficCounter`` (:meth:`csbp.parallel.comm.TrafficCounter.recomputing`). Under
``selective`` the recompute issues none (its counter records no ``recompute.attention``); FSDP2's
parameter all-gathers are repeated under both.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Literal

from torch import nn

from csbp.attention.kept_forwards import KeptForwards, keeping, replaying
from csbp.parallel.comm import TrafficCounter

ActivationCheckpointing = Literal["none", "full", "selective"]
ACTIVATION_CHECKPOINTING_MODES: tuple[str, ...] = ("none", "full", "selective")


def checkpoint_layers(
    layers: Iterable[nn.Module], mode: ActivationCheckpointing, counter: TrafficCounter | None = None
) -> int:
    """Checkpoint every module of ``layers`` for ``mode`` (``none``: nothing); return how many.

    Call before FSDP is applied. ``counter`` receives the recomputed collectives' bytes under
    ``recompute.<category>``.
    """
    if mode not in ACTIVATION_CHECKPOINTING_MODES:
        raise ValueError(
            f"train.activation_checkpointing: {mode!r} is not one of {ACTIVATION_CHECKPOINTING_MODES}"
        )
    if mode == "none":
        return 0
    from torch.distributed._composable import checkpoint

    def context_fn() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        recompute = counter.recomputing() if counter is not None else contextlib.nullcontext()
        if mode == "full":
            return contextlib.nullcontext(), recompute
        kept = KeptForwards()  # one per layer call: its forward keeps, its recompute replays
        return keeping(kept), _replaying_with(kept, recompute)

    count = 0
    for layer in layers:
        checkpoint(layer, context_fn=context_fn)
        count += 1
    return count


@contextlib.contextmanager
def _replaying_with(kept: KeptForwards, recompute: contextlib.AbstractContextManager) -> Iterator[None]:
    """The recompute of a ``selective`` layer call: its attention replays ``kept``, its counter counts."""
    with recompute, replaying(kept):
        yield
