"""Which context rows a DFlash ring member sends to which: the document-aware context exchange
(csbp.md §11's halo exchange applied to DFlash, csbp.md §14).

An anchor ``a`` sees only the context ``[doc_start(a), a)`` (``[doc_start(a), a]`` inclusive; with a
sliding window also no earlier than ``a + j − (W − 1)``). With packed documents a ring member's
anchors therefore read only a few documents' rows, while the all-gather of
``csbp.dflash.attention`` moves every ring member's whole context shard to every other member.
The *context exchange* moves exactly what is read instead: member ``s`` sends member ``d``
``need(d) ∩ owned(s)``, with ``owned(s)`` the zigzag context shard of ``s`` and ``need(d)`` the
union of the live block rows' context intervals of ``d``'s anchor packet
(``csbp.attention.layouts.halo_sends``, the rule the BD3 halo exchange uses). The plan is a
``csbp.attention.layouts.WindowPlan`` executed by the window transport's all-to-all helpers.

**When it is used** (``context_exchange_kinds``: per layer kind, full attention then sliding), the
BD3 factory's rule (``csbp.attention.transports.factory``) applied to DFlash:

* CSBP (``cp > 1``, anchors dealt over ``bp`` ranks), every kind: for every sample that packs more
  than one document, unless ``topology.transport`` is ``streaming`` (DFlash has no ring transport;
  it then keeps the all-gather);
* CSBP, sliding-window kinds (``DFlashConfig.sliding_window`` ``W``): also for a sample with a
  single document (the long-context case), under any transport but ``streaming``: its anchors read
  only the ``W − 1`` rows before them (``[max(doc_start, a + j − (W − 1)), a)``), whatever the
  documents; the full-attention kinds of such a sample keep the all-gather (an anchor late in the
  row reads nearly all of it);
* CP-only (``bp == 1``): only with ``topology.transport: halo`` (the mask-aware CP baseline,
  ``cp-aware``), every kind; plain CP-only stays generic context parallelism and all-gathers,
  sliding kinds included (every CP rank holds every anchor, so the window rows of all anchors
  span the row);
* ``transport: halo`` also plans samples with a single document (a ring member then receives
  only the rows before its last anchor, or its anchors' windows);
* and in every case only when it pays (``csbp.attention.counts.exchange_pays``, per sample and
  kind, the rule the planner prices and BD3's halo exchange follows too): the busiest ring member
  moves at most ``EXCHANGE_MAX_SHARE`` (90%) of the all-gather's ``(cp−1)·L/cp`` rows in its
  busier direction (sent or received); otherwise the all-gather is kept. Both collectives overlap
  the block partial (forward) and the block-diagonal backward. The rule reads only the layout
  (the same ``cp``/``bp`` on every member), the transport, the sample's documents and anchors and
  every member's packet, all shared by the ring, so every member picks the same collective.

A sample with one document under the default transport and a drafter without sliding layers is
unchanged: same collectives, same bytes.

Shape legend: ``L`` sequence length, ``cp`` ring size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from torch import Tensor

from csbp.attention.draft_counts import context_exchange_pays
from csbp.attention.layouts import WindowPlan, halo_sends, needed_positions
from csbp.attention.rows import Rows
from csbp.dflash.config import DFlashConfig
from csbp.dflash.layouts import DFlashLayout, context_positions, draft_query_rows, owned_packet

DFLASH_TRANSPORTS = ("collective", "streaming", "halo")
"""``topology.transport`` values a DFlash run accepts (``streaming`` runs the all-gather)."""


def ring_member_layouts(layout: DFlashLayout) -> list[DFlashLayout]:
    """The layouts of the members of this rank's CP ring, in ring order (member ``d`` holds context
    shard ``d``; under CSBP the ring is local ranks ``ring·cp … ring·cp + cp − 1``)."""
    if layout.num_owners == 1:
        return [replace(layout, cp_rank=d) for d in range(layout.cp)]
    first = layout.owner_rank - layout.cp_rank
    return [replace(layout, cp_rank=d, owner_rank=first + d) for d in range(layout.cp)]


def context_exchange_wanted(layout: DFlashLayout, transport: str, *, packs_documents: bool) -> bool:
    """Whether a sample's full-attention kind is planned for the context exchange (module
    docstring; the row count decides afterwards)."""
    if transport not in DFLASH_TRANSPORTS:
        raise ValueError(f"transport must be one of {DFLASH_TRANSPORTS}, got {transport!r}")
    if layout.cp < 2:
        return False
    if transport == "halo":
        return True
    return layout.num_owners > 1 and packs_documents and transport != "streaming"


def context_exchange_kinds(
    cfg: DFlashConfig, layout: DFlashLayout, transport: str, *, packs_documents: bool
) -> list[bool]:
    """Per layer kind (``layouts.draft_query_rows``: full attention, then sliding if any layer
    slides), whether a sample is planned for the context exchange (module docstring): a sliding
    kind also under CSBP with one document, unless ``streaming``."""
    full = context_exchange_wanted(layout, transport, packs_documents=packs_documents)
    kinds = [full]
    if "sliding_attention" in (cfg.layer_types or ()):
        kinds.append(full or (layout.cp > 1 and layout.num_owners > 1 and transport != "streaming"))
    return kinds


def packs_documents(segment_starts_L: Tensor) -> bool:
    """True when a sample holds more than one document segment (``anchors.segment_starts``)."""
    return bool(segment_starts_L.numel() > 0 and int(segment_starts_L[-1]) > 0)


def context_exchange_plan(
    seq_len: int,
    layout: DFlashLayout,
    member_rows: Sequence[Rows],
    *,
    block_size: int,
    window: int | None = None,
) -> WindowPlan:
    """The exchange plan of this rank's ring for one layer kind: ``member_rows[d]`` are ring member
    ``d``'s block query rows (``layouts.block_query_rows`` of its packet, CPU)."""
    if layout.cp < 2:
        raise ValueError(f"a context exchange needs a CP ring (cp > 1), got cp={layout.cp}")
    if len(member_rows) != layout.cp:
        raise ValueError(f"need the query rows of all {layout.cp} ring members, got {len(member_rows)}")
    owned = tuple(context_positions(seq_len, layout.cp, d) for d in range(layout.cp))
    needed = [needed_positions(rows, seq_len) for rows in member_rows]
    return WindowPlan(
        seq_len=seq_len,
        block_size=block_size,
        cp=layout.cp,
        bp=layout.num_owners,
        ring_index=layout.owner_rank // layout.cp if layout.num_owners > 1 else 0,
        window=window,
        owned_positions=owned,
        send=halo_sends(owned, needed, seq_len),
    )


