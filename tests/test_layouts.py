"""Per-rank row layouts (csbp.md §5, §8) checked against the single-rank reference mask.

For every layout, rank and window: the rank's rows carry exactly the reference metadata of the
same logical rows; its (query rows x keys it holds or gathers) allow-matrix equals the matching
sub-matrix of the dense ``2L x 2L`` reference; and no reference-allowed key lies outside that key
set. Window-exchange plans are checked the same way with only the exchanged halo rows.
"""

from __future__ import annotations

import pytest
import torch

from csbp.attention.layouts import (
    RankLayout,
    bd3_rows,
    bp_only_layout,
    cp_zigzag_layout,
    csbp_layout,
    rank_layout,
    reference_layout,
    ring_clean_positions,
    window_exchange_plan,
)
from csbp.attention.rows import Rows, allow_matrix
from csbp.topology import Topology

GOLDEN_L6_B2 = """
11..........
11..........
..11..11....
..11..11....
....111111..
....111111..
......11....
......11....
......1111..
......1111..
......111111
......111111
"""

FIELDS = ("pos", "clean", "block", "ctx_start", "ctx_stop", "live")


def _reference_index(rows: Rows, seq_len: int) -> torch.Tensor:
    """Index of each row in ``reference_layout`` order (noisy 0..L-1, then clean 0..L-1)."""
    return rows.pos + seq_len * rows.clean.long()


def _noisy_part(layout: RankLayout) -> Rows:
    return layout.rows.select(slice(0, layout.num_noisy))


def _clean_part(layout: RankLayout) -> Rows:
    return layout.rows.select(slice(layout.num_noisy, len(layout.rows)))


def _assert_matches_reference(queries: Rows, keys: Rows, seq_len: int, block_size: int, window) -> None:
    reference = reference_layout(seq_len, block_size, window).rows
    dense = allow_matrix(reference, reference)  # [2L, 2L]
    query_index = _reference_index(queries, seq_len)
    key_index = _reference_index(keys, seq_len)
    assert len(set(key_index.tolist())) == len(keys), "a key row is held twice"
    for name in FIELDS:
        assert torch.equal(getattr(queries, name), getattr(reference, name)[query_index]), name
    assert torch.equal(allow_matrix(queries, keys), dense[query_index][:, key_index])
    missing = torch.ones(2 * seq_len, dtype=torch.bool)
    missing[key_index] = False
    assert not dense[query_index][:, missing].any(), "an allowed key is not available on the rank"


def test_reference_mask_golden_l6_b2():
    """The BD3 rows reproduce csbp.md §3.1's golden matrix."""
    rows = reference_layout(6, 2).rows
    expected = torch.tensor([[c == "1" for c in line] for line in GOLDEN_L6_B2.split()])
    assert torch.equal(allow_matrix(rows, rows), expected)
    assert int(expected.sum()) == 6 * 2 + 6 * 6  # L*B + L^2 allowed pairs


