"""The KL teacher rows' exchange (``csbp.dflash.teacher_rows``): on cp=2 and cp=4 gloo rings, with
CP-only (every member holds all anchors) and CSBP (anchors dealt over the ring) packets, one and
two packed documents, each rank receives exactly the replicated last hidden rows its supervised
rows read (float64, copied rows: error 0) and sends exactly ``teacher_exchange_bytes`` over
``dflash.teacher``, fewer than the all-gather of every shard it replaces."""

from __future__ import annotations

import pytest
import torch

from csbp.dflash.anchors import sample_anchors, segment_starts
from csbp.dflash.features import capture_target_features
from csbp.dflash.layouts import DFlashLayout, dflash_layout, owned_packet
from csbp.dflash.loss import block_targets
from csbp.dflash.step import DFlashBatch
from csbp.dflash.target_shard import capture_sharded_target_features
from csbp.dflash.teacher_rows import (
    TEACHER_CATEGORY,
    exchange_teacher_rows,
    ring_member_packets,
    ring_teacher_needs,
    teacher_exchange_bytes,
    teacher_positions,
)
from csbp.dflash.verify import BLOCK_SIZE, TARGET_CONFIG, DFlashVerifyCase, build_models, make_batch
from csbp.engine.context import build_parallel_context
from csbp.parallel.launch import run_local
from csbp.topology import Topology

SEQ_LEN = 64


def _anchors(batch: DFlashBatch, sample: int) -> tuple[torch.Tensor, torch.Tensor]:
    anchors = sample_anchors(
        batch.loss_mask[sample], batch.doc_ids[sample], max_anchors=6, method="uniform", block_size=BLOCK_SIZE,
        generator=torch.Generator().manual_seed(11 + sample),
    )
    return anchors, segment_starts(batch.doc_ids[sample])[anchors]


