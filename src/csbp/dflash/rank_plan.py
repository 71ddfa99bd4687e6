"""What one rank holds of a DFlash step and which communicators it uses, decided once after the
parallel context is built: ``build_dflash_rank_plan`` gives the ``DFlashRankPlan`` (its zigzag
context shard and, under CSBP, its share of the anchors, ``csbp.dflash.layouts``; the CP ring, the
anchor owners' and the data-parallel replicas' communicators; the attention kernels and the
transport) that ``csbp.dflash.step.DFlashStep`` runs with.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from csbp.attention.backends import check_backend, check_clean
from csbp.attention.diagonal import check_diagonal_backend
from csbp.dflash.config import DFlashObjectiveConfig
from csbp.dflash.exchange import DFLASH_TRANSPORTS
from csbp.dflash.layouts import DFlashLayout, dflash_layout
from csbp.engine.context import ParallelContext
from csbp.parallel.comm import Comm


@dataclass(frozen=True, eq=False)
class DFlashRankPlan:
    """This rank's layout and communicators.

    Attributes:
        layout: context shard, anchor share and loss scale.
        ring_comm: the CP ring for context K/V (None when ``cp == 1``).
        owner_comm: sums over the ranks that split a sample's anchors (None when one rank holds
            all anchors); used without gradient for global denominators and metrics.
        backend: attention backend of the draft layers (``csbp.attention.backends``).
        diagonal: kernel of the draft blocks' block diagonal (``csbp.attention.diagonal``).
        clean: kernel of the draft blocks over the context (``csbp.attention.backends.CLEAN_KERNELS``).
        transport: ``topology.transport``; decides with packed documents whether the context K/V
            are all-gathered or exchanged (``csbp.dflash.exchange``).
        replica_comm: sums over the data-parallel replicas (None when ``dp == 1``); with
            ``owner_comm`` it gives statistics of the whole micro-batch (the ``lambda`` LK loss's
            acceptance), as one process holding every replica's samples computes them.
    """

    layout: DFlashLayout
    ring_comm: Comm | None
    owner_comm: Comm | None
    backend: str = "tiles"
    diagonal: str = "auto"
    clean: str = "generic"
    transport: str = "collective"
    replica_comm: Comm | None = None

    def reduce_sum(self, values: Tensor) -> Tensor:
        """Sum a small stats tensor over the anchor owners (identity for one owner)."""
        if self.owner_comm is None or self.owner_comm.size == 1:
            return values
        return self.owner_comm.all_reduce(values.clone().contiguous())

    def reduce_batch(self, values: Tensor) -> Tensor:
        """Sum a small stats tensor over every anchor of the micro-batch: over the owners of each
        sample, then over the data-parallel replicas (each replica counted once)."""
        values = self.reduce_sum(values)
        if self.replica_comm is None or self.replica_comm.size == 1:
            return values
        return self.replica_comm.all_reduce(values.clone().contiguous())


def build_dflash_rank_plan(
    ctx: ParallelContext,
    objective: DFlashObjectiveConfig,
    *,
    backend: str = "tiles",
    diagonal: str = "auto",
    clean: str = "generic",
    transport: str = "collective",
) -> DFlashRankPlan:
    """Plan this rank's share of every sample (call once after building the parallel context);
    ``backend``: the attention backend of the draft layers (auto, tiles, flex); ``diagonal``: the
    kernel of their block diagonal (auto, matmul, sdpa, sdpa_fold, flex); ``clean``: the kernel of
    their context partials (generic, pieces, pieces-cudnn); ``transport``: ``topology.transport``
    (with packed documents CSBP exchanges only the visible context rows, and so does CP-only with
    ``halo``; ``csbp.dflash.exchange``)."""
    if transport not in DFLASH_TRANSPORTS:
        raise ValueError(f"transport must be one of {DFLASH_TRANSPORTS}, got {transport!r}")
    layout = dflash_layout(ctx.topology, ctx.coords.local_rank)
    if objective.max_anchors < layout.num_owners:
        raise ValueError(
            f"objective max_anchors={objective.max_anchors} is below bp={layout.num_owners}: "
            "every BP rank needs an "
            f"anchor; raise max_anchors to at least {layout.num_owners}"
        )
    ring = ctx.ring_comm() if layout.cp > 1 else None
    owner = None
    if layout.num_owners > 1 and ctx.groups is not None:
        owner = ctx.model_input_comm("dflash.stats")
    replicas = ctx.dp_comm("dflash.stats") if ctx.topology.dp > 1 else None
    return DFlashRankPlan(
        layout, ring, owner, check_backend(backend), check_diagonal_backend(diagonal, backend, where="diagonal"),
        check_clean(clean), transport, replicas,
    )
