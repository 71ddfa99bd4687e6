"""``csbp plan --doc-length``: the planner's torch-free counts over packed documents equal what the
runtime builds (host only, tiny sizes): per-rank allowed pairs against the mask predicate over the
real document rows, halo rows against ``halo_exchange_plan``, DFlash anchors, pairs and context
exchange rows against ``csbp.dflash.exchange``; and the ranking consequences the model implies."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from csbp.attention.counts import halo_rows, layout_positions, rank_pairs
from csbp.attention.documents import random_documents
from csbp.attention.draft_counts import (
    context_pairs,
    draft_intervals,
    exchange_recv_rows,
    exchange_rows,
    owner_anchor_indices,
    spread_anchors,
)
from csbp.attention.layouts import halo_exchange_plan, rank_layout, reference_layout
from csbp.attention.rows import allow_matrix
from csbp.dflash.config import DFlashConfig
from csbp.dflash.exchange import all_gather_rows, ring_member_layouts, sample_context_exchanges
from csbp.dflash.layouts import block_query_rows, dflash_layout, owned_packet
from csbp.models.config import DecoderConfig
from csbp.plan.calibration import packaged_calibration
from csbp.plan.documents import (
    DOCUMENT_SEED,
    document_halo_rows,
    draft_counts,
    one_document,
    packed_documents,
)
from csbp.plan.hardware import hardware
from csbp.plan.layout import Layout
from csbp.plan.model import predict, rank_counts
from csbp.plan.search import candidate_layouts, transports_for
from csbp.plan.search import rank as rank_layouts
from csbp.plan.workload import preset_workload
from csbp.topology import Topology

SEQ_LEN, BLOCK, DOC = 64, 4, 6
DEGREES = [(1, 1), (2, 1), (4, 1), (1, 2), (1, 4), (2, 2), (2, 4), (4, 4)]


def _documents(seed: int = DOCUMENT_SEED):
    docs = random_documents(SEQ_LEN, DOC, torch.Generator().manual_seed(seed))
    return docs, (docs.start.numpy(), docs.stop.numpy())


def test_packed_documents_are_the_benchmarks_documents() -> None:
    docs, (start, stop) = _documents()
    planned = packed_documents(SEQ_LEN, DOC)
    assert np.array_equal(planned[0], start) and np.array_equal(planned[1], stop)
    assert docs.num_documents > 3  # several documents, the last one cut at the row's end
    assert stop[-1] == SEQ_LEN


@pytest.mark.parametrize(("cp", "bp"), DEGREES)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("seed", [0, 1])
def test_rank_pairs_and_rows_equal_the_document_mask(cp: int, bp: int, window: int | None, seed: int) -> None:
    docs, bounds = _documents(seed)
    topology = Topology(cp=cp, bp=bp, replicate_clean_prefix=cp == 1 and bp > 1)
    keys = reference_layout(SEQ_LEN, BLOCK, window, docs).rows  # every row of the sequence
    for rank in range(topology.local):
        layout = rank_layout(topology, rank, SEQ_LEN, BLOCK, window=window, documents=docs)
        noisy, clean, _ = layout_positions(SEQ_LEN, BLOCK, cp, bp, rank, documents=bounds)
        assert np.array_equal(clean, layout.clean_positions.numpy())  # BP-only: the documents' prefixes
        assert np.array_equal(noisy, layout.noisy_positions.numpy())
        allowed = allow_matrix(layout.rows, keys)
        num_noisy = layout.num_noisy
        expected = (int(allowed[:num_noisy].sum()), int(allowed[num_noisy:].sum()))
        assert rank_pairs(SEQ_LEN, BLOCK, cp, bp, rank, window=window, documents=bounds) == expected


@pytest.mark.parametrize(("cp", "bp"), [(2, 1), (4, 1), (2, 2), (2, 4), (4, 4)])
@pytest.mark.parametrize("window", [None, 5])
def test_halo_rows_equal_the_halo_exchange_plan(cp: int, bp: int, window: int | None) -> None:
    """CSBP and, with ``bp == 1``, the cp-aware baseline: rows received = the plan's recv counts."""
    docs, bounds = _documents()
    worst = 0
    for ring in range(max(bp, cp) // cp):
        plan = halo_exchange_plan(SEQ_LEN, BLOCK, cp, bp, ring, window=window, documents=docs)
        for member in range(cp):
            received = sum(plan.recv_counts(member))
            rank = ring * cp + member
            assert halo_rows(SEQ_LEN, BLOCK, cp, bp, rank, window=window, documents=bounds) == received
            worst = max(worst, received)
    assert document_halo_rows(SEQ_LEN, BLOCK, cp, bp, "dual_end", window or 0, DOC) == worst
    if window is None:
        assert worst < (2 if bp == 1 else 1) * SEQ_LEN // cp * (cp - 1)  # less than the all-gather


def test_planner_rank_counts_are_the_document_counts() -> None:
    _, bounds = _documents()
    counts = rank_counts(SEQ_LEN, BLOCK, 2, 4, "dual_end", 0, DOC)
    for rank, c in enumerate(counts):
        assert c.pairs == sum(rank_pairs(SEQ_LEN, BLOCK, 2, 4, rank, documents=bounds))
    no_docs = rank_counts(SEQ_LEN, BLOCK, 2, 4, "dual_end", 0)
    assert sum(c.pairs for c in counts) < sum(c.pairs for c in no_docs)


def _dflash_config(window: int) -> DFlashConfig:
    target = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=4, num_heads=4,
                           num_kv_heads=2, head_dim=8)
    return DFlashConfig.from_target(
        target, num_layers=2, block_size=BLOCK, mask_token_id=63, target_layer_ids=(0, 2),
        layer_types=("full_attention", "sliding_attention"), sliding_window=window,
    )


