"""Torch-free arithmetic of DFlash drafter layouts (csbp.md §14): how anchors are dealt to the BP
ranks, the context (query, key) pairs of a rank's draft rows, and the context rows each ring member
receives in the document-aware context exchange.

NumPy only, so the cost model (``csbp.plan``) counts with the rules the runtime uses:
``deal_order`` *is* ``csbp.dflash.layouts.deal_anchors``' dealing, the row intervals are those of
``csbp.dflash.layouts.block_query_rows`` and the received rows are what
``csbp.dflash.exchange.context_exchange_plan``'s ``recv_counts`` sum to (``interval_cover`` of the
live rows minus the member's own zigzag shard, as ``csbp.attention.layouts.halo_sends`` deals it),
and whether the exchange replaces the all-gather is ``context_exchange_pays`` (``counts.exchange_pays``).

Shape legend: ``L`` sequence length, ``N`` anchors, ``B`` block size, ``cp`` ring size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from csbp.attention.counts import DocBounds, exchange_pays, interval_cover
from csbp.schedules import zigzag_array

if TYPE_CHECKING:
    import torch

Anchors = TypeVar("Anchors", np.ndarray, "torch.Tensor")


def deal_order(costs: Sequence[int] | np.ndarray, num_owners: int) -> list[np.ndarray]:
    """Sorted indices of the anchors each of ``num_owners`` ranks gets, dealt by context cost: sort
    by cost (stable); with ``N >= 2·owners`` pair the cheapest with the most expensive and deal the
    pairs round-robin, otherwise deal single anchors round-robin."""
    if num_owners < 1:
        raise ValueError(f"num_owners must be >= 1, got {num_owners}")
    order = np.argsort(np.asarray(costs), kind="stable").tolist()
    count = len(order)
    if count >= 2 * num_owners:
        units = [[order[i], order[count - 1 - i]] for i in range(count // 2)]
        if count % 2 == 1:
            units.append([order[count // 2]])
    else:
        units = [[index] for index in order]
    owned: list[list[int]] = [[] for _ in range(num_owners)]
    for unit_index, unit in enumerate(units):
        owned[unit_index % num_owners].extend(unit)
    return [np.array(sorted(indices), dtype=np.int64) for indices in owned]


def spread_anchors(documents: DocBounds, count: int) -> np.ndarray:
    """``min(count, #valid)`` sorted anchors spread evenly over the valid positions of a fully
    supervised row (``a + 1`` exists and lies in ``a``'s document, ``csbp.dflash.anchors``): the
    cost model's stand-in for one random draw."""
    start, stop = documents
    positions = np.arange(len(start) - 1, dtype=np.int64)
    valid = positions[stop[:-1] > positions + 1]
    n = min(count, len(valid))
    return valid[((np.arange(n) + 0.5) * len(valid) / max(n, 1)).astype(np.int64)]


def context_stop(anchors: Anchors, context: str) -> Anchors:
    """One past the last visible context position: ``a`` (strict) or ``a + 1`` (inclusive); numpy
    here, torch for the training layouts (``csbp.dflash.layouts``)."""
    if context not in ("strict", "inclusive"):
        raise ValueError(f"context must be 'strict' or 'inclusive', got {context!r}")
    return anchors if context == "strict" else anchors + 1


def draft_intervals(
    anchors: np.ndarray, doc_start: np.ndarray, block_size: int, *, context: str, window: int | None
) -> tuple[np.ndarray, np.ndarray]:
    """``(ctx_start, ctx_stop)`` ``[N·B]`` of the draft rows ``(n, j)`` of these anchors: context
    ``[doc_start_n, stop(a_n))``, with a window also no earlier than ``a_n + j − (W − 1)``."""
    offsets = np.tile(np.arange(block_size, dtype=np.int64), len(anchors))
    first = np.repeat(anchors, block_size)
    start = np.repeat(doc_start, block_size)
    if window is not None:
        start = np.maximum(start, first + offsets - (window - 1))
    return start, context_stop(first, context)


def owner_anchor_indices(
    anchors: np.ndarray, doc_start: np.ndarray, num_owners: int, *, context: str
) -> list[np.ndarray]:
    """Per anchor owner, the indices of its live anchors (``num_owners == 1``: every anchor)."""
    if num_owners == 1:
        return [np.arange(len(anchors), dtype=np.int64)]
    return deal_order(context_stop(anchors, context) - doc_start, num_owners)


def context_pairs(start: np.ndarray, stop: np.ndarray) -> int:
    """Context (query, key) pairs of draft rows with these intervals."""
    return int((stop - start).clip(min=0).sum())


def context_exchange_pays(traffic_rows: Sequence[int], seq_len: int, cp: int) -> bool:
    """Whether a DFlash ring whose members' busier directions would move ``traffic_rows`` context
    rows (``max(sent, received)`` per member, ``exchange_rows``) uses the context exchange instead
    of the all-gather of ``(cp-1)·L/cp`` rows per member and direction (``counts.exchange_pays``).
    ``csbp.dflash.exchange`` calls it per sample and layer kind, the planner too."""
    return cp > 1 and exchange_pays(traffic_rows, (cp - 1) * seq_len // cp)


def exchange_recv_rows(seq_len: int, cp: int, member_intervals: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[int]:
    """Context rows each ring member ``d`` receives in the context exchange: the positions its live
    rows' intervals cover that its zigzag shard does not hold."""
    return exchange_rows(seq_len, cp, member_intervals)[0]


def exchange_rows(
    seq_len: int, cp: int, member_intervals: Sequence[tuple[np.ndarray, np.ndarray]]
) -> tuple[list[int], list[int]]:
    """``(received, sent)`` context rows of each ring member in the context exchange: what
    ``context_exchange_plan``'s ``recv_counts`` and ``send_counts`` sum to (a row of ``d``'s shard
    that several members need is sent to each of them)."""
    shards = [zigzag_array(seq_len, cp, member) for member in range(cp)]
    received, sent = [], [0] * cp
    for member, (start, stop) in enumerate(member_intervals):
        need = interval_cover(start, stop, seq_len)
        need[shards[member]] = False
        received.append(int(need.sum()))
        for owner in range(cp):
            if owner != member:
                sent[owner] += int(need[shards[owner]].sum())
    return received, sent
