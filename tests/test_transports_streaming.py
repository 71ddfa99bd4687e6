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


def _streaming_rank_results(
    monkeypatch: pytest.MonkeyPatch, sliced_runs: int,
) -> tuple[list[list[torch.Tensor]], list[int]]:
    """Out and dq/dk/dv (bf16, tiles) of every rank of a CP-only and a CSBP ring over packed short
    documents through ``LocalRing`` (every member's shard a copy of this rank's), with ``SLICED_RUNS =
    sliced_runs``; and the number of runs of query rows of every step."""
    from csbp.attention.documents import seeded_documents
    from csbp.attention.layouts import rank_layout
    from csbp.attention.transports import streaming
    from csbp.attention.transports.factory import build_attention
    from csbp.bench.kernel_ranks import LocalRing
    from csbp.topology import Topology

    monkeypatch.setattr(streaming, "SLICED_RUNS", sliced_runs)
    documents, results, runs = seeded_documents(128, 6, seed=0), [], []
    for cp, bp in ((4, 1), (2, 4)):
        topology = Topology(cp=cp, bp=bp)
        for rank in range(max(cp, bp)):
            layout = rank_layout(topology, rank, 128, 4, documents=documents)
            attention = build_attention(
                topology, rank, layout, LocalRing(cp, rank % cp), block_size=4, backend="tiles", transport="streaming",
                device=torch.device("cpu"),
            )
            gen = torch.Generator().manual_seed(rank)
            q, k, v, dout = (torch.randn(1, h, len(layout.rows), 8, generator=gen).to(torch.bfloat16) for h in (4, 2, 2, 4))
            leaves = [x.requires_grad_() for x in (q, k, v)]
            out = attention(*leaves)
            out.backward(dout)
            results.append([out.detach()] + [leaf.grad for leaf in leaves])
            runs.extend(len(step.runs) for step in attention._plans.get(torch.device("cpu")).steps)
    return results, runs


def test_steps_merge_the_same_bits_run_by_run_and_gathered(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's query rows merged and added run by run into slices of the packed rows (one run a view,
    no gather) and gathered by index give the same bits, over packed documents that cut them into one
    to many runs."""
    by_runs, runs = _streaming_rank_results(monkeypatch, sliced_runs=1_000)
    assert {1, 2} <= set(runs) and max(runs) > 4, runs  # views, a few slices, and many runs
    for sliced_runs in (0, 4):
        for rank, (got, want) in enumerate(zip(_streaming_rank_results(monkeypatch, sliced_runs)[0], by_runs)):
            for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
                assert torch.equal(a, b), f"SLICED_RUNS={sliced_runs}, result {rank}: {name} differs"
