"""Topology validation, rank coordinates and sequence-length rules (csbp.md §5-§6, §18 check 13)."""

from __future__ import annotations

import re

import pytest

from csbp.topology import RankCoords, Topology


@pytest.mark.parametrize(
    "kwargs, layout, local, num_rings",
    [
        ({}, "data", 1, 1),
        ({"dp": 4}, "data", 1, 1),
        ({"cp": 4}, "cp", 4, 1),
        ({"bp": 4, "replicate_clean_prefix": True}, "bp", 4, 4),
        ({"cp": 2, "bp": 2}, "csbp", 2, 1),
        ({"cp": 2, "bp": 4}, "csbp", 4, 2),
        ({"dp": 2, "cp": 2, "bp": 6}, "csbp", 6, 3),
    ],
)
def test_accepted_layouts(kwargs, layout, local, num_rings):
    topology = Topology(**kwargs)
    assert topology.layout == layout
    assert topology.local == local
    assert topology.num_rings == num_rings
    assert topology.world_size == kwargs.get("dp", 1) * local


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"cp": 3, "bp": 4}, r"bp must be a multiple of cp .* bp=6"),
        ({"cp": 4, "bp": 2}, r"bp must be a multiple of cp .* bp=4"),
        ({"cp": 4, "bp": 6}, r"bp must be a multiple of cp"),
        ({"bp": 2}, r"set replicate_clean_prefix=True"),
        ({"cp": 2, "replicate_clean_prefix": True}, r"only valid for BP-only"),
        ({"cp": 2, "bp": 4, "replicate_clean_prefix": True}, r"only valid for BP-only"),
        ({"replicate_clean_prefix": True}, r"only valid for BP-only"),
        ({"dp": 0}, r"Topology.dp must be a positive integer"),
        ({"cp": -1}, r"Topology.cp must be a positive integer"),
        ({"bp": 2.0}, r"Topology.bp must be a positive integer"),
        ({"dp": True}, r"Topology.dp must be a positive integer"),
        ({"bp": 2, "replicate_clean_prefix": 1}, r"must be a bool"),
    ],
)
def test_rejected_layouts(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Topology(**kwargs)


def test_coords_worked_example():
    """csbp.md §6: world 4, CP=2, BP=4 gives cp ranks [0,1,0,1], bp ranks [0,1,2,3]."""
    topology = Topology(cp=2, bp=4)
    coords = [topology.coords(r) for r in range(4)]
    assert [c.cp_rank for c in coords] == [0, 1, 0, 1]
    assert [c.bp_rank for c in coords] == [0, 1, 2, 3]
    assert [c.ring_index for c in coords] == [0, 0, 1, 1]
    assert coords[3] == RankCoords(rank=3, dp_rank=0, local_rank=3, cp_rank=1, bp_rank=3, ring_index=1)


@pytest.mark.parametrize(
    "topology",
    [
        Topology(dp=3),
        Topology(dp=2, cp=4),
        Topology(dp=2, bp=3, replicate_clean_prefix=True),
        Topology(dp=2, cp=2, bp=4),
        Topology(cp=3, bp=6),
    ],
)
def test_coords_round_trip(topology):
    for rank in range(topology.world_size):
        c = topology.coords(rank)
        assert c.rank == rank == c.dp_rank * topology.local + c.local_rank
        assert 0 <= c.dp_rank < topology.dp and 0 <= c.local_rank < topology.local
        assert c.cp_rank == c.local_rank % topology.cp
        assert c.bp_rank == (c.local_rank if topology.bp > 1 else 0)
        assert c.ring_index == c.local_rank // topology.cp < topology.num_rings


def test_coords_rejects_out_of_range_rank():
    with pytest.raises(ValueError, match=r"rank must be in \[0, 4\)"):
        Topology(cp=2, bp=4).coords(4)


def test_check_world_size():
    Topology(dp=2, cp=2, bp=4).check_world_size(8)
    with pytest.raises(ValueError, match=r"world_size=6 does not match dp\*max\(cp, bp\)=8"):
        Topology(dp=2, cp=2, bp=4).check_world_size(6)


@pytest.mark.parametrize(
    "topology, seq_len, block_size",
    [
        (Topology(), 6, 2),
        (Topology(cp=2), 16, 4),  # L/cp = 8, a multiple of B
        (Topology(cp=2), 8, 4),  # one block per zigzag chunk of 2L
        (Topology(bp=4, replicate_clean_prefix=True), 8, 2),  # N = 4 = bp
        (Topology(cp=2, bp=2), 16, 4),  # L % (2*cp*B) == 0
        (Topology(cp=2, bp=4), 32, 2),
    ],
)
def test_validate_sequence_accepts(topology, seq_len, block_size):
    topology.validate_sequence(seq_len, block_size)


@pytest.mark.parametrize(
    "topology, seq_len, block_size, match",
    [
        (Topology(), 7, 2, r"seq_len=7 is not a multiple of block_size=2 \(fix: seq_len=6 or 8, or block_size=1 or 7\)$"),
        (Topology(), 1, 2, r"fix: seq_len=2, or block_size=1\)$"),
        (Topology(), 30, 4, r"fix: seq_len=28 or 32, or block_size=3 or 5\)$"),  # the nearest divisors of 30
        (Topology(), 0, 2, r"seq_len must be a positive integer"),
        (Topology(), 8, 0, r"block_size must be a positive integer"),
        (Topology(), True, 1, r"seq_len must be a positive integer, got True"),  # a bool is no length (audit: survived)
        (Topology(), 8, True, r"block_size must be a positive integer, got True"),
        (Topology(bp=4, replicate_clean_prefix=True), 6, 2, r"3 blocks .* fewer than bp=4 \(fix: seq_len >= 8"),
        (Topology(cp=4), 24, 4, r"multiple of cp\*block_size .* = 16 .* \(fix: seq_len=16 or 32, or block_size=3 or 6\)"),
        (Topology(cp=2, bp=2), 24, 4, r"multiple of 2\*cp\*block_size .* = 16 .* \(fix: seq_len=16 or 32, or block_size=3 or 6\)"),
        (Topology(cp=2, bp=4), 10, 1, r"multiple of 2\*cp\*block_size .* = 4 .* \(fix: seq_len=8 or 12\)$"),
        (Topology(cp=2, bp=2), 30, 4, r"not a multiple of block_size=4 \(fix: seq_len=16 or 32\)$"),  # 28 was refused next
        (Topology(cp=2, bp=4), 12, 4, r"3 blocks .* fewer than bp=4"),
    ],
)
def test_validate_sequence_rejects(topology, seq_len, block_size, match):
    with pytest.raises(ValueError, match=match):
        topology.validate_sequence(seq_len, block_size)


@pytest.mark.parametrize("cp, bp", [(1, 1), (2, 1), (4, 1), (1, 4), (2, 2), (2, 4), (3, 6)])
def test_every_suggested_sequence_fix_is_accepted(cp: int, bp: int) -> None:
    """`--seq-len 30` on cp2/bp2 suggested 28 (refused next: a multiple of 16 is needed) and block sizes 3
    or 5 (refused too): every length and block size a refusal suggests now passes every rule."""
    topology = Topology(cp=cp, bp=bp, replicate_clean_prefix=cp == 1 and bp > 1)
    refused = 0
    for seq_len in range(1, 80):
        for block_size in range(1, 9):
            try:
                topology.validate_sequence(seq_len, block_size)
                continue
            except ValueError as exc:
                fix = str(exc).split("(fix: ", 1)[1]
            refused += 1
            lengths = re.search(r"seq_len(?:=| >= )([\d or]+)", fix)
            assert lengths, fix
            for suggested in map(int, lengths.group(1).split(" or ")):
                topology.validate_sequence(suggested, block_size)
            blocks = re.search(r"block_size=([\d or]+)", fix)
            for suggested in map(int, blocks.group(1).split(" or ")) if blocks else ():
                topology.validate_sequence(seq_len, suggested)
    assert refused > 100


@pytest.mark.parametrize("seq_len", [2**61 - 1, 2**63 - 1, 10**30 + 2])
def test_the_fix_for_a_huge_sequence_length_comes_at_once(seq_len):
    """The suggested block sizes come from a bounded divisor search: ``data.seq_len: 9223372036854775807``
    made `csbp config validate` and `csbp train` search divisors up to its square root for 4 minutes."""
    import signal

    def too_slow(signum, frame):
        raise TimeoutError("the sequence-length fix took more than 5 s")

    previous = signal.signal(signal.SIGALRM, too_slow)
    signal.setitimer(signal.ITIMER_REAL, 5.0)
    try:
        with pytest.raises(ValueError, match=rf"seq_len={seq_len} is not a multiple of block_size=4 \(fix: seq_len="):
            Topology(cp=2, bp=2).validate_sequence(seq_len, 4)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_the_divisor_search_is_complete_for_lengths_runs_use():
    from csbp.topology import _divisors

    assert _divisors(2**40) == [2**k for k in range(41)]
    assert _divisors(720) == [d for d in range(1, 721) if 720 % d == 0]
