"""The DFlash context exchange plan (``csbp.dflash.exchange``), on the host only: every context row
some anchor of a ring member may see reaches that member exactly once (its own or received), no
row that none of its anchors sees is sent, every member sends only rows it owns; the ring members'
layouts; and the rule of when the exchange replaces the all-gather."""

from __future__ import annotations

import pytest
import torch

from csbp.attention.documents import packed_doc_ids, random_documents
from csbp.attention.rows import Rows
from csbp.dflash.anchors import sample_anchors, segment_starts
from csbp.dflash.config import DFlashConfig
from csbp.dflash.exchange import (
    all_gather_rows,
    context_exchange_kinds,
    context_exchange_plan,
    context_exchange_wanted,
    context_exchanges,
    exchange_pays_off,
    exchanged_rows,
    packs_documents,
    ring_member_layouts,
    sample_context_exchanges,
)
from csbp.dflash.layouts import block_query_rows, context_positions, dflash_layout, owned_packet
from csbp.models.config import DecoderConfig
from csbp.topology import Topology

SEQ_LEN, BLOCK = 64, 4
TOPOLOGIES = [Topology(cp=2), Topology(cp=4), Topology(cp=2, bp=2), Topology(cp=2, bp=4), Topology(cp=4, bp=4)]


def _sample(doc_length: int | None, num_anchors: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(anchors, doc_start of each anchor, segment starts [L])`` of a fully supervised sample."""
    generator = torch.Generator().manual_seed(seed)
    doc_ids = torch.zeros(SEQ_LEN, dtype=torch.long)
    if doc_length is not None:
        doc_ids = packed_doc_ids(random_documents(SEQ_LEN, doc_length, generator))
    anchors = sample_anchors(
        torch.ones(SEQ_LEN, dtype=torch.bool), doc_ids, max_anchors=num_anchors, method="uniform",
        block_size=BLOCK, generator=generator,
    )
    starts = segment_starts(doc_ids)
    return anchors, starts[anchors], starts


def _visible(rows: Rows) -> set[int]:
    """Context positions some live row may see, by brute force over the rows."""
    seen: set[int] = set()
    for start, stop, live in zip(rows.ctx_start.tolist(), rows.ctx_stop.tolist(), rows.live.tolist()):
        if live:
            seen.update(range(start, stop))
    return seen


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=str)
@pytest.mark.parametrize(("context", "window"), [("strict", None), ("inclusive", None), ("strict", 5)])
def test_every_visible_row_arrives_exactly_once_and_nothing_else(
    topology: Topology, context: str, window: int | None
) -> None:
    anchors, doc_start, _ = _sample(doc_length=8, num_anchors=6, seed=topology.cp * 10 + topology.bp)
    cp = topology.cp
    for local_rank in range(topology.local):
        layout = dflash_layout(topology, local_rank)
        members = ring_member_layouts(layout)
        packets = [owned_packet(anchors, doc_start, m, context=context, min_bucket=1) for m in members]
        rows = [block_query_rows(p, BLOCK, context=context, window=window) for p in packets]
        plan = context_exchange_plan(SEQ_LEN, layout, rows, block_size=BLOCK, window=window)
        for dest in range(cp):
            own = set(context_positions(SEQ_LEN, cp, dest).tolist())
            received = plan.recv_positions(dest).tolist()
            assert len(received) == len(set(received))  # once
            assert set(received) == _visible(rows[dest]) - own  # every visible row, nothing invisible
            assert plan.recv_counts(dest)[dest] == 0
            for source in range(cp):
                sent = set(plan.send[source][dest].tolist())
                assert sent <= set(context_positions(SEQ_LEN, cp, source).tolist())
        assert exchanged_rows(plan) == sum(len(plan.recv_positions(d)) for d in range(cp))
        assert exchanged_rows(plan) <= all_gather_rows(SEQ_LEN, cp)


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=str)
def test_ring_members_are_the_layouts_of_the_ring(topology: Topology) -> None:
    cp = topology.cp
    for local_rank in range(topology.local):
        ring = local_rank // cp if topology.bp > 1 else 0
        expected = [dflash_layout(topology, ring * cp + d) for d in range(cp)]
        members = ring_member_layouts(dflash_layout(topology, local_rank))
        assert members == expected and members[local_rank % cp] == dflash_layout(topology, local_rank)


def test_when_the_exchange_is_used() -> None:
    csbp, cp_only = dflash_layout(Topology(cp=2, bp=2), 0), dflash_layout(Topology(cp=2), 0)
    bp_only = dflash_layout(Topology(bp=2, replicate_clean_prefix=True), 0)
    assert context_exchange_wanted(csbp, "collective", packs_documents=True)
    assert not context_exchange_wanted(csbp, "collective", packs_documents=False)  # one document: unchanged
    assert not context_exchange_wanted(csbp, "streaming", packs_documents=True)  # as the BD3 factory
    assert not context_exchange_wanted(cp_only, "collective", packs_documents=True)  # generic CP baseline
    assert context_exchange_wanted(cp_only, "halo", packs_documents=True)  # cp-aware
    assert context_exchange_wanted(cp_only, "halo", packs_documents=False)
    assert not context_exchange_wanted(bp_only, "halo", packs_documents=True)  # no ring
    with pytest.raises(ValueError, match="transport must be one of"):
        context_exchange_wanted(csbp, "ring", packs_documents=True)
    assert not packs_documents(segment_starts(torch.zeros(8, dtype=torch.long)))
    assert packs_documents(segment_starts(torch.tensor([0, 0, 0, 0, 0, 0, -1, -1])))  # padding is a segment


def test_an_exchange_that_saves_nothing_keeps_the_all_gather() -> None:
    layout = dflash_layout(Topology(cp=2, bp=2), 0)
    zeros = torch.zeros(BLOCK, dtype=torch.long)
    sees_all = Rows(zeros, zeros.bool(), zeros, zeros, zeros + SEQ_LEN, torch.ones(BLOCK, dtype=torch.bool))
    plan = context_exchange_plan(SEQ_LEN, layout, [sees_all, sees_all], block_size=BLOCK)
    assert exchanged_rows(plan) == all_gather_rows(SEQ_LEN, 2) and not exchange_pays_off(plan)
    dead = Rows(zeros, zeros.bool(), zeros, zeros, zeros + SEQ_LEN, torch.zeros(BLOCK, dtype=torch.bool))
    plan = context_exchange_plan(SEQ_LEN, layout, [dead, sees_all], block_size=BLOCK)
    assert plan.recv_counts(0) == [0, 0] and exchanged_rows(plan) == all_gather_rows(SEQ_LEN, 2) // 2
    assert not exchange_pays_off(plan)  # half the ring's rows, but member 1 still receives all of member 0's
    assert SEQ_LEN == 64  # member 1 reads [0, stop): of member 0's shard [0, 16) ∪ [48, 64), 16 + stop - 48 rows
    for stop, pays in ((64, False), (61, False), (60, True)):  # 32, 29 and 28 of 32 rows: 90% is 28.8
        reads = Rows(zeros, zeros.bool(), zeros, zeros, zeros + stop, torch.ones(BLOCK, dtype=torch.bool))
        plan = context_exchange_plan(SEQ_LEN, layout, [dead, reads], block_size=BLOCK)
        assert exchange_pays_off(plan) == pays, (stop, plan.recv_counts(1))


def test_the_exchange_pays_only_with_a_margin() -> None:
    """The shared rule: the busiest member must receive at most 90% of the all-gather's rows."""
    from csbp.attention.counts import EXCHANGE_MAX_SHARE, exchange_pays
    from csbp.attention.draft_counts import context_exchange_pays

    gather = 3 * 64 // 4
    assert EXCHANGE_MAX_SHARE == 0.9 and exchange_pays([9, 0], 10) and not exchange_pays([0, 10], 10)
    assert context_exchange_pays([0, 0, 43, 0], 64, 4) and not context_exchange_pays([0, 0, 44, 0], 64, 4)  # 43.2
    assert not context_exchange_pays([gather - 1] * 4, 64, 4)  # 2% fewer rows: a wash, keep the all-gather
    assert not context_exchange_pays([0], 64, 1)


def test_one_plan_per_layer_kind_and_short_documents_move_little() -> None:
    target = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                           num_kv_heads=2, head_dim=8)
    config = DFlashConfig.from_target(
        target, num_layers=2, block_size=BLOCK, mask_token_id=63, target_layer_ids=(0, 2),
        layer_types=("sliding_attention", "full_attention"), sliding_window=5,
    )
    anchors, doc_start, _ = _sample(doc_length=6, num_anchors=4, seed=3)
    layout = dflash_layout(Topology(cp=4, bp=4), 1)
    full, sliding = context_exchanges(config, SEQ_LEN, layout, anchors, doc_start, context="strict", min_bucket=1)
    assert full is not None and sliding is not None and sliding.window == 5 and full.window is None
    assert exchanged_rows(sliding) <= exchanged_rows(full) < all_gather_rows(SEQ_LEN, 4) // 4


