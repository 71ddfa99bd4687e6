"""Attention results kept through an activation checkpoint's recompute
(``train.activation_checkpointing: selective``).

Under ``full`` checkpointing a layer's backward first re-runs its whole forward, attention included:
at long context that is most of the layer's forward FLOPs again, and every collective of the
transport (the clean K/V all-gather, ring steps, halo exchanges) a second time. ``selective`` keeps
what the attention's backward needs from the first forward instead (its output, log-sum-exp and the
K/V it received, the tensors an attention autograd Function saves besides its inputs) and recomputes
only the rest of the layer: norms, projections, RoPE, the MLP. Its ``q, k, v`` inputs come back from
the recomputed projections, bit for bit the same.

Mechanics. :func:`csbp.training.activation_checkpointing.checkpoint_layers` gives every checkpointed
layer call a fresh :class:`KeptForwards`: its forward runs inside :func:`keeping` and its recompute
inside :func:`replaying`. An attention autograd Function computes its results through
:func:`kept_or_computed`: outside both it just computes; while keeping (with gradients enabled) it
computes and keeps them; while replaying it takes the kept results of the same call, in call order,
and computes nothing. The kept tensors are the ones the Function saves for its backward, so keeping
them costs no copy; each is released from the store when it is replayed.

The state is thread-local: the recompute runs on whichever thread runs the backward (an autograd
device thread on CUDA), and enters :func:`replaying` on that thread itself.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import Tensor


class KeptForwards:
    """One checkpointed layer call's attention results, in call order."""

    def __init__(self) -> None:
        self.results: deque[tuple[Tensor, ...]] = deque()


class _State(threading.local):
    mode: str | None = None  # "keep" | "replay" | None
    store: KeptForwards | None = None


_STATE = _State()


@contextmanager
def _mode(mode: str | None, store: KeptForwards) -> Iterator[None]:
    previous = (_STATE.mode, _STATE.store)
    _STATE.mode, _STATE.store = mode, store
    try:
        yield
    finally:
        _STATE.mode, _STATE.store = previous


@contextmanager
def keeping(store: KeptForwards) -> Iterator[None]:
    """A checkpointed forward: attention results computed inside are kept in ``store`` (only when
    gradients are enabled: a forward without them has no backward, so nothing is recomputed)."""
    with _mode("keep" if torch.is_grad_enabled() else None, store):
        yield


@contextmanager
def replaying(store: KeptForwards) -> Iterator[None]:
    """A checkpoint's recompute: attention calls inside take ``store``'s results instead of computing."""
    with _mode("replay", store):
        yield


def is_active() -> bool:
    """Whether attention calls now are kept or replayed (a path with its own autograd, which cannot
    be replayed, must then run through a Function that calls :func:`kept_or_computed`)."""
    return _STATE.mode is not None


def kept_or_computed(compute: Callable[[], tuple[Tensor, ...]]) -> tuple[Tensor, ...]:
    """``compute()``'s results, computed (and kept while keeping) or, while replaying, the kept ones."""
    mode, store = _STATE.mode, _STATE.store
    if mode is None or store is None:
        return compute()
    if mode == "keep":
        results = compute()
        # detached aliases (same storage, no copy): the returned output gets the Function's grad_fn,
        # which leads back to the checkpoint that holds this store; keeping it as returned made a cycle
        # through the autograd graph that garbage collection cannot break (a graph dropped without its
        # backward leaked)
        store.results.append(tuple(tensor.detach() for tensor in results))
        return results
    if not store.results:
        raise RuntimeError(
            "train.activation_checkpointing: selective replays each attention result once, and this "
            "recompute found none (a second backward over one graph, or an attention call the first "
            "forward did not make) (fix: use train.activation_checkpointing: full)"
        )
    return store.results.popleft()
