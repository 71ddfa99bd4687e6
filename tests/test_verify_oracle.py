"""``csbp verify``'s reference is the dense predicate oracle (``csbp.engine.oracle``), not the tiled
kernels it checks: ``csbp verify --nproc 1`` once compared the one-process layout with itself."""

from __future__ import annotations

import pytest
import torch

import csbp.attention.transports.local as local
from csbp.attention.documents import Documents, packed_doc_ids, random_documents
from csbp.attention.rows import allow_matrix
from csbp.engine.block_diffusion import build_rank_plan
from csbp.engine.context import single_process_context
from csbp.engine.oracle import DenseAttention, oracle_allow
from csbp.engine.verify import VerifyCase, _forward_backward, compare, reference
from csbp.topology import Topology


def _one_process_result(case: VerifyCase) -> bool:
    loss_ref, grads_ref = reference(case)
    loss, grads = _forward_backward(case, single_process_context(), num_replicas=1)
    return compare(case, [(loss, grads, 0)], loss_ref, grads_ref).ok


@pytest.mark.parametrize("doc_length", [None, 6])
def test_the_one_process_check_fails_when_the_tiled_kernels_are_wrong(
    doc_length: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = VerifyCase(Topology(), doc_length=doc_length)
    assert _one_process_result(case)
    original = local.LocalAttentionFn.__call__

    def off_by_a_thousandth(self, q, k, v, layer_index=0):  # noqa: ANN001, ANN202
        return original(self, q, k, v, layer_index) * 1.001

    monkeypatch.setattr(local.LocalAttentionFn, "__call__", off_by_a_thousandth)
    assert not _one_process_result(case), "the reference ran the sabotaged kernel: a check that cannot fail"


@pytest.mark.parametrize(("window", "doc_length"), [(None, None), (6, None), (None, 5), (7, 5)])
def test_the_oracle_mask_equals_the_runtime_rows_predicate(window: int | None, doc_length: int | None) -> None:
    seq_len, block = 32, 4
    doc_ids = None
    documents = None
    if doc_length is not None:
        doc_ids = packed_doc_ids(random_documents(seq_len, doc_length, torch.Generator().manual_seed(3)))
        documents = Documents.from_doc_ids(doc_ids)
    plan = build_rank_plan(single_process_context(), seq_len, block, window=window, documents=documents)
    allow = oracle_allow(plan, seq_len=seq_len, block_size=block, window=window, doc_ids=doc_ids, single_stream=False)
    assert torch.equal(allow, allow_matrix(plan.rows, plan.rows))


def test_dense_attention_gives_zeros_to_a_row_that_sees_nothing() -> None:
    allow = torch.tensor([[True, False], [False, False]])
    q, k, v = (torch.randn(1, 2, 2, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    out = DenseAttention(allow)(q, k, v)
    assert torch.equal(out[:, :, 1], torch.zeros_like(out[:, :, 1]))
    assert torch.allclose(out[:, :, 0], v[:, :, 0])
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
