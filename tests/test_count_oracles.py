"""The counts behind every reported rate and traffic figure, against independent references.

``csbp bench``'s TFLOP/s, ``csbp gpu``'s MFU and ``csbp plan``'s step times count (query, key) pairs
with ``csbp.attention.counts`` (itself the source of the layouts' interval bounds, so checking it
against the layouts' own rows compares a formula with itself). Here the references are the closed
mask predicates of ``csbp.masks`` evaluated densely over tiny cases (``bd3_mask`` over the
``[x_t ; x_0]`` logical rows, ``dflash_mask`` over a drafter packet), and hand-worked examples of
the rules the docstrings state.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from csbp.attention.counts import allowed_pairs, bd3_bounds, layout_positions, position_pairs
from csbp.attention.documents import Documents
from csbp.attention.draft_counts import context_pairs, deal_order, draft_intervals, spread_anchors
from csbp.attention.layouts import rank_layout
from csbp.bench.measure import allowed_pairs as measured_pairs
from csbp.masks.builders import dense_mask
from csbp.masks.predicates import bd3_mask, dflash_mask
from csbp.topology import Topology


def _bd3_dense(seq_len: int, block: int, window: int | None, doc_ids: torch.Tensor | None,
               causal_in_block: bool = False) -> torch.Tensor:
    """``[2L, 2L]`` allow matrix of ``bd3_mask``; ``causal_in_block`` keeps noisy -> noisy pairs with
    ``k <= q`` only (the lower-triangular own block)."""
    allow = dense_mask(bd3_mask(seq_len, block, window, doc_ids), 2 * seq_len, 2 * seq_len)
    if causal_in_block:
        q = torch.arange(2 * seq_len)[:, None]
        k = torch.arange(2 * seq_len)[None, :]
        both_noisy = (q < seq_len) & (k < seq_len)
        allow = allow & (~both_noisy | (k <= q))
    return allow


def _logical(noisy: np.ndarray, clean: np.ndarray, seq_len: int) -> torch.Tensor:
    return torch.as_tensor(np.concatenate([noisy, clean + seq_len]), dtype=torch.long)


DOC_IDS = torch.tensor([0] * 5 + [1] * 9 + [2] * 3 + [3] * 15)  # L = 32: boundaries inside blocks


@pytest.mark.parametrize("window", [None, 3, 6])
@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize(("cp", "bp"), [(1, 1), (2, 1), (4, 1), (1, 4), (2, 2), (2, 4)])
def test_every_ranks_pairs_are_the_bd3_masks_over_its_logical_rows(cp, bp, window, documents):
    """``counts.position_pairs`` of each rank's rows (noisy, clean) equals the True entries of
    ``bd3_mask`` in those rows of the ``[2L, 2L]`` matrix: every layout's pairs add up to the mask's."""
    seq_len, block = 32, 4
    doc_ids = DOC_IDS if documents else None
    docs = Documents.from_doc_ids(DOC_IDS) if documents else None
    bounds = (docs.start.numpy(), docs.stop.numpy()) if docs is not None else None
    allow = _bd3_dense(seq_len, block, window, doc_ids)
    total = 0
    for rank in range(max(cp, bp)):
        noisy, clean, _ = layout_positions(seq_len, block, cp, bp, rank, "dual_end", bounds, window)
        n_pairs, c_pairs = position_pairs(noisy, clean, block_size=block, window=window, documents=bounds)
        assert n_pairs == int(allow[_logical(noisy, clean[:0], seq_len)].sum()), rank
        assert c_pairs == int(allow[_logical(noisy[:0], clean, seq_len)].sum()), rank
        if bp == 1:  # CP-only and data layouts partition the 2L rows
            total += n_pairs + c_pairs
    if bp == 1:
        assert total == int(allow.sum())


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("topology", [Topology(), Topology(cp=2, bp=2), Topology(bp=4, replicate_clean_prefix=True)])
def test_causal_in_block_pairs_count_the_lower_triangular_block(topology, window, documents):
    """``causal_in_block`` (the DFlash-style lower-triangular own block) counts ``j + 1`` noisy keys for
    the ``j``-th row of a block (segment, with documents): ``counts.allowed_pairs`` and the bench's
    ``measure.allowed_pairs`` (its segment path with documents) against the mask with ``k <= q`` in the
    noisy block."""
    seq_len, block = 32, 4
    docs = Documents.from_doc_ids(DOC_IDS) if documents else None
    allow = _bd3_dense(seq_len, block, window, DOC_IDS if documents else None, causal_in_block=True)
    for rank in range(topology.local):
        layout = rank_layout(topology, rank, seq_len, block, window=window, documents=docs)
        rows = layout.rows
        logical = rows.pos + rows.clean.long() * seq_len
        expected = int(allow[logical[rows.live]].sum())
        assert measured_pairs(rows, block_size=block, causal_in_block=True) == expected, rank
        if not documents:
            got = allowed_pairs(rows.pos, rows.clean, rows.ctx_start, rows.ctx_stop, rows.live, block_size=block,
                                causal_in_block=True)
            assert got == expected, rank


def test_bd3_bounds_are_the_masks_clean_intervals():
    """Each row's clean interval ``[start, stop)`` from ``bd3_bounds`` is exactly the clean keys the
    mask allows it (windowed and not), row by row."""
    seq_len, block = 24, 4
    positions = np.arange(seq_len)
    for window in (None, 1, 3, 4, 9, 30):
        allow = _bd3_dense(seq_len, block, window, None)[:, seq_len:]
        n_start, n_stop, c_start, c_stop = bd3_bounds(positions, positions, block_size=block, window=window)
        for p in range(seq_len):
            for query, (start, stop) in ((p, (n_start[p], n_stop[p])), (seq_len + p, (c_start[p], c_stop[p]))):
                keys = torch.nonzero(allow[query]).flatten().tolist()
                assert keys == list(range(start, max(start, stop))), (window, query)


def test_anchors_are_dealt_in_pairs_from_two_per_owner():
    """``deal_order``'s rule: with ``N >= 2·owners`` anchors the cheapest is paired with the most
    expensive and the pairs go round-robin; ``N = 2·owners`` is already paired (dealing the sorted
    anchors singly would give one owner both cheap and the other both expensive ones)."""
    costs = [5, 1, 4, 2]  # by cost: anchors 1, 3, 2, 0
    assert [a.tolist() for a in deal_order(costs, 2)] == [[0, 1], [2, 3]]  # pairs (1, 0) and (3, 2)
    assert [a.tolist() for a in deal_order(costs, 3)] == [[0, 1], [3], [2]]  # fewer than 2·owners: singly
    assert [a.tolist() for a in deal_order([7, 3, 9, 1, 5], 2)] == [[2, 3, 4], [0, 1]]  # (3, 2), (1, 0), (4)


def test_spread_anchors_sit_at_the_middle_of_equal_shares():
    """One 10-token document: positions 0..8 are valid (``a + 1`` in the row); 3 anchors take the
    middle of each third, ``int((i + 0.5)·9/3)`` = 1, 4, 7; a document ending at 4 leaves 3 invalid."""
    start, stop = np.zeros(10, dtype=np.int64), np.full(10, 10, dtype=np.int64)
    assert spread_anchors((start, stop), 3).tolist() == [1, 4, 7]
    assert spread_anchors((start, stop), 20).tolist() == list(range(9))
    start = np.array([0] * 4 + [4] * 6)
    stop = np.array([4] * 4 + [10] * 6)
    assert spread_anchors((start, stop), 8).tolist() == [0, 1, 2, 4, 5, 6, 7, 8]


@pytest.mark.parametrize("window", [None, 2, 3, 6])
@pytest.mark.parametrize("context", ["strict", "inclusive"])
def test_draft_context_pairs_are_the_dflash_masks(window, context):
    """``context_pairs(draft_intervals(...))`` equals the context keys ``dflash_mask`` allows a packet's
    rows, a window shorter than the block included (its late rows see no context at all)."""
    anchors = torch.tensor([0, 3, 9, 14, 20])
    doc_start = torch.tensor([0, 0, 6, 6, 17])
    block, context_len = 4, 24
    start, stop = draft_intervals(anchors.numpy(), doc_start.numpy(), block, context=context, window=window)
    stops = anchors + (1 if context == "inclusive" else 0)
    keep = torch.ones(len(anchors), dtype=torch.bool)
    rows, keys = len(anchors) * block, context_len + 1 + len(anchors) * block
    allow = dense_mask(dflash_mask(context_len + 1, block, stops, keep, doc_start=doc_start), rows, keys)
    allow = allow[:, : context_len + 1]
    if window is not None:  # the window counts from the anchor a, whatever the context's end
        q = torch.arange(len(anchors) * block)
        lowest = anchors[q // block] + q % block - (window - 1)
        allow = allow & (torch.arange(context_len + 1)[None, :] >= lowest[:, None])
    assert context_pairs(start, stop) == int(allow.sum())


@pytest.mark.multiprocess
def test_bench_attention_flops_per_rank_are_the_busiest_ranks_mask_pairs_in_every_layer():
    """``csbp bench attention``'s ``GFLOP/rank`` (and time per GFLOP): the allowed pairs of the rank with
    the most, counted on ``bd3_mask``, x heads x 14·d (forward 4·d, backward 10·d) x layers."""
    from csbp.bench.attention import run_attention_bench

    seq_len, block, heads, head_dim, layers = 32, 4, 2, 8, 3
    records = run_attention_bench([seq_len], nproc=2, layouts=["cp", "csbp"], block_size=block, repeats=1, warmup=0,
                                  num_heads=heads, num_kv_heads=1, head_dim=head_dim, num_layers=layers,
                                  timeout_s=240)
    allow = _bd3_dense(seq_len, block, None, None)
    for record in records:
        cp, bp = (2, 1) if record.layout == "cp" else (2, 2)
        busiest = 0
        for rank in range(2):
            noisy, clean, _ = layout_positions(seq_len, block, cp, bp, rank)
            busiest = max(busiest, int(allow[_logical(noisy, clean, seq_len)].sum()))
        assert record.attn_flops_per_rank == busiest * heads * 14 * head_dim * layers, record.layout


@pytest.mark.parametrize("name", ["ar", "mdlm"])
@pytest.mark.parametrize("documents", [False, True])
def test_single_stream_pairs_are_the_ar_and_mdlm_masks(name, documents):
    """``csbp plan`` prices AR (causal) and MDLM (bidirectional) rows by formula: the True entries of
    ``ar_mask`` / ``mdlm_mask``, over one document or within each of a row's documents."""
    from dataclasses import replace

    from csbp.masks.predicates import ar_mask, mdlm_mask
    from csbp.plan.documents import RowDocuments
    from csbp.plan.layout import Layout
    from csbp.plan.model import _counts
    from csbp.plan.workload import preset_workload

    seq_len = len(DOC_IDS)
    workload = preset_workload("nemotron-3b")
    workload = replace(workload, objective=replace(workload.objective, name=name, block=seq_len))
    if documents:
        workload = replace(workload, doc_length=RowDocuments(seq_len, (0, 5, 14, 17)))
    (counts,) = _counts(workload, Layout(1), seq_len, 0)
    mask = (ar_mask if name == "ar" else mdlm_mask)(seq_len, DOC_IDS if documents else None)
    assert counts.pairs == int(dense_mask(mask, seq_len, seq_len).sum())
