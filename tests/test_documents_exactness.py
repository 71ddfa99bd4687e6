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
    pytest.param(VerifyCase(Topology(cp=2, bp=2), seq_len=16, doc_length=1), id="csbp-one-token-documents"),
    pytest.param(VerifyCase(Topology(cp=2, bp=2), seq_len=16, doc_length=1000), id="csbp-document-longer-than-L"),
    pytest.param(VerifyCase(Topology(cp=2, bp=4), doc_length=5, window=5), id="csbp-cp2bp4-window5"),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES)
def test_documents_equal_single_process(case: VerifyCase) -> None:
    result = verify(case, timeout_s=240)
    assert result.ok, (result.loss_rel_err, result.grad_rel_err, result.worst_param)
