"""The one counted collectives layer: every attention collective in csbp goes through ``Comm``.

Each call adds the bytes *this rank sends to other ranks* to a ``TrafficCounter``, so a step's
communication is known exactly (the benchmark reports it; tests assert the byte identities of
csbp.md §12). Bytes are defined independently of the algorithm the backend runs, for a group of
``P`` ranks:

===================  =====================================================================
operation            bytes counted on this rank
===================  =====================================================================
all-gather           ``(P-1)·n`` for a local shard of ``n`` bytes
reduce-scatter       ``(P-1)·n`` for an input of ``P·n`` bytes
all-to-all           sum of the send splits addressed to other ranks
P2P send / ring      the size of the sent tensor
all-reduce           ``2·(P-1)·n // P`` for ``n`` bytes: the ring cost (reduce-scatter then
                     all-gather), rounded down to whole bytes
broadcast            ``(P-1)·n`` on the source rank, 0 elsewhere
===================  =====================================================================

Collectives issued while a layer is recomputed in backward (activation checkpointing) are counted
under ``recompute.<category>`` (``TrafficCounter.recomputing``), so ``attention`` stays the traffic
of one forward and backward and the recompute cost is reported on its own.

A group of size 1 (including ``group=None`` with no initialised process group) short-circuits:
no collective is issued and nothing is counted.

Device rule: every tensor handed to a collective must live on the communicator's ``device`` (the
compute device of the ``ParallelContext``; by default the device the group's backend serves: the
current GPU for NCCL, the CPU for gloo). It is checked on every call, also in groups of size 1,
so a CPU tensor meant for NCCL fails on a one-GPU run with one line, not on the first multi-GPU
run.

Asynchronous operations (``async_op=True`` of all-gather, reduce-scatter and all-to-all, the
``*_async`` methods) return a ``Pending``; bytes are counted when an operation is issued, and
``Pending.wait()`` returns the result. On CUDA the backend runs the transfer on its own stream:
``wait()`` makes the *current* stream wait for it (no host sync), and the ``Pending`` keeps the
buffers the backend reads alive until then (the caller must not modify them before ``wait()``).
Inside ``serialized_collectives()`` every one of them is waited for when issued: the same
transfers and bytes with no overlap, the ablation ``csbp bench attention|dflash --ablate-overlap``
times against the overlapped run.

The collectives are data movement only (no autograd); transports wrap them in their own
``autograd.Function``s whose backward calls the mirror collective.

Usage::

    counter = TrafficCounter()
    comm = Comm(ring_group, counter, category="attention.kv")
    kv_all, _ = comm.all_gather(kv_shard)              # [P*n, ...] in group-rank order
    rows, pending = comm.all_to_all(send, send_splits, recv_splits, async_op=True)
    ...                                                # compute that does not need ``rows``
    rows = pending.wait()
    handle = comm.ring_shift_async(kv_block)           # overlap compute, then
    kv_next = handle.wait()
    counter.bytes("attention.kv")
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor

from csbp.devices import backend_device, same_device

# ``all_gather_single`` / ``reduce_scatter_single`` are the 2.13 names (the ``*_into_tensor`` /
# ``*_tensor`` spellings still work but warn); keep the old ones for older torch builds.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_serialized_depth = 0  # > 0 inside serialized_collectives()


@contextmanager
def serialized_collectives() -> Iterator[None]:
    """Inside, every asynchronous ``Comm`` operation (``async_op=True``, ``*_async``) waits for its
    transfer before returning its ``Pending``, so no compute overlaps it (an ablation: what the
    transports' overlap buys). Values and counted bytes are unchanged."""
    global _serialized_depth
    _serialized_depth += 1
    try:
        yield
    finally:
        _serialized_depth -= 1


def _issued(pending: Pending) -> Pending:
    """``pending``, already waited for inside ``serialized_collectives()``."""
    if _serialized_depth:
        pending.wait()
    return pending


RECOMPUTE_PREFIX = "recompute."
"""Counter categories of collectives re-issued by activation-checkpointing recomputation."""


class TrafficCounter:
    """Per-category byte and call counts of what this rank sends to other ranks."""

    def __init__(self) -> None:
        self._bytes: dict[str, int] = defaultdict(int)
        self._calls: dict[str, int] = defaultdict(int)
        self._recompute_depth = 0

    def add(self, category: str, nbytes: int) -> None:
        """Record one call in ``category`` that sent ``nbytes`` bytes to other ranks (inside
        :meth:`recomputing`: in ``recompute.<category>``)."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        if self._recompute_depth:
            category = f"{RECOMPUTE_PREFIX}{category}"
        self._bytes[category] += int(nbytes)
        self._calls[category] += 1

    @contextmanager
    def recomputing(self) -> Iterator[None]:
        """Attribute the collectives issued inside to ``recompute.<category>``: activation
        checkpointing re-runs a layer's forward (and its collectives) during backward, and that
        traffic is real but must not blur the per-step identities of the first forward."""
        self._recompute_depth += 1
        try:
            yield
        finally:
            self._recompute_depth -= 1

    def bytes(self, category: str | None = None) -> int:
        """Bytes sent in ``category``, or in all categories when None."""
        if category is None:
            return sum(self._bytes.values())
        return self._bytes.get(category, 0)

    def calls(self, category: str | None = None) -> int:
        """Calls issued in ``category``, or in all categories when None."""
        if category is None:
            return sum(self._calls.values())
        return self._calls.get(category, 0)

    def reset(self) -> None:
        self._bytes.clear()
        self._calls.clear()

    def snapshot(self) -> dict[str, dict[str, int]]:
        """``{category: {"bytes": int, "calls": int}}`` (a copy)."""
        return {c: {"bytes": self._bytes[c], "calls": self._calls[c]} for c in sorted(self._bytes)}


class Pending:
    """An issued asynchronous operation: ``wait()`` blocks, finishes it and returns its tensor.

    Wraps the backend ``Work`` handles plus the post-processing that must run after them
    (``finish``; ``then`` chains more), and keeps the tensors the backend still reads
    (``keepalive``, e.g. a contiguous copy of the send buffer) alive until then. Calling
    ``wait()`` again returns the same tensor.
    """

    def __init__(
        self,
        works: list[dist.Work],
        result: Tensor,
        finish: Callable[[Tensor], Tensor] | None = None,
        keepalive: tuple[Tensor, ...] = (),
    ) -> None:
        self._works = works
        self._result = result
        self._finish = finish
        self._keepalive = keepalive
        self._done = False

    @property
    def done(self) -> bool:
        """Whether ``wait()`` has run (inside ``serialized_collectives()``: at issue)."""
        return self._done

    def then(self, finish: Callable[[Tensor], Tensor]) -> Pending:
        """A ``Pending`` whose ``wait()`` waits for this one and returns ``finish`` of its result
        (post-processing, e.g. a reordering of received rows, that must run after the transfer)."""
        return Pending([], self._result, lambda _: finish(self.wait()))

    def wait(self) -> Tensor:
        if not self._done:
            for work in self._works:
                work.wait()
            if self._finish is not None:
                self._result = self._finish(self._result)
            self._works, self._finish, self._keepalive = [], None, ()  # free what only the transfer needed
            self._done = True
        return self._result


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


class Comm:
    """Counted collectives over one process group.

    Args:
        group: the process group (None = the default world group, or a single process when
            ``torch.distributed`` is not initialised).
        counter: where bytes are recorded; a fresh ``TrafficCounter`` when None.
        category: the default counter category; every method accepts ``category=`` to override it.
        device: where every tensor passed in must live (see the module docstring); None: the device
            the group's backend serves (the current GPU for NCCL, else the CPU), or no check for a
            single process without ``torch.distributed``.

    Ranks in arguments and results are *group* ranks; peers are converted to global ranks
    internally. Input tensors need the same shape on every rank unless stated otherwise.
    """

    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        counter: TrafficCounter | None = None,
        category: str = "attention",
        device: torch.device | str | None = None,
    ) -> None:
        self.group = group
        self.counter = counter if counter is not None else TrafficCounter()
        self.category = category
        self.device = None if device is None else torch.device(device)
        if group is None and not dist.is_initialized():
            self.size, self.rank, self.global_ranks = 1, 0, [0]
            return
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError("this process is not in the group passed to Comm; build Comm on members only")
        if self.device is None:
            self.device = backend_device(group)
        if group is None:
            self.global_ranks = list(range(self.size))
        else:
            self.global_ranks = [dist.get_global_rank(group, r) for r in range(self.size)]

    # ---- helpers -------------------------------------------------------------------------------

    def _count(self, category: str | None, nbytes: int) -> None:
        self.counter.add(self.category if category is None else category, nbytes)

    def _check_device(self, operation: str, t: Tensor) -> None:
        if self.device is not None and not same_device(t.device, self.device):
            raise ValueError(
                f"Comm.{operation}: a tensor on {t.device} was given to a collective whose device is "
                f"{self.device}; create it on the context's device (device=ctx.device)"
            )

    def _peer(self, offset: int) -> int:
        """Global rank of the group member ``offset`` places away in group order."""
        return self.global_ranks[(self.rank + offset) % self.size]

    # ---- collectives ---------------------------------------------------------------------------

    def all_gather(
        self, shard: Tensor, async_op: bool = False, *, category: str | None = None
    ) -> tuple[Tensor, Pending | None]:
        """Concatenate every rank's ``shard [n, ...]`` along dim 0 in group-rank order.

        Returns ``(out [P*n, ...], pending)``; ``pending`` is None unless ``async_op``, and ``out``
        is only valid after ``pending.wait()``. For ``P == 1`` ``out`` is ``shard`` itself.
        """
        self._check_device("all_gather", shard)
        if self.size == 1:
            return shard, (_issued(Pending([], shard)) if async_op else None)
        shard = shard.contiguous()
        out = shard.new_empty((self.size * shard.shape[0], *shard.shape[1:]))
        work = _all_gather_single(out, shard, group=self.group, async_op=async_op)
        self._count(category, (self.size - 1) * _nbytes(shard))
        return out, (_issued(Pending([work], out, keepalive=(shard,))) if async_op else None)

    def reduce_scatter(
        self, full: Tensor, async_op: bool = False, *, category: str | None = None
    ) -> tuple[Tensor, Pending | None]:
        """Sum ``full [P*n, ...]`` over ranks and keep this rank's chunk ``[n, ...]`` (group order).

        Returns ``(out [n, ...], pending)`` like ``all_gather``. For ``P == 1`` ``out`` is ``full``.
        """
        self._check_device("reduce_scatter", full)
        if full.dim() == 0 or full.shape[0] % self.size != 0:
            raise ValueError(
                f"reduce_scatter input dim 0 must be a multiple of the group size {self.size}, "
                f"got shape {tuple(full.shape)}"
            )
        if self.size == 1:
            return full, (_issued(Pending([], full)) if async_op else None)
        full = full.contiguous()
        out = full.new_empty((full.shape[0] // self.size, *full.shape[1:]))
        work = _reduce_scatter_single(out, full, group=self.group, async_op=async_op)
        self._count(category, (self.size - 1) * _nbytes(out))
        return out, (_issued(Pending([work], out, keepalive=(full,))) if async_op else None)

    def all_to_all(
        self,
        send: Tensor,
        send_splits: list[int],
        recv_splits: list[int],
        async_op: bool = False,
        *,
        category: str | None = None,
    ) -> tuple[Tensor, Pending | None]:
        """Exchange variable-size row ranges: rows ``send_splits[d]`` go to group rank ``d``.

        ``send [sum(send_splits), ...]`` holds the rows for rank 0, then rank 1, ...; the result
        ``[sum(recv_splits), ...]`` holds the rows from rank 0, then rank 1, ... ``recv_splits[s]``
        must equal what rank ``s`` sends here. Zero splits are allowed; trailing shapes must agree.

        Returns ``(out, pending)`` like ``all_gather``: ``pending`` is None unless ``async_op``, and
        ``out`` is only valid after ``pending.wait()`` (the send buffer is kept alive until then;
        the caller must not modify ``send`` before it). For ``P == 1`` ``out`` is ``send``.
        """
        self._check_device("all_to_all", send)
        if len(send_splits) != self.size or len(recv_splits) != self.size:
            raise ValueError(
                f"all_to_all needs one split per group rank ({self.size}), got "
                f"{len(send_splits)} send and {len(recv_splits)} recv splits"
            )
        if min(send_splits) < 0 or min(recv_splits) < 0 or sum(send_splits) != send.shape[0]:
            raise ValueError(
                f"all_to_all splits must be >= 0 and send_splits {send_splits} must sum to "
                f"send.shape[0] = {send.shape[0]}"
            )
        if self.size == 1:
            if recv_splits != send_splits:
                raise ValueError(f"one rank receives what it sends: recv_splits {recv_splits} != send_splits")
            return send, (_issued(Pending([], send)) if async_op else None)
        send = send.contiguous()
        recv = send.new_empty((sum(recv_splits), *send.shape[1:]))
        work = dist.all_to_all_single(recv, send, recv_splits, send_splits, group=self.group, async_op=async_op)
        row_bytes = _row_numel(send) * send.element_size()
        rows_to_others = sum(s for d, s in enumerate(send_splits) if d != self.rank)
        self._count(category, rows_to_others * row_bytes)
        return recv, (_issued(Pending([work], recv, keepalive=(send,))) if async_op else None)

    def ring_shift_async(self, send: Tensor, direction: int = -1, *, category: str | None = None) -> Pending:
        """Send ``send`` to group rank ``(rank + direction) % P`` and receive the same-shaped tensor
        from ``(rank - direction) % P``; ``wait()`` returns the received tensor.

        Even ranks post the send first, odd ranks the receive first (safe ordering for backends
        that execute P2P ops in posting order). For ``P == 1`` the tensor is returned unchanged.
        """
        self._check_device("ring_shift", send)
        if self.size == 1:
            return _issued(Pending([], send))
        send = send.contiguous()
        recv = torch.empty_like(send)
        ops = [
            dist.P2POp(dist.isend, send, self._peer(direction), group=self.group),
            dist.P2POp(dist.irecv, recv, self._peer(-direction), group=self.group),
        ]
        if self.rank % 2 == 1:
            ops.reverse()
        works = dist.batch_isend_irecv(ops)
        self._count(category, _nbytes(send))
        return _issued(Pending(works, recv, keepalive=(send,)))

    def ring_shift(self, send: Tensor, direction: int = -1, *, category: str | None = None) -> Tensor:
        """Synchronous ``ring_shift_async``: returns the tensor received from the opposite neighbour."""
        return self.ring_shift_async(send, direction, category=category).wait()

    def all_reduce(
        self, t: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, *, category: str | None = None
    ) -> Tensor:
        """Reduce ``t`` over the group **in place** and return it (counted at the ring cost)."""
        self._check_device("all_reduce", t)
        if self.size == 1:
            return t
        if not t.is_contiguous():
            raise ValueError("all_reduce works in place and needs a contiguous tensor; pass t.contiguous()")
        dist.all_reduce(t, op=op, group=self.group)
        self._count(category, 2 * (self.size - 1) * _nbytes(t) // self.size)
        return t

    def all_reduce_async(
        self, t: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM, *, category: str | None = None
    ) -> Pending:
        """Start an in-place ``all_reduce`` of ``t``; ``wait()`` returns ``t`` reduced (counted like
        ``all_reduce`` when issued)."""
        self._check_device("all_reduce_async", t)
        if self.size == 1:
            return _issued(Pending([], t))
        if not t.is_contiguous():
            raise ValueError("all_reduce works in place and needs a contiguous tensor; pass t.contiguous()")
        work = dist.all_reduce(t, op=op, group=self.group, async_op=True)
        self._count(category, 2 * (self.size - 1) * _nbytes(t) // self.size)
        return _issued(Pending([work], t))

    def broadcast(self, t: Tensor, src_group_rank: int, *, category: str | None = None) -> Tensor:
        """Overwrite ``t`` **in place** with group rank ``src_group_rank``'s tensor and return it."""
        if not 0 <= src_group_rank < self.size:
            raise ValueError(f"src_group_rank must be in [0, {self.size}), got {src_group_rank}")
        self._check_device("broadcast", t)
        if self.size == 1:
            return t
        if not t.is_contiguous():
            raise ValueError("broadcast works in place and needs a contiguous tensor; pass t.contiguous()")
        dist.broadcast(t, src=self.global_ranks[src_group_rank], group=self.group)
        self._count(category, (self.size - 1) * _nbytes(t) if self.rank == src_group_rank else 0)
        return t


def _row_numel(t: Tensor) -> int:
    """Elements in one dim-0 row of ``t`` (valid also when ``t`` has zero rows)."""
    numel = 1
    for size in t.shape[1:]:
        numel *= size
    return numel
