"""Document masking is exact in every layout (float64, 1e-9): loss and every gradient equal one
process on random packed documents that straddle block, shard and rank boundaries, one-token
documents and a document longer than the sequence; the ``cp-aware`` baseline too."""

from __future__ import annotations

import pytest

from csbp.engine.verify import VerifyCase, verify
from csbp.topology import Topology

CASES = [
    pytest.param(VerifyCase(Topology(dp=2), seq_len=16, doc_length=3), id="dp2"),
    pytest.param(VerifyCase(Topology(cp=2), seq_len=16, doc_length=3), id="cp2-generic"),
    pytest.param(VerifyCase(Topology(cp=2), seq_len=16, doc_length=3, transport="halo"), id="cp2-aware"),
    pytest.param(VerifyCase(Topology(cp=2), seq_len=16, transport="halo"), id="cp2-aware-one-document"),
    pytest.param(VerifyCase(Topology(bp=2, replicate_clean_prefix=True), seq_len=16, doc_length=3), id="bp2"),
    pytest.param(VerifyCase(Topology(cp=2, bp=2), seq_len=16, doc_length=3), id="csbp-cp2bp2"),
    pytest.param(VerifyCase(Topology(cp=2, bp=2), seq_len=16, doc_length=3, transport="streaming"),
                 id="csbp-cp2bp2-streaming"),
    pytest.param(VerifyCase(Topology(cp=2, bp=2), seq_len=16, doc_length=1), id="csbp-one-token-documents"),
    pytest.param(VerifyCase(Topology(cp=2, bp=2), seq_len=16, doc_length=1000), id="csbp-document-longer-than-L"),
    pytest.param(VerifyCase(Topology(cp=2, bp=4), doc_length=5, window=5), id="csbp-cp2bp4-window5"),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES)
def test_documents_equal_single_process(case: VerifyCase) -> None:
    result = verify(case, timeout_s=240)
    assert result.ok, (result.loss_rel_err, result.grad_rel_err, result.worst_param)


@pytest.mark.multiprocess
def test_document_traffic_is_counted_exactly() -> None:
    """CSBP with documents sends exactly its halo plan's rows (K and V of the rows it sends forward,
    dK and dV of the rows it received backward, every layer and sample), and less than its whole
    clean shard."""
    import torch

    from csbp.attention.documents import Documents
    from csbp.attention.layouts import halo_exchange_plan
    from csbp.engine.verify import corrupted_batch, tiny_model_config

    case = VerifyCase(Topology(cp=2, bp=2), seq_len=32, doc_length=4)
    result = verify(case, timeout_s=240)
    assert result.ok
    model = tiny_model_config()
    row_bytes = 2 * model.num_kv_heads * model.head_dim * torch.float64.itemsize  # K and V of one row
    doc_ids = corrupted_batch(case).doc_ids
    for rank, sent in enumerate(result.attention_bytes_per_rank):
        forward = backward = 0
        for sample in range(doc_ids.shape[0]):
            plan = halo_exchange_plan(32, 4, 2, 2, 0, documents=Documents.from_doc_ids(doc_ids[sample]))
            forward += sum(plan.send_counts(rank))
            backward += sum(plan.recv_counts(rank))
        assert sent == (forward + backward) * row_bytes * model.num_layers
        assert forward < doc_ids.shape[0] * 16  # below the whole 16-row shard per sample


@pytest.mark.multiprocess
def test_attention_bench_documents_side_by_side() -> None:
    """``csbp bench attention --doc-length``: cp-aware moves less than generic CP for the same FLOPs;
    CSBP moves less than both; FLOPs fall below the unmasked run. ``ablate_overlap`` also times the
    masked layouts with serialized collectives (the same bytes)."""
    from csbp.bench.attention import run_attention_bench

    common = {"nproc": 2, "block_size": 8, "repeats": 1, "warmup": 0}
    masked = {r.layout: r for r in run_attention_bench([128], layouts=["cp", "cp-aware", "csbp"], doc_length=16,
                                                       ablate_overlap=True, **common)}
    (unmasked,) = run_attention_bench([128], layouts=["csbp"], **common)
    assert unmasked.serialized_step_time_s is None and unmasked.overlap_ratio is None
    for r in masked.values():
        assert r.serialized_step_time_s is not None and r.serialized_step_time_s > 0
        assert r.overlap_ratio == pytest.approx(r.step_time_s / r.serialized_step_time_s)
    assert masked["cp-aware"].attn_flops_per_rank == masked["cp"].attn_flops_per_rank
    assert masked["csbp"].kv_bytes_per_rank < masked["cp-aware"].kv_bytes_per_rank < masked["cp"].kv_bytes_per_rank
    assert masked["csbp"].transport == "halo" and masked["cp-aware"].transport == "halo"
    assert masked["csbp"].attn_flops_per_rank < 0.5 * unmasked.attn_flops_per_rank