def exchanged_rows(plan: WindowPlan) -> int:
    """Rows the exchange moves over the whole ring in one direction (forward K/V)."""
    return sum(sum(plan.send_counts(source)) for source in range(plan.cp))


def all_gather_rows(seq_len: int, cp: int) -> int:
    """Rows the context all-gather moves over the whole ring in one direction."""
    return (cp - 1) * seq_len


def exchange_pays_off(plan: WindowPlan) -> bool:
    """``draft_counts.context_exchange_pays`` of this plan: its busiest member moves at most
    ``counts.EXCHANGE_MAX_SHARE`` of the all-gather's rows in its busier direction."""
    return context_exchange_pays(plan.traffic_rows(), plan.seq_len, plan.cp)


def context_exchanges(
    cfg: DFlashConfig,
    seq_len: int,
    layout: DFlashLayout,
    anchors: Tensor,
    doc_start: Tensor,
    *,
    context: str,
    min_bucket: int,
    kinds: Sequence[bool] | None = None,
) -> list[WindowPlan | None]:
    """Per layer kind (``layouts.draft_query_rows``), the context exchange plan of this rank's ring
    for one sample's sorted ``anchors`` (every member's packet as ``layouts.owned_packet`` deals
    it), or None where it does not pay off against the all-gather (``exchange_pays_off``) or
    ``kinds`` (one flag per kind, default all) does not plan it."""
    member_variants = [
        draft_query_rows(cfg, owned_packet(anchors, doc_start, member, context=context, min_bucket=min_bucket),
                         context=context)[0]
        for member in ring_member_layouts(layout)
    ]
    windows = [None, cfg.sliding_window]
    wanted = [True] * len(member_variants[0]) if kinds is None else list(kinds)
    if len(wanted) != len(member_variants[0]):
        raise ValueError(f"got {len(wanted)} layer-kind flags for {len(member_variants[0])} layer kinds")
    plans: list[WindowPlan | None] = []
    for kind in range(len(member_variants[0])):
        if not wanted[kind]:
            plans.append(None)
            continue
        plan = context_exchange_plan(
            seq_len, layout, [rows[kind] for rows in member_variants], block_size=cfg.block_size,
            window=windows[kind],
        )
        plans.append(plan if exchange_pays_off(plan) else None)
    return plans


def sample_context_exchanges(
    cfg: DFlashConfig,
    seq_len: int,
    layout: DFlashLayout,
    anchors: Tensor,
    segment_starts_L: Tensor,
    *,
    transport: str,
    context: str,
    min_bucket: int,
) -> list[WindowPlan | None] | None:
    """The context exchanges of one sample (``DFlashStep``'s rule, module docstring): per layer
    kind a plan or None (all-gather), or None when no kind is planned. ``segment_starts_L`` are the
    sample's ``anchors.segment_starts``."""
    kinds = context_exchange_kinds(cfg, layout, transport, packs_documents=packs_documents(segment_starts_L))
    if not any(kinds):
        return None
    doc_start = segment_starts_L[anchors]
    return context_exchanges(
        cfg, seq_len, layout, anchors, doc_start, context=context, min_bucket=min_bucket, kinds=kinds
    )
