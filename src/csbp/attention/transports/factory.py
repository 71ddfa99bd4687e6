"""Choose and build the attention transport of one rank from its topology and layout.

=========  =======================================================================================
layout     transport
=========  =======================================================================================
``data``   ``LocalAttentionFn``: every row is local (single process or plain data parallelism)
``bp``     ``LocalAttentionFn``: BP-only, the clean prefix is replicated, no attention traffic
``cp``     the CP-only baseline: every row (noisy and clean) is exchanged, like generic context
           parallelism; ``collective`` (all-gather / reduce-scatter) or ``streaming`` (ring).
           ``halo`` is the mask-aware CP baseline (``cp-aware``): same zigzag rows, one all-to-all
           of only the clean rows some remote query may see (no remote query reads a noisy key)
``csbp``   only clean rows move: ``WindowAttention`` (the halo all-to-all) when ``window`` is set,
           with packed ``documents`` (unless ``transport="streaming"``: the bounded-memory ring) or
           with ``transport="halo"``, else ``CollectiveAttention`` or ``StreamingAttention`` over
           the clean shards
=========  =======================================================================================

A windowed CP-only layer still exchanges every row (what generic context parallelism does); its
layout carries the window, so the result is exact. ``transport`` is ignored for a windowed CSBP
layer: the all-to-all moves only the halo, less than either full-attention transport.

Every halo (``cp-aware``, CSBP with a window or documents) is used only where it pays
(``halo_pays``, ``counts.exchange_pays``): its busiest ring member must move at most 90% of what the
all-gather moves per member, in its busier direction. Otherwise (one long document, a window about
as long as the row) the ring keeps ``CollectiveAttention`` (``StreamingAttention`` with ``transport="streaming"``), whose rows
carry the same mask, so the result is the same.

Usage::

    layout = rank_layout(topology, local_rank, seq_len, block_size, window=window)
    attention = build_attention(topology, local_rank, layout, Comm(groups.ring, counter),
                                block_size=block_size, transport="collective", window=window)
"""

from __future__ import annotations

from typing import Literal, get_args

import torch

from csbp.attention.backends import check_backend, check_clean
from csbp.attention.counts import exchange_pays
from csbp.attention.diagonal import check_diagonal_backend
from csbp.attention.documents import Documents
from csbp.attention.layouts import RankLayout, WindowPlan, halo_exchange_plan, window_exchange_plan
from csbp.attention.transports.collective import CollectiveAttention
from csbp.attention.transports.exchange import cp_exchange_spec, csbp_exchange_spec
from csbp.attention.transports.local import LocalAttentionFn
from csbp.attention.transports.streaming import StreamingAttention
from csbp.attention.transports.window import WindowAttention
from csbp.models.decoder import AttentionFn
from csbp.parallel.comm import Comm
from csbp.schedules import SchedulePolicy
from csbp.topology import Topology

TransportName = Literal["collective", "streaming", "halo"]
TRANSPORTS: tuple[str, ...] = get_args(TransportName)


