"""Document masking (docs/document-masking.md): predicates and golden matrices, the interval rows of
every layout against the predicate, and work and traffic that follow the mask.

Documents used: ones that straddle block, zigzag-shard and rank boundaries, one-token documents,
and a single document longer than the sequence (cut at its end).
"""

from __future__ import annotations

import pytest
import torch

from csbp.attention.documents import Documents, packed_doc_ids, random_documents
from csbp.attention.layouts import bd3_rows, halo_exchange_plan, rank_layout, reference_layout
from csbp.attention.rows import Rows, allow_matrix
from csbp.attention.tile_plan import build_tile_plan
from csbp.masks import ar_mask, bd3_mask, dense_mask, mdlm_mask
from csbp.topology import Topology


def _matrix(text: str) -> torch.Tensor:
    return torch.tensor([[c == "1" for c in line] for line in text.split()], dtype=torch.bool)


# L=4, B=2, documents {0} and {1, 2, 3}: block 0 straddles the boundary and is split by it.
GOLDEN_BD3_DOCS = """
10000000
01000000
00110100
00110100
00001000
00000100
00000111
00000111
"""


def test_bd3_golden_with_documents():
    doc_ids = torch.tensor([0, 1, 1, 1])
    assert torch.equal(dense_mask(bd3_mask(4, 2, doc_ids=doc_ids), 8, 8), _matrix(GOLDEN_BD3_DOCS))
    rows = reference_layout(4, 2, documents=Documents.from_doc_ids(doc_ids)).rows
    assert torch.equal(allow_matrix(rows, rows), _matrix(GOLDEN_BD3_DOCS))


def test_ar_and_mdlm_golden_with_documents():
    doc_ids = torch.tensor([5, 5, 7, 7, 5])  # a reused id after another document is a new document
    ar = _matrix("10000 11000 00100 00110 00001")
    mdlm = _matrix("11000 11000 00110 00110 00001")
    assert torch.equal(dense_mask(ar_mask(5, doc_ids), 5, 5), ar)
    assert torch.equal(dense_mask(mdlm_mask(5, doc_ids), 5, 5), mdlm)
    assert torch.equal(dense_mask(ar_mask(3), 3, 3), torch.ones(3, 3, dtype=torch.bool).tril())


def test_documents_spans_and_segments():
    docs = Documents.from_lengths([1, 4, 1, 2])
    assert docs.start.tolist() == [0, 1, 1, 1, 1, 5, 6, 6]
    assert docs.stop.tolist() == [1, 5, 5, 5, 5, 6, 8, 8]
    assert docs.num_documents == 4
    assert docs.segment_ids(4).tolist() == [0, 1, 1, 1, 2, 3, 4, 4]
    assert Documents.from_lengths([8]).segment_ids(4).tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert packed_doc_ids(docs).tolist() == [0, 1, 1, 1, 1, 2, 3, 3]
    with pytest.raises(ValueError, match="positive ints"):
        Documents.from_lengths([2, 0])


def test_documents_from_doc_ids_start_at_every_id_change() -> None:
    """A document starts wherever the id changes, also to a smaller id: a reused id after another
    document, and the padding id -1 after a document (its own, never merged into the one before)."""
    docs = Documents.from_doc_ids(torch.tensor([5, 5, 7, 7, 5, 3, -1, -1]))
    assert docs.start.tolist() == [0, 0, 2, 2, 4, 5, 6, 6]
    assert docs.stop.tolist() == [2, 2, 4, 4, 5, 6, 8, 8]
    assert docs.num_documents == 5


def _document_cases():
    """(seq_len, documents): straddling, one-token, and one document longer than the sequence."""
    yield 32, Documents.from_lengths([3, 1, 1, 9, 2, 7, 1, 8])
    yield 32, Documents.from_lengths([32])  # the rest of a longer document, cut at L
    yield 24, random_documents(24, 3, torch.Generator().manual_seed(3))


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("seq_len, documents", list(_document_cases()))
def test_reference_rows_equal_predicate(seq_len, documents, window):
    doc_ids = packed_doc_ids(documents)
    rows = reference_layout(seq_len, 4, window, documents).rows
    expected = dense_mask(bd3_mask(seq_len, 4, window, doc_ids), 2 * seq_len, 2 * seq_len)
    assert torch.equal(allow_matrix(rows, rows), expected)


