"""Which rank owns which noisy block, and which clean positions each CP rank holds.

* ``dual_end_schedule`` (csbp.md §7): pairs block ``i`` with block ``N-1-i`` so that every pair
  costs ``N-1`` under the BD3 cost proxy ``cost(worker) = sum of owned block indices``;
* ``contiguous_schedule``: the even contiguous split, kept for ablations;
* ``balanced_schedule``: packed documents (docs/document-masking.md) make a block's cost its
  document prefix, not its index; this starts from dual-end over runs of blocks and swaps runs
  away from the heaviest rank while that lowers it, so every rank's attention work nears the mean. ``csbp.attention.counts.document_schedule`` feeds it the
  document-mask costs; without documents the ``balanced`` policy *is* ``dual_end``;
* ``zigzag_positions`` (csbp.md §8): CP rank ``c`` owns chunks ``c`` and ``2*cp-1-c`` of a
  sequence cut into ``2*cp`` equal chunks.

Everything here is pure Python / NumPy and deterministic, so every rank computes the same plan
without communicating. The module imports no torch (the cost model of ``csbp.plan`` uses it);
``zigzag_positions`` imports torch when called.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:
    from torch import Tensor

SchedulePolicy = Literal["dual_end", "contiguous", "balanced"]
SCHEDULES: tuple[str, ...] = ("dual_end", "contiguous", "balanced")


@dataclass(frozen=True)
class BlockSchedule:
    """Assignment of ``num_blocks`` noisy blocks to workers (BP ranks).

    Attributes:
        assignment: per worker, its blocks in the order the schedule assigned them (for dual-end,
            the pairs flattened: worker 0 of ``N = 32, P = 8`` has ``(0, 31, 1, 30)``).
        num_blocks: ``N``.
        policy: the rule that produced the assignment.
    """

    assignment: tuple[tuple[int, ...], ...]
    num_blocks: int
    policy: SchedulePolicy

    @property
    def num_workers(self) -> int:
        return len(self.assignment)

    def blocks(self, worker: int) -> tuple[int, ...]:
        """Blocks owned by ``worker``, sorted (the packed row order)."""
        return tuple(sorted(self.assignment[worker]))

    @property
    def costs(self) -> tuple[int, ...]:
        """Per-worker cost proxy: the sum of owned block indices."""
        return tuple(sum(blocks) for blocks in self.assignment)

    def owner_of(self, block: int) -> int:
        """The worker that owns ``block``."""
        for worker, blocks in enumerate(self.assignment):
            if block in blocks:
                return worker
        raise ValueError(f"block must be in [0, {self.num_blocks}), got {block}")

    def validate(self) -> None:
        """Raise ``ValueError`` unless every block is owned exactly once, every worker owns at least
        one block and, for dual-end, ``max(cost) - min(cost) <= num_blocks``."""
        flat = sorted(b for blocks in self.assignment for b in blocks)
        if flat != list(range(self.num_blocks)):
            raise ValueError(f"BlockSchedule.assignment must own blocks 0..{self.num_blocks - 1} once each")
        if any(len(blocks) == 0 for blocks in self.assignment):
            raise ValueError(f"BlockSchedule.assignment has a worker without blocks: {self.assignment}")
        if self.policy == "dual_end":
            spread = max(self.costs) - min(self.costs)
            if spread > self.num_blocks:
                raise ValueError(f"dual-end cost spread {spread} exceeds num_blocks={self.num_blocks}")


def dual_end_pairs(num_blocks: int) -> list[tuple[int, ...]]:
    """``(i, N-1-i)`` for ``i < N // 2``, then ``(N // 2,)`` when ``N`` is odd."""
    pairs: list[tuple[int, ...]] = [(i, num_blocks - 1 - i) for i in range(num_blocks // 2)]
    if num_blocks % 2 == 1:
        pairs.append((num_blocks // 2,))
    return pairs


def dual_end_schedule(num_blocks: int, num_workers: int) -> BlockSchedule:
    """The dual-end block schedule of csbp.md §7.

    Normal regime (``N >= 2P``): the ``N // 2`` pairs are split in order into ``P`` contiguous runs,
    the first ``(N // 2) % P`` workers taking one extra pair; an odd middle block goes to the
    worker with the lowest cost (lowest index on ties). Short regime (``P <= N < 2P``): blocks
    ``N-1`` down to ``0`` each go to the currently lightest worker (lowest index on ties).
    """
    _check_counts(num_blocks, num_workers)
    pairs = dual_end_pairs(num_blocks)
    middle = pairs.pop()[0] if num_blocks % 2 == 1 else None
    assignment: list[list[int]] = [[] for _ in range(num_workers)]
    if len(pairs) >= num_workers:
        base, extra = divmod(len(pairs), num_workers)
        start = 0
        for worker in range(num_workers):
            count = base + (1 if worker < extra else 0)
            for pair in pairs[start : start + count]:
                assignment[worker].extend(pair)
            start += count
        if middle is not None:
            assignment[_lightest(assignment)].append(middle)
    else:
        for block in range(num_blocks - 1, -1, -1):
            assignment[_lightest(assignment)].append(block)
    return BlockSchedule(tuple(tuple(a) for a in assignment), num_blocks, "dual_end")


def contiguous_schedule(num_blocks: int, num_workers: int) -> BlockSchedule:
    """Even contiguous split of blocks ``0 .. N-1``; the first ``N % P`` workers take one extra."""
    _check_counts(num_blocks, num_workers)
    base, extra = divmod(num_blocks, num_workers)
    assignment = []
    start = 0
    for worker in range(num_workers):
        count = base + (1 if worker < extra else 0)
        assignment.append(tuple(range(start, start + count)))
        start += count
    return BlockSchedule(tuple(assignment), num_blocks, "contiguous")


@functools.lru_cache(maxsize=64)
def block_schedule(num_blocks: int, num_workers: int, policy: SchedulePolicy = "dual_end") -> BlockSchedule:
    """The schedule named by ``policy`` (``"dual_end"`` or ``"contiguous"``); cached (immutable), since
    every rank's layout asks for the same one. ``"balanced"`` without per-block costs (one document
    per row) is ``dual_end``: a block's cost is then its index, which dual-end already balances."""
    if policy in ("dual_end", "balanced"):
        return dual_end_schedule(num_blocks, num_workers)
    if policy == "contiguous":
        return contiguous_schedule(num_blocks, num_workers)
    raise ValueError(f"schedule policy must be one of {SCHEDULES}, got {policy!r}")


def block_runs(num_blocks: int, num_workers: int, run: int) -> list[tuple[int, ...]]:
    """Blocks ``0 .. N-1`` cut into runs of ``run`` consecutive blocks (the last one shorter), with
    ``run`` lowered so that there are at least ``2P`` runs (single blocks when ``N < 2P``)."""
    _check_counts(num_blocks, num_workers)
    if run < 1:
        raise ValueError(f"run must be >= 1 block, got {run}")
    run = max(1, min(run, num_blocks // (2 * num_workers)))
    return [tuple(range(s, min(s + run, num_blocks))) for s in range(0, num_blocks, run)]


def balanced_schedule(
    units: Sequence[tuple[int, ...]],
    unit_costs: Sequence[int],
    num_workers: int,
    *,
    base_loads: Sequence[int] | None = None,
) -> BlockSchedule:
    """Deal ``units`` (``block_runs``) to ``num_workers`` workers by their cost (``unit_costs[u]``,
    e.g. the allowed pairs of unit ``u``'s rows under the document mask), deterministically.

    Start from dual-end over the units (worker ``w`` of ``2P`` runs holds runs ``w`` and ``2P-1-w``:
    with ``cp == bp`` exactly its own zigzag clean shard, so no halo rows beyond document prefixes),
    then, while it helps, swap one unit of the heaviest worker (lowest index on ties) with a cheaper
    unit of another worker: the swap that most lowers the heavier of the two, as long as that is
    below the heaviest's load. Swapping keeps every worker's unit count (rows, hence MLP work and
    memory, stay as dual-end's) and moves as few runs off their home as balancing needs (each moved
    run's clean rows become halo rows). A worker's load starts at ``base_loads[w]`` (rows the
    schedule cannot move, e.g. its clean shard; default 0).
    """
    num_blocks = sum(len(unit) for unit in units)
    _check_counts(num_blocks, num_workers)
    if sorted(b for unit in units for b in unit) != list(range(num_blocks)) or len(unit_costs) != len(units):
        raise ValueError(f"units must cover blocks 0..{num_blocks - 1} once each, with one cost per unit")
    if len(units) < num_workers:
        raise ValueError(f"{len(units)} units cannot give each of {num_workers} workers a block: use block_runs")
    loads = [int(b) for b in base_loads] if base_loads is not None else [0] * num_workers
    if len(loads) != num_workers:
        raise ValueError(f"base_loads must have one entry per worker ({num_workers}), got {len(loads)}")
    costs = [int(c) for c in unit_costs]
    owned = [sorted(home) for home in dual_end_schedule(len(units), num_workers).assignment]  # unit indices
    for worker, mine in enumerate(owned):
        loads[worker] += sum(costs[u] for u in mine)
    for _ in range(len(units) * num_workers):  # each swap lowers the sorted loads; this bound is never reached
        heavy = max(range(num_workers), key=lambda w: (loads[w], -w))
        best: tuple[int, int, int, int] | None = None  # (new max of the two, other, unit out, unit in)
        for other in range(num_workers):
            for out in owned[heavy] if other != heavy else ():
                for into in owned[other]:
                    delta = costs[out] - costs[into]
                    peak = max(loads[heavy] - delta, loads[other] + delta)
                    if delta > 0 and peak < loads[heavy] and (best is None or peak < best[0]):
                        best = (peak, other, out, into)
        if best is None:
            break
        _, other, out, into = best
        delta = costs[out] - costs[into]
        owned[heavy] = sorted([u for u in owned[heavy] if u != out] + [into])
        owned[other] = sorted([u for u in owned[other] if u != into] + [out])
        loads[heavy], loads[other] = loads[heavy] - delta, loads[other] + delta
    assignment = tuple(tuple(sorted(b for u in mine for b in units[u])) for mine in owned)
    return BlockSchedule(assignment, num_blocks, "balanced")


def zigzag_chunk_ids(cp_rank: int, cp: int) -> tuple[int, int]:
    """The two chunks ``(c, 2*cp-1-c)`` of CP rank ``c`` among ``2*cp`` chunks."""
    if cp < 1 or not 0 <= cp_rank < cp:
        raise ValueError(f"cp_rank must be in [0, cp) with cp >= 1, got cp_rank={cp_rank}, cp={cp}")
    return cp_rank, 2 * cp - 1 - cp_rank


def zigzag_array(length: int, cp: int, cp_rank: int) -> np.ndarray:
    """Sorted positions (int64 ``[length / cp]``) of zigzag chunks ``c`` and ``2*cp-1-c`` of
    ``[0, length)`` cut into ``2*cp`` equal chunks."""
    if length % (2 * cp) != 0:
        raise ValueError(
            f"length={length} must be divisible by 2*cp={2 * cp} for zigzag chunks: "
            f"use a multiple of {2 * cp}"
        )
    chunk = length // (2 * cp)
    low, high = zigzag_chunk_ids(cp_rank, cp)
    return np.concatenate(
        [np.arange(low * chunk, (low + 1) * chunk), np.arange(high * chunk, (high + 1) * chunk)]
    ).astype(np.int64)


def zigzag_positions(length: int, cp: int, cp_rank: int) -> Tensor:
    """``zigzag_array`` as an int64 tensor."""
    import torch  # here, not at module level: the planner imports this module without torch

    return torch.from_numpy(zigzag_array(length, cp, cp_rank))


def _check_counts(num_blocks: int, num_workers: int) -> None:
    if num_workers < 1:
        raise ValueError(f"num_workers must be >= 1, got {num_workers}")
    if num_blocks < num_workers:
        raise ValueError(
            f"num_blocks={num_blocks} is fewer than num_workers={num_workers}: every worker needs a "
            "block; use a longer sequence, a smaller block size or fewer BP ranks"
        )


def _lightest(assignment: list[list[int]]) -> int:
    """Index of the worker with the lowest cost (sum of block indices), lowest index on ties."""
    costs = [sum(blocks) for blocks in assignment]
    return costs.index(min(costs))
