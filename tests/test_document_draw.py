"""The NumPy draw of ``--doc-length`` documents (``csbp.attention.document_draw``) is
``torch.rand``'s bit for bit, so ``csbp plan`` prices the benchmarks' documents without torch
(``tests/test_plan_artifact_documents.py`` checks that it imports none)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from csbp.attention.document_draw import random_document_bounds, random_document_starts
from csbp.attention.documents import random_documents, seeded_documents


@pytest.mark.parametrize("seed", [0, 1, 7 * 1009 + 3, 2**32 + 5])
@pytest.mark.parametrize("mean", [1, 2, 25, 256, 8192])  # 1/25 rounds down in float32: compared as float32
def test_numpy_draw_is_torch_rand(seed: int, mean: int) -> None:
    seq_len = 20_000
    expected = torch.rand(seq_len, generator=torch.Generator().manual_seed(seed)) < 1.0 / mean
    expected[0] = True
    assert np.array_equal(random_document_starts(seq_len, mean, seed), expected.numpy())
    docs = random_documents(seq_len, mean, torch.Generator().manual_seed(seed))
    start, stop = random_document_bounds(seq_len, mean, seed)
    assert np.array_equal(start, docs.start.numpy()) and np.array_equal(stop, docs.stop.numpy())
    seeded = seeded_documents(seq_len, mean, seed)
    assert torch.equal(seeded.start, docs.start) and torch.equal(seeded.stop, docs.stop)


def test_bad_draws_fail_closed() -> None:
    with pytest.raises(ValueError, match="mean document length"):
        random_document_starts(10, 0, 0)
    with pytest.raises(ValueError, match="seed"):
        random_document_starts(10, 4, -1)
