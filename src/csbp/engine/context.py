"""Who this process is in the parallel world: topology, coordinates, process groups, traffic counter.

One code path serves one process and N processes: without ``torch.distributed`` the context is a
single ``data`` rank and every collective is a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from csbp.parallel.comm import Comm, TrafficCounter
from csbp.parallel.groups import ProcessGroups, build_process_groups
from csbp.topology import RankCoords, Topology


@dataclass(frozen=True, eq=False)
class ParallelContext:
    """This rank's place in the world.

    Attributes:
        topology: the validated layout of the world.
        coords: this rank's coordinates (dp rank, local rank, cp/bp rank, ring index).
        groups: the process groups, or None when running as a single process.
        counter: bytes this rank sends, by category ("attention", "gradients", ...).
    """

    topology: Topology
    coords: RankCoords
    groups: ProcessGroups | None
    counter: TrafficCounter

    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def is_distributed(self) -> bool:
        return self.groups is not None

    def ring_comm(self) -> Comm | None:
        """Counted collectives over the attention ring (None when single-process)."""
        return None if self.groups is None else Comm(self.groups.ring, self.counter, "attention")

    def world_comm(self, category: str) -> Comm | None:
        return None if self.groups is None else Comm(self.groups.world, self.counter, category)

    def dp_comm(self, category: str) -> Comm | None:
        return None if self.groups is None else Comm(self.groups.dp, self.counter, category)


def single_process_context() -> ParallelContext:
    """The context of a plain one-process run (the reference every layout must equal)."""
    topology = Topology()
    return ParallelContext(topology, topology.coords(0), None, TrafficCounter())


def build_parallel_context(topology: Topology, *, timeout: timedelta | None = None) -> ParallelContext:
    """Create the process groups of ``topology``; call on every rank after ``init_process_group``.

    ``timeout`` bounds every collective of every group (None: torch's default)."""
    if not dist.is_initialized():
        if topology.world_size != 1:
            raise ValueError(
                f"topology needs {topology.world_size} processes but torch.distributed is not initialised; "
                "launch with `csbp train --nproc N` or torchrun"
            )
        return single_process_context()
    groups = build_process_groups(topology, timeout=timeout)
    return ParallelContext(topology, groups.coords, groups, TrafficCounter())
