"""Which anchors and which context rows a rank holds when training a DFlash drafter (csbp.md §14),
and the ``Rows`` metadata of both.

**Context rows** (target features) are zigzag-sharded over the CP ring: CP rank ``c`` holds chunks
``c`` and ``2·cp−1−c`` of the sequence (``csbp.schedules.zigzag_positions``). The fusion ``fc``,
``hidden_norm`` and every layer's k/v projections are row-local, so each rank computes the context
K/V of its own rows; attention all-gathers them (``csbp.dflash.attention``).

**Anchors** (draft blocks):

* ``data`` / CP-only (``bp == 1``): every rank holds *all* anchors of the sample. The block-local
  decoder, the vocabulary loss and the selector are replicated on every CP rank; only the context
  K/V are sharded.
* CSBP (``cp > 1``, ``bp >= cp``) and BP-only (``cp == 1``, context replicated): anchors are owned
  by the ``bp`` ranks, dealt by context cost ``cost(a) = context_stop(a) − doc_start(a)``: sort by
  cost; with ``#anchors >= 2·bp`` pair the cheapest with the most expensive and deal the pairs
  round-robin, otherwise deal single anchors round-robin. Each rank's packet is padded with dead
  anchors (``keep = False``: weight 0, rows see nothing) to a power-of-two bucket, at least
  ``min_bucket`` (default ``min(128, max_anchors // bp)``), to bound the number of shapes.

**Loss scale [derived].** Gradients are averaged over all ``dp · local`` ranks
(``csbp.engine.grads``), and the attention backward reduce-scatters (sums) context dK/dV over the
ring. A rank's loss is ``loss_scale · (its anchors' share of the sample-group loss L)`` with
``loss_scale = local / replication``, where ``replication`` is the number of ranks computing each
anchor:

* CSBP / BP-only: each anchor lives on one rank, ``replication = 1``, ``loss_scale = local``
  (csbp.md §13). Σ_ranks ∇ℓ_r = local·∇L, and the average over ``local`` ranks gives ∇L.
* CP-only: every rank computes every anchor, ``replication = cp = local``, ``loss_scale = 1``.
  Block-path parameters get the full ∇L on each of the ``cp`` ranks; each context row's dK/dV is
  the sum over ``cp`` identical query sets, i.e. ``cp`` times its true gradient, on its owner. The
  parameter gradients therefore sum to ``cp·∇L`` over the ring and average to ∇L. (The generic CP
  rule "multiply by ``s = cp``" is divided by the replication ``cp``.)

Shape legend: ``L`` sequence length, ``N`` anchors, ``n`` anchors of a packet, ``B`` block size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from csbp.attention.draft_counts import context_stop, deal_order
from csbp.attention.rows import Rows
from csbp.dflash.config import DFlashConfig
from csbp.schedules import zigzag_positions
from csbp.topology import Topology


@dataclass(frozen=True)
class DFlashLayout:
    """This rank's share of one sample.

    Attributes:
        cp: context shards (ring size).
        cp_rank: which zigzag context shard this rank holds.
        num_owners: ranks that split the anchors (1: every rank holds all anchors).
        owner_rank: which anchor share this rank holds.
        loss_scale: ``local / replication`` (module docstring).
    """

    cp: int
    cp_rank: int
    num_owners: int
    owner_rank: int
    loss_scale: float


def dflash_layout(topology: Topology, local_rank: int) -> DFlashLayout:
    """The DFlash layout of ``local_rank`` (a rank's index among the ``local`` ranks of a sample)."""
    if not 0 <= local_rank < topology.local:
        raise ValueError(f"local_rank must be in [0, {topology.local}), got {local_rank}")
    if topology.bp == 1:  # data or CP-only: every rank holds every anchor
        return DFlashLayout(topology.cp, local_rank % topology.cp, 1, 0, 1.0)
    return DFlashLayout(topology.cp, local_rank % topology.cp, topology.bp, local_rank, float(topology.local))


def context_positions(seq_len: int, cp: int, cp_rank: int) -> Tensor:
    """Sorted context positions of CP rank ``cp_rank`` (all of ``[0, seq_len)`` when ``cp == 1``)."""
    if cp == 1:
        return torch.arange(seq_len)
    return zigzag_positions(seq_len, cp, cp_rank)


def ring_context_positions(seq_len: int, cp: int) -> Tensor:
    """Positions of the gathered context rows: every ring member's shard, in ring order."""
    return torch.cat([context_positions(seq_len, cp, rank) for rank in range(cp)])


def context_rows(positions: Tensor) -> Rows:
    """Clean key rows at ``positions`` (every row live)."""
    n = positions.shape[0]
    zeros = torch.zeros(n, dtype=torch.long)
    return Rows(
        positions.long(),
        torch.ones(n, dtype=torch.bool),
        zeros,
        zeros,
        zeros,
        torch.ones(n, dtype=torch.bool),
    )


def deal_anchors(costs: Tensor, num_owners: int) -> list[Tensor]:
    """Indices of the anchors each owner gets (sorted ascending), dealt by cost (module docstring)."""
    return [torch.from_numpy(indices) for indices in deal_order(costs.detach().cpu().numpy(), num_owners)]


def bucket_size(count: int, minimum: int) -> int:
    """The smallest power of two ``>= max(count, minimum, 1)``."""
    size = 1
    while size < max(count, minimum, 1):
        size *= 2
    return size


@dataclass(frozen=True)
class AnchorPacket:
    """The anchors a rank computes for one sample, padded with dead anchors.

    Attributes:
        anchor_index: ``[n]`` index into the sample's sorted anchor list, ``-1`` for dead anchors.
        anchors: ``[n]`` anchor positions (0 for dead anchors).
        doc_start: ``[n]`` first position of the anchor's document segment (0 for dead anchors).
        keep: ``[n]`` False for dead anchors.
    """

    anchor_index: Tensor
    anchors: Tensor
    doc_start: Tensor
    keep: Tensor

    def __len__(self) -> int:
        return int(self.anchors.shape[0])


def full_packet(anchors: Tensor, doc_start: Tensor) -> AnchorPacket:
    """Every anchor of a sample, none dead (CP-only ranks; global denominators)."""
    index = torch.arange(anchors.shape[0])
    return AnchorPacket(index, anchors.clone(), doc_start.clone(), torch.ones(len(index), dtype=torch.bool))


def owned_packet(
    anchors: Tensor, doc_start: Tensor, layout: DFlashLayout, *, context: str, min_bucket: int
) -> AnchorPacket:
    """This rank's packet of the sample's sorted ``anchors`` (module docstring)."""
    if layout.num_owners == 1:
        return full_packet(anchors, doc_start)
    costs = context_stop(anchors, context) - doc_start
    index = deal_anchors(costs, layout.num_owners)[layout.owner_rank]
    size = bucket_size(int(index.numel()), min_bucket)
    padding = size - int(index.numel())
    pad = torch.zeros(padding, dtype=torch.long)
    return AnchorPacket(
        anchor_index=torch.cat([index, pad - 1]),
        anchors=torch.cat([anchors[index], pad]),
        doc_start=torch.cat([doc_start[index], pad]),
        keep=torch.cat([torch.ones(len(index), dtype=torch.bool), torch.zeros(padding, dtype=torch.bool)]),
    )


def block_query_rows(
    packet: AnchorPacket,
    block_size: int,
    *,
    context: str,
    window: int | None = None,
) -> Rows:
    """Rows of the packet's blocks: row ``(n, j)`` has position ``a_n + j``, block id ``n`` and
    context ``[doc_start_n, a_n)`` (strict) or ``[doc_start_n, a_n]`` (inclusive); with a sliding
    window ``W`` the context also starts no earlier than ``a_n + j − (W − 1)``."""
    num = len(packet)
    offsets = torch.arange(block_size).repeat(num)  # j
    block = torch.arange(num).repeat_interleave(block_size)  # n
    anchors = packet.anchors[block]
    start = packet.doc_start[block]
    if window is not None:
        start = torch.maximum(start, anchors + offsets - (window - 1))
    stop = context_stop(anchors, context)
    return Rows(
        pos=anchors + offsets,
        clean=torch.zeros(num * block_size, dtype=torch.bool),
        block=block,
        ctx_start=start,
        ctx_stop=stop,
        live=packet.keep[block],
    )


def draft_query_rows(
    cfg: DFlashConfig, packet: AnchorPacket, *, context: str
) -> tuple[list[Rows], list[bool], list[int]]:
    """The packet's block rows per layer kind (full attention, then sliding if any layer slides), their
    causal-in-block flags, and each layer's kind."""
    variants = [block_query_rows(packet, cfg.block_size, context=context)]
    causal = [False]
    layer_variant = [0] * cfg.num_layers
    if "sliding_attention" in (cfg.layer_types or ()):
        variants.append(block_query_rows(packet, cfg.block_size, context=context, window=cfg.sliding_window))
        causal.append(cfg.sliding_window_causal)
        layer_variant = [1 if t == "sliding_attention" else 0 for t in cfg.layer_types or ()]
    return variants, causal, layer_variant
