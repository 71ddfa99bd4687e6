"""Streaming ring transport (csbp.md §10): reference equality, agreement with the collective
transport, byte identities, and the row-skipping predicate. Harness: ``test_transports_collective``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from csbp.attention.layouts import bd3_rows, cp_zigzag_layout, csbp_layout, ring_clean_positions
from csbp.attention.rows import allow_matrix
from csbp.attention.transports.exchange import padded_rows, queries_touching
from test_transports_collective import (
    TransportCase,
    assert_matches_reference,
    backward_bytes,
    case_id,
    cases_with,
    collective_bytes_expected,
    forward_bytes,
    results_of,
)

STREAMING_CASES = cases_with(transport="streaming")


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", STREAMING_CASES, ids=case_id)
def test_streaming_matches_reference(case: TransportCase) -> None:
    assert_matches_reference(case, results_of(case))


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", STREAMING_CASES, ids=case_id)
def test_streaming_equals_collective(case: TransportCase) -> None:
    collective = results_of(replace(case, transport="collective"))
    for rank, (ring, gathered) in enumerate(zip(results_of(case), collective)):
        for name in ("out", "dq", "dk", "dv"):
            torch.testing.assert_close(ring[name], gathered[name], **case.tolerance, msg=f"rank {rank} {name}")


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", STREAMING_CASES, ids=case_id)
def test_streaming_byte_identities(case: TransportCase) -> None:
    """Forward K/V and backward dK/dV bytes equal the collective transport's (csbp.md §12); the
    re-circulated K/V of the backward is counted apart, one forward's worth."""
    expected = collective_bytes_expected(case)
    for rank, result in enumerate(results_of(case)):
        assert forward_bytes(result) == expected, f"rank {rank} forward"
        assert backward_bytes(result) == collective_bytes_expected(case, gradients=True), f"rank {rank} dK/dV"
        assert backward_bytes(result, "attention_recompute") == expected, f"rank {rank} re-circulated K/V"
        hops = result["traffic"]["attention"]["calls"]
        assert hops == 2 * (case.cp - 1), f"rank {rank}: P-1 forward hops and P-1 dK/dV hops"


@pytest.mark.parametrize(
    "layout, member_rows",
    [
        (csbp_layout(32, 2, 2, 4, 0), bd3_rows(torch.zeros(0, dtype=torch.long), ring_clean_positions(32, 2)[1],
                                                block_size=2)),
        (csbp_layout(32, 2, 4, 4, 0, window=3), bd3_rows(torch.zeros(0, dtype=torch.long),
                                                          ring_clean_positions(32, 4)[1], block_size=2)),
        (cp_zigzag_layout(32, 4, 2, 1), cp_zigzag_layout(32, 4, 2, 0).rows),
    ],
    ids=["csbp", "csbp-window", "cp-only"],
)
def test_row_skipping_keeps_exactly_the_rows_that_see_the_owner(layout, member_rows) -> None:
    """``queries_touching`` selects exactly the query rows with an allowed key in the owner's shard
    (padding rows are invisible)."""
    keys = padded_rows(member_rows, len(member_rows) + 3)
    expected = torch.nonzero(allow_matrix(layout.rows, keys).any(1)).flatten()
    selected = queries_touching(layout.rows, keys)
    assert torch.equal(selected, expected)
    assert 0 < len(selected) < len(layout.rows), "the case must skip some rows and keep some"
