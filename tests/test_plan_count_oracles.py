"""The cost model's traffic and memory terms against independent references: the runtime's own
exchange plans (``layouts.halo_exchange_plan``: the rows each ring member actually receives) and the
hand-computed identities of cost-model.md (the published 14B traffic, one more K/V pass for the
streaming ring's backward, the streaming overlap bounded by the ring's attention time)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from csbp.attention.documents import Documents
from csbp.attention.layouts import halo_exchange_plan
from csbp.plan.calibration import packaged_calibration
from csbp.plan.documents import RowDocuments
from csbp.plan.hardware import hardware
from csbp.plan.layout import Layout
from csbp.plan.model import halo_used, predict
from csbp.plan.workload import preset_workload

CAL = packaged_calibration("h200")
LENGTHS = [300, 700, 1100, 96, 900, 1000]  # one 4096-token row


def test_cp_aware_without_checkpointing_keeps_every_layers_halo_for_its_backward() -> None:
    """``cp-aware`` (CP-only's halo all-to-all) saves each layer's received K/V rows for that layer's
    backward, as the all-gather does: without checkpointing all 26 layers hold them at once. The rows
    are the member's own ``2L/cp`` plus what the runtime's halo plan sends it (the busiest member)."""
    seq_len, cp = 4096, 4
    starts = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]
    workload = preset_workload("nemotron-3b").with_options()
    workload = replace(workload, doc_length=RowDocuments(seq_len, tuple(starts)))
    group, layers = workload.model.groups[0], workload.model.num_layers
    layout = Layout(2, cp, transport="halo", checkpointing="none")
    assert halo_used(workload, layout, seq_len, group)
    plan = halo_exchange_plan(seq_len, workload.objective.block, cp, 1, 0, documents=Documents.from_lengths(LENGTHS))
    held = 2 * seq_len // cp + max(sum(plan.recv_counts(member)) for member in range(cp))
    row = 2 * group.n_kv_heads * group.head_dim * 2  # K and V, bf16
    got = predict(workload, layout, seq_len, hardware("h200", gpus=8), CAL).mem_terms["gathered K/V"]
    assert got == pytest.approx(held * row * (layers + 4 / 2))  # every layer's K/V, one layer's fp32 dK/dV