def _drafter_config(layer_types: tuple[str, ...], window: int | None = 5) -> DFlashConfig:
    target = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                           num_kv_heads=2, head_dim=8)
    return DFlashConfig.from_target(target, num_layers=len(layer_types), block_size=BLOCK, mask_token_id=63,
                                    target_layer_ids=(0, 2), layer_types=layer_types, sliding_window=window)


def test_sliding_kinds_exchange_one_document_rows_under_csbp() -> None:
    """One document per row: CSBP plans its sliding kind (its anchors read only W-1 rows back), its
    full kind keeps the all-gather; CP-only keeps it for both unless ``halo``; ``streaming`` never."""
    mixed = _drafter_config(("sliding_attention", "full_attention"))
    full_only = _drafter_config(("full_attention", "full_attention"), window=None)
    csbp, cp_only = dflash_layout(Topology(cp=2, bp=2), 0), dflash_layout(Topology(cp=2), 0)
    bp_only = dflash_layout(Topology(bp=2, replicate_clean_prefix=True), 0)
    assert context_exchange_kinds(mixed, csbp, "collective", packs_documents=False) == [False, True]
    assert context_exchange_kinds(mixed, csbp, "collective", packs_documents=True) == [True, True]
    assert context_exchange_kinds(mixed, csbp, "streaming", packs_documents=False) == [False, False]
    assert context_exchange_kinds(mixed, cp_only, "collective", packs_documents=False) == [False, False]
    assert context_exchange_kinds(mixed, cp_only, "halo", packs_documents=False) == [True, True]
    assert context_exchange_kinds(mixed, bp_only, "halo", packs_documents=False) == [False, False]
    assert context_exchange_kinds(full_only, csbp, "collective", packs_documents=False) == [False]
    one_doc = torch.zeros(SEQ_LEN, dtype=torch.long)
    starts = segment_starts(one_doc)
    assert sample_context_exchanges(full_only, SEQ_LEN, csbp, torch.tensor([9, 30, 50]), starts,
                                    transport="collective", context="strict", min_bucket=1) is None


