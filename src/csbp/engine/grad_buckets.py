"""Gradient averaging overlapped with backward: DDP-style buckets of gradient views, all-reduced
asynchronously as soon as backward has produced every gradient of a bucket.

Layout: the trainable parameters are grouped by (device, dtype) in *reverse* registration order
(about the order backward produces their gradients) and cut into buckets of at most
``bucket_bytes``. Each bucket owns one flat buffer and every parameter's ``.grad`` *is* a view into
it, so backward accumulates straight into the buffer and the all-reduce runs in place on it: no
full-size copy of the gradients is ever made (``average_gradients`` concatenates and copies back).

Protocol of one optimizer step with ``K`` micro-batches::

    sync.zero_grad()                     # zero the buffers (keeps .grad as views)
    for k in range(K):
        if k == K - 1:
            sync.arm()                   # the last backward launches the buckets
        loss_k.backward()
    sync.finish()                        # launch what is left, wait, divide by the group size

Earlier micro-batches only accumulate locally. During the armed backward a per-parameter
``post_accumulate_grad`` hook counts down its bucket; a bucket whose gradients are all final is
launched, but only after every bucket before it (bucket order is the same on every rank, so the
ranks issue identical collectives in identical order whatever order their backward runs in).
Buckets holding a parameter that got no gradient on this rank are launched by ``finish``; their
zeros take part in the average, exactly as :func:`csbp.engine.grads.fill_missing_gradients` does.
Nothing here reads a tensor value on the host: no ``.item()``, no synchronisation but the waits.

The average is the one of :func:`csbp.engine.grads.average_gradients` (sum over the group, then
divide by its size); bytes are counted by the ``Comm`` under its category (``gradients``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from csbp.parallel.comm import Comm, Pending

DEFAULT_BUCKET_BYTES = 25 * 2**20


@dataclass(eq=False)
class _Bucket:
    index: int
    flat: Tensor
    params: list[nn.Parameter]
    remaining: int = 0
    pending: Pending | None = None
    views: list[Tensor] = field(default_factory=list)


class OverlappedGradientSync:
    """Bucketed, asynchronous gradient averaging over ``comm`` (see the module docstring).

    Args:
        params: the model's parameters (frozen ones are skipped).
        comm: the group to average over; None or a group of one: only local accumulation.
        bucket_bytes: largest bucket size (a single larger parameter gets a bucket of its own).
    """

    def __init__(
        self, params: Iterable[nn.Parameter], comm: Comm | None, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> None:
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.comm = comm if comm is not None and comm.size > 1 else None
        trainable = [p for p in params if p.requires_grad]
        seen: set[int] = set()
        unique = [p for p in trainable if not (id(p) in seen or seen.add(id(p)))]  # type: ignore[func-returns-value]
        self.buckets: list[_Bucket] = []
        self._bucket_of: dict[int, _Bucket] = {}
        groups: dict[tuple[torch.device, torch.dtype], list[nn.Parameter]] = {}
        for param in reversed(unique):
            groups.setdefault((param.device, param.dtype), []).append(param)
        for members in groups.values():
            current: list[nn.Parameter] = []
            size = 0
            for param in members:
                nbytes = param.numel() * param.element_size()
                if current and size + nbytes > bucket_bytes:
                    self._add_bucket(current)
                    current, size = [], 0
                current.append(param)
                size += nbytes
            if current:
                self._add_bucket(current)
        self._armed = False
        self._next_launch = 0
        on_gradient = _weak_hook(self)
        for param in unique:
            param.register_post_accumulate_grad_hook(on_gradient)

    def _add_bucket(self, params: list[nn.Parameter]) -> None:
        numel = sum(p.numel() for p in params)
        flat = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
        bucket = _Bucket(len(self.buckets), flat, params)
        offset = 0
        for param in params:
            view = flat[offset : offset + param.numel()].view_as(param)
            param.grad = view
            bucket.views.append(view)
            self._bucket_of[id(param)] = bucket
            offset += param.numel()
        self.buckets.append(bucket)

    def _check_views(self) -> None:
        for bucket in self.buckets:
            for param, view in zip(bucket.params, bucket.views, strict=True):
                if param.grad is None or param.grad.data_ptr() != view.data_ptr():
                    raise RuntimeError(
                        "a parameter's .grad is no longer a view of its gradient bucket; zero gradients "
                        "with OverlappedGradientSync.zero_grad(), not optimizer.zero_grad(set_to_none=True)"
                    )

    def zero_grad(self) -> None:
        """Zero every bucket (the gradients stay views of the buckets)."""
        for bucket in self.buckets:
            bucket.flat.zero_()
            bucket.pending = None

    def arm(self) -> None:
        """The next backward is the step's last one: launch buckets as their gradients complete."""
        self._check_views()
        for bucket in self.buckets:
            bucket.remaining = len(bucket.params)
            bucket.pending = None
        self._next_launch = 0
        self._armed = True

    def _on_gradient(self, param: Tensor) -> None:
        if not self._armed:
            return
        bucket = self._bucket_of[id(param)]
        bucket.remaining -= 1
        self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets) and self.buckets[self._next_launch].remaining <= 0:
            self._launch(self.buckets[self._next_launch])

    def _launch(self, bucket: _Bucket) -> None:
        if self.comm is not None:
            bucket.pending = self.comm.all_reduce_async(bucket.flat)
        self._next_launch = bucket.index + 1

    def finish(self) -> None:
        """Launch the buckets not launched yet (in order), wait for all and divide by the group size."""
        if not self._armed:
            raise RuntimeError("OverlappedGradientSync.finish() without arm() before the last backward")
        self._armed = False
        self._check_views()
        while self._next_launch < len(self.buckets):
            self._launch(self.buckets[self._next_launch])
        if self.comm is None:
            return
        for bucket in self.buckets:
            assert bucket.pending is not None
            bucket.pending.wait()
            bucket.flat.div_(self.comm.size)
            bucket.pending = None


def _weak_hook(sync: OverlappedGradientSync) -> Callable[[Tensor], None]:
    """``sync._on_gradient`` through a weak reference. A parameter keeps its hooks for life, and a
    bound method would make each parameter hold the sync, which holds the parameters (its
    buckets): a cycle through the autograd engine that the garbage collector never frees, so every
    ``train`` in a process (``csbp compare``'s layouts) kept its whole model, gradient buffers and
    the world group's sockets and threads. Once the sync is gone the hook does nothing."""
    ref = weakref.ref(sync)

    def on_gradient(param: Tensor) -> None:
        owner = ref()
        if owner is not None:
            owner._on_gradient(param)

    return on_gradient
