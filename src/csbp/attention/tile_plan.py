"""Block-sparse tile schedule of attention over interval row metadata (csbp.md §3.2), used by the
kernels of ``csbp.attention.kernel``.

``build_tile_plan(q_rows, k_rows)`` runs once per step and is reused by every layer, forward and
backward (the rows are the same in every layer). It puts the live keys in canonical order
``[noisy keys by block ; clean keys by pos]`` (the packed order of ``docs/design.md`` already is;
any other order costs one gather of K/V per call, never a wrong result), the queries in order
``[noisy by block ; clean by ctx_stop]``, and gives each tile of ``tile_rows`` consecutive queries
at most two contiguous candidate key ranges: the noisy keys of the tile's blocks and the clean keys
inside the union of the tile's ``[ctx_start, ctx_stop)``. Kernels touch only those keys and apply
the exact predicate inside the tile (``mask_tile_scores``); tiles without a candidate key are not
in the plan. Padding keys (``live = False``) are never candidates.

The predicate is ``csbp.masks.rows_mask`` (the one definition the FlexAttention backend and the
dense reference use too), evaluated once per plan and causal flag on the columns of each tile that
are not entirely allowed; every layer's forward and backward then applies those stored strips
with one ``masked_fill_`` each instead of rebuilding the mask from the row metadata, or (the CPU
kernels) passes the tile's additive ``[T*G, C]`` form of them, built once per plan within
``MASK_CACHE_BYTES`` (``TilePlan.additive_masks``).

Shape legend: ``S`` samples, ``Hkv`` KV heads, ``G`` query heads per KV head, ``T`` rows of a tile,
``C`` candidate keys of a tile, ``n`` used (live) keys, ``d`` head dim.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from csbp.attention.rows import Rows
from csbp.masks import rows_mask


@dataclass(frozen=True)
class TileMask:
    """The mask of one tile's candidate keys, evaluated once per plan and causal flag.

    Attributes:
        strips: ``(first, stop, blocked [T, 1, stop-first])`` column ranges that hold a disallowed
            pair (``blocked`` True where disallowed); every other candidate column is allowed.
        empty: ``[T]`` bool, rows that see no candidate key; None when every row sees one.
    """

    strips: tuple[tuple[int, int, Tensor], ...]
    empty: Tensor | None

DEFAULT_TILE_ROWS = 128
MASK_CACHE_BYTES = 256 << 20  # additive tile masks kept per plan (CPU kernels) up to this size
_INT64_MAX = torch.iinfo(torch.int64).max
_INT64_MIN = torch.iinfo(torch.int64).min


@dataclass(frozen=True)
class TileRange:
    """One tile: canonical query rows ``[q_lo, q_hi)`` and canonical candidate keys
    ``[noisy_lo, noisy_hi)`` (noisy) plus ``[clean_lo, clean_hi)`` (clean). Every row of the tile
    may see the clean keys ``[full_lo, full_hi)`` (a sub-range, possibly empty), which need no mask."""

    q_lo: int
    q_hi: int
    noisy_lo: int
    noisy_hi: int
    clean_lo: int
    clean_hi: int
    full_lo: int
    full_hi: int

    @property
    def num_keys(self) -> int:
        return (self.noisy_hi - self.noisy_lo) + (self.clean_hi - self.clean_lo)


@dataclass(frozen=True, eq=False)
class TilePlan:
    """Block-sparse schedule of one (query rows, key rows) pair; build with ``build_tile_plan``.

    Attributes:
        num_queries, num_keys: sizes of the row sets the plan was built for.
        tile_rows: query rows per tile.
        tiles: the tiles that have at least one candidate key.
        query_index: int64 ``[num_queries]``, canonical -> original query row; None when identical.
        query_inverse: int64 ``[num_queries]``, original -> canonical query row; None when identical.
        key_index: int64 ``[num_used_keys]``, canonical -> original key row; None when the canonical
            keys are the first ``num_used_keys`` original keys in order.
        num_noisy_keys: canonical keys ``[0, num_noisy_keys)`` are noisy, the rest clean (all live).
        query_rows: query metadata in canonical order.
        key_rows: metadata of the used (live) keys in canonical order.
    """

    num_queries: int
    num_keys: int
    tile_rows: int
    tiles: tuple[TileRange, ...]
    query_index: Tensor | None
    query_inverse: Tensor | None
    key_index: Tensor | None
    num_noisy_keys: int
    query_rows: Rows
    key_rows: Rows
    _strips: dict[bool, tuple[TileMask, ...]] = field(default_factory=dict, repr=False)
    _additive: dict[tuple[bool, torch.dtype, int], tuple[Tensor | None, ...] | None] = field(
        default_factory=dict, repr=False
    )

    def tile_strips(self, causal_in_block: bool) -> tuple[TileMask, ...]:
        """The mask of every tile, evaluated once per causal flag and then reused."""
        strips = self._strips.get(causal_in_block)
        if strips is None:
            strips = self._strips[causal_in_block] = tuple(
                _tile_strips(self, tile, causal_in_block) for tile in self.tiles
            )
        return strips

    def additive_masks(
        self, causal_in_block: bool, dtype: torch.dtype, group: int = 1
    ) -> tuple[Tensor | None, ...] | None:
        """Every tile's ``[T*group, C]`` additive mask (``additive_mask``; None for a tile without a
        disallowed pair) in ``dtype``, built once per causal flag, dtype and group and then reused;
        None when they would take more than ``MASK_CACHE_BYTES`` (callers then build one at a time).

        Tiles whose masks end in the same pattern (the columns from the first one holding a
        disallowed pair to the last, e.g. the block-causal corner every clean tile of the BD3 mask
        has) share one ``[T*group, W]`` buffer, zeros before the pattern: a tile's mask is a view of
        its last ``C`` columns (the kernel reads masks through their row stride), so the memory is
        per pattern and the widest tile, not per tile."""
        key = (causal_in_block, dtype, group)
        if key not in self._additive:
            self._additive[key] = _shared_additive_masks(self, self.tile_strips(causal_in_block), dtype, group)
        return self._additive[key]

    @property
    def num_used_keys(self) -> int:
        return len(self.key_rows)

    @property
    def num_candidate_pairs(self) -> int:
        """(query, key) pairs the kernels compute scores for (dense would be ``Nq * Nk``)."""
        return sum((t.q_hi - t.q_lo) * t.num_keys for t in self.tiles)

    @property
    def keys_reordered(self) -> bool:
        """True when K/V are gathered into canonical order on every call (keys not in packed order)."""
        return self.key_index is not None


def build_tile_plan(q_rows: Rows, k_rows: Rows, *, tile_rows: int = DEFAULT_TILE_ROWS) -> TilePlan:
    """The tile schedule of ``q_rows`` x ``k_rows``; compute once per step, reuse in every layer."""
    if tile_rows < 1:
        raise ValueError(f"tile_rows must be >= 1, got {tile_rows}")
    num_queries, num_keys = len(q_rows), len(k_rows)
    device = q_rows.pos.device
    if k_rows.pos.device != device:
        raise ValueError(f"q_rows are on {device} but k_rows on {k_rows.pos.device}; move both with Rows.to")

    query_order = _stable_lexsort(q_rows.clean, torch.where(q_rows.clean, q_rows.ctx_stop, q_rows.block))
    query_index = None if _is_prefix_identity(query_order) else query_order
    queries = q_rows if query_index is None else q_rows.select(query_index)

    live_keys = torch.nonzero(k_rows.live).flatten()
    live = k_rows.select(live_keys)
    key_order = live_keys[_stable_lexsort(live.clean, torch.where(live.clean, live.pos, live.block))]
    key_index = None if _is_prefix_identity(key_order) else key_order
    keys = k_rows.select(key_order)
    num_noisy_keys = int((~keys.clean).sum())
    noisy_key_block = keys.block[:num_noisy_keys].contiguous()  # non-decreasing
    clean_key_pos = keys.pos[num_noisy_keys:].contiguous()  # non-decreasing

    num_tiles = -(-num_queries // tile_rows)
    noisy_rows = queries.live & ~queries.clean
    context_rows = queries.live & (queries.ctx_start < queries.ctx_stop)
    block_lo = _per_tile(queries.block, noisy_rows, _INT64_MAX, tile_rows, num_tiles).amin(1)
    block_hi = _per_tile(queries.block, noisy_rows, _INT64_MIN, tile_rows, num_tiles).amax(1)
    ctx_lo = _per_tile(queries.ctx_start, context_rows, _INT64_MAX, tile_rows, num_tiles).amin(1)
    ctx_hi = _per_tile(queries.ctx_stop, context_rows, _INT64_MIN, tile_rows, num_tiles).amax(1)
    every_row = torch.ones_like(queries.live)
    all_live = _per_tile(queries.live.long(), every_row, 1, tile_rows, num_tiles).amin(1) == 1
    shared_lo = _per_tile(queries.ctx_start, every_row, _INT64_MIN, tile_rows, num_tiles).amax(1)
    shared_hi = _per_tile(queries.ctx_stop, every_row, _INT64_MAX, tile_rows, num_tiles).amin(1)
    has_noisy = block_lo <= block_hi
    has_context = ctx_lo < ctx_hi
    noisy_lo = torch.searchsorted(noisy_key_block, block_lo)
    noisy_hi = torch.searchsorted(noisy_key_block, block_hi, right=True)
    clean_lo = torch.searchsorted(clean_key_pos, ctx_lo) + num_noisy_keys
    clean_hi = torch.searchsorted(clean_key_pos, ctx_hi) + num_noisy_keys
    noisy_lo, noisy_hi = noisy_lo.where(has_noisy, 0), noisy_hi.where(has_noisy, 0)
    clean_lo = clean_lo.where(has_context, num_noisy_keys)
    clean_hi = clean_hi.where(has_context, num_noisy_keys)
    # clean keys every row of the tile sees: [max ctx_start, min ctx_stop) when all rows are live
    full_lo = torch.maximum(torch.searchsorted(clean_key_pos, shared_lo) + num_noisy_keys, clean_lo)
    full_hi = torch.minimum(torch.searchsorted(clean_key_pos, shared_hi) + num_noisy_keys, clean_hi)
    has_full = all_live & (full_lo < full_hi)
    full_lo, full_hi = full_lo.where(has_full, clean_hi), full_hi.where(has_full, clean_hi)

    tiles = []
    ranges = torch.stack([noisy_lo, noisy_hi, clean_lo, clean_hi, full_lo, full_hi], dim=1).tolist()
    for index, (n_lo, n_hi, c_lo, c_hi, f_lo, f_hi) in enumerate(ranges):
        if n_hi > n_lo or c_hi > c_lo:
            q_lo = index * tile_rows
            q_hi = min(q_lo + tile_rows, num_queries)
            tiles.append(TileRange(q_lo, q_hi, n_lo, n_hi, c_lo, c_hi, f_lo, f_hi))
    return TilePlan(
        num_queries=num_queries,
        num_keys=num_keys,
        tile_rows=tile_rows,
        tiles=tuple(tiles),
        query_index=query_index,
        query_inverse=None if query_index is None else torch.argsort(query_index),
        key_index=key_index,
        num_noisy_keys=num_noisy_keys,
        query_rows=queries,
        key_rows=keys,
    )


def mask_tile_scores(scores: Tensor, tile_mask: TileMask, group: int) -> None:
    """Set the scores ``[S, Hkv, T*G, C]`` of a tile's disallowed (query, key) pairs to -inf, in place.

    ``tile_mask`` is the tile's entry of ``TilePlan.tile_strips(causal_in_block)``; columns are the
    tile's noisy candidates then its clean candidates (``gather_tile_keys``).
    """
    if not tile_mask.strips:
        return
    scores_view = scores.view(*scores.shape[:2], -1, group, scores.shape[-1])  # [S, Hkv, T, G, C]
    for first, stop, blocked in tile_mask.strips:
        scores_view[..., first:stop].masked_fill_(blocked, float("-inf"))


def additive_mask(tile_mask: TileMask, tile: TileRange, dtype: torch.dtype, group: int = 1) -> Tensor | None:
    """``[T*group, C]`` additive mask (0 allowed, -inf disallowed) of a tile's strips, row ``t*group + g``
    for query row ``t`` (the grouped layout of the CPU kernels); None when the tile is unmasked."""
    if not tile_mask.strips:
        return None
    device = tile_mask.strips[0][2].device
    mask = torch.zeros(tile.q_hi - tile.q_lo, group, tile.num_keys, dtype=dtype, device=device)
    for first, stop, blocked in tile_mask.strips:
        mask[..., first:stop].masked_fill_(blocked, float("-inf"))  # blocked [T, 1, w]: every head alike
    return mask.view(-1, tile.num_keys)


def _shared_additive_masks(
    plan: TilePlan, masks: tuple[TileMask, ...], dtype: torch.dtype, group: int
) -> tuple[Tensor | None, ...] | None:
    """``TilePlan.additive_masks``: one buffer per distinct ending pattern; None over the budget."""
    tails: dict[tuple[int, int, bytes], Tensor] = {}
    users: dict[tuple[int, int, bytes], list[int]] = {}
    for index, (tile, tile_mask) in enumerate(zip(plan.tiles, masks)):
        if not tile_mask.strips:
            continue
        start = min(first for first, _, _ in tile_mask.strips)
        tail = torch.zeros(tile.q_hi - tile.q_lo, 1, tile.num_keys - start, dtype=torch.bool)
        for first, stop, blocked in tile_mask.strips:
            tail[..., first - start : stop - start] = blocked.cpu()
        key = (tail.shape[0], tail.shape[2], tail.numpy().tobytes())
        tails.setdefault(key, tail)
        users.setdefault(key, []).append(index)
    widest = {key: max(plan.tiles[i].num_keys for i in indices) for key, indices in users.items()}
    size = group * sum(key[0] * width for key, width in widest.items())
    if size * torch.empty((), dtype=dtype).element_size() > MASK_CACHE_BYTES:
        return None
    shared: list[Tensor | None] = [None] * len(plan.tiles)
    device = plan.query_rows.pos.device
    for key, indices in users.items():
        num_rows, tail_width, width = key[0], key[1], widest[key]
        buffer = torch.zeros(num_rows, group, width, dtype=dtype, device=device)
        buffer[..., width - tail_width :].masked_fill_(tails[key].to(device), float("-inf"))
        buffer = buffer.view(num_rows * group, width)
        for index in indices:
            shared[index] = buffer[:, width - plan.tiles[index].num_keys :]
    return tuple(shared)


def _tile_strips(plan: TilePlan, tile: TileRange, causal: bool) -> TileMask:
    """Evaluate the predicate on the tile's candidate columns outside ``[full_lo, full_hi)``."""
    predicate = rows_mask(plan.query_rows, plan.key_rows, causal_in_block=causal)
    device = plan.query_rows.pos.device
    zero = torch.zeros((), dtype=torch.long, device=device)
    rows = torch.arange(tile.q_lo, tile.q_hi, device=device)[:, None]
    num_noisy = tile.noisy_hi - tile.noisy_lo
    spans = [(tile.noisy_lo, tile.noisy_hi, 0)] + [
        (lo, hi, num_noisy + lo - tile.clean_lo)
        for lo, hi in ((tile.clean_lo, tile.full_lo), (tile.full_hi, tile.clean_hi))
    ]
    strips = []
    sees_key = torch.full((tile.q_hi - tile.q_lo,), tile.full_hi > tile.full_lo, device=device)
    for lo, hi, first in spans:
        if hi > lo:
            blocked = ~predicate(zero, zero, rows, torch.arange(lo, hi, device=device)[None, :])
            sees_key |= ~blocked.all(-1)
            if bool(blocked.any()):
                strips.append((first, first + hi - lo, blocked[:, None, :]))
    return TileMask(tuple(strips), None if bool(sees_key.all()) else ~sees_key)


