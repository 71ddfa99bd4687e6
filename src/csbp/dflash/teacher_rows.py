"""The KL teacher rows of each rank's draft blocks under the context-sharded target pass (csbp.md §14).

With ``loss='kl'`` the teacher of draft row ``(n, j)`` is the target's final-normed last hidden
state at ``a_n + j − 1``, and the loss reads it only at the *supervised* rows
(``BlockTargets.valid``: live anchor, ``j >= 1``, inside the sample, loss mask, same document).
The sharded pass (``csbp.dflash.target_shard``) leaves every ring member with the last hidden state
of its own zigzag rows only. Instead of all-gathering the whole ``[L/cp, H]`` shard of every
member, each member sends a peer exactly the rows the peer's supervised rows read
(``Comm.all_to_all``, one call per sample, category ``dflash.teacher``):

* every ring member knows every member's packet without communication: anchors are identical on
  the ranks of a sample and the packets are dealt deterministically (``owned_packet``; ring member
  ``c`` of the ring holding this rank is local rank ``owner_rank − cp_rank + c`` under CSBP, and
  every member holds all anchors under CP-only);
* ``need_c`` = the sorted distinct positions ``a + j − 1`` of member ``c``'s supervised rows;
  member ``r`` sends ``c`` its rows at ``need_c ∩ context_positions(L, cp, r)`` in position order.

The result is the ``[N, H]`` rows at ``need_{cp_rank}`` (sorted positions, ``N`` of them) with
those positions; ``block_targets(..., last_hidden_positions=...)`` looks the supervised rows up in
it, so no ``[L, H]`` tensor is built (at L = 1M, H = 4096 in bf16 that would be 8 GiB per sample).
Rows are copied, not recomputed, so the loss is exact. Bytes a rank sends per sample: ``Σ_{c ≠ r} |need_c ∩ rows_r| · H · element_size``
(``teacher_exchange_bytes``), against ``(cp − 1)·(L/cp)·H·element_size`` for the all-gather.

Shape legend: ``L`` sequence length, ``M`` this rank's context rows, ``H`` hidden size, ``n``
anchors of a packet, ``B`` block size.
"""

from __future__ import annotations

import torch
from torch import Tensor

from csbp.dflash.exchange import ring_member_layouts
from csbp.dflash.layouts import AnchorPacket, DFlashLayout, context_positions, owned_packet
from csbp.dflash.loss import block_targets
from csbp.parallel.comm import Comm

TEACHER_CATEGORY = "dflash.teacher"


def teacher_positions(
    input_ids_L: Tensor, loss_mask_L: Tensor, doc_ids_L: Tensor, packet: AnchorPacket, block_size: int
) -> Tensor:
    """Sorted distinct positions ``a + j − 1`` of the packet's supervised rows (module docstring)."""
    targets = block_targets(input_ids_L, loss_mask_L, doc_ids_L, packet, block_size, sample=0)
    previous = packet.anchors.repeat_interleave(block_size) + targets.slot - 1
    return torch.unique(previous[targets.valid])


def ring_member_packets(
    anchors: Tensor, doc_start: Tensor, layout: DFlashLayout, *, context: str, min_bucket: int
) -> list[AnchorPacket]:
    """The packet of every member ``c`` of this rank's CP ring, in ring order."""
    return [
        owned_packet(anchors, doc_start, member, context=context, min_bucket=min_bucket)
        for member in ring_member_layouts(layout)
    ]


def ring_teacher_needs(
    input_ids_L: Tensor,
    loss_mask_L: Tensor,
    doc_ids_L: Tensor,
    anchors: Tensor,
    doc_start: Tensor,
    layout: DFlashLayout,
    *,
    block_size: int,
    context: str,
    min_bucket: int,
) -> list[Tensor]:
    """``need_c`` of every ring member ``c`` for one sample (module docstring)."""
    return [
        teacher_positions(input_ids_L, loss_mask_L, doc_ids_L, packet, block_size)
        for packet in ring_member_packets(anchors, doc_start, layout, context=context, min_bucket=min_bucket)
    ]


def ring_row_owners(seq_len: int, cp: int) -> tuple[Tensor, Tensor]:
    """``(owner [L], local [L])``: the ring member holding each position and its row in that shard."""
    owner = torch.empty(seq_len, dtype=torch.long)
    local = torch.empty(seq_len, dtype=torch.long)
    for member in range(cp):
        mine = context_positions(seq_len, cp, member)
        owner[mine] = member
        local[mine] = torch.arange(mine.shape[0])
    return owner, local


def _sent_rows(needs: list[Tensor], owner_L: Tensor, sender: int) -> list[Tensor]:
    """The positions ``sender`` sends to every member, in ring order (each sorted)."""
    return [need[owner_L[need] == sender] for need in needs]


def exchange_teacher_rows(
    last_MD: Tensor, needs: list[Tensor], comm: Comm, *, seq_len: int, cp: int, cp_rank: int
) -> tuple[Tensor, Tensor]:
    """``(rows [N, H], positions [N])``: the ring's last hidden rows at ``needs[cp_rank]`` (sorted
    positions; module docstring). ``last_MD`` holds this rank's rows ``context_positions(L, cp,
    cp_rank)``; every ring member must call it together with the same ``needs``."""
    if len(needs) != cp or comm.size != cp or comm.rank != cp_rank:
        raise ValueError(
            f"teacher exchange: {len(needs)} needs and a ring comm of size {comm.size} rank {comm.rank} for "
            f"cp={cp} cp_rank={cp_rank}; pass one need per ring member and the plan's ring_comm"
        )
    device = last_MD.device
    owner_L, local_L = ring_row_owners(seq_len, cp)
    sent = _sent_rows(needs, owner_L, cp_rank)
    send = last_MD[local_L[torch.cat(sent)].to(device)]
    mine = needs[cp_rank]
    received_from = [mine[owner_L[mine] == source] for source in range(cp)]
    received, _ = comm.all_to_all(
        send, [int(p.numel()) for p in sent], [int(p.numel()) for p in received_from], category=TEACHER_CATEGORY
    )
    positions, order = torch.sort(torch.cat(received_from))
    return received[order.to(device)], positions


def teacher_exchange_bytes(needs: list[Tensor], *, seq_len: int, cp: int, rank: int, row_bytes: int) -> int:
    """Bytes ring member ``rank`` sends in one sample's teacher exchange (``row_bytes = H·element_size``)."""
    sent = _sent_rows(needs, ring_row_owners(seq_len, cp)[0], rank)
    return sum(int(positions.numel()) for c, positions in enumerate(sent) if c != rank) * row_bytes
