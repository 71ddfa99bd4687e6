"""The halo model's time and overlap: a halo all-to-all is priced by its busiest ring member's
larger direction (sent or received, ``halo_exchange_plan``'s counts) and exposed like the
all-gather, by one share (``collective_overlap``), which the plan prints."""

from __future__ import annotations

from dataclasses import replace

from csbp.cli.main import main
from csbp.plan.calibration import packaged_calibration
from csbp.plan.documents import layout_totals
from csbp.plan.hardware import hardware
from csbp.plan.layout import Layout
from csbp.plan.model import collective_overlap, kv_passes, kv_row_bytes, predict
from csbp.plan.workload import preset_workload

SEQ_LEN, DOC = 64 * 1024, 2048


def test_halo_bytes_are_the_busiest_members_larger_direction() -> None:
    workload = preset_workload("nemotron-3b").with_options(doc_length=DOC)
    hw, cal = hardware("h200", gpus=16), packaged_calibration("h200")
    block, group = workload.objective.block, workload.model.groups[0]
    for layout in (Layout(1, 8, 16, schedule="balanced"), Layout(2, 8, transport="halo")):
        totals = layout_totals(SEQ_LEN, block, layout.cp, layout.bp, layout.schedule, 0, DOC)
        busiest = max(max(t.sent, t.halo) for t in totals)
        layout = replace(layout, checkpointing="full")
        passes = sum(kv_passes(layout, workload.objective.kv_grad_bytes / 2))  # forward, recompute, dK/dV
        predicted = predict(workload, layout, SEQ_LEN, hw, cal)
        assert predicted.kv_bytes == passes * group.count * busiest * kv_row_bytes(group, 2)
    for cp, bp, schedule in ((8, 1, "dual_end"), (4, 16, "balanced")):  # receiving alone under-prices these
        totals = layout_totals(SEQ_LEN, block, cp, bp, schedule, 0, DOC)
        assert max(t.sent for t in totals) > 1.2 * max(t.halo for t in totals)


def test_halo_all_to_all_is_exposed_like_the_all_gather() -> None:
    workload = preset_workload("nemotron-3b").with_options(doc_length=DOC)
    hw = hardware("h200", gpus=16)
    base = packaged_calibration("h200")
    halo, cp_aware, generic = Layout(1, 8, 16), Layout(2, 8, transport="halo"), Layout(2, 8)
    assert collective_overlap(halo, base) == collective_overlap(Layout(1, 8, 8), base) == base.overlap_csbp
    assert collective_overlap(cp_aware, base) == base.overlap_csbp
    assert collective_overlap(generic, base) == base.overlap_cp
    none, half = replace(base, overlap_csbp=0.0), replace(base, overlap_csbp=0.5)
    for layout in (halo, cp_aware):
        exposed = [predict(workload, layout, SEQ_LEN, hw, c).exposed_kv_s for c in (none, half)]
        assert exposed[0] > 0 and abs(exposed[1] - exposed[0] / 2) < 1e-12 * exposed[0]
    drafter = preset_workload("dflash2-qwen3.8").with_options(drafter_context="all", doc_length=DOC)
    for layout in (Layout(2, 4, 4), Layout(2, 4)):  # the drafter's rings all take overlap_csbp, CP-only too
        exposed = [predict(drafter, layout, SEQ_LEN, hardware("h100", gpus=8), c).exposed_kv_s for c in (none, half)]
        assert exposed[0] > 0 and abs(exposed[1] - exposed[0] / 2) < 1e-12 * exposed[0]


def test_plan_states_the_overlap_it_assumed(capsys) -> None:
    assert main(["plan", "--model", "nemotron-3b", "--seq-len", "64K", "--gpus", "8", "--gpu", "h200", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert "overlap: CP-only all-gather hides 37%" in out and "halo all-to-all, DFlash rings 0%" in out
    assert "unmeasured on GPU" in out


def test_a_packed_ring_crosses_nodes_exactly_when_csbps_rank_order_puts_it_across() -> None:
    """``ring_bandwidth`` against the rings of ``csbp.topology``'s rank order: the network when a
    node boundary cuts any CP ring (a ring larger than a node, or ``gpus_per_node`` not a multiple
    of ``cp``), NVLink otherwise, however many BP ranks (which exchange no K/V) a sample spans."""
    from csbp.plan.model import ring_bandwidth
    from csbp.plan.search import divisors

    cal = packaged_calibration("h200")
    for gpus, per_node in ((16, 8), (24, 6), (24, 8), (8, 8), (32, 8)):
        hw = hardware("h200", gpus=gpus, gpus_per_node=per_node)
        for local in divisors(gpus):
            for cp in (c for c in divisors(local) if c > 1):
                layout = Layout(gpus // local, cp, local)
                topo = layout.topology
                rings: dict[tuple[int, int], set[int]] = {}
                for rank in range(gpus):
                    c = topo.coords(rank)
                    rings.setdefault((c.dp_rank, c.ring_index), set()).add(rank // per_node)
                across = any(len(nodes) > 1 for nodes in rings.values())
                expected = (hw.inter_gbps * cal.net_eff if across else hw.intra_gbps * cal.intra_eff) * 1e9
                assert ring_bandwidth(layout, hw, cal) == expected, (gpus, per_node, layout.name)
                striped = ring_bandwidth(replace(layout, placement="striped"), hw, cal)
                assert striped == (hw.inter_gbps * cal.net_eff if gpus > per_node else hw.intra_gbps * cal.intra_eff) * 1e9
