"""Process groups of a ``Topology`` (csbp.md §6).

=================  ===========================================================================
group              members (global ranks) and use
=================  ===========================================================================
``dp``             ranks with the same ``local_rank``: DP-only reductions
``ring``           fused CSBP: the ``cp`` consecutive local ranks from ``(l // cp) * cp``; the
                   whole local axis when ``cp == 1`` or ``bp == 1``: attention collectives
``clean_replica``  local ranks with the same ``cp_rank`` (the ``bp // cp`` copies of one clean
                   shard; a singleton unless ``bp > cp``): owner broadcast of replicated clean work
``model_input``    all local ranks of one sample: broadcast of the corrupted batch
``world``          every rank, on its own communicator: gradient averaging over ``dp * local``
=================  ===========================================================================

Every axis gets its own communicator, even one spanning the world, so optimizer collectives never
interleave with attention traffic on one communicator.

Construction uses explicit ``torch.distributed.new_group`` calls driven by the pure
``plan_group_ranks``: every rank creates every group in the same order (``new_group`` is collective
over the world) and keeps the ones that contain it. A ``DeviceMesh`` of shape ``(dp, num_rings, cp)``
builds the ``dp``/``clean_replica``/CSBP ``ring`` axes fine on gloo, but ``model_input``, ``world``
and the BP-only ``ring`` group are flattened axes that only the private ``DeviceMesh._flatten``
provides; one explicit plan keeps a single, testable source of truth instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch.distributed import ProcessGroup

from csbp.topology import RankCoords, Topology

GROUP_NAMES = ("dp", "ring", "clean_replica", "model_input", "world")


def plan_group_ranks(topology: Topology) -> dict[str, list[list[int]]]:
    """Member lists (global ranks, ascending) of every group of every kind, in creation order.

    Pure: no ``torch.distributed`` needed. Keys are ``GROUP_NAMES``.
    """
    local, cp = topology.local, topology.cp

    def rank_of(dp_rank: int, local_rank: int) -> int:
        return dp_rank * local + local_rank

    fused = cp > 1 and topology.bp > 1
    ring_size = cp if fused else local
    plan: dict[str, list[list[int]]] = {name: [] for name in GROUP_NAMES}
    plan["dp"] = [[rank_of(d, lr) for d in range(topology.dp)] for lr in range(local)]
    for d in range(topology.dp):
        for start in range(0, local, ring_size):
            plan["ring"].append([rank_of(d, lr) for lr in range(start, start + ring_size)])
        for cp_rank in range(cp):
            plan["clean_replica"].append([rank_of(d, lr) for lr in range(cp_rank, local, cp)])
        plan["model_input"].append([rank_of(d, lr) for lr in range(local)])
    plan["world"] = [list(range(topology.world_size))]
    return plan


@dataclass(frozen=True)
class ProcessGroups:
    """The groups this rank belongs to, with their members (global ranks, ascending).

    A rank's index inside a group is its position in the member tuple (e.g. ``ring_rank``).
    """

    topology: Topology
    coords: RankCoords
    dp: ProcessGroup
    ring: ProcessGroup
    clean_replica: ProcessGroup
    model_input: ProcessGroup
    world: ProcessGroup
    dp_ranks: tuple[int, ...]
    ring_ranks: tuple[int, ...]
    clean_replica_ranks: tuple[int, ...]
    model_input_ranks: tuple[int, ...]
    world_ranks: tuple[int, ...]

    @property
    def ring_rank(self) -> int:
        """This rank's index in the ring group (the CP rank in CP-only and fused layouts)."""
        return self.ring_ranks.index(self.coords.rank)


def build_process_groups(topology: Topology, *, timeout: timedelta | None = None) -> ProcessGroups:
    """Create every group of ``topology`` and return this rank's.

    Call on every rank after ``init_process_group``, in the same program order on all ranks.
    ``timeout`` bounds every collective of every group (``train.collective_timeout_s``); without it
    torch gives sub-groups its 30-minute default whatever the world group's timeout, so a stalled
    peer would hang the job that long.
    """
    if not dist.is_initialized():
        raise ValueError("build_process_groups needs torch.distributed: call init_process_group first")
    topology.check_world_size(dist.get_world_size())
    rank = dist.get_rank()
    mine: dict[str, tuple[ProcessGroup, tuple[int, ...]]] = {}
    for name, member_lists in plan_group_ranks(topology).items():
        for members in member_lists:
            group = dist.new_group(members, timeout=timeout)  # collective: every rank creates every group
            if rank in members:
                mine[name] = (group, tuple(members))
    return ProcessGroups(
        topology=topology,
        coords=topology.coords(rank),
        **{name: mine[name][0] for name in GROUP_NAMES},
        **{f"{name}_ranks": mine[name][1] for name in GROUP_NAMES},
    )


def release_process_groups(groups: ProcessGroups) -> None:
    """Destroy the groups :func:`build_process_groups` created for this rank (their sockets and
    threads). Call on every rank once nothing will use them again: a process that builds groups
    again (``csbp compare`` trains every layout of a round in the same processes) otherwise keeps
    every earlier set, about 23 file descriptors and 15 threads a set on gloo."""
    for name in GROUP_NAMES:
        dist.destroy_process_group(getattr(groups, name))
