"""Where a clean-context partial splits into fused flash-attention pieces and a small residual (csbp.md §9.1).

A partial whose keys are clean rows (the clean stream, a remote clean shard, a DFlash context) has,
for every query row, one contiguous range of visible keys per run of keys sorted by position. In
BD3 these ranges form *staircases*: a clean row of block ``b`` sees the clean keys ``[0, (b+1)B)``,
a noisy row ``[0, bB)``. A staircase is a causal triangle (each row one key further than the row
before) plus a band narrower than ``B`` above the diagonal; rows that see the same range form a
dense rectangle. Dense rectangles and causal triangles are exactly what fused flash kernels run at
full speed (``csbp.attention.flash_ops``: FlashAttention-2 or cuDNN on CUDA, ATen's flash kernel on
CPU), while a generic block-sparse kernel (FlexAttention over a ``BlockMask``, or the tiles) pays for
every mask it evaluates. So ``plan_key_runs`` cuts the partial into

* **dense pieces**: ``>= 2 * min_rows`` consecutive query rows with one visible key range (DFlash
  anchors under a whole remote shard, the rows of a shard entirely after a key shard);
* **causal pieces**: in a *segment* (consecutive query rows at consecutive positions with one range
  start; a segment whose rows all see one range is a dense piece), a maximal run of ``>= min_rows``
  rows along which the *causal envelope* ``c[r] = r + min_{r' >= r} (hi[r'] - r')`` grows by one per
  row. Row ``r`` of the run sees keys ``[lo, c[r])``, run as one dense call over ``[lo, c[a] - 1)``
  and one square causal call over the next ``b - a`` keys;
* **the residual**: what the pieces leave (the in-block band ``[c[r], hi[r])``, short runs, anything
  irregular), as the same generic partial over rows whose ``ctx_start`` is raised past what the
  pieces cover. Its mask touches only blocks next to the diagonal.

Pieces are found per *key run* (a maximal run of keys, all live and clean, with increasing
positions; a remote partial holds one or two runs per peer), and each key run with pieces gets its
own residual. Noisy keys no query row can see (another rank's blocks in a CP-only ring step) are
skipped like padding. Noisy keys that queries see (the block-diagonal part of the mixed rows
``[noisy ; clean]``) are *folded* into the residual of the nearest key run with pieces (no other run
between them): that residual runs over both key ranges, so on the ``flex`` backend one Flex call
computes the in-block band and the noisy blocks together (one launch and one merge fewer than a
separate block-diagonal partial; a BlockMask only visits the tiles on those diagonals). Noisy keys
with no such run, or a partial without any piece worth a call, are planned as one generic partial.
``csbp.attention.flash_pieces`` runs the plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from csbp.attention.rows import Rows


@dataclass(frozen=True)
class FlashPiece:
    """One fused call: query rows ``[q_start, q_stop)`` over keys ``[k_start, k_stop)`` (indices into the
    partial's q and k), bidirectional or causal (square)."""

    q_start: int
    q_stop: int
    k_start: int
    k_stop: int
    causal: bool

    @property
    def pairs(self) -> int:
        """Allowed (query, key) pairs of this piece."""
        rows, keys = self.q_stop - self.q_start, self.k_stop - self.k_start
        return rows * (rows + 1) // 2 if self.causal else rows * keys


@dataclass(frozen=True)
class KeyRunPlan:
    """The pieces and the residual partial of one key run ``[k_start, k_stop)``; the residual's keys
    are ``residual_keys`` when it also holds the noisy keys next to the run (see the module doc)."""

    k_start: int
    k_stop: int
    pieces: tuple[FlashPiece, ...]
    residual: object | None  # a PartialPlan over (rows with raised ctx_start, residual_span's keys), or None
    residual_keys: tuple[int, int] | None = None  # None: the run's own keys

    @property
    def residual_span(self) -> tuple[int, int]:
        """``[start, stop)`` of the keys the residual partial runs over."""
        return self.residual_keys if self.residual_keys is not None else (self.k_start, self.k_stop)


def plan_key_runs(
    q_rows: Rows, k_rows: Rows, *, min_rows: int, generic: Callable[[Rows, Rows], object]
) -> tuple[KeyRunPlan, ...] | None:
    """Per key run of ``k_rows``, the pieces over ``q_rows`` and the residual (``generic(q_rows, k_rows)``
    plans a plain partial, also for the residuals); None when no piece of ``>= min_rows`` rows exists,
    or queries see noisy keys with another key run between them and every run with pieces (the caller
    then plans one generic partial)."""
    if min_rows < 1:
        raise ValueError(f"min_rows must be >= 1, got {min_rows}")
    q_cpu, k_cpu = q_rows.to("cpu"), k_rows.to("cpu")
    if len(k_cpu) == 0 or len(q_cpu) == 0:
        return None
    found = []
    for k_start, k_stop in _key_runs(k_cpu):
        lo, hi = _visible_ranges(q_cpu, k_cpu.pos[k_start:k_stop], k_start)
        pieces, covered_to = _find_pieces(q_cpu, lo, hi, min_rows)
        found.append((k_start, k_stop, pieces, lo, hi, covered_to))
    if not any(pieces for _, _, pieces, *_ in found):
        return None
    residual_keys = {k_start: (k_start, k_stop) for k_start, k_stop, *_ in found}
    noisy = _seen_noisy_span(q_cpu, k_cpu)
    if noisy is not None:  # the block-diagonal keys go into the residual of the nearest run with pieces
        fold = _run_next_to(noisy, [(a, b) for a, b, pieces, *_ in found if pieces], list(residual_keys.values()))
        if fold is None:
            return None
        residual_keys[fold[0]] = (min(noisy[0], fold[0]), max(noisy[1], fold[1]))
    runs = []
    for k_start, k_stop, pieces, lo, hi, covered_to in found:
        if not pieces:
            runs.append(KeyRunPlan(k_start, k_stop, (), generic(q_rows, k_rows.select(slice(k_start, k_stop)))))
            continue
        span = residual_keys[k_start]
        residual = None
        if bool((covered_to < hi).any()) or span != (k_start, k_stop):
            # Raise ctx_start to the first key not covered (a covered row: past its ctx_stop); noisy keys
            # in the span are seen by block, whatever the rows' clean context.
            key_pos = torch.cat([k_cpu.pos[k_start:k_stop], k_cpu.pos.new_tensor([torch.iinfo(torch.long).max])])
            first_left = torch.where(covered_to < hi, key_pos[(covered_to - k_start).clamp(min=0)], q_cpu.ctx_stop)
            ctx_start = torch.where(covered_to > lo, first_left, q_cpu.ctx_start).to(q_rows.ctx_start.device)
            residual = generic(replace(q_rows, ctx_start=ctx_start), k_rows.select(slice(*span)))
        keys = None if span == (k_start, k_stop) else span
        runs.append(KeyRunPlan(k_start, k_stop, tuple(pieces), residual, keys))
    return tuple(runs)


def _seen_noisy_span(q_rows: Rows, k_rows: Rows) -> tuple[int, int] | None:
    """``[start, stop)`` from the first to the last live noisy key that a live noisy query of its block
    sees (the block-diagonal part), or None when there is none. Noisy keys no query can see (another
    rank's blocks in a CP-only ring step) are skipped like padding."""
    queries = q_rows.live & ~q_rows.clean
    seen = k_rows.live & ~k_rows.clean & torch.isin(k_rows.block, q_rows.block[queries])
    if not bool(seen.any()):
        return None
    index = torch.nonzero(seen).flatten()
    return int(index[0]), int(index[-1]) + 1


def _run_next_to(
    span: tuple[int, int], candidates: list[tuple[int, int]], runs: list[tuple[int, int]]
) -> tuple[int, int] | None:
    """The nearest of ``candidates`` (key runs with pieces) with no other key run between it and ``span``
    (so the residual over their union sees no other run's clean keys; dead keys between cost nothing),
    or None."""
    def distance(run: tuple[int, int]) -> int:
        return max(run[0] - span[1], span[0] - run[1], 0)

    for run in sorted(candidates, key=distance):
        lo, hi = min(span[0], run[0]), max(span[1], run[1])
        if all(other == run or other[1] <= lo or hi <= other[0] for other in runs):
            return run
    return None


def _key_runs(k_rows: Rows) -> list[tuple[int, int]]:
    """Maximal ``[start, stop)`` runs of live clean keys with strictly increasing positions."""
    usable = k_rows.live & k_rows.clean
    return _runs(usable, usable[1:] & usable[:-1] & (k_rows.pos[1:] > k_rows.pos[:-1]))


def _visible_ranges(q_rows: Rows, run_pos: Tensor, k_start: int) -> tuple[Tensor, Tensor]:
    """Per query row, the key indices ``[lo, hi)`` of the run it sees (``lo == hi`` when none)."""
    lo = torch.searchsorted(run_pos, q_rows.ctx_start) + k_start
    hi = torch.searchsorted(run_pos, q_rows.ctx_stop) + k_start
    hi = torch.where(q_rows.live & (hi > lo), hi, lo)
    return lo, hi


def _find_pieces(q_rows: Rows, lo: Tensor, hi: Tensor, min_rows: int) -> tuple[list[FlashPiece], Tensor]:
    """The pieces of one key run and, per row, the key index up to which pieces cover ``[lo, hi)``
    (``lo`` for rows no piece covers)."""
    covered_to = lo.clone()
    pieces: list[FlashPiece] = []
    sees = hi > lo
    segments = _segments(q_rows, lo, sees)
    starts, stops = {s0 for s0, _ in segments}, {s1 for _, s1 in segments}

    def dense(a: int, b: int) -> None:
        pieces.append(FlashPiece(a, b, int(lo[a]), int(hi[b - 1]), False))
        covered_to[a:b] = hi[a:b]

    # Dense pieces over whole segments: rows of several segments (DFlash anchors, noisy blocks of a
    # rank) that all see one range. A run inside one segment is a staircase step: left to the envelope.
    for a, b in _equal_runs(sees, lo, hi):
        if b - a >= 2 * min_rows and a in starts and b in stops:
            dense(a, b)
    # Causal pieces, per remaining segment (after a long flat tail, which is one dense rectangle).
    for s0, s1 in segments:
        if covered_to[s0] != lo[s0]:
            continue
        flat = s1 - int(torch.flip(hi[s0:s1] == hi[s1 - 1], [0]).cumprod(0).sum())  # start of the flat tail
        if s1 - flat >= (min_rows if flat == s0 else 2 * min_rows) and not _one_more_step(hi, s0, flat, s1):
            dense(flat, s1)
            s1 = flat
        for a, b in _envelope_runs(lo, hi, s0, s1, min_rows):
            envelope = _envelope(hi, s0, s1)[a - s0 : b - s0]
            first = int(envelope[0]) - 1
            if first > int(lo[a]):
                pieces.append(FlashPiece(a, b, int(lo[a]), first, False))
            pieces.append(FlashPiece(a, b, first, first + (b - a), True))
            covered_to[a:b] = envelope
    # Dense pieces over what is left: long runs of untouched rows that see one range.
    for a, b in _equal_runs(sees & (covered_to == lo), lo, hi):
        if b - a >= 2 * min_rows:
            dense(a, b)
    return pieces, covered_to


def _one_more_step(hi: Tensor, s0: int, flat: int, s1: int) -> bool:
    """Whether the flat tail ``[flat, s1)`` of the segment ``[s0, s1)`` is one more step of the staircase
    before it: its range ends ``s1 - flat`` keys past the row before it, so the causal diagonal runs
    straight through it (the last block of BD3's noisy or clean rows). It then joins the causal piece: a
    dense piece of its few rows over the whole range would be a thin call that fills few of a GPU's
    multiprocessors. A longer tail (rows after a key shard, which all see the whole shard) would lower
    the diagonal of every row before it, so that one stays a dense rectangle."""
    return s0 < flat and int(hi[s1 - 1]) - int(hi[flat - 1]) == s1 - flat


def _segments(q_rows: Rows, lo: Tensor, sees: Tensor) -> list[tuple[int, int]]:
    """Maximal runs of rows that see keys, at consecutive positions, with one ``lo`` and one stream."""
    joins = (
        sees[1:] & sees[:-1] & (q_rows.pos[1:] == q_rows.pos[:-1] + 1)
        & (lo[1:] == lo[:-1]) & (q_rows.clean[1:] == q_rows.clean[:-1])
    )
    return _runs(sees, joins)


def _equal_runs(selected: Tensor, lo: Tensor, hi: Tensor) -> list[tuple[int, int]]:
    """Maximal runs of selected rows with equal ``(lo, hi)``."""
    joins = selected[1:] & selected[:-1] & (lo[1:] == lo[:-1]) & (hi[1:] == hi[:-1])
    return _runs(selected, joins)


def _runs(selected: Tensor, joins: Tensor) -> list[tuple[int, int]]:
    """``[start, stop)`` runs of ``selected`` rows where row ``i`` and ``i + 1`` are joined by ``joins[i]``."""
    if selected.numel() == 0:
        return []
    starts = selected.clone()
    starts[1:] &= ~joins
    start_idx = torch.nonzero(starts).flatten().tolist()
    stops = selected.clone()
    stops[:-1] &= ~joins
    stop_idx = (torch.nonzero(stops).flatten() + 1).tolist()
    return list(zip(start_idx, stop_idx))


def _envelope(hi: Tensor, s0: int, s1: int) -> Tensor:
    """``c[r] = r + min_{r' in [r, s1)} (hi[r'] - r')`` for ``r`` in ``[s0, s1)``: the last key + 1 of the
    steepest causal diagonal under the staircase ``hi`` (it grows by at least one per row)."""
    index = torch.arange(s0, s1)
    shifted = hi[s0:s1] - index
    suffix_min = torch.flip(torch.cummin(torch.flip(shifted, [0]), 0).values, [0])
    return index + suffix_min


def _envelope_runs(lo: Tensor, hi: Tensor, s0: int, s1: int, min_rows: int) -> list[tuple[int, int]]:
    """Runs of ``>= min_rows`` rows of ``[s0, s1)`` whose envelope grows by exactly one per row and whose
    first row sees at least one key on the diagonal (``c[a] - 1 >= lo``)."""
    if s1 - s0 < min_rows:
        return []
    envelope = _envelope(hi, s0, s1)
    ok = envelope - 1 >= lo[s0:s1]
    joins = ok[1:] & ok[:-1] & (envelope[1:] == envelope[:-1] + 1)
    return [(s0 + a, s0 + b) for a, b in _runs(ok, joins) if b - a >= min_rows]
