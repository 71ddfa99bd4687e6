"""Sliding-window CSBP transport (csbp.md §11, §18 item 5): reference equality with a window smaller
than the clean shard, halo-only traffic, and the plan/layout consistency checks.
Harness: ``test_transports_collective``.
"""

from __future__ import annotations

import pytest
import torch

from csbp.attention.layouts import bd3_rows, csbp_layout, window_exchange_plan
from csbp.attention.transports.factory import build_attention
from csbp.attention.transports.window import WindowAttention, build_window_exchange
from csbp.parallel.comm import Comm
from csbp.topology import Topology
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

WINDOW_CASES = [case for case in cases_with(transport="collective") if case.window is not None]


def _halo_bytes(case: TransportCase, local_rank: int) -> tuple[int, int]:
    """Bytes of the clean K/V rows ``local_rank`` sends to the other ring members (forward) and of
    the dK/dV rows it returns for the rows it received (backward)."""
    plan = window_exchange_plan(
        case.seq_len, case.block_size, case.cp, case.bp, local_rank // case.cp, case.window, case.schedule
    )
    me = local_rank % case.cp
    sent = sum(n for dest, n in enumerate(plan.send_counts(me)) if dest != me)
    received = sum(n for source, n in enumerate(plan.recv_counts(me)) if source != me)
    return sent * case.kv_row_bytes, received * case.grad_row_bytes


def test_window_cases_cover_the_required_topologies() -> None:
    assert {(c.cp, c.bp) for c in WINDOW_CASES} >= {(2, 2), (2, 4)}
    assert all(c.window < c.seq_len // c.cp for c in WINDOW_CASES), "window smaller than the clean shard"


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", WINDOW_CASES, ids=case_id)
def test_window_matches_reference(case: TransportCase) -> None:
    assert_matches_reference(case, results_of(case))


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", WINDOW_CASES, ids=case_id)
def test_window_moves_only_the_halo(case: TransportCase) -> None:
    """Forward bytes are the halo rows a rank sends, backward bytes the dK/dV of the halo rows it
    received, and both are strictly below the full-attention collective transport's bytes."""
    full_attention = collective_bytes_expected(case)
    results = results_of(case)
    for rank, result in enumerate(results):
        sent, received = _halo_bytes(case, rank)
        assert forward_bytes(result) == sent, f"rank {rank} forward"
        assert backward_bytes(result) == received, f"rank {rank} backward"
        assert sent < full_attention, f"rank {rank}: windowed traffic must be below the collective's"
        assert received < collective_bytes_expected(case, gradients=True), f"rank {rank}: dK/dV as well"
    assert sum(forward_bytes(r) for r in results) > 0, "the window case must exchange something"


def test_window_plan_must_serve_the_layout() -> None:
    """A layout without the window, or built with another schedule, is rejected before any traffic."""
    plan = window_exchange_plan(32, 2, 2, 4, 0, 3)
    with pytest.raises(ValueError, match="does not deliver"):
        WindowAttention(csbp_layout(32, 2, 2, 4, 0), plan, 0, Comm(None))  # full-attention rows
    with pytest.raises(ValueError, match="does not deliver"):
        build_attention(
            Topology(cp=2, bp=4), 3, csbp_layout(32, 2, 2, 4, 3, schedule="contiguous", window=3), None,
            block_size=2, window=3,
        )  # the factory's default schedule is dual_end
    with pytest.raises(ValueError, match="clean shard"):
        WindowAttention(csbp_layout(32, 2, 2, 4, 1, window=3), plan, 0, Comm(None))  # another member's rows
    with pytest.raises(ValueError, match="ring"):
        WindowAttention(csbp_layout(32, 2, 2, 4, 0, window=3), plan, 0, Comm(None))  # not the ring comm



def test_window_exchange_sorts_the_halo_and_returns_gradients_source_major() -> None:
    """The received rows (source-major on the wire) are kept sorted by position, and their gradients
    go back in wire order: ``recv_inverse`` undoes ``recv_order``. The CP-only zigzag with W=5 receives
    from several sources out of position order, where that permutation is not its own inverse."""
    plan = window_exchange_plan(32, 2, 4, 1, 0, 5)
    empty = torch.zeros(0, dtype=torch.long)
    scrambled = 0
    for ring_rank in range(plan.cp):
        exchange = build_window_exchange(
            plan, ring_rank, lambda positions: bd3_rows(empty, positions, block_size=2), torch.device("cpu")
        )
        wire = plan.recv_positions(ring_rank)
        halo = exchange.halo_rows.pos
        assert torch.equal(halo, torch.sort(wire).values)
        assert torch.equal(halo.index_select(0, exchange.recv_inverse), wire)  # gradients back in wire order
        scrambled += not torch.equal(exchange.recv_order, exchange.recv_inverse)
    assert scrambled > 0, "the case must receive rows out of order"