LAYOUTS = [Topology(cp=2), Topology(cp=4), Topology(bp=4, replicate_clean_prefix=True), Topology(cp=2, bp=2),
           Topology(cp=2, bp=4)]


def _reference_index(rows: Rows, seq_len: int) -> torch.Tensor:
    return rows.pos + seq_len * rows.clean.long()


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("topology", LAYOUTS)
@pytest.mark.parametrize("seq_len, documents", list(_document_cases())[:2])
def test_layout_rows_and_exchange_follow_documents(topology, seq_len, documents, window):
    """Each rank's rows x (own rows + what the exchange delivers) reproduce the reference mask, and
    no allowed key is missing: the halo plan is exact for CP-only (cp-aware) and CSBP."""
    block = 4
    reference = reference_layout(seq_len, block, window, documents).rows
    dense = allow_matrix(reference, reference)
    layouts = [rank_layout(topology, r, seq_len, block, window=window, documents=documents)
               for r in range(topology.local)]
    for local_rank, layout in enumerate(layouts):
        keys = layout.rows
        if topology.cp > 1:
            plan = halo_exchange_plan(seq_len, block, topology.cp, topology.bp, local_rank // topology.cp,
                                      window=window, documents=documents)
            received = plan.recv_positions(local_rank % topology.cp)
            keys = Rows.cat([keys, bd3_rows(received[:0], received, block_size=block)])
        queries = _reference_index(layout.rows, seq_len)
        held = _reference_index(keys, seq_len)
        assert len(set(held.tolist())) == len(keys)
        for name in ("pos", "clean", "block", "ctx_start", "ctx_stop"):
            assert torch.equal(getattr(layout.rows, name), getattr(reference, name)[queries]), name
        assert torch.equal(allow_matrix(layout.rows, keys), dense[queries][:, held])
        missing = torch.ones(2 * seq_len, dtype=torch.bool)
        missing[held] = False
        assert not dense[queries][:, missing].any()


def test_bp_only_recomputes_only_the_document_prefix():
    documents = Documents.from_lengths([10, 6, 16])
    layout = rank_layout(Topology(bp=2, replicate_clean_prefix=True), 1, 32, 4, documents=documents)
    # dual-end: rank 1 owns blocks 2-5; block 2 straddles documents 0 and 1
    assert layout.owned_blocks == (2, 3, 4, 5)
    assert layout.clean_positions.tolist() == list(range(0, 8)) + [10, 11] + list(range(16, 20))
    assert len(rank_layout(Topology(bp=2, replicate_clean_prefix=True), 1, 32, 4).clean_positions) == 20