@pytest.mark.parametrize("topology", [Topology(cp=2, bp=2), Topology(cp=2, bp=4), Topology(cp=4, bp=4)], ids=str)
def test_one_document_sliding_exchange_moves_only_window_rows(topology: Topology) -> None:
    """Every ring of the sample plans the same per-kind choice on every member; the sliding plan
    receives exactly the window rows its anchors see that it does not own, fewer than the all-gather."""
    config = _drafter_config(("sliding_attention", "full_attention"))
    anchors, doc_start, starts = _sample(doc_length=None, num_anchors=6, seed=5)
    assert not packs_documents(starts) and int(doc_start.max()) == 0
    for local_rank in range(topology.local):
        layout = dflash_layout(topology, local_rank)
        plans = sample_context_exchanges(config, SEQ_LEN, layout, anchors, starts, transport="collective",
                                         context="strict", min_bucket=1)
        assert plans is not None and plans[0] is None and plans[1] is not None and plans[1].window == 5
        members = [sample_context_exchanges(config, SEQ_LEN, m, anchors, starts, transport="collective",
                                            context="strict", min_bucket=1)[1] for m in ring_member_layouts(layout)]
        for m in members:  # the ring agrees on the plan
            assert m is not None and all(torch.equal(a, b) for sa, sb in zip(m.send, plans[1].send)
                                         for a, b in zip(sa, sb))
        packets = [owned_packet(anchors, doc_start, m, context="strict", min_bucket=1)
                   for m in ring_member_layouts(layout)]
        for dest, packet in enumerate(packets):
            seen = _visible(block_query_rows(packet, BLOCK, context="strict", window=5))
            assert set(plans[1].recv_positions(dest).tolist()) == seen - set(
                context_positions(SEQ_LEN, topology.cp, dest).tolist())
        assert exchanged_rows(plans[1]) < all_gather_rows(SEQ_LEN, topology.cp)