def build_attention(
    topology: Topology,
    local_rank: int,
    layout: RankLayout,
    comm: Comm | None,
    *,
    block_size: int,
    transport: TransportName = "collective",
    window: int | None = None,
    causal_in_block: bool = False,
    schedule: SchedulePolicy = "dual_end",
    backend: str = "tiles",
    documents: Documents | None = None,
    diagonal: str = "auto",
    clean: str = "generic",
    device: torch.device | str | None = None,
) -> AttentionFn:
    """The ``AttentionFn`` of local rank ``local_rank`` over ``layout.rows``.

    Args:
        topology: the run's degrees; ``topology.layout`` picks the transport family.
        local_rank: this rank's index among the ranks sharing a sample (``RankCoords.local_rank``).
        layout: this rank's rows, from ``rank_layout(topology, local_rank, ...)`` with the same
            ``window`` and ``schedule``.
        comm: ``Comm`` over this rank's ring group (``ProcessGroups.ring``); unused (may be None) for
            the ``data`` and ``bp`` layouts.
        block_size: ``B``.
        transport: ``"collective"`` (throughput) or ``"streaming"`` (bounded memory).
        window: sliding window of this layer (None: full attention).
        causal_in_block: lower-triangular attention inside a noisy block.
        schedule: block schedule the layout was built with (the window plan needs it).
        backend: attention backend of every partial: ``auto`` (flex on CUDA, tiles otherwise),
            ``tiles`` or ``flex`` (``csbp.attention.backends``).
        documents: packed documents the layout was built with (None: one document).
        diagonal: kernel of the noisy block diagonal (``csbp.attention.diagonal``: auto, matmul,
            sdpa, sdpa_fold, flex).
        clean: kernel of the clean-context partials (``csbp.attention.backends.CLEAN_KERNELS``:
            generic, pieces, pieces-cudnn).
        device: the compute device, where the per-step plans are built (default: the layout rows'
            device; CPU rows of a GPU run would otherwise first plan for the CPU, unused).
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}, got transport={transport!r}")
    if not 0 <= local_rank < topology.local:
        raise ValueError(f"local_rank must be in [0, {topology.local}) for {topology}, got {local_rank}")
    check_backend(backend)
    check_diagonal_backend(diagonal, backend, where="diagonal")
    check_clean(clean)
    kind = topology.layout
    if kind in ("data", "bp"):
        return LocalAttentionFn(
            layout.rows, num_noisy=layout.num_noisy, causal_in_block=causal_in_block, backend=backend,
            diagonal=diagonal, clean=clean, device=device,
        )
    cp, cp_rank = topology.cp, local_rank % topology.cp
    seq_len = _sequence_length(topology, layout)
    topology.validate_sequence(seq_len, block_size)
    options = {"causal_in_block": causal_in_block, "backend": backend, "diagonal": diagonal, "clean": clean,
               "device": device}
    # CSBP moves only the clean rows a receiver may see whenever the mask is sparse (a window or
    # documents); with documents an explicit "streaming" keeps the bounded-memory ring instead.
    sparse = window is not None or (documents is not None and transport != "streaming")
    halo = transport == "halo" or (kind == "csbp" and sparse)
    if halo:
        ring_index = local_rank // cp
        if documents is None and window is not None:
            plan = window_exchange_plan(seq_len, block_size, cp, topology.bp, ring_index, window, schedule)
        else:
            plan = halo_exchange_plan(
                seq_len, block_size, cp, topology.bp, ring_index, window=window, schedule=schedule,
                documents=documents,
            )
        if halo_pays(plan, kind):  # else the ring's all-gather (the same on every member)
            return WindowAttention(layout, plan, cp_rank, comm, **options)
    if kind == "cp":
        spec = cp_exchange_spec(
            layout, seq_len=seq_len, block_size=block_size, cp=cp, cp_rank=cp_rank, documents=documents
        )
    else:
        spec = csbp_exchange_spec(layout, seq_len=seq_len, block_size=block_size, cp=cp, cp_rank=cp_rank)
    if transport == "streaming":
        return StreamingAttention(layout, spec, comm, **options)
    return CollectiveAttention(layout, spec, comm, **options)


def halo_pays(plan: WindowPlan, kind: str) -> bool:
    """``counts.exchange_pays`` of a halo plan: its busiest ring member moves at most
    ``EXCHANGE_MAX_SHARE`` of the all-gather's rows per member and direction in its busier direction
    (``max(sent, received)``): ``(cp-1)·L/cp`` clean rows under CSBP, ``(cp-1)·2L/cp`` noisy and
    clean rows in CP-only. The planner (``csbp.plan.model``) prices the same rule."""
    gathered = (plan.cp - 1) * plan.seq_len * (2 if kind == "cp" else 1) // plan.cp
    return exchange_pays(plan.traffic_rows(), gathered)


def _sequence_length(topology: Topology, layout: RankLayout) -> int:
    """``L`` implied by the layout's size: CP-only ranks hold ``2L/cp`` rows, CSBP ranks ``L/cp`` clean."""
    if topology.layout == "cp":
        doubled = topology.cp * len(layout.rows)
        if doubled % 2 != 0 or layout.num_noisy * 2 != len(layout.rows):
            raise ValueError(
                f"layout with {layout.num_noisy} noisy and {layout.num_clean} clean rows is not a CP-only "
                f"zigzag layout (equal noisy and clean halves) for topology {topology}; use cp_zigzag_layout"
            )
        return doubled // 2
    return topology.cp * layout.num_clean
