"""Shared pieces of the transports that exchange K/V rows inside a ring (csbp.md §9-§11).

A ring member's packed rows are ``[noisy rows ; clean rows]``; the *exchanged* rows are a suffix
of them starting at ``exchange_start``: every row for the CP-only baseline (generic context
parallelism moves noisy and clean K/V), only the clean rows for CSBP (noisy K/V never leave the
rank). ``ExchangeSpec`` records, for every ring member, the key metadata of its exchanged rows, so
each rank can tag rows it receives without communicating metadata.

Wire format: a member's exchanged K and V rows are packed into one buffer
``kv_shard [2, S, Hkv, shard_rows, d]`` (index 0 = K, 1 = V), zero-padded to the ring's largest
shard (padding rows are dead keys). An all-gather of these shards is ``[P*2, S, Hkv, shard_rows, d]``
in owner-major order (viewable as ``[P, 2, S, Hkv, shard_rows, d]``).

Shape legend: ``S`` samples, ``Hkv`` KV heads, ``d`` head dim, ``P`` ring size, ``R`` remote rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

import torch
from torch import Tensor

from csbp.attention.backends import check_backend, check_clean
from csbp.attention.diagonal import check_diagonal_backend
from csbp.attention.documents import Documents
from csbp.attention.kernel import DEFAULT_TILE_ROWS
from csbp.attention.layouts import RankLayout, bd3_rows, cp_zigzag_layout, ring_clean_positions
from csbp.attention.rows import Rows
from csbp.attention.transports.function import TransportBackward, TransportForward, TransportFunction
from csbp.parallel.comm import Comm

RECOMPUTE_SUFFIX = "_recompute"
PlanT = TypeVar("PlanT")


@dataclass(frozen=True, eq=False)
class ExchangeSpec:
    """Which packed rows every ring member exchanges, with their key metadata.

    Attributes:
        ring_rank: this rank's index in the ring (its ``Comm`` group rank).
        exchange_start: packed index of this rank's first exchanged row (rows ``[exchange_start, N)``).
        member_rows: per ring member, the metadata of its exchanged rows in its packed order.
    """

    ring_rank: int
    exchange_start: int
    member_rows: tuple[Rows, ...]

    @property
    def ring_size(self) -> int:
        return len(self.member_rows)

    @property
    def shard_rows(self) -> int:
        """Rows of the padded wire shard: the largest member's exchanged rows."""
        return max(len(rows) for rows in self.member_rows)

    @property
    def num_exchanged(self) -> int:
        """This rank's exchanged rows."""
        return len(self.member_rows[self.ring_rank])

    def to(self, device: torch.device | str) -> ExchangeSpec:
        return ExchangeSpec(self.ring_rank, self.exchange_start, tuple(r.to(device) for r in self.member_rows))


def csbp_exchange_spec(layout: RankLayout, *, seq_len: int, block_size: int, cp: int, cp_rank: int) -> ExchangeSpec:
    """CSBP: only the zigzag clean shards (``ring_clean_positions``) are exchanged."""
    shards = ring_clean_positions(seq_len, cp)
    if not torch.equal(layout.clean_positions.cpu(), shards[cp_rank]):
        raise ValueError(
            f"layout does not hold the zigzag clean shard of cp_rank={cp_rank} (cp={cp}, seq_len={seq_len}): "
            "build it with csbp_layout/rank_layout for the same topology and local rank"
        )
    empty = torch.zeros(0, dtype=torch.long)
    members = tuple(bd3_rows(empty, positions, block_size=block_size) for positions in shards)
    return ExchangeSpec(ring_rank=cp_rank, exchange_start=layout.num_noisy, member_rows=members)


