"""Block schedules and zigzag shards: csbp.md §7 goldens, invariants, and the §8 equivalence."""

from __future__ import annotations

import pytest
import torch

from csbp.schedules import (
    BlockSchedule,
    block_schedule,
    contiguous_schedule,
    dual_end_pairs,
    dual_end_schedule,
    zigzag_chunk_ids,
    zigzag_positions,
)


def test_dual_end_pairs_golden():
    assert dual_end_pairs(8) == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert dual_end_pairs(5) == [(0, 4), (1, 3), (2,)]
    assert dual_end_pairs(1) == [(0,)]


def test_dual_end_n32_p8():
    schedule = dual_end_schedule(32, 8)
    assert schedule.assignment[0] == (0, 31, 1, 30)
    assert schedule.assignment[1] == (2, 29, 3, 28)
    assert schedule.costs == (62,) * 8


def test_dual_end_n32_p4():
    schedule = dual_end_schedule(32, 4)
    assert schedule.assignment[0] == (0, 31, 1, 30, 2, 29, 3, 28)
    assert schedule.costs == (124,) * 4


def test_dual_end_n5_p2_middle_block_to_lightest():
    schedule = dual_end_schedule(5, 2)
    assert schedule.assignment == ((0, 4, 2), (1, 3))
    assert schedule.costs == (6, 4)
    assert schedule.blocks(0) == (0, 2, 4)


def test_dual_end_n10_p4_extra_pair_to_first_worker():
    schedule = dual_end_schedule(10, 4)
    assert schedule.assignment == ((0, 9, 1, 8), (2, 7), (3, 6), (4, 5))
    assert schedule.costs == (18, 9, 9, 9)


def test_dual_end_short_regime_n6_p4():
    schedule = dual_end_schedule(6, 4)
    assert [set(a) for a in schedule.assignment] == [{5}, {4}, {3, 0}, {2, 1}]
    assert schedule.assignment[2] == (3, 0)  # assignment order: 3 first, 0 last
    assert schedule.costs == (5, 4, 3, 3)


def test_contiguous_n16_p4():
    schedule = contiguous_schedule(16, 4)
    assert schedule.assignment == ((0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15))
    assert schedule.costs == (6, 22, 38, 54)


def test_contiguous_uneven_split():
    assert contiguous_schedule(7, 3).assignment == ((0, 1, 2), (3, 4), (5, 6))


@pytest.mark.parametrize("policy", ["dual_end", "contiguous"])
def test_invariants_over_many_shapes(policy):
    for num_workers in range(1, 17):
        for num_blocks in range(num_workers, 4 * num_workers + 9):
            schedule = block_schedule(num_blocks, num_workers, policy)
            schedule.validate()  # raises on any violation
            assert schedule.num_workers == num_workers
            owners = [schedule.owner_of(b) for b in range(num_blocks)]
            for worker in range(num_workers):
                assert schedule.blocks(worker) == tuple(b for b, o in enumerate(owners) if o == worker)
            if policy == "dual_end":
                assert max(schedule.costs) - min(schedule.costs) <= num_blocks


def test_validate_catches_broken_assignments():
    with pytest.raises(ValueError, match="once each"):
        BlockSchedule(((0, 1), (1, 2)), 3, "contiguous").validate()
    with pytest.raises(ValueError, match="without blocks"):
        BlockSchedule(((0, 1, 2), ()), 3, "contiguous").validate()
    BlockSchedule(((0, 1), (2, 3)), 4, "dual_end").validate()  # costs 1, 5: spread 4 is allowed
    with pytest.raises(ValueError, match="cost spread 6 exceeds num_blocks=4"):
        BlockSchedule(((0,), (1, 2, 3)), 4, "dual_end").validate()  # costs 0, 6
    BlockSchedule(((0,), (1, 2, 3)), 4, "contiguous").validate()  # no spread bound for contiguous


def test_schedule_rejects_too_few_blocks():
    with pytest.raises(ValueError, match="num_blocks=3 is fewer than num_workers=4"):
        dual_end_schedule(3, 4)
    with pytest.raises(ValueError, match="num_blocks=3 is fewer than num_workers=4"):
        contiguous_schedule(3, 4)
    with pytest.raises(ValueError, match="num_workers must be >= 1"):
        dual_end_schedule(3, 0)
    with pytest.raises(ValueError, match="schedule policy"):
        block_schedule(8, 2, "round_robin")  # type: ignore[arg-type]


def test_owner_of_rejects_unknown_block():
    with pytest.raises(ValueError, match=r"block must be in \[0, 8\)"):
        dual_end_schedule(8, 2).owner_of(8)


def test_zigzag_chunk_ids():
    assert [zigzag_chunk_ids(c, 4) for c in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    with pytest.raises(ValueError, match="cp_rank must be in"):
        zigzag_chunk_ids(2, 2)


def test_zigzag_positions_golden():
    assert zigzag_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert zigzag_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert zigzag_positions(4, 1, 0).tolist() == [0, 1, 2, 3]
    assert zigzag_positions(8, 2, 0).dtype == torch.long
    with pytest.raises(ValueError, match="length=10 must be divisible by 2\\*cp=4"):
        zigzag_positions(10, 2, 0)


@pytest.mark.parametrize("length, cp", [(8, 1), (16, 2), (24, 3), (32, 4), (64, 8)])
def test_zigzag_shards_partition(length, cp):
    shards = [zigzag_positions(length, cp, c) for c in range(cp)]
    assert all(s.tolist() == sorted(s.tolist()) and s.numel() == length // cp for s in shards)
    assert torch.cat(shards).sort().values.tolist() == list(range(length))


@pytest.mark.parametrize("num_blocks, num_workers", [(8, 2), (16, 2), (16, 4), (32, 4), (24, 3), (32, 8)])
def test_dual_end_blocks_equal_zigzag_chunks(num_blocks, num_workers):
    """csbp.md §8: with BP == CP == P and N % 2P == 0 a rank's blocks are its zigzag clean chunks."""
    assert num_blocks % (2 * num_workers) == 0
    schedule = dual_end_schedule(num_blocks, num_workers)
    for worker in range(num_workers):
        zigzag_blocks = zigzag_positions(num_blocks, num_workers, worker).tolist()
        assert list(schedule.blocks(worker)) == zigzag_blocks