def gather_tile_keys(x: Tensor, tile: TileRange) -> Tensor:
    """Candidate rows ``[S, Hkv, C, d]`` of canonical keys ``x [S, Hkv, n, d]`` (a view when contiguous)."""
    if tile.noisy_hi == tile.noisy_lo or tile.noisy_hi == tile.clean_lo:
        lo = tile.clean_lo if tile.noisy_hi == tile.noisy_lo else tile.noisy_lo
        return x[:, :, lo : tile.clean_hi]
    if tile.clean_hi == tile.clean_lo:
        return x[:, :, tile.noisy_lo : tile.noisy_hi]
    return torch.cat([x[:, :, tile.noisy_lo : tile.noisy_hi], x[:, :, tile.clean_lo : tile.clean_hi]], dim=2)


def add_tile_keys(total: Tensor, grad: Tensor, tile: TileRange) -> None:
    """Add a tile's candidate-key gradient ``[S, Hkv, C, d]`` into canonical ``total [S, Hkv, n, d]``."""
    num_noisy = tile.noisy_hi - tile.noisy_lo
    if num_noisy:
        total[:, :, tile.noisy_lo : tile.noisy_hi].add_(grad[:, :, :num_noisy])
    if tile.clean_hi > tile.clean_lo:
        total[:, :, tile.clean_lo : tile.clean_hi].add_(grad[:, :, num_noisy:])


def _stable_lexsort(primary: Tensor, secondary: Tensor) -> Tensor:
    """Indices sorting by ``(primary, secondary)``, ties kept in original order."""
    order = torch.sort(secondary, stable=True).indices
    return order[torch.sort(primary[order].to(torch.int64), stable=True).indices]


def _is_prefix_identity(order: Tensor) -> bool:
    return bool(torch.equal(order, torch.arange(order.shape[0], device=order.device)))


def _per_tile(values: Tensor, valid: Tensor, fill: int, tile_rows: int, num_tiles: int) -> Tensor:
    """``values`` where ``valid`` else ``fill``, padded with ``fill``, as ``[num_tiles, tile_rows]``."""
    padded = values.new_full((num_tiles * tile_rows,), fill)
    padded[: values.shape[0]] = torch.where(valid, values, fill)
    return padded.view(num_tiles, tile_rows)