def _worker(rank: int, world: int, cp: int, owners: int) -> list[tuple[float, int, int, int]]:
    ctx = build_parallel_context(Topology(cp=cp))
    ring = ctx.ring_comm()
    assert ring is not None
    target, _ = build_models(DFlashVerifyCase())
    batch = make_batch(2, SEQ_LEN, seed=4)
    # CP-only: every member holds every anchor; owners == cp: the CSBP deal of one ring (bp = cp)
    layout = DFlashLayout(cp, ring.rank, owners, ring.rank if owners > 1 else 0, 1.0)
    sharded = capture_sharded_target_features(
        target, batch.input_ids, (0, 2), comm=ring, cp=cp, cp_rank=ring.rank, doc_ids_SL=batch.doc_ids,
        with_last_hidden=True,
    )
    full = capture_target_features(target, batch.input_ids, (0, 2), doc_ids_SL=batch.doc_ids, with_last_hidden=True)
    assert sharded.last_hidden is not None and full.last_hidden is not None
    results = []
    for s in range(batch.num_samples):
        anchors, doc_start = _anchors(batch, s)
        needs = ring_teacher_needs(
            batch.input_ids[s], batch.loss_mask[s], batch.doc_ids[s], anchors, doc_start, layout,
            block_size=BLOCK_SIZE, context="strict", min_bucket=1,
        )
        ctx.counter.reset()
        rows_ND, held = exchange_teacher_rows(
            sharded.last_hidden[s], needs, ring, seq_len=SEQ_LEN, cp=cp, cp_rank=ring.rank
        )
        assert torch.equal(held, needs[ring.rank]) and rows_ND.shape[0] == held.numel() < SEQ_LEN
        packet = owned_packet(anchors, doc_start, layout, context="strict", min_bucket=1)
        got = block_targets(batch.input_ids[s], batch.loss_mask[s], batch.doc_ids[s], packet, BLOCK_SIZE,
                            sample=s, last_hidden_LD=rows_ND, last_hidden_positions=held)
        ref = block_targets(batch.input_ids[s], batch.loss_mask[s], batch.doc_ids[s], packet, BLOCK_SIZE,
                            sample=s, last_hidden_LD=full.last_hidden[s])
        assert got.teacher is not None and ref.teacher is not None and bool(got.valid.any())
        err = float((got.teacher[got.valid] - ref.teacher[ref.valid]).abs().max())
        expected = teacher_exchange_bytes(needs, seq_len=SEQ_LEN, cp=cp, rank=ring.rank, row_bytes=32 * 8)
        gather = (cp - 1) * (SEQ_LEN // cp) * TARGET_CONFIG.hidden_size * 8
        results.append((err, ctx.counter.bytes(TEACHER_CATEGORY), expected, gather))
    return results


@pytest.mark.multiprocess
@pytest.mark.parametrize(("cp", "owners"), [(2, 1), (2, 2), (4, 4)], ids=["cp2", "csbp-cp2", "csbp-cp4"])
def test_exchanged_teacher_rows_equal_replicated(cp: int, owners: int) -> None:
    for rank_results in run_local(_worker, cp, (cp, owners), timeout_s=120):
        for err, moved, expected, gather in rank_results:
            assert err == 0.0
            assert moved == expected < gather


def test_ring_member_packets_are_the_members_own() -> None:
    """Under CSBP with two rings (cp=2, bp=4), member ``c`` of local rank ``r``'s ring is local rank
    ``2·(r // 2) + c``, and the packet this rank computes for it is the one that rank computes."""
    topology = Topology(cp=2, bp=4)
    batch = make_batch(2, SEQ_LEN, seed=4)
    anchors, doc_start = _anchors(batch, 1)
    for local_rank in range(topology.local):
        layout = dflash_layout(topology, local_rank)
        packets = ring_member_packets(anchors, doc_start, layout, context="strict", min_bucket=1)
        for c, packet in enumerate(packets):
            member = dflash_layout(topology, 2 * (local_rank // 2) + c)
            own = owned_packet(anchors, doc_start, member, context="strict", min_bucket=1)
            assert torch.equal(packet.anchors, own.anchors) and torch.equal(packet.keep, own.keep)


def test_teacher_positions_are_the_supervised_rows_predecessors() -> None:
    batch = make_batch(2, SEQ_LEN, seed=4)
    anchors, doc_start = _anchors(batch, 1)
    packet = owned_packet(anchors, doc_start, dflash_layout(Topology(cp=2, bp=2), 1), context="strict", min_bucket=4)
    needed = teacher_positions(batch.input_ids[1], batch.loss_mask[1], batch.doc_ids[1], packet, BLOCK_SIZE)
    targets = block_targets(batch.input_ids[1], batch.loss_mask[1], batch.doc_ids[1], packet, BLOCK_SIZE, sample=1,
                            last_hidden_LD=torch.arange(SEQ_LEN, dtype=torch.float64)[:, None])
    assert targets.teacher is not None
    read = torch.unique(targets.teacher[targets.valid, 0].long())
    assert torch.equal(needed, read) and needed.numel() < SEQ_LEN
    assert bool((needed < SEQ_LEN - 1).all())  # a supervised row's predecessor is never the last position


def test_compact_teacher_rows_read_like_the_full_rows() -> None:
    batch = make_batch(2, SEQ_LEN, seed=4)
    anchors, doc_start = _anchors(batch, 1)
    packet = owned_packet(anchors, doc_start, dflash_layout(Topology(cp=2, bp=2), 1), context="strict", min_bucket=4)
    ids, mask, docs = batch.input_ids[1], batch.loss_mask[1], batch.doc_ids[1]
    needed = teacher_positions(ids, mask, docs, packet, BLOCK_SIZE)
    full_LD = torch.randn(SEQ_LEN, 3, dtype=torch.float64)
    ref = block_targets(ids, mask, docs, packet, BLOCK_SIZE, sample=1, last_hidden_LD=full_LD)
    got = block_targets(ids, mask, docs, packet, BLOCK_SIZE, sample=1, last_hidden_LD=full_LD[needed],
                        last_hidden_positions=needed)
    assert got.teacher is not None and ref.teacher is not None and bool(ref.valid.any())
    assert torch.equal(got.teacher[got.valid], ref.teacher[ref.valid])
    # a rank whose packet supervises nothing holds no rows: its teacher is zeros of the right shape
    none = block_targets(ids, mask, docs, packet, BLOCK_SIZE, sample=1, last_hidden_LD=full_LD[:0],
                         last_hidden_positions=needed[:0])
    assert none.teacher is not None and none.teacher.shape == ref.teacher.shape and not bool(none.teacher.any())