@pytest.mark.parametrize("seq_len, block_size, window", [(12, 3, 1), (12, 3, 4), (16, 4, 6), (8, 2, 100)])
def test_reference_windowed_bounds(seq_len, block_size, window):
    """Windowed reference rows against csbp.md §3.3 written out per (query, key) pair."""
    rows = reference_layout(seq_len, block_size, window).rows
    got = allow_matrix(rows, rows)
    for qi in range(2 * seq_len):
        q_clean, p = qi >= seq_len, qi % seq_len
        start = (p // block_size) * block_size
        for ki in range(2 * seq_len):
            k_clean, k = ki >= seq_len, ki % seq_len
            if q_clean:
                allowed = k_clean and max(0, p + 1 - window) <= k < p + 1
            elif k_clean:
                allowed = max(0, start - (window - 1)) <= k < start
            else:
                allowed = k // block_size == p // block_size
            assert bool(got[qi, ki]) == allowed, (qi, ki)


def test_bd3_rows_packing_and_window_validation():
    rows = bd3_rows(torch.tensor([6, 7]), torch.tensor([0, 5]), block_size=2, window=3)
    assert rows.pos.tolist() == [6, 7, 0, 5]
    assert rows.clean.tolist() == [False, False, True, True]
    assert rows.block.tolist() == [3, 3, 0, 2]
    assert rows.ctx_start.tolist() == [4, 4, 0, 3]
    assert rows.ctx_stop.tolist() == [6, 6, 1, 6]
    assert rows.live.all()
    with pytest.raises(ValueError, match="window must be None"):
        bd3_rows(torch.tensor([0]), torch.tensor([0]), block_size=2, window=0)


def test_bp_only_golden():
    """csbp.md §5.3: L=32, B=1, BP=4."""
    rank0 = bp_only_layout(32, 1, 4, 0)
    assert rank0.noisy_positions.tolist() == [0, 1, 2, 3, 28, 29, 30, 31]
    assert rank0.owned_blocks == (0, 1, 2, 3, 28, 29, 30, 31)
    assert rank0.clean_positions.tolist() == list(range(31))
    assert bp_only_layout(32, 1, 4, 1).num_clean == 27


def test_cp_zigzag_golden():
    rank0, rank1 = (cp_zigzag_layout(16, 2, 2, r) for r in range(2))
    assert rank0.noisy_positions.tolist() == list(range(8))
    assert rank0.clean_positions.tolist() == list(range(8, 16))
    assert rank1.noisy_positions.tolist() == list(range(8, 16))
    assert rank1.clean_positions.tolist() == list(range(8))
    assert rank1.owned_blocks == (4, 5, 6, 7)


def test_csbp_golden():
    rank0 = csbp_layout(16, 2, 2, 2, 0)
    assert rank0.owned_blocks == (0, 1, 6, 7)
    assert rank0.noisy_positions.tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert rank0.clean_positions.tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    rank3 = csbp_layout(32, 2, 2, 4, 3)  # ring 1, cp_rank 1; dual-end N=16, P=4
    assert rank3.owned_blocks == (6, 7, 8, 9)
    assert rank3.clean_positions.tolist() == list(range(8, 24))
    assert [p.tolist() for p in ring_clean_positions(8, 2)] == [[0, 1, 6, 7], [2, 3, 4, 5]]


LAYOUT_CASES = [
    # (topology, seq_len, block_size)
    (Topology(), 8, 2),
    (Topology(cp=2), 16, 2),
    (Topology(cp=2), 16, 4),
    (Topology(cp=3), 24, 2),
    (Topology(cp=4), 32, 2),
    (Topology(bp=3, replicate_clean_prefix=True), 12, 2),
    (Topology(bp=4, replicate_clean_prefix=True), 32, 1),
    (Topology(cp=2, bp=2), 16, 2),
    (Topology(cp=2, bp=4), 32, 2),  # bp = 2*cp: two rings
    (Topology(cp=2, bp=4), 24, 2),
    (Topology(cp=3, bp=6), 24, 1),
    (Topology(cp=2, bp=6), 24, 2),
]


def _ring_keys(layouts: list[RankLayout], topology: Topology, local_rank: int) -> Rows:
    """Keys a rank attends over: its own noisy rows and the clean rows of its whole ring (its own
    rows only when nothing is exchanged)."""
    own = layouts[local_rank]
    if topology.layout in ("data", "bp"):
        return own.rows
    ring = local_rank // topology.cp
    members = range(ring * topology.cp, (ring + 1) * topology.cp)
    return Rows.cat([_noisy_part(own)] + [_clean_part(layouts[m]) for m in members])


@pytest.mark.parametrize("window", [None, 1, 3, 5])
@pytest.mark.parametrize("schedule", ["dual_end", "contiguous"])
@pytest.mark.parametrize("topology, seq_len, block_size", LAYOUT_CASES)
def test_layout_mask_equivalence(topology, seq_len, block_size, schedule, window):
    layouts = [
        rank_layout(topology, lr, seq_len, block_size, schedule=schedule, window=window)
        for lr in range(topology.local)
    ]
    for local_rank, layout in enumerate(layouts):
        keys = _ring_keys(layouts, topology, local_rank)
        _assert_matches_reference(layout.rows, keys, seq_len, block_size, window)


@pytest.mark.parametrize("schedule", ["dual_end", "contiguous"])
@pytest.mark.parametrize("topology, seq_len, block_size", LAYOUT_CASES)
def test_layout_ownership(topology, seq_len, block_size, schedule):
    """Noisy positions: each held by exactly one rank of the sample. Clean rows: a partition of
    [0, L) inside every ring (a replicated prefix in BP-only). Packing: [noisy ; clean]."""
    layouts = [
        rank_layout(topology, lr, seq_len, block_size, schedule=schedule) for lr in range(topology.local)
    ]
    all_noisy = torch.cat([layout.noisy_positions for layout in layouts])
    assert sorted(all_noisy.tolist()) == list(range(seq_len))
    for layout in layouts:
        noisy, clean = layout.noisy_positions.tolist(), layout.clean_positions.tolist()
        assert noisy == sorted(noisy) and clean == sorted(clean)
        assert layout.owned_blocks == tuple(sorted({p // block_size for p in noisy}))
        assert len(noisy) == block_size * len(layout.owned_blocks)
        assert layout.rows.pos.tolist() == noisy + clean
        assert layout.rows.clean.tolist() == [False] * len(noisy) + [True] * len(clean)
        if topology.layout == "bp":
            assert clean == list(range(max(layout.owned_blocks) * block_size))
    if topology.layout in ("cp", "csbp"):
        for ring in range(topology.num_rings):
            members = layouts[ring * topology.cp : (ring + 1) * topology.cp]
            ring_clean = torch.cat([m.clean_positions for m in members])
            assert sorted(ring_clean.tolist()) == list(range(seq_len))
    if topology.layout == "csbp":
        expected = ring_clean_positions(seq_len, topology.cp)
        for local_rank, layout in enumerate(layouts):
            assert torch.equal(layout.clean_positions, expected[local_rank % topology.cp])


def test_layout_rejections():
    with pytest.raises(ValueError, match="use cp_zigzag_layout"):
        csbp_layout(16, 2, 2, 1, 0)
    with pytest.raises(ValueError, match="bp must be a multiple of cp"):
        csbp_layout(24, 1, 3, 4, 0)
    with pytest.raises(ValueError, match=r"multiple of 2\*cp\*block_size"):
        csbp_layout(24, 4, 2, 2, 0)
    with pytest.raises(ValueError, match=r"multiple of cp\*block_size"):
        cp_zigzag_layout(12, 4, 2, 0)
    with pytest.raises(ValueError, match="fewer than bp=4"):
        bp_only_layout(6, 2, 4, 0)
    with pytest.raises(ValueError, match=r"BP rank must be in \[0, 4\)"):
        bp_only_layout(16, 2, 4, 4)
    with pytest.raises(ValueError, match=r"local_rank must be in \[0, 2\)"):
        rank_layout(Topology(cp=2), 2, 16, 2)


WINDOW_PLAN_CASES = [
    # (seq_len, block_size, cp, bp, window)
    (32, 2, 2, 2, 3),
    (32, 2, 2, 4, 3),  # two rings
    (32, 2, 2, 4, 1),
    (32, 1, 4, 4, 4),
    (48, 2, 3, 6, 2),
    (24, 2, 3, 1, 5),  # CP-only zigzag layout
    (32, 4, 2, 2, 6),
]


def _need_per_section_11(layout: RankLayout, block_size: int, window: int) -> set[int]:
    """csbp.md §11's need(d), written out."""
    need: set[int] = set()
    for p in layout.clean_positions.tolist():
        need.update(range(max(0, p + 1 - window), p + 1))
    for b in layout.owned_blocks:
        need.update(range(max(0, b * block_size - (window - 1)), b * block_size))
    return need


def _window_plan_cases():
    for seq_len, block_size, cp, bp, window in WINDOW_PLAN_CASES:
        for ring in range(max(cp, bp) // cp):
            yield seq_len, block_size, cp, bp, ring, window


@pytest.mark.parametrize("seq_len, block_size, cp, bp, ring, window", list(_window_plan_cases()))
def test_window_plan(seq_len, block_size, cp, bp, ring, window):
    plan = window_exchange_plan(seq_len, block_size, cp, bp, ring, window)
    topology = Topology(cp=cp, bp=bp)
    members = [rank_layout(topology, ring * cp + d, seq_len, block_size, window=window) for d in range(cp)]
    owned = [set(m.clean_positions.tolist()) for m in members]

    # send[s][d] = need(d) ∩ owned(s), nothing to oneself
    for dest, member in enumerate(members):
        need = _need_per_section_11(member, block_size, window)
        for source in range(cp):
            expected = [] if source == dest else sorted(need & owned[source])
            assert plan.send[source][dest].tolist() == expected

    # simulate all_to_all_single: what s sends to d is exactly what d expects from s
    received: list[list[torch.Tensor]] = [[] for _ in range(cp)]
    for source, member in enumerate(members):
        buffer = member.clean_positions[plan.send_index(source)]  # stands in for the K/V rows
        for dest, chunk in enumerate(torch.split(buffer, plan.send_counts(source))):
            received[dest].append(chunk)
    for dest in range(cp):
        assert [len(chunk) for chunk in received[dest]] == plan.recv_counts(dest)
        assert torch.equal(torch.cat(received[dest]), plan.recv_positions(dest))

    # halo only: strictly fewer rows than the rest of the clean stream
    for dest, member in enumerate(members):
        assert sum(plan.recv_counts(dest)) < seq_len - member.num_clean

    # own rows + received rows reproduce the windowed reference mask
    for dest, member in enumerate(members):
        halo = bd3_rows(
            torch.zeros(0, dtype=torch.long), plan.recv_positions(dest), block_size=block_size, window=window
        )
        keys = Rows.cat([member.rows, halo])
        _assert_matches_reference(member.rows, keys, seq_len, block_size, window)


def test_window_plan_large_window_sends_every_needed_row():
    """A window covering the sequence needs the full clean prefix of the ring's rows."""
    plan = window_exchange_plan(16, 2, 2, 2, 0, 64)
    for dest, layout in enumerate(csbp_layout(16, 2, 2, 2, d, window=64) for d in range(2)):
        top = int(layout.rows.ctx_stop.max())
        own = set(layout.clean_positions.tolist())
        assert plan.recv_positions(dest).tolist() == sorted(set(range(top)) - own)


def test_window_plan_rejections():
    with pytest.raises(ValueError, match="needs cp > 1"):
        window_exchange_plan(16, 2, 1, 4, 0, 3)
    with pytest.raises(ValueError, match=r"ring_index must be in \[0, 2\)"):
        window_exchange_plan(32, 2, 2, 4, 2, 3)
    with pytest.raises(ValueError, match="window must be"):
        window_exchange_plan(32, 2, 2, 4, 0, 0)