@pytest.mark.parametrize("topology", [Topology(cp=2), Topology(cp=4), Topology(cp=2, bp=2),
                                      Topology(cp=2, bp=4), Topology(cp=4, bp=4)], ids=str)
@pytest.mark.parametrize("transport", ["collective", "halo", "streaming"])
@pytest.mark.parametrize("documents", ["packed", "one"])
def test_draft_counts_equal_the_dflash_exchange(topology: Topology, transport: str, documents: str) -> None:
    """Anchors dealt, context pairs per rank and exchange rows per ring member, against the real
    packets and ``context_exchange_plan``; which layer kinds exchange, against the step's rule
    (``sample_context_exchanges``): with packed documents, and with one document per row, where
    CSBP's sliding kind exchanges its window rows and its full kind all-gathers."""
    window, num_anchors, context = 5, 6, "strict"
    config = _dflash_config(window)
    key = DOC if documents == "packed" else one_document(SEQ_LEN)
    start, _ = packed_documents(SEQ_LEN, key)
    counts = draft_counts(SEQ_LEN, key, block=BLOCK, anchors=num_anchors, cp=topology.cp, bp=topology.bp,
                          transport=transport, windows=(0, window), context=context)
    anchors_np = spread_anchors(packed_documents(SEQ_LEN, key), num_anchors)
    assert len(anchors_np) == num_anchors and np.all(start[anchors_np + 1] == start[anchors_np])  # valid
    draft_counts_anchors = torch.from_numpy(anchors_np)
    doc_start = torch.from_numpy(start[anchors_np].copy())
    owners = owner_anchor_indices(anchors_np, start[anchors_np], topology.bp if topology.bp > 1 else 1,
                                  context=context)
    load, recv_worst, used = [], {0: 0, window: 0}, {0: False, window: False}
    busiest = {0: 0, window: 0}
    gather = (topology.cp - 1) * SEQ_LEN // topology.cp
    for ring in range(topology.local // topology.cp):
        layout = dflash_layout(topology, ring * topology.cp)
        members = ring_member_layouts(layout)
        packets = [owned_packet(draft_counts_anchors, doc_start, m, context=context, min_bucket=1) for m in members]
        real = sample_context_exchanges(config, SEQ_LEN, layout, draft_counts_anchors, torch.from_numpy(start.copy()),
                                        transport=transport, context=context, min_bucket=1) or [None, None]
        for kind, w in enumerate((0, window)):
            rows = [block_query_rows(p, BLOCK, context=context, window=w or None) for p in packets]
            mine = [draft_intervals(anchors_np[owners[m.owner_rank]], start[anchors_np[owners[m.owner_rank]]],
                                    BLOCK, context=context, window=w or None) for m in members]
            for r, (s, e) in zip(rows, mine):
                live = r.live
                assert context_pairs(s, e) == int(((r.ctx_stop - r.ctx_start).clamp(min=0) * live).sum())
            recv = exchange_recv_rows(SEQ_LEN, topology.cp, mine)
            sent = exchange_rows(SEQ_LEN, topology.cp, mine)[1]
            if real[kind] is not None:
                assert recv == [sum(real[kind].recv_counts(d)) for d in range(topology.cp)]
                assert sent == [sum(real[kind].send_counts(d)) for d in range(topology.cp)]
                assert sum(recv) < all_gather_rows(SEQ_LEN, topology.cp)
                used[w] = True
            recv_worst[w] = max(recv_worst[w], max(recv) if real[kind] is not None else gather)
            busiest[w] = max(busiest[w], max(*recv, *sent) if real[kind] is not None else gather)
        for m, p in zip(members, packets):
            assert p.anchor_index[p.keep].tolist() == owners[m.owner_rank].tolist()  # the real dealing
    for o in owners:
        load.append(sum(context_pairs(*draft_intervals(anchors_np[o], start[anchors_np[o]], BLOCK, context=context,
                                                       window=w or None)) for w in (0, window)))
    assert counts.recv_rows == recv_worst and counts.exchanged == used and counts.traffic_rows == busiest
    assert counts.anchors == len(owners[int(np.argmax(load))])
    if documents == "one" and transport != "halo":  # the full kind reads the whole prefix: all-gather
        assert not counts.exchanged[0]
        assert counts.exchanged[window] == (topology.bp > 1 and transport != "streaming")


def test_cp_aware_is_a_candidate_only_with_documents() -> None:
    workload = preset_workload("nemotron-3b")
    docs = workload.with_options(doc_length=2048)
    cp = Layout(1, 8)
    assert "halo" not in transports_for(workload, cp) and "halo" in transports_for(docs, cp)
    assert transports_for(docs, Layout(1, 8, 8)) == ("collective", "streaming")
    with pytest.raises(ValueError, match="--doc-length must be >= 1"):
        workload.with_options(doc_length=0)
    with pytest.raises(ValueError, match="--doc-length must be >= 2"):
        preset_workload("dflash2-qwen3.8").with_options(doc_length=1)


def test_short_documents_make_the_all_gather_useless() -> None:
    """At L=256K with 2K documents (~128 per row) on two nodes of 8 GPUs: every query sees at most
    its own document, so a ring member needs only the rows of the few documents its shard cuts.
    The model must then (a) predict, for every ring that crosses the network, that the halo
    layouts (CSBP, cp-aware) send less K/V than the all-gathers of the same degrees (collective
    or streaming: documents leave their bytes unchanged) and run at least as fast (same rows and
    pairs, less traffic to expose), and (b) pick a halo or ring-free layout as best, where
    without documents its best layout gathers every clean row. (Inside one node the streaming
    ring hides its traffic behind attention, so there the two are a tie, not an ordering.)"""
    seq_len, gpus = 256 * 1024, 16
    hw, cal = hardware("h200", gpus=gpus), packaged_calibration("h200")
    plain = preset_workload("nemotron-3b")
    docs = plain.with_options(doc_length=2048)

    def kv(workload, layout):
        return predict(workload, layout, seq_len, hw, cal)

    for cp, bp in ((16, 1), (16, 16), (8, 1), (8, 8)):
        base = Layout(gpus // max(cp, bp), cp, bp, placement="striped")
        gathers = [replace(base, transport=t) for t in ("collective", "streaming")]
        halo = replace(base, transport="halo" if bp == 1 else "collective")
        best_gather = max((kv(docs, g) for g in gathers if g != halo), key=lambda p: p.tokens_per_s)
        h = kv(docs, halo)
        assert h.kv_bytes < min(kv(docs, g).kv_bytes for g in gathers if g != halo)
        assert h.tokens_per_s >= best_gather.tokens_per_s
    for gather in (Layout(1, 16, 16, transport="streaming"), Layout(1, 16), Layout(1, 16, transport="streaming")):
        assert kv(plain, gather).kv_bytes == kv(docs, gather).kv_bytes

    def best(workload):
        # the dual-end schedule: with the balanced one an intra-node streaming ring, whose traffic the
        # model hides behind attention, can win by balance alone (tests/test_schedule_balanced.py)
        layouts = [
            lay for lay in candidate_layouts(workload, gpus, seq_len)
            if lay.checkpointing == "full" and lay.schedule == "dual_end"
        ]
        return rank_layouts(workload, layouts, seq_len, hw, cal).best.layout

    without, with_docs = best(plain), best(docs)
    assert without.cp > 1 and without.transport != "halo"  # one document: the clean rows are all needed
    assert with_docs.cp == 1 or with_docs.transport == "halo" or (with_docs.kind == "csbp" and with_docs.transport == "collective")


def test_drafter_traffic_and_received_memory_follow_the_context_exchange() -> None:
    """csbp's drafter step (``--drafter-context all``): every layer keeps the context K/V it received;
    an all-gather receives ``(cp-1)·L/cp`` rows, the context exchange its plan's rows."""
    seq_len, hw, cal = 64 * 1024, hardware("h100", gpus=8), packaged_calibration("h100")
    plain = preset_workload("dflash2-qwen3.8").with_options(drafter_context="all")
    docs = plain.with_options(doc_length=512)
    model, p = plain.model, plain.dtype_bytes
    layout = Layout(2, 4, 4)
    gather = predict(plain, layout, seq_len, hw, cal)
    row_bytes = sum(g.count * 2 * g.n_kv_heads * g.head_dim * p for g in model.groups)
    assert gather.mem_terms["received context K/V"] == 3 * seq_len // 4 * row_bytes
    assert gather.kv_bytes == 2 * gather.mem_terms["received context K/V"]  # gather + dK/dV
    windows = tuple(sorted({g.window for g in model.groups}))
    counts = draft_counts(seq_len, 512, block=plain.objective.block, anchors=plain.objective.anchors, cp=4, bp=4,
                          transport="collective", windows=windows)
    exchanged = predict(docs, layout, seq_len, hw, cal)
    expected = sum(g.count * 2 * g.n_kv_heads * g.head_dim * p * counts.recv_rows[g.window] for g in model.groups)
    assert all(counts.exchanged.values())
    assert exchanged.mem_terms["received context K/V"] == expected < gather.mem_terms["received context K/V"]
    assert "received context K/V" not in predict(docs, Layout(2, 1, 4), seq_len, hw, cal).mem_terms  # no ring
    # 2048-token documents: the busiest member would move over 90% of the all-gather's rows; not worth it
    longer = draft_counts(seq_len, 2048, block=plain.objective.block, anchors=plain.objective.anchors, cp=4, bp=4,
                          transport="collective", windows=windows)
    assert not any(longer.exchanged.values()) and longer.recv_rows == {w: 3 * seq_len // 4 for w in windows}
    assert predict(plain.with_options(doc_length=2048), layout, seq_len, hw, cal).mem_terms[
        "received context K/V"] == gather.mem_terms["received context K/V"]


def test_one_document_sliding_layers_price_the_window_exchange() -> None:
    """No ``--doc-length``, csbp's step (``--drafter-context all``), every layer sliding (W = 2048), 256K:
    a CSBP ring whose members' anchors leave gaps between their windows exchanges only the window
    rows, so only the K/V terms move (traffic, its exposed time, the received K/V each layer keeps);
    a ring whose windows cover the row, CP-only, ``streaming`` and the reference's ``windows``
    context keep the all-gather, and the exchange is never priced above the all-gather."""
    seq_len, hw, cal = 256 * 1024, hardware("h100", gpus=8), packaged_calibration("h100")
    # 512 anchors every 512 positions: a member of 8 owners has one every 4096, of 4 owners every 2048
    plain = preset_workload("dflash2-qwen3.8").with_options(drafter_context="all", anchors=512)
    model, obj, p = plain.model, plain.objective, plain.dtype_bytes
    windows = tuple(sorted({g.window for g in model.groups}))
    assert windows == (2048,)
    row_bytes = sum(g.count * 2 * g.n_kv_heads * g.head_dim * p for g in model.groups)
    for cp, bp, pays in ((8, 8, True), (4, 8, True), (4, 4, False)):
        layout = Layout(8 // max(cp, bp), cp, bp)
        got = predict(plain, layout, seq_len, hw, cal)
        kept = predict(plain, replace(layout, transport="streaming"), seq_len, hw, cal)  # keeps the all-gather
        gather = (cp - 1) * seq_len // cp
        assert kept.mem_terms["received context K/V"] == gather * row_bytes
        counts = draft_counts(seq_len, one_document(seq_len), block=obj.block, anchors=obj.anchors, cp=cp, bp=bp,
                              transport="collective", windows=windows)
        assert counts.exchanged[2048] == pays
        assert got.mem_terms["received context K/V"] == counts.recv_rows[2048] * row_bytes
        assert got.kv_bytes == 2 * counts.traffic_rows[2048] * row_bytes  # exchange + dK/dV, busiest direction
        assert (got.kv_bytes < 0.9 * kept.kv_bytes) == pays and got.kv_bytes <= kept.kv_bytes
        assert {k: v for k, v in got.mem_terms.items() if k != "received context K/V"} == {
            k: v for k, v in kept.mem_terms.items() if k != "received context K/V"}
        assert got.fwd_s == kept.fwd_s and got.bwd_s == kept.bwd_s  # the compute is unchanged
    for layout in (Layout(1, 8), Layout(2, 4)):  # CP-only: every rank holds every anchor, all-gather
        assert predict(plain, layout, seq_len, hw, cal).mem_terms["received context K/V"] == (
            (layout.cp - 1) * seq_len // layout.cp * row_bytes)
    reference = preset_workload("dflash2-qwen3.8")  # context_rows "windows": its own gather, unchanged
    assert predict(reference, Layout(1, 8, 8), seq_len, hw, cal).kv_bytes == predict(
        reference, Layout(1, 8, 8, transport="streaming"), seq_len, hw, cal).kv_bytes


@pytest.mark.parametrize("objective", ["mdlm", "ar"])
def test_single_stream_pairs_are_the_document_mask(objective: str) -> None:
    """MDLM (bidirectional) and AR (causal) rows over packed documents: the planner's pairs are the
    predicate's (``csbp.masks``) over the same documents."""
    from csbp.attention.documents import packed_doc_ids
    from csbp.masks import ar_mask, dense_mask, mdlm_mask
    from csbp.plan.model import _counts
    from csbp.plan.workload import Objective, Workload

    workload = Workload(preset_workload("nemotron-3b").model, Objective(objective, block=SEQ_LEN), 2, doc_length=DOC)
    doc_ids = packed_doc_ids(random_documents(SEQ_LEN, DOC, torch.Generator().manual_seed(DOCUMENT_SEED)))
    mask = (mdlm_mask if objective == "mdlm" else ar_mask)(SEQ_LEN, doc_ids)
    (counts,) = _counts(workload, Layout(1), SEQ_LEN, 0)
    assert counts.pairs == int(dense_mask(mask, SEQ_LEN, SEQ_LEN).sum())
