"""Which logical rows of the BD3 ``[x_t ; x_0]`` sequence each rank holds (csbp.md §5, §8, §11).

A layout answers, for one rank: which noisy positions (query rows whose logits it scores), which
clean positions (its share of the clean stream) and, as ``Rows``, the interval metadata every
kernel evaluates. The packed order is always ``[noisy rows, grouped by block in block order ;
clean rows sorted by position]``.

Mask bounds in token units (csbp.md §3.3), for a row at position ``p`` in block ``b`` (``s = b*B``):

======  ======================  ==================================
row     full attention          sliding window ``W`` (counts self)
======  ======================  ==================================
noisy   clean ``[0, s)``        clean ``[max(0, s-(W-1)), s)``
clean   clean ``[0, (b+1)*B)``  clean ``[max(0, p+1-W), p+1)``
======  ======================  ==================================

plus, for a noisy row, the noisy rows of its own block (``Rows.block``).

With packed ``documents`` (docs/document-masking.md) every bound is also clipped to the row's
document ``[d_start, d_stop)``: ``ctx_start >= d_start``, a clean row's ``ctx_stop <= d_stop``, and
``Rows.block`` is the row's *segment* (its block cut by document starts), so a noisy row sees only
the noisy rows of its block and document. Keys need nothing new: their position says it all.

Layouts: ``reference_layout`` (everything on one rank), ``cp_zigzag_layout`` (CP-only over ``2L``),
``bp_only_layout`` (clean-prefix replication), ``csbp_layout`` (fused CP x BP), and
``rank_layout`` to pick one from a ``Topology``. ``window_exchange_plan`` / ``halo_exchange_plan``
are the static plans of the variable-split all-to-all that moves only the clean rows some query
of the receiver may see (sliding windows, packed documents, the ``cp-aware`` baseline).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from csbp.attention.counts import bd3_bounds, interval_cover, layout_positions
from csbp.attention.documents import Documents
from csbp.attention.rows import Rows
from csbp.schedules import SchedulePolicy, zigzag_positions
from csbp.topology import Topology


def bd3_rows(
    noisy_positions: Tensor,
    clean_positions: Tensor,
    *,
    block_size: int,
    window: int | None = None,
    documents: Documents | None = None,
) -> Rows:
    """Rows ``[noisy ; clean]`` (each in the given order) of the BD3 mask, optionally windowed and
    restricted to packed ``documents``."""
    _check_window(window)
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    noisy_pos = noisy_positions.to(torch.long)  # [A]
    clean_pos = clean_positions.to(torch.long)  # [C]
    noisy_start, noisy_stop, clean_start, clean_stop = bd3_bounds(
        noisy_pos, clean_pos, block_size=block_size, window=window
    )
    noisy_block, clean_block = noisy_pos // block_size, clean_pos // block_size
    if documents is not None:
        start, stop, segment = documents.start, documents.stop, documents.segment_ids(block_size)
        noisy_start = torch.maximum(noisy_start, start[noisy_pos])
        clean_start = torch.maximum(clean_start, start[clean_pos])
        clean_stop = torch.minimum(clean_stop, stop[clean_pos])
        noisy_block, clean_block = segment[noisy_pos], segment[clean_pos]
    num_rows = noisy_pos.shape[0] + clean_pos.shape[0]
    return Rows(
        pos=torch.cat([noisy_pos, clean_pos]),
        clean=torch.cat(
            [torch.zeros_like(noisy_pos, dtype=torch.bool), torch.ones_like(clean_pos, dtype=torch.bool)]
        ),
        block=torch.cat([noisy_block, clean_block]),
        ctx_start=torch.cat([noisy_start, clean_start]),
        ctx_stop=torch.cat([noisy_stop, clean_stop]),
        live=torch.ones(num_rows, dtype=torch.bool, device=noisy_pos.device),
    )


@dataclass(frozen=True, eq=False)
class RankLayout:
    """The rows one rank holds.

    Attributes:
        rows: packed metadata, ``num_noisy`` noisy rows then the clean rows.
        num_noisy: number of noisy (loss-bearing) rows at the front of ``rows``.
        noisy_positions: int64 ``[num_noisy]``, grouped by block in block order.
        clean_positions: int64 ``[len(rows) - num_noisy]``, sorted.
        owned_blocks: sorted blocks whose noisy rows this rank holds.
    """

    rows: Rows
    num_noisy: int
    noisy_positions: Tensor
    clean_positions: Tensor
    owned_blocks: tuple[int, ...]

    @property
    def num_clean(self) -> int:
        return int(self.clean_positions.shape[0])


def reference_layout(
    seq_len: int, block_size: int, window: int | None = None, documents: Documents | None = None
) -> RankLayout:
    """All ``2L`` rows on one rank: noisy ``0 .. L-1`` then clean ``0 .. L-1``."""
    Topology().validate_sequence(seq_len, block_size)
    return _positions_layout(seq_len, block_size, 1, 1, 0, "dual_end", window, documents)


def cp_zigzag_layout(
    seq_len: int,
    block_size: int,
    cp: int,
    cp_rank: int,
    window: int | None = None,
    documents: Documents | None = None,
) -> RankLayout:
    """CP-only (csbp.md §5.1): ``[0, 2L)`` cut into ``2*cp`` chunks of ``L/cp`` rows; rank ``r`` holds
    chunk ``r`` (noisy ``[r*L/cp, (r+1)*L/cp)``) and chunk ``2cp-1-r`` (clean
    ``[(cp-1-r)*L/cp, (cp-r)*L/cp)``)."""
    Topology(cp=cp).validate_sequence(seq_len, block_size)
    return _positions_layout(seq_len, block_size, cp, 1, cp_rank, "dual_end", window, documents)


def bp_only_layout(
    seq_len: int,
    block_size: int,
    bp: int,
    bp_rank: int,
    schedule: SchedulePolicy = "dual_end",
    window: int | None = None,
    documents: Documents | None = None,
) -> RankLayout:
    """BP-only (csbp.md §5.3): the noisy rows of ``bp_rank``'s blocks and the replicated clean prefix
    ``[0, b_max*B)``, ``b_max`` being its highest owned block. With ``documents`` only the prefix of
    each owned block's documents is kept (``∪ [d_start, b*B)``): a clean row depends only on earlier
    rows of its own document, so that set is closed under every layer's dependencies.

    With a window the full prefix is still kept: a windowed clean row needs the ``W-1`` clean rows
    before it *at the previous layer*, which need theirs one layer below, so an ``n``-layer model
    reaches ``n*(W-1)`` rows back. A layout does not know the depth, and recomputing the prefix from
    position 0 is what makes every kept clean row exact at every layer.
    """
    Topology(bp=bp, replicate_clean_prefix=bp > 1).validate_sequence(seq_len, block_size)
    _check_worker(bp, bp_rank)
    return _positions_layout(seq_len, block_size, 1, bp, bp_rank, schedule, window, documents)


def csbp_layout(
    seq_len: int,
    block_size: int,
    cp: int,
    bp: int,
    local_rank: int,
    schedule: SchedulePolicy = "dual_end",
    window: int | None = None,
    documents: Documents | None = None,
) -> RankLayout:
    """Fused CP x BP (csbp.md §5.4-§5.5): the noisy rows of the blocks BP worker ``local_rank`` owns
    and the zigzag clean shard of ``cp_rank = local_rank % cp``. With ``bp > cp`` every ring
    (``local_rank // cp``) holds a complete CP-sharded copy of the clean stream."""
    topology = Topology(cp=cp, bp=bp)
    if topology.layout != "csbp":
        raise ValueError(
            f"csbp_layout needs cp > 1 and bp a multiple of cp, got cp={cp}, bp={bp}: "
            "use cp_zigzag_layout (bp=1) or bp_only_layout (cp=1)"
        )
    topology.validate_sequence(seq_len, block_size)
    _check_worker(bp, local_rank)
    return _positions_layout(seq_len, block_size, cp, bp, local_rank, schedule, window, documents)


def rank_layout(
    topology: Topology,
    local_rank: int,
    seq_len: int,
    block_size: int,
    *,
    schedule: SchedulePolicy = "dual_end",
    window: int | None = None,
    documents: Documents | None = None,
) -> RankLayout:
    """The layout of local rank ``local_rank`` under ``topology`` (any of its four layouts)."""
    if not 0 <= local_rank < topology.local:
        raise ValueError(f"local_rank must be in [0, {topology.local}), got {local_rank}")
    if documents is not None and documents.seq_len != seq_len:
        raise ValueError(f"documents cover {documents.seq_len} positions but seq_len={seq_len}")
    if topology.layout == "data":
        return reference_layout(seq_len, block_size, window, documents)
    if topology.layout == "cp":
        return cp_zigzag_layout(seq_len, block_size, topology.cp, local_rank, window, documents)
    if topology.layout == "bp":
        return bp_only_layout(seq_len, block_size, topology.bp, local_rank, schedule, window, documents)
    return csbp_layout(seq_len, block_size, topology.cp, topology.bp, local_rank, schedule, window, documents)


def ring_clean_positions(seq_len: int, cp: int) -> list[Tensor]:
    """Zigzag clean positions owned by each CSBP ring member ``0 .. cp-1`` (to tag gathered rows)."""
    return [zigzag_positions(seq_len, cp, c) for c in range(cp)]


@dataclass(frozen=True, eq=False)
class WindowPlan:
    """Static plan of the clean-row (halo) exchange inside one ring (csbp.md §11): for a sliding
    window, packed documents, or the mask-aware CP baseline (``halo_exchange_plan``).

    ``send[s][d]`` are the sorted clean positions ring member ``s`` sends to member ``d``: those
    ``d``'s query rows may attend to and ``s`` owns (empty for ``s == d``). The forward is one
    ``all_to_all_single`` with ``input_split_sizes = send_counts(s)`` on a buffer gathered by
    ``send_index(s)`` from ``s``'s clean shard, and ``output_split_sizes = recv_counts(d)``; the
    received rows are ``recv_positions(d)`` (source-major). The backward is the reverse exchange,
    the owner adding the returned gradients at ``send_index``. All tensors are CPU int64; treat them
    as read-only: the plan is cached and shared.
    """

    seq_len: int
    block_size: int
    cp: int
    bp: int
    ring_index: int
    window: int | None
    owned_positions: tuple[Tensor, ...]  # [cp] sorted clean positions of each ring member
    send: tuple[tuple[Tensor, ...], ...]  # [cp][cp] sorted positions, source-major

    def send_counts(self, source: int) -> list[int]:
        """Rows ``source`` sends to each ring member (``input_split_sizes``)."""
        return [int(t.shape[0]) for t in self.send[source]]

    def recv_counts(self, dest: int) -> list[int]:
        """Rows ``dest`` receives from each ring member (``output_split_sizes``)."""
        return [int(self.send[s][dest].shape[0]) for s in range(self.cp)]

    def traffic_rows(self) -> list[int]:
        """Per ring member, the rows of its busier direction: ``max(sent, received)`` (what
        ``counts.exchange_pays`` weighs against the all-gather)."""
        return [max(sum(self.send_counts(d)), sum(self.recv_counts(d))) for d in range(self.cp)]

    def send_index(self, source: int) -> Tensor:
        """Row indices into ``source``'s clean shard of its send buffer (destination-major)."""
        positions = torch.cat(list(self.send[source]))
        return torch.searchsorted(self.owned_positions[source], positions)

    def recv_positions(self, dest: int) -> Tensor:
        """Clean positions of the rows ``dest`` receives, in receive-buffer order (source-major)."""
        return torch.cat([self.send[s][dest] for s in range(self.cp)])


@functools.lru_cache(maxsize=64)
def window_exchange_plan(
    seq_len: int,
    block_size: int,
    cp: int,
    bp: int,
    ring_index: int,
    window: int,
    schedule: SchedulePolicy = "dual_end",
) -> WindowPlan:
    """The exchange plan of ring ``ring_index`` for a layer with window ``window`` (cached).

    ``need(d)`` is the union of ``d``'s query-row clean intervals, i.e. csbp.md §11's
    ``∪_p [max(0, p+1-W), p+1) ∪ ∪_b [max(0, b*B-(W-1)), b*B)`` over ``d``'s clean rows ``p`` and
    owned blocks ``b``; ``send[s][d] = need(d) ∩ owned(s)``. ``bp == 1`` plans the CP-only zigzag
    layout, ``bp > 1`` the fused one (ring members are local ranks ``ring_index*cp + d``).
    """
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1 for window_exchange_plan, got {window!r}")
    return halo_exchange_plan(seq_len, block_size, cp, bp, ring_index, window=window, schedule=schedule)


def halo_exchange_plan(
    seq_len: int,
    block_size: int,
    cp: int,
    bp: int,
    ring_index: int,
    *,
    window: int | None = None,
    schedule: SchedulePolicy = "dual_end",
    documents: Documents | None = None,
) -> WindowPlan:
    """The plan that sends each ring member exactly the clean rows some query of its may see.

    A window and a document start are both lower bounds of a query's clean interval (and a document
    end an upper bound), so one rule serves both: ``send[s][d] = need(d) ∩ owned(s)`` with ``need(d)``
    the union of ``d``'s rows' ``[ctx_start, ctx_stop)``. With neither, this is the mask-aware
    full-attention exchange (the ``cp-aware`` baseline for ``bp == 1``).
    """
    if cp < 2:
        raise ValueError(f"an exchange plan needs cp > 1 (a ring to exchange in), got cp={cp}")
    topology = Topology(cp=cp, bp=bp)
    if not 0 <= ring_index < topology.num_rings:
        raise ValueError(f"ring_index must be in [0, {topology.num_rings}), got {ring_index}")
    members = [
        rank_layout(
            topology, ring_index * cp + d, seq_len, block_size, schedule=schedule, window=window, documents=documents
        )
        for d in range(cp)
    ]
    owned = tuple(m.clean_positions for m in members)
    return WindowPlan(
        seq_len=seq_len,
        block_size=block_size,
        cp=cp,
        bp=bp,
        ring_index=ring_index,
        window=window,
        owned_positions=owned,
        send=halo_sends(owned, [needed_positions(m.rows, seq_len) for m in members], seq_len),
    )


def needed_positions(rows: Rows, seq_len: int) -> Tensor:
    """Sorted int64 positions in the union of the live rows' ``[ctx_start, ctx_stop)``: the clean
    rows some query of ``rows`` may see."""
    live = rows.select(rows.live)
    cover = interval_cover(live.ctx_start.numpy(), live.ctx_stop.numpy(), seq_len)
    return torch.from_numpy(cover).nonzero().flatten()


def halo_sends(
    owned: tuple[Tensor, ...], needed: list[Tensor], seq_len: int
) -> tuple[tuple[Tensor, ...], ...]:
    """``send[s][d] = needed[d] ∩ owned[s]`` for ``s != d`` (empty for ``s == d``): the sorted
    positions ring member ``s`` sends member ``d`` (``WindowPlan.send``). ``owned`` are the ring
    members' disjoint sorted positions, ``needed[d]`` the sorted positions member ``d`` may read."""
    cp = len(owned)
    owner_of_position = torch.full((seq_len,), -1, dtype=torch.long)  # [L] ring member owning each position
    for source, positions in enumerate(owned):
        owner_of_position[positions] = source
    send: list[list[Tensor]] = [[torch.zeros(0, dtype=torch.long)] * cp for _ in range(cp)]
    for dest, need in enumerate(needed):
        needed_owner = owner_of_position[need]
        for source in range(cp):
            if source != dest:
                send[source][dest] = need[needed_owner == source]
    return tuple(tuple(row) for row in send)


def _check_worker(num_workers: int, worker: int) -> None:
    if not 0 <= worker < num_workers:
        raise ValueError(f"BP rank must be in [0, {num_workers}), got {worker}")


def _positions_layout(
    seq_len: int,
    block_size: int,
    cp: int,
    bp: int,
    local_rank: int,
    schedule: SchedulePolicy,
    window: int | None,
    documents: Documents | None = None,
) -> RankLayout:
    """The layout of ``counts.layout_positions`` (the positions the cost model counts too). With
    ``documents`` BP-only (``cp == 1 < bp``) keeps only each owned block's document prefix."""
    bounds = None if documents is None else (documents.start.numpy(), documents.stop.numpy())
    noisy, clean, blocks = layout_positions(seq_len, block_size, cp, bp, local_rank, schedule, bounds, window)
    noisy_positions, clean_positions = torch.from_numpy(noisy), torch.from_numpy(clean)
    return RankLayout(
        rows=bd3_rows(noisy_positions, clean_positions, block_size=block_size, window=window, documents=documents),
        num_noisy=int(noisy_positions.shape[0]),
        noisy_positions=noisy_positions,
        clean_positions=clean_positions,
        owned_blocks=tuple(int(b) for b in blocks),
    )


def _check_window(window: int | None) -> None:
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be None (full attention) or an int >= 1, got {window!r}")