def test_exchange_and_tiles_follow_short_documents():
    """Bytes: with short documents CSBP's halo is a small part of the other shards; FLOPs: the tile
    plan's candidate pairs fall with the allowed pairs."""
    seq_len, block = 512, 16
    documents = random_documents(seq_len, 32, torch.Generator().manual_seed(0))
    plan = halo_exchange_plan(seq_len, block, 4, 4, 0, documents=documents)
    received = sum(sum(plan.recv_counts(d)) for d in range(4))
    assert received < 0.15 * (4 * 3 * seq_len // 4)
    full = halo_exchange_plan(seq_len, block, 4, 1, 0)  # cp-aware without documents
    assert sum(sum(full.recv_counts(d)) for d in range(4)) < 4 * 3 * seq_len // 4  # below an all-gather
    rows_docs = reference_layout(seq_len, block, documents=documents).rows
    rows_full = reference_layout(seq_len, block).rows
    pairs_docs = build_tile_plan(rows_docs, rows_docs, tile_rows=16).num_candidate_pairs
    pairs_full = build_tile_plan(rows_full, rows_full, tile_rows=16).num_candidate_pairs
    allowed_docs = int(allow_matrix(rows_docs, rows_docs).sum())
    assert pairs_docs < 0.2 * pairs_full
    assert pairs_docs < 4 * allowed_docs


def test_engine_with_documents_equals_dense_predicate():
    """One process: the engine's per-sample document plan gives the hidden states of the decoder
    under the dense ``bd3_mask(doc_ids=...)``, and they differ from the unmasked ones."""
    from csbp.engine.block_diffusion import DocumentPlanner, build_rank_plan, rank_inputs
    from csbp.engine.context import single_process_context
    from csbp.engine.verify import VerifyCase, corrupted_batch, tiny_model_config
    from csbp.models.attention_fns import DenseMaskAttention
    from csbp.models.decoder import Decoder

    case = VerifyCase(Topology(), seq_len=16, samples=1, doc_length=3)
    batch = corrupted_batch(case)
    model = Decoder(tiny_model_config(), dtype=torch.float64, seed=0)
    ctx = single_process_context()
    (plan,) = DocumentPlanner(ctx, 16, 4).plans_for(batch.doc_ids)
    ids, positions = rank_inputs(batch, plan)
    hidden = model(ids, positions, plan.attention)
    mask = dense_mask(bd3_mask(16, 4, doc_ids=batch.doc_ids[0]), 32, 32)
    assert torch.allclose(hidden, model(ids, positions, DenseMaskAttention(mask)), atol=1e-12, rtol=0)
    unmasked = model(ids, positions, build_rank_plan(ctx, 16, 4).attention)
    assert not torch.allclose(hidden, unmasked)


def test_reset_positions_restart_rope_at_documents():
    from csbp.engine.block_diffusion import build_rank_plan
    from csbp.engine.context import single_process_context

    documents = Documents.from_lengths([3, 5])
    plan = build_rank_plan(single_process_context(), 8, 4, documents=documents, reset_positions=True)
    assert plan.rope_positions.tolist() == [0, 1, 2, 0, 1, 2, 3, 4] * 2
    assert plan.rows.pos.tolist() == list(range(8)) * 2


def test_document_mask_config_defaults_rules_and_explanation():
    from csbp.cli.config_cmd import summary_rows
    from csbp.config.loading import ConfigError
    from csbp.recipes import load_run_config

    assert load_run_config("demo").document_mask is False
    assert load_run_config("fast-dllm-v2-demo").document_mask is True
    assert load_run_config("mdlm-demo").document_mask is False  # unset: the mdlm default
    assert load_run_config("dflash-demo").document_mask is True
    explained = dict(summary_rows(load_run_config("mdlm-demo")))["documents"]
    assert "not masked" in explained and "default for mdlm" in explained
    on = dict(summary_rows(load_run_config("demo", ["data.document_mask=true", "data.reset_positions=true"])))
    assert on["documents"].startswith("masked") and "restart" in on["documents"]
    with pytest.raises(ConfigError, match="data.reset_positions"):
        load_run_config("demo", ["data.reset_positions=true"])
    with pytest.raises(ConfigError, match="data.document_mask"):
        load_run_config("dflash-demo", ["data.document_mask=false"])


def test_data_stats_document_pieces_and_mask_share():
    import numpy as np

    from csbp.data.report import _piece_lengths, format_length_summary

    doc_ids = np.array([[0, 0, 0, 1], [1, 1, -1, -1]])  # document 1 is cut into two rows; padding skipped
    pieces = _piece_lengths(doc_ids)
    assert sorted(pieces.tolist()) == [1, 2, 3]
    lines = format_length_summary(pieces, seq_len=4, num_rows=2)
    assert "mean 2.0, median 2, p90 3, max 3" in lines[0]
    assert "43.75%" in lines[1]  # (9 + 1 + 4) / (2 * 16)


@pytest.mark.parametrize("causal", [False, True], ids=["mdlm", "ar"])
def test_single_stream_plans_follow_documents(causal):
    from csbp.engine.block_diffusion import build_rank_plan
    from csbp.engine.context import single_process_context

    documents = Documents.from_lengths([3, 1, 4])
    plan = build_rank_plan(single_process_context(), 8, 8 if not causal else 1, uses_clean_stream=False,
                           causal=causal, documents=documents)
    doc_ids = packed_doc_ids(documents)
    expected = dense_mask((ar_mask if causal else mdlm_mask)(8, doc_ids), 8, 8)
    assert torch.equal(allow_matrix(plan.rows, plan.rows, causal_in_block=causal), expected)


def test_verify_doc_length_fails_closed(capsys: pytest.CaptureFixture[str]) -> None:
    """``--doc-length 0`` is refused while parsing, for the BD3 and the DFlash verify alike."""
    from csbp.cli.main import main

    for extra in ([], ["--objective", "dflash"]):
        assert main(["verify", "--nproc", "2", "--doc-length", "0", *extra]) == 2
        assert "argument --doc-length: 0 must be >= 1" in capsys.readouterr().err
