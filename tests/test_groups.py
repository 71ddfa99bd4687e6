"""Process-group plans (pure) and the groups actually built on 4 gloo processes (csbp.md §6)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from csbp.parallel.groups import GROUP_NAMES, build_process_groups, plan_group_ranks
from csbp.parallel.launch import run_local
from csbp.topology import Topology


def test_plan_worked_example():
    """csbp.md §6: world 4, CP=2, BP=4."""
    plan = plan_group_ranks(Topology(cp=2, bp=4))
    assert plan["ring"] == [[0, 1], [2, 3]]
    assert plan["clean_replica"] == [[0, 2], [1, 3]]
    assert plan["model_input"] == [[0, 1, 2, 3]]
    assert plan["dp"] == [[0], [1], [2], [3]]
    assert plan["world"] == [[0, 1, 2, 3]]


def test_plan_with_data_parallel():
    plan = plan_group_ranks(Topology(dp=2, cp=2, bp=4))
    assert plan["ring"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert plan["clean_replica"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert plan["model_input"] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert plan["dp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert plan["world"] == [list(range(8))]


@pytest.mark.parametrize(
    "topology, ring, clean_replica",
    [
        (Topology(dp=2, cp=2), [[0, 1], [2, 3]], [[0], [1], [2], [3]]),  # CP-only: ring = local axis
        (Topology(bp=3, replicate_clean_prefix=True), [[0, 1, 2]], [[0, 1, 2]]),  # BP-only
        (Topology(cp=2, bp=2), [[0, 1]], [[0], [1]]),  # fused, one ring
        (Topology(dp=3), [[0], [1], [2]], [[0], [1], [2]]),  # pure data parallel
        (Topology(cp=2, bp=6), [[0, 1], [2, 3], [4, 5]], [[0, 2, 4], [1, 3, 5]]),
    ],
)
def test_plan_layouts(topology, ring, clean_replica):
    plan = plan_group_ranks(topology)
    assert plan["ring"] == ring
    assert plan["clean_replica"] == clean_replica


@pytest.mark.parametrize(
    "topology",
    [Topology(dp=2, cp=2, bp=4), Topology(dp=3, cp=4), Topology(dp=2, bp=3, replicate_clean_prefix=True)],
)
def test_plan_partitions_the_world(topology):
    """Each kind of group partitions the world, and members agree with the rank coordinates."""
    plan = plan_group_ranks(topology)
    for name in GROUP_NAMES:
        flat = sorted(r for members in plan[name] for r in members)
        assert flat == list(range(topology.world_size)), name
    coords = [topology.coords(r) for r in range(topology.world_size)]
    for members in plan["clean_replica"]:
        assert len({(coords[r].dp_rank, coords[r].cp_rank) for r in members}) == 1
    for members in plan["dp"]:
        assert len({coords[r].local_rank for r in members}) == 1
    for members in plan["model_input"]:
        assert len({coords[r].dp_rank for r in members}) == 1 and len(members) == topology.local


WORLD4_TOPOLOGIES = [
    Topology(cp=2, bp=4),
    Topology(dp=2, cp=2, bp=2),
    Topology(cp=4),
    Topology(bp=4, replicate_clean_prefix=True),
    Topology(dp=4),
]


def _gather_group_members(rank: int, world_size: int, topologies: list[Topology]) -> list[dict]:
    """Build the groups of each topology and all-gather the global rank over every group."""
    results = []
    for topology in topologies:
        groups = build_process_groups(topology)
        seen: dict = {"coords": groups.coords, "ring_rank": groups.ring_rank}
        for name in GROUP_NAMES:
            group = getattr(groups, name)
            members = getattr(groups, f"{name}_ranks")
            gathered = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size(group))]
            dist.all_gather(gathered, torch.tensor([rank]), group=group)
            seen[name] = ([int(t.item()) for t in gathered], list(members))
        results.append(seen)
    return results


@pytest.mark.multiprocess
def test_built_groups_match_plan():
    results = run_local(_gather_group_members, 4, args=(WORLD4_TOPOLOGIES,), timeout_s=60)
    for index, topology in enumerate(WORLD4_TOPOLOGIES):
        plan = plan_group_ranks(topology)
        for rank in range(4):
            seen = results[rank][index]
            assert seen["coords"] == topology.coords(rank)
            for name in GROUP_NAMES:
                gathered, members = seen[name]
                assert gathered == members, (topology, rank, name)
                assert rank in members and members in plan[name], (topology, rank, name)
            assert seen["ring_rank"] == seen["ring"][1].index(rank)
        if topology.layout in ("cp", "csbp"):
            assert [results[r][index]["ring_rank"] for r in range(4)] == [
                topology.coords(r).cp_rank for r in range(4)
            ]


def _build_with_wrong_world(rank: int, world_size: int) -> None:
    build_process_groups(Topology(cp=2, bp=4))


@pytest.mark.multiprocess
def test_build_rejects_world_size_mismatch():
    from csbp.parallel.launch import WorkerError

    with pytest.raises(WorkerError, match=r"world_size=2 does not match"):
        run_local(_build_with_wrong_world, 2, timeout_s=30)


def test_build_needs_initialised_process_group():
    with pytest.raises(ValueError, match="call init_process_group first"):
        build_process_groups(Topology())
