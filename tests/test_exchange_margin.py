"""The halo exchanges' margin (``counts.exchange_pays``): BD3's halo all-to-all (CSBP with a window
or documents, ``cp-aware``) replaces the ring's all-gather only where its busiest member receives at
most 90% of the all-gather's rows; elsewhere the ring all-gathers, exactly, and the planner prices
the same choice. DFlash's context exchange follows the same rule (``tests/test_dflash_exchange.py``)."""

from __future__ import annotations

import pytest

from csbp.attention.counts import EXCHANGE_MAX_SHARE, exchange_pays
from csbp.attention.documents import Documents, random_documents
from csbp.attention.layouts import halo_exchange_plan, window_exchange_plan
from csbp.attention.transports.factory import halo_pays
from csbp.topology import Topology


def test_the_rule_is_the_busiest_member_against_the_all_gather() -> None:
    assert EXCHANGE_MAX_SHARE == 0.9
    assert exchange_pays([0, 90], 100) and not exchange_pays([0, 91], 100) and exchange_pays([], 1)


def test_bd3_halo_pays_for_short_documents_and_windows_only() -> None:
    """L=64, cp=2: a CSBP member's all-gather brings 32 clean rows. A 9-token window needs 8 of them,
    one document spanning the row (or a 33-token window) all 32: the halo is not worth it.
    CP-only's all-gather brings 64 rows (noisy and clean), its ``cp-aware`` halo at most the 32 clean."""
    one = Documents.from_lengths([64])
    assert halo_pays(window_exchange_plan(64, 4, 2, 2, 0, 9, "dual_end"), "csbp")
    assert not halo_pays(window_exchange_plan(64, 4, 2, 2, 0, 33, "dual_end"), "csbp")
    assert not halo_pays(halo_exchange_plan(64, 4, 2, 4, 1, documents=one), "csbp")
    assert halo_pays(halo_exchange_plan(64, 4, 2, 4, 1, documents=random_documents(64, 8, _gen(0))), "csbp")
    assert halo_pays(halo_exchange_plan(64, 4, 2, 1, 0, documents=one), "cp")


def test_the_planner_prices_the_all_gather_where_the_halo_does_not_pay() -> None:
    """A window as long as the row: the runtime all-gathers, so the plan's K/V bytes are the
    all-gather's, not the halo's; a short window keeps the halo."""
    from csbp.cli.plan_output import exchange_label
    from csbp.plan.layout import Layout
    from csbp.plan.model import _kv_per_pass
    from csbp.plan.workload import preset_workload

    layout, seq_len = Layout(1, 2, 2), 8192
    for window, halo in ((8192, False), (512, True)):
        workload = preset_workload("nemotron-3b").with_options(window=window)
        group = workload.model.groups[0]
        sent, held = _kv_per_pass(workload, layout, seq_len, group)
        row = 2 * group.n_kv_heads * group.head_dim * workload.dtype_bytes
        gather = (seq_len // 2) * row
        assert (sent < gather) == halo and (sent == gather) == (not halo)
        assert exchange_label(workload, layout, seq_len) == ("halo" if halo else "clean")  # csbp plan's column


@pytest.mark.multiprocess
def test_a_halo_that_does_not_pay_all_gathers_exactly() -> None:
    """One document per row, and a 33-token window on a 64-token row: both rings fall back to the
    all-gather of the clean shards (the same bytes), and both equal one process (float64)."""
    from csbp.engine.verify import VerifyCase, verify

    one_document = verify(VerifyCase(Topology(cp=2, bp=2), seq_len=64, doc_length=10**6), timeout_s=240)
    window = verify(VerifyCase(Topology(cp=2, bp=2), seq_len=64, window=33), timeout_s=240)
    for result in (one_document, window):
        assert result.ok, (result.loss_rel_err, result.grad_rel_err, result.worst_param)
    assert one_document.attention_bytes_per_rank == window.attention_bytes_per_rank
    # the all-gather moves every member's whole shard (the same bytes on every rank); the halo here
    # would have been uneven (member 0 receives 32 rows, member 1 16)
    assert len(set(window.attention_bytes_per_rank)) == 1 and min(window.attention_bytes_per_rank) > 0


def _gen(seed: int):
    import torch

    return torch.Generator().manual_seed(seed)