def cp_exchange_spec(
    layout: RankLayout,
    *,
    seq_len: int,
    block_size: int,
    cp: int,
    cp_rank: int,
    documents: Documents | None = None,
) -> ExchangeSpec:
    """CP-only zigzag over ``2L``: every packed row (noisy and clean) is exchanged (with packed
    ``documents`` the noisy keys carry their segment ids)."""
    members = tuple(cp_zigzag_layout(seq_len, block_size, cp, c, documents=documents) for c in range(cp))
    mine = members[cp_rank]
    if not (
        torch.equal(layout.noisy_positions.cpu(), mine.noisy_positions)
        and torch.equal(layout.clean_positions.cpu(), mine.clean_positions)
    ):
        raise ValueError(
            f"layout does not hold the CP zigzag rows of cp_rank={cp_rank} (cp={cp}, seq_len={seq_len}): "
            "build it with cp_zigzag_layout/rank_layout for the same topology and local rank"
        )
    return ExchangeSpec(ring_rank=cp_rank, exchange_start=0, member_rows=tuple(m.rows for m in members))


def check_ring_comm(comm: Comm | None, spec_ring_size: int, ring_rank: int, what: str) -> Comm:
    """``comm`` must span this rank's ring, with this rank at ``ring_rank``."""
    if comm is None:
        raise ValueError(f"{what} needs comm=Comm(ring_group, counter): got comm=None")
    if comm.size != spec_ring_size or comm.rank != ring_rank:
        raise ValueError(
            f"{what}: comm group has size {comm.size} and this rank at {comm.rank}, expected the ring "
            f"(size {spec_ring_size}, rank {ring_rank}); pass Comm(process_groups.ring, counter)"
        )
    return comm


