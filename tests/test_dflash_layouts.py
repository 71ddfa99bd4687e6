"""DFlash rank layouts (csbp.md §14): per-topology anchor ownership and loss scale, cost-based
dealing from both ends, power-of-two packets of dead anchors, zigzag context shards, block rows
and the ``max_anchors >= bp`` rule."""

from __future__ import annotations

import pytest
import torch

from csbp.dflash.config import DFlashObjectiveConfig
from csbp.dflash.layouts import (
    DFlashLayout,
    block_query_rows,
    bucket_size,
    context_positions,
    deal_anchors,
    dflash_layout,
    owned_packet,
    ring_context_positions,
)
from csbp.dflash.rank_plan import build_dflash_rank_plan
from csbp.engine.context import ParallelContext
from csbp.parallel.comm import TrafficCounter
from csbp.topology import Topology


@pytest.mark.parametrize(
    ("topology", "local_rank", "expected"),
    [
        (Topology(), 0, DFlashLayout(1, 0, 1, 0, 1.0)),
        (Topology(cp=4), 3, DFlashLayout(4, 3, 1, 0, 1.0)),  # CP-only: all anchors, block loss replicated
        (Topology(cp=2, bp=2), 1, DFlashLayout(2, 1, 2, 1, 2.0)),
        (Topology(cp=2, bp=4), 3, DFlashLayout(2, 1, 4, 3, 4.0)),  # two rings; ring 1, cp rank 1
        (Topology(bp=2, replicate_clean_prefix=True), 1, DFlashLayout(1, 0, 2, 1, 2.0)),
    ],
)
def test_layout_per_topology(topology: Topology, local_rank: int, expected: DFlashLayout) -> None:
    assert dflash_layout(topology, local_rank) == expected


def test_deal_pairs_cheapest_with_most_expensive() -> None:
    costs = torch.tensor([5, 1, 8, 3, 7, 2, 6, 4])  # sorted order of indices: 1,5,3,7,0,6,4,2
    owned = deal_anchors(costs, 2)
    # pairs (1,2) (5,4) (3,6) (7,0): pair k -> owner k % 2
    assert [o.tolist() for o in owned] == [[1, 2, 3, 6], [0, 4, 5, 7]]
    assert [int(costs[o].sum()) for o in owned] == [18, 18]
    odd = deal_anchors(torch.arange(5), 2)  # pairs (0,4) (1,3), middle 2 as a third unit
    assert [o.tolist() for o in odd] == [[0, 2, 4], [1, 3]]
    few = deal_anchors(torch.tensor([4, 1, 3]), 2)  # fewer than 2P: singles round-robin by cost
    assert [o.tolist() for o in few] == [[0, 1], [2]]
    assert [o.tolist() for o in deal_anchors(torch.tensor([2]), 4)] == [[0], [], [], []]


def test_packets_partition_anchors_and_pad_to_powers_of_two() -> None:
    anchors = torch.tensor([1, 3, 4, 9, 12, 20, 21])
    doc_start = torch.tensor([0, 0, 0, 0, 10, 10, 10])
    seen = []
    for owner in range(3):
        layout = DFlashLayout(1, 0, 3, owner, 3.0)
        packet = owned_packet(anchors, doc_start, layout, context="strict", min_bucket=2)
        size = len(packet)
        assert size & (size - 1) == 0 and size >= 2
        live = packet.keep
        assert torch.equal(packet.anchors[live], anchors[packet.anchor_index[live]])
        assert bool((packet.anchor_index[~live] == -1).all()) and bool((packet.anchors[~live] == 0).all())
        seen += packet.anchor_index[live].tolist()
    assert sorted(seen) == list(range(7))
    assert [bucket_size(c, m) for c, m in ((0, 1), (3, 1), (4, 1), (5, 2), (1, 8))] == [1, 4, 4, 8, 8]


def test_context_shards_and_block_rows() -> None:
    assert context_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert context_positions(8, 1, 0).tolist() == list(range(8))
    assert sorted(ring_context_positions(16, 4).tolist()) == list(range(16))
    anchors, doc_start = torch.tensor([2, 9]), torch.tensor([0, 6])
    packet = owned_packet(anchors, doc_start, DFlashLayout(1, 0, 1, 0, 1.0), context="strict", min_bucket=1)
    rows = block_query_rows(packet, 4, context="strict", window=3)
    assert rows.pos.tolist() == [2, 3, 4, 5, 9, 10, 11, 12]
    assert rows.block.tolist() == [0] * 4 + [1] * 4
    assert rows.ctx_stop.tolist() == [2] * 4 + [9] * 4
    assert rows.ctx_start.tolist() == [0, 1, 2, 3, 7, 8, 9, 10]  # max(doc_start, a + j - (W - 1))
    inclusive = block_query_rows(packet, 4, context="inclusive")
    assert (
        inclusive.ctx_stop.tolist() == [3] * 4 + [10] * 4
        and inclusive.ctx_start.tolist() == [0] * 4 + [6] * 4
    )


def test_max_anchors_below_bp_is_rejected() -> None:
    topology = Topology(cp=2, bp=4)
    ctx = ParallelContext(topology, topology.coords(0), None, TrafficCounter())
    with pytest.raises(ValueError, match="max_anchors=2 is below bp=4"):
        build_dflash_rank_plan(ctx, DFlashObjectiveConfig(max_anchors=2))
    assert build_dflash_rank_plan(ctx, DFlashObjectiveConfig(max_anchors=4)).layout.num_owners == 4
    assert DFlashObjectiveConfig(max_anchors=512).anchor_bucket_minimum(4) == 128
    assert DFlashObjectiveConfig(max_anchors=64).anchor_bucket_minimum(4) == 16