def check_packed_inputs(q: Tensor, k: Tensor, v: Tensor, num_rows: int, what: str) -> None:
    """``q [S, Hq, N, d]`` and ``k, v [S, Hkv, N, d]`` over the ``N`` packed rows of the layout."""
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape or q.shape[2] != num_rows or k.shape[2] != num_rows:
        raise ValueError(
            f"{what} expects q [S, Hq, {num_rows}, d] and k, v [S, Hkv, {num_rows}, d] (the layout's packed "
            f"rows), got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )


def recompute_category(comm: Comm) -> str:
    """Counter category of K/V that is re-sent for the backward (kept apart from dK/dV bytes)."""
    return comm.category + RECOMPUTE_SUFFIX


def pack_shard(k: Tensor, v: Tensor, start: int, shard_rows: int) -> Tensor:
    """Rows ``[start, N)`` of ``k, v [S, Hkv, N, d]`` as ``kv_shard [2, S, Hkv, shard_rows, d]``
    (zero padding at the end)."""
    num_rows = k.shape[2] - start
    if num_rows == shard_rows:
        return torch.stack([k[:, :, start:], v[:, :, start:]])
    shard = k.new_zeros(2, *k.shape[:2], shard_rows, k.shape[-1])
    shard[0, :, :, :num_rows] = k[:, :, start:]
    shard[1, :, :, :num_rows] = v[:, :, start:]
    return shard


def padded_rows(rows: Rows, num_rows: int) -> Rows:
    """``rows`` followed by dead rows (``live = False``) up to ``num_rows`` rows."""
    return rows.padded(num_rows)


def canonical_key_order(rows: Rows) -> Tensor:
    """Indices ordering keys as the tile kernel wants them: noisy by block, then clean by position."""
    secondary = torch.where(rows.clean, rows.pos, rows.block)
    order = torch.sort(secondary, stable=True).indices
    return order[torch.sort(rows.clean[order].to(torch.int64), stable=True).indices]


def queries_touching(query_rows: Rows, key_rows: Rows) -> Tensor:
    """Indices of the live query rows that may attend to at least one live row of ``key_rows``:
    a clean key inside the query's ``[ctx_start, ctx_stop)`` or a noisy key of its own block."""
    keys = key_rows.select(key_rows.live)
    clean_pos = torch.sort(keys.pos[keys.clean]).values
    lo = torch.searchsorted(clean_pos, query_rows.ctx_start)
    hi = torch.searchsorted(clean_pos, query_rows.ctx_stop)
    noisy_blocks = torch.unique(keys.block[~keys.clean])
    sees_noisy = ~query_rows.clean & torch.isin(query_rows.block, noisy_blocks)
    return torch.nonzero(query_rows.live & ((hi > lo) | sees_noisy)).flatten()


@dataclass(frozen=True, eq=False)
class RemoteKeys:
    """The live rows of the *other* members in a gathered buffer, in canonical key order.

    Attributes:
        owner: int64 ``[R]``, ring member of each remote row.
        row: int64 ``[R]``, its row inside the member's wire shard.
        rows: key metadata of the remote rows (canonical order, all live).
        idle_owner: int64 ``[I]``, ring member of each other member's shard row that carries no key
            (a dead row, or padding up to the wire shard's length) ...
        idle_row: int64 ``[I]``, ... and that row: where ``scatter_remote`` writes zeros.
    """

    owner: Tensor
    row: Tensor
    rows: Rows
    idle_owner: Tensor
    idle_row: Tensor

    def __len__(self) -> int:
        return int(self.owner.shape[0])


def remote_keys(spec: ExchangeSpec) -> RemoteKeys:
    """Remote rows of a gathered buffer, sorted once so the tile plan needs no per-call key gather."""
    parts, owners, rows_in_shard, idle_owners, idle_rows = [], [], [], [], []
    for member, rows in enumerate(spec.member_rows):
        if member == spec.ring_rank:
            continue
        live = torch.nonzero(rows.live).flatten()
        parts.append(rows.select(live))
        owners.append(torch.full_like(live, member))
        rows_in_shard.append(live)
        padding = torch.arange(len(rows), spec.shard_rows, device=live.device)
        idle = torch.cat([torch.nonzero(~rows.live).flatten(), padding])
        idle_owners.append(torch.full_like(idle, member))
        idle_rows.append(idle)
    all_rows = Rows.cat(parts)
    order = canonical_key_order(all_rows)
    return RemoteKeys(
        owner=torch.cat(owners)[order], row=torch.cat(rows_in_shard)[order], rows=all_rows.select(order),
        idle_owner=torch.cat(idle_owners), idle_row=torch.cat(idle_rows),
    )


def select_remote(gathered: Tensor, remote: RemoteKeys) -> Tensor:
    """``gathered [P*2, S, Hkv, n, d]`` -> remote rows ``[2, S, Hkv, R, d]`` (one copy)."""
    num_members, n, d = gathered.shape[0] // 2, gathered.shape[3], gathered.shape[4]
    per_member = gathered.view(num_members, -1, n, d)  # [P, 2*S*Hkv, n, d]
    lanes = torch.arange(per_member.shape[1], device=gathered.device)
    picked = per_member[remote.owner[None, :], lanes[:, None], remote.row[None, :]]  # [2*S*Hkv, R, d]
    return picked.view(2, *gathered.shape[1:3], len(remote), d)


def scatter_remote(
    dk: Tensor, dv: Tensor, remote: RemoteKeys, ring_rank: int, num_members: int, shard_rows: int, *,
    dtype: torch.dtype | None = None,
) -> Tensor:
    """Inverse of ``select_remote`` for gradients: ``dk, dv [S, Hkv, R, d]`` -> ``[P*2, S, Hkv, n, d]`` in
    ``dtype`` (default dk's; the accumulation dtype for a kernel's bf16 gradients, which the ring sums)
    with zeros at this member's own slot and at every idle row. Each row is written once: the remote
    rows from ``dk``/``dv`` directly (no stacked copy of them), zeros only where no remote row lands (not a
    zero pass over the whole buffer first)."""
    heads, num_remote, d = dk.shape[0] * dk.shape[1], dk.shape[2], dk.shape[3]
    dtype = dk.dtype if dtype is None else dtype
    dk, dv = dk.to(dtype), dv.to(dtype)  # an indexed write takes one dtype
    full = dk.new_empty(num_members, 2 * heads, shard_rows, d)  # lanes: dk's S*Hkv, then dv's
    full[ring_rank] = 0.0
    lanes = torch.arange(2 * heads, device=dk.device)
    owner, row = remote.owner[None, :], remote.row[None, :]
    full[owner, lanes[:heads, None], row] = dk.reshape(heads, num_remote, d)
    full[owner, lanes[heads:, None], row] = dv.reshape(heads, num_remote, d)
    if len(remote.idle_row) > 0:
        full[remote.idle_owner[None, :], lanes[:, None], remote.idle_row[None, :]] = 0.0
    return full.view(num_members * 2, *dk.shape[:2], shard_rows, d)


def check_spec_matches_layout(layout: RankLayout, spec: ExchangeSpec, what: str) -> None:
    """The spec's rows for this rank must be the layout's packed rows from ``exchange_start`` on."""
    if not 0 <= spec.ring_rank < spec.ring_size or not 0 <= spec.exchange_start <= len(layout.rows):
        raise ValueError(
            f"{what}: ring_rank={spec.ring_rank} / exchange_start={spec.exchange_start} out of range for a "
            f"ring of {spec.ring_size} and a layout of {len(layout.rows)} rows"
        )
    exchanged = layout.rows.select(slice(spec.exchange_start, None))
    mine = spec.member_rows[spec.ring_rank]
    if not (
        len(exchanged) == len(mine)
        and torch.equal(exchanged.pos.cpu(), mine.pos.cpu())
        and torch.equal(exchanged.clean.cpu(), mine.clean.cpu())
    ):
        raise ValueError(
            f"{what}: the layout's rows from exchange_start={spec.exchange_start} are not the rows the "
            f"exchange spec lists for ring rank {spec.ring_rank}; build layout and spec for the same rank"
        )


class PlanCache(Generic[PlanT]):
    """Per-device plans: built once on the layout's device, rebuilt once per other device seen."""

    def __init__(self, build: Callable[[torch.device], PlanT], device: torch.device | str) -> None:
        self._build = build
        self._plans: dict[torch.device, PlanT] = {}
        self.get(torch.device(device))

    def get(self, device: torch.device) -> PlanT:
        plan = self._plans.get(device)
        if plan is None:
            plan = self._plans[device] = self._build(device)
        return plan


class RingTransport(Generic[PlanT]):
    """The shell shared by the ring transports (collective, streaming): argument checks, per-device
    plans, and the ``AttentionFn`` call through :class:`TransportFunction`.

    Subclasses set ``name``, ``forward_fn`` and ``backward_fn`` and implement ``_build_plan``.

    Args:
        layout: this rank's rows (packed ``[noisy ; clean]``).
        spec: which rows each ring member exchanges (``csbp_exchange_spec`` / ``cp_exchange_spec``).
        comm: ``Comm`` over the ring group (size ``spec.ring_size``, this rank at ``spec.ring_rank``).
        causal_in_block: lower-triangular attention inside a noisy block.
        tile_rows: query rows per kernel tile.
        backend: attention backend of the partials (``csbp.attention.backends``: auto, tiles, flex).
        diagonal: kernel of the local noisy block diagonal (``csbp.attention.diagonal``).
        clean: kernel of the clean-context partials (``csbp.attention.backends.CLEAN_KERNELS``).
        device: where the plan is built now, the compute device (default: the rows' device); a call
            on another device builds that device's plan on first use.
    """

    name: ClassVar[str]
    forward_fn: ClassVar[TransportForward]
    backward_fn: ClassVar[TransportBackward]

    def __init__(
        self,
        layout: RankLayout,
        spec: ExchangeSpec,
        comm: Comm,
        *,
        causal_in_block: bool = False,
        tile_rows: int = DEFAULT_TILE_ROWS,
        backend: str = "tiles",
        diagonal: str = "auto",
        clean: str = "generic",
        device: torch.device | str | None = None,
    ) -> None:
        check_spec_matches_layout(layout, spec, self.name)
        self.backend = check_backend(backend)
        self.diagonal = check_diagonal_backend(diagonal, backend, where="diagonal")
        self.clean = check_clean(clean)
        self.comm = check_ring_comm(comm, spec.ring_size, spec.ring_rank, self.name)
        self.layout, self.spec = layout, spec
        self.causal_in_block, self.tile_rows = causal_in_block, tile_rows
        self._plans = PlanCache(self._build_plan, layout.rows.pos.device if device is None else device)

    def _build_plan(self, device: torch.device) -> PlanT:
        raise NotImplementedError

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, layer_index: int = 0) -> Tensor:
        check_packed_inputs(q, k, v, len(self.layout.rows), self.name)
        plan = self._plans.get(q.device)
        return TransportFunction.apply(q, k, v, plan, type(self).forward_fn, type(self).backward_fn)
