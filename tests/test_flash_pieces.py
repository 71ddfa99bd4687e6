"""Clean-context partials as fused flash pieces plus a residual (``csbp.attention.flash_pieces``).

Checked on every layout's clean-key partials, in float64 against the dense reference (out, lse and
the explicit backward from the merged statistics, GQA), and structurally: the pieces and the
residuals together cover every allowed (query, key) pair exactly once and nothing else.
"""

from __future__ import annotations

import pytest
import torch

from csbp.attention import flash_pieces, flash_pieces_plan
from csbp.attention.backends import TilesPartial, plan_partial
from csbp.attention.documents import Documents
from csbp.attention.flash_ops import flash_backward, flash_forward, flash_kernel
from csbp.attention.flash_pieces import FlashPiecesPartial
from csbp.attention.layouts import bp_only_layout, cp_zigzag_layout, csbp_layout, reference_layout
from csbp.attention.rows import Rows, allow_matrix
from csbp.dflash.layouts import block_query_rows, context_rows, full_packet
from test_flex_direct_backward import flex_trains_on_cpu, needs_direct  # noqa: F401 - flex_trains_on_cpu: a fixture
from test_kernel import TOL64, dense_attention_reference, random_qkv, reference_grads

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile.*")

L, B = 64, 4


def _clean(rows: Rows) -> Rows:
    return rows.select(torch.nonzero(rows.clean).flatten())


def _cases() -> dict[str, tuple[Rows, Rows]]:
    """(query rows, key rows) of every layout's clean-context partials (and a CP-only ring step, whose
    keys include the peer's noisy rows no query sees)."""
    cases = {}
    reference = reference_layout(L, B).rows
    cases["reference"] = (reference, _clean(reference))
    cases["reference_window"] = (reference_layout(L, B, window=9).rows, _clean(reference_layout(L, B, window=9).rows))
    documents = Documents.from_doc_ids(torch.tensor([0] * 7 + [1] * 29 + [2] * 28))  # starts mid-block
    doc_rows = reference_layout(L, B, documents=documents).rows
    cases["documents"] = (doc_rows, _clean(doc_rows))
    for me, peer in ((1, 0), (0, 1)):
        cases[f"cp_zigzag_{me}_over_{peer}"] = (
            cp_zigzag_layout(L, B, 2, me).rows,
            _clean(cp_zigzag_layout(L, B, 2, peer).rows),
        )
    cases["cp_zigzag_noisy_keys_of_a_peer"] = (cp_zigzag_layout(L, B, 2, 1).rows, cp_zigzag_layout(L, B, 2, 0).rows)
    cases["bp_only"] = (bp_only_layout(L, B, 2, 1).rows, _clean(bp_only_layout(L, B, 2, 1).rows))
    for me, peer in ((3, 0), (0, 3), (2, 2)):
        cases[f"csbp_{me}_over_{peer}"] = (csbp_layout(L, B, 2, 4, me).rows, _clean(csbp_layout(L, B, 2, 4, peer).rows))
    ring = torch.cat([_clean(csbp_layout(L, B, 2, 4, r).rows).pos for r in (1, 0)])  # two peers' keys, out of order
    cases["csbp_two_peers"] = (csbp_layout(L, B, 2, 4, 3).rows, context_rows(ring))
    anchors = torch.tensor([40, 44, 48, 52, 56, 60, 3, 9])  # six anchors under the same context, then two
    packet = full_packet(anchors, torch.zeros(8, dtype=torch.long))
    cases["dflash_context"] = (block_query_rows(packet, B, context="strict"), context_rows(torch.arange(32)))
    # the mixed rows [noisy ; clean] over themselves: the noisy keys fold into the clean run's residual
    for name in ("reference", "reference_window", "documents", "bp_only"):
        cases[f"{name}_mixed"] = (cases[name][0], cases[name][0])
    for me in (0, 1):
        cases[f"cp_zigzag_{me}_local"] = (cp_zigzag_layout(L, B, 2, me).rows, cp_zigzag_layout(L, B, 2, me).rows)
    cases["csbp_3_local"] = (csbp_layout(L, B, 2, 4, 3).rows, csbp_layout(L, B, 2, 4, 3).rows)
    cases["noisy_keys_between_two_runs"] = (reference, _noisy_between_clean(reference, 40))
    return cases


def _noisy_between_clean(rows: Rows, split: int) -> Rows:
    """``rows``' keys reordered ``[clean[:split] ; noisy ; clean[split:]]``."""
    noisy, clean = torch.nonzero(~rows.clean).flatten(), torch.nonzero(rows.clean).flatten()
    return rows.select(torch.cat([clean[:split], noisy, clean[split:]]))


CASES = _cases()


def _coverage(plan: FlashPiecesPartial, q_rows: Rows, k_rows: Rows) -> torch.Tensor:
    """How many times the plan computes each (query, key) pair."""
    count = torch.zeros(len(q_rows), len(k_rows), dtype=torch.long)
    for run in plan.runs:
        for p in run.pieces:
            block = torch.ones(p.q_stop - p.q_start, p.k_stop - p.k_start, dtype=torch.long)
            count[p.q_start : p.q_stop, p.k_start : p.k_stop] += block.tril() if p.causal else block
        if run.residual is not None:
            start, stop = run.residual_span
            count[:, start:stop] += allow_matrix(run.residual.q_rows, run.residual.k_rows).long()
    return count


@pytest.mark.parametrize("min_rows", [2, 4, 8])
@pytest.mark.parametrize("case", sorted(CASES))
def test_pieces_cover_every_allowed_pair_once(case: str, min_rows: int) -> None:
    q_rows, k_rows = CASES[case]
    plan = plan_partial(q_rows, k_rows, backend="tiles", clean="pieces", min_rows=min_rows)
    allow = allow_matrix(q_rows, k_rows)
    if isinstance(plan, FlashPiecesPartial):
        assert torch.equal(_coverage(plan, q_rows, k_rows), allow.long())
    else:
        assert isinstance(plan, TilesPartial)


@pytest.mark.parametrize("min_rows", [2, 8])
@pytest.mark.parametrize("case", sorted(CASES))
def test_pieces_forward_and_backward_match_reference(case: str, min_rows: int) -> None:
    q_rows, k_rows = CASES[case]
    plan = plan_partial(q_rows, k_rows, backend="tiles", clean="pieces", min_rows=min_rows)
    q, k, v = random_qkv(len(q_rows), len(k_rows))
    allow, scale = allow_matrix(q_rows, k_rows), 8**-0.5
    dout = torch.randn(q.shape[:-1] + (v.shape[-1],), generator=torch.Generator().manual_seed(1), dtype=q.dtype)
    ref_out, ref_lse, ref_grads = reference_grads(q, k, v, allow, scale, dout)
    out, lse = plan.forward(q, k, v, scale=scale)
    torch.testing.assert_close(out, ref_out, **TOL64)
    torch.testing.assert_close(lse, ref_lse, **TOL64)
    grads = plan.backward(q, k, v, ref_out, ref_lse, dout, scale=scale)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, **TOL64)


@pytest.mark.parametrize("case", ["reference", "reference_mixed", "documents_mixed", "csbp_two_peers", "dflash_context"])
def test_buffers_are_filled_only_where_no_first_piece_writes(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward's out/lse and the backward's gradient buffers start uninitialised (NaN here): the
    rows and keys no first piece writes are filled, and the result still matches the reference."""
    new_empty, empty = torch.Tensor.new_empty, torch.empty
    monkeypatch.setattr(torch.Tensor, "new_empty", lambda self, *a, **kw: new_empty(self, *a, **kw).fill_(float("nan")))
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(float("nan")))
    q_rows, k_rows = CASES[case]
    plan = plan_partial(q_rows, k_rows, backend="tiles", clean="pieces", min_rows=4)
    assert isinstance(plan, FlashPiecesPartial)
    q, k, v = random_qkv(len(q_rows), len(k_rows))
    dout = torch.randn(q.shape[:-1] + (v.shape[-1],), generator=torch.Generator().manual_seed(1), dtype=q.dtype)
    ref_out, ref_lse, ref_grads = reference_grads(q, k, v, allow_matrix(q_rows, k_rows), 8**-0.5, dout)
    out, lse = plan.forward(q, k, v, scale=8**-0.5)
    torch.testing.assert_close(out, ref_out, **TOL64)
    torch.testing.assert_close(lse, ref_lse, **TOL64)
    for got, want in zip(plan.backward(q, k, v, out, lse, dout, scale=8**-0.5), ref_grads):
        torch.testing.assert_close(got, want, **TOL64)
    assert flash_pieces._gaps([(2, 5), (4, 8), (10, 12)], 14) == ((0, 2), (8, 10), (12, 14))
    assert flash_pieces._gaps([], 3) == ((0, 3),) and flash_pieces._gaps([(0, 3)], 3) == ()


def test_bd3_clean_context_runs_almost_all_in_pieces() -> None:
    """One device, L = 512, B = 16 (CPU default min_rows): the noisy and clean rows' clean context is
    two causal pieces; the residual keeps only the in-block band (< B / L of the pairs)."""
    rows = reference_layout(512, 16).rows
    keys = _clean(rows)
    plan = plan_partial(rows, keys, backend="tiles", clean="pieces")
    assert isinstance(plan, FlashPiecesPartial)
    in_pieces = sum(p.pairs for p in plan.pieces)
    total = int(allow_matrix(rows, keys).sum())
    assert [p.causal for p in plan.pieces] == [True, True]
    assert in_pieces / total > 0.95


def test_anchors_under_one_context_are_one_dense_piece() -> None:
    q_rows, k_rows = CASES["dflash_context"]
    plan = plan_partial(q_rows, k_rows, backend="tiles", clean="pieces", min_rows=4)
    dense = [p for p in plan.pieces if not p.causal]
    assert [(p.q_start, p.q_stop, p.k_start, p.k_stop) for p in dense] == [(0, 24, 0, 32), (24, 28, 0, 3), (28, 32, 0, 9)]
    assert not [p for p in plan.pieces if p.causal]


def test_noisy_keys_no_query_sees_are_skipped_like_padding() -> None:
    q_rows, k_rows = CASES["cp_zigzag_noisy_keys_of_a_peer"]
    plan = plan_partial(q_rows, k_rows, backend="tiles", clean="pieces", min_rows=4)
    assert isinstance(plan, FlashPiecesPartial)
    in_runs = torch.zeros(len(k_rows), dtype=torch.bool)
    for run in plan.runs:
        in_runs[run.k_start : run.k_stop] = True
    assert bool(k_rows.clean[in_runs].all()) and not bool(in_runs[~k_rows.clean].any())


def test_noisy_keys_fold_into_the_residual_of_the_clean_run_next_to_them() -> None:
    rows = reference_layout(L, B).rows
    plan = plan_partial(rows, rows, backend="tiles", clean="pieces", min_rows=2)
    assert isinstance(plan, FlashPiecesPartial)
    (run,) = plan.runs
    assert (run.k_start, run.k_stop) == (L, 2 * L) and run.residual_span == (0, 2 * L)
    assert all(p.k_start >= L for p in run.pieces)  # pieces see clean keys only
    plan = plan_partial(rows, _noisy_between_clean(rows, 40), backend="tiles", clean="pieces", min_rows=2)
    assert [run.residual_span for run in plan.runs] == [(0, 40 + L), (40 + L, 2 * L)]  # the first run next to them


def test_noisy_keys_with_another_run_before_every_run_with_pieces_plan_one_generic_partial() -> None:
    rows = reference_layout(L, B).rows
    noisy, clean = torch.nonzero(~rows.clean).flatten(), torch.nonzero(rows.clean).flatten()
    apart = rows.select(torch.cat([noisy, clean[[61, 59]], clean[:56]]))  # a one-key run without pieces next to them
    assert isinstance(plan_partial(rows, apart, backend="tiles", clean="pieces", min_rows=8), TilesPartial)
    keys = rows.select(torch.cat([clean[[61, 59]], clean[:56]]))
    assert isinstance(plan_partial(rows, keys, backend="tiles", clean="pieces", min_rows=8), FlashPiecesPartial)
    assert flash_pieces_plan._run_next_to((0, 8), [(8, 20)], [(8, 20), (20, 30)]) == (8, 20)
    assert flash_pieces_plan._run_next_to((10, 20), [(0, 10)], [(0, 10), (14, 16)]) is None  # another run inside
    assert flash_pieces_plan._run_next_to((0, 8), [(9, 20)], [(9, 20)]) == (9, 20)  # a dead key between: nothing seen
    assert flash_pieces_plan._run_next_to((0, 8), [(30, 40), (9, 20)], [(9, 20), (30, 40)]) == (9, 20)  # the nearest


def test_noisy_keys_and_no_pieces_plan_one_generic_partial() -> None:
    rows = reference_layout(L, B).rows
    assert isinstance(plan_partial(rows, rows, backend="tiles", clean="pieces", min_rows=10_000), TilesPartial)
    assert isinstance(plan_partial(rows, _clean(rows), backend="tiles", clean="pieces", min_rows=10_000), TilesPartial)
    assert isinstance(plan_partial(rows, _clean(rows), backend="tiles", clean="generic"), TilesPartial)
    assert isinstance(plan_partial(rows, _clean(rows), backend="tiles"), TilesPartial)  # off by default
    with pytest.raises(ValueError, match="clean-context kernel must be one of"):
        plan_partial(rows, _clean(rows), clean="flash")
    with pytest.raises(ValueError, match="cuda_kernel must be one of"):
        flash_kernel(torch.zeros(1, 1, 1, 8), "fa3")


def test_without_a_fused_kernel_the_whole_partial_runs_generically(monkeypatch: pytest.MonkeyPatch) -> None:
    q_rows, k_rows = CASES["reference"]
    plan = plan_partial(q_rows, k_rows, backend="tiles", clean="pieces", min_rows=4)
    assert isinstance(plan, FlashPiecesPartial)
    monkeypatch.setattr(flash_pieces, "flash_kernel", lambda q, cuda_kernel: None)
    q, k, v = random_qkv(len(q_rows), len(k_rows))
    out, lse = plan.forward(q, k, v)
    ref_out, ref_lse = dense_attention_reference(q, k, v, allow_matrix(q_rows, k_rows), 8**-0.5)
    torch.testing.assert_close(out, ref_out, **TOL64)
    assert isinstance(plan._generic_plan, TilesPartial)


def test_flex_residual_forward_matches_reference() -> None:
    q_rows, k_rows = CASES["csbp_two_peers"]
    plan = plan_partial(q_rows, k_rows, backend="flex", clean="pieces", min_rows=2)
    assert isinstance(plan, FlashPiecesPartial)
    q, k, v = random_qkv(len(q_rows), len(k_rows), dtype=torch.float32)
    out, lse = plan.forward(q, k, v)
    ref_out, ref_lse = dense_attention_reference(q.double(), k.double(), v.double(), allow_matrix(q_rows, k_rows), 8**-0.5)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-5, rtol=2e-5)


MIXED_CASES = [name for name in sorted(CASES) if name.endswith(("_mixed", "_local"))]


@pytest.mark.parametrize("causal_in_block", [False, True])
@pytest.mark.parametrize("backend", ["tiles", pytest.param("flex", marks=needs_direct)])
@pytest.mark.parametrize("case", MIXED_CASES)
@pytest.mark.usefixtures("flex_trains_on_cpu")
def test_residual_with_the_noisy_blocks_folded_in_matches_reference(case: str, backend: str, causal_in_block: bool) -> None:
    """The mixed rows: clean pieces plus one residual over the in-block band and the noisy blocks (on
    flex one Flex call), forward and backward from the merged statistics, in float64; with a
    causal noisy block (Fast-dLLM v2) too."""
    q_rows, k_rows = CASES[case]
    plan = plan_partial(q_rows, k_rows, backend=backend, clean="pieces", min_rows=4, causal_in_block=causal_in_block)
    assert isinstance(plan, FlashPiecesPartial) and any(run.residual_keys is not None for run in plan.runs)
    q, k, v = random_qkv(len(q_rows), len(k_rows))
    scale = 8**-0.5
    dout = torch.randn(q.shape[:-1] + (v.shape[-1],), generator=torch.Generator().manual_seed(1), dtype=q.dtype)
    allow = allow_matrix(q_rows, k_rows, causal_in_block=causal_in_block)
    ref_out, ref_lse, ref_grads = reference_grads(q, k, v, allow, scale, dout)
    out, lse = plan.forward(q, k, v, scale=scale)
    torch.testing.assert_close(out, ref_out, **TOL64)
    torch.testing.assert_close(lse, ref_lse, **TOL64)
    for got, want in zip(plan.backward(q, k, v, out, lse, dout, scale=scale), ref_grads):
        torch.testing.assert_close(got, want, **TOL64)
    assert plan._generic_plan is None  # the pieces ran, not the whole partial generically


def test_flash_ops_checks_and_dtypes() -> None:
    q, k, v = random_qkv(8, 6, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="causal flash call must be square"):
        flash_forward(q, k, v, causal=True, scale=0.3)
    out, lse = flash_forward(q, k, v, causal=False, scale=0.3)
    assert out.dtype == lse.dtype == torch.float32
    dq, dk, dv = flash_backward(q, k, v, out, lse, torch.ones_like(out), causal=False, scale=0.3)
    assert (dq.dtype, dk.shape, dv.shape) == (torch.float32, k.shape, v.shape)


@pytest.mark.parametrize("kernel", ["flash", "cudnn"])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_ops_cuda_calls_fit_the_kernels_meta_registrations(
    monkeypatch: pytest.MonkeyPatch, causal: bool, kernel: str
) -> None:
    """FlashAttention-2's and cuDNN's argument order, GQA shapes and lse layout, checked on meta tensors
    (no GPU): a key slice of a larger K/V, 16 query heads over 4 KV heads, bf16 in, fp32 out."""
    from csbp.attention import flash_ops

    monkeypatch.setattr(flash_ops, "flash_kernel", lambda q, cuda_kernel: cuda_kernel)
    q = torch.empty(1, 16, 256, 128, dtype=torch.bfloat16, device="meta")
    kv = torch.empty(1, 4, 1024, 128, dtype=torch.bfloat16, device="meta")
    keys = slice(100, 356) if causal else slice(0, 1024)
    out, lse = flash_ops.flash_forward(q, kv[:, :, keys], kv[:, :, keys], causal=causal, scale=0.1, cuda_kernel=kernel)
    assert (out.shape, lse.shape, out.dtype, lse.dtype) == ((1, 16, 256, 128), (1, 16, 256), torch.float32, torch.float32)
    dq, dk, dv = flash_ops.flash_backward(
        q, kv[:, :, keys], kv[:, :, keys], out, lse, out, causal=causal, scale=0.1, cuda_kernel=kernel
    )
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, kv[:, :, keys].shape, kv[:, :, keys].shape)


def test_run_config_attention_clean_is_typed() -> None:
    from csbp.config import ConfigError, config_from_dict
    from test_config import with_changes

    assert config_from_dict(with_changes({})).attention.clean == "generic"
    assert config_from_dict(with_changes({"attention.clean": "pieces-cudnn"})).attention.clean == "pieces-cudnn"
    with pytest.raises(ConfigError, match="attention.clean"):
        config_from_dict(with_changes({"attention.clean": "flash"}))


def test_local_transport_runs_its_clean_partial_as_pieces() -> None:
    from csbp.attention.transports.local import LocalAttentionFn

    rows = reference_layout(64, 4).rows
    attn = LocalAttentionFn(rows, num_noisy=64, clean="pieces")
    assert isinstance(attn.plan.interval_plan, FlashPiecesPartial) and attn.plan.interval_plan.pieces
    q, k, v = random_qkv(128, 128)
    ref_out, _ = dense_attention_reference(q, k, v, allow_matrix(rows, rows), 8**-0.5)
    torch.testing.assert_close(attn(q, k, v), ref_out.to(q.dtype), **TOL64)


@needs_direct
@pytest.mark.usefixtures("flex_trains_on_cpu")
def test_local_transport_on_flex_folds_the_noisy_blocks_into_the_clean_residual() -> None:
    """The flex diagonal with clean pieces: no separate block-diagonal partial; one Flex residual over
    the noisy blocks and the band. Its bench form (``csbp bench kernels``) is the same plan."""
    from csbp.attention.transports.local import LocalAttentionFn
    from csbp.bench.kernels import build_form

    rows = reference_layout(64, 4).rows
    attn = LocalAttentionFn(rows, num_noisy=64, backend="flex", diagonal="flex", clean="pieces")
    plan = attn.plan
    assert plan.block_size is None and plan.block_plan is None and isinstance(plan.interval_plan, FlashPiecesPartial)
    assert [run.residual_span for run in plan.interval_plan.runs] == [(0, 128)]
    bench = build_form(rows, 64, 4, "flex", "decomposed", "flex", "pieces")
    assert bench.block_plan is None and [r.residual_span for r in bench.interval_plan.runs] == [(0, 128)]
    q, k, v = (x.requires_grad_() for x in random_qkv(128, 128))
    allow = allow_matrix(rows, rows)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(2), dtype=q.dtype)
    ref_out, _, ref_grads = reference_grads(q.detach(), k.detach(), v.detach(), allow, 8**-0.5, dout)
    out = attn(q, k, v)
    torch.testing.assert_close(out, ref_out, **TOL64)
    out.backward(dout)
    for got, want in zip((q.grad, k.grad, v.grad), ref_grads):
        torch.testing.assert_close(got, want, **TOL64)


def test_cuda_flash_pieces_path_with_a_cpu_stand_in_kernel_matches_the_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The pieces' CUDA ``flash`` branch (bf16 casts, key slices, the merged out/lse handed to each
    piece's backward, chunks of the batch) run on the CPU with a stand-in for FlashAttention-2's ops."""
    from csbp.attention import flash_ops
    from test_block_diagonal_sdpa import flash2_stand_in

    calls: list[int] = []
    forward, backward = flash2_stand_in(calls)
    monkeypatch.setattr(flash_ops, "flash_kernel", lambda q, cuda_kernel="flash": cuda_kernel)
    monkeypatch.setattr(flash_ops, "_FLASH_FORWARD", forward)
    monkeypatch.setattr(flash_ops, "_FLASH_BACKWARD", backward)
    monkeypatch.setattr(flash_ops, "FLASH_MAX_BATCH", 1)  # two samples: calls of one
    q_rows, k_rows = CASES["csbp_two_peers"]
    plan = plan_partial(q_rows, k_rows, backend="tiles", clean="pieces", min_rows=4)
    q, k, v = random_qkv(len(q_rows), len(k_rows), dim=16)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(5), dtype=q.dtype)
    ref_out, ref_lse, ref_grads = reference_grads(q, k, v, allow_matrix(q_rows, k_rows), 16**-0.5, dout)
    bf16 = {"atol": 3e-2, "rtol": 3e-2}
    qb, kb, vb, doutb = (t.to(torch.bfloat16) for t in (q, k, v, dout))
    out, lse = plan.forward(qb, kb, vb)
    assert calls and set(calls) == {1} and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, **bf16)
    grads = plan.backward(qb, kb, vb, out, lse, doutb)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.double(), want, **bf16)


def test_a_piece_first_over_its_rows_is_written_and_the_rest_merge_in_place() -> None:
    """The forward writes a piece no earlier piece or residual covered (merging it into zeros / -inf would
    give it back) and merges the others into their row slice in place; the flags follow the rows."""
    from csbp.attention.flash_pieces_plan import FlashPiece, KeyRunPlan

    dense, causal = FlashPiece(0, 8, 0, 4, False), FlashPiece(0, 8, 4, 12, True)
    later = FlashPiece(8, 16, 0, 12, False)
    plan = FlashPiecesPartial((KeyRunPlan(0, 12, (dense, causal, later), None),), 16, 12, generic=lambda: None)
    assert plan.first_over_their_rows == (True, False, True)
    second_run = FlashPiece(8, 16, 12, 20, False)
    with_residual = FlashPiecesPartial(
        (KeyRunPlan(0, 12, (dense,), object()), KeyRunPlan(12, 20, (second_run,), None)), 16, 20, generic=lambda: None
    )
    assert with_residual.first_over_their_rows == (True, False)  # the residual covers every row
    # keys: the dense and causal pieces of one run share rows but not keys; a later row range reuses keys
    assert plan.first_over_their_keys == (True, True, False)
    assert with_residual.first_over_their_keys == (True, True)  # the residual covers its own run's keys only


@pytest.mark.parametrize(("block", "min_rows"), [(16, 16), (32, 16), (64, 16), (128, 16), (256, 128)])
def test_a_last_block_on_the_staircase_joins_the_causal_piece(block: int, min_rows: int) -> None:
    """The last block of a staircase (flat, one step of B rows) stays on the causal diagonal: a
    separate dense piece of B rows over the whole context would be a thin call that fills few of a
    GPU's multiprocessors. So the mixed rows' clean context is two causal pieces at every B (CPU's
    default ``min_rows`` 16; CUDA's 128, where the split came at B >= 256)."""
    rows = reference_layout(1024, block).rows
    plan = plan_partial(rows, rows, backend="tiles", clean="pieces", min_rows=min_rows)
    assert isinstance(plan, FlashPiecesPartial)
    assert [(p.q_start, p.q_stop, p.k_start, p.k_stop, p.causal) for p in plan.pieces] == [
        (block, 1024, 1024, 2048 - block, True),
        (1024, 2048, 1024, 2048, True),
    ]


def test_a_flat_tail_longer_than_a_step_is_one_dense_piece() -> None:
    """Rows after a key shard all see the whole shard: that tail is longer than the staircase's step,
    so putting it on the causal diagonal would widen every row's band; it is one dense rectangle."""
    q_rows, k_rows = CASES["csbp_3_over_0"]
    plan = plan_partial(q_rows, k_rows, backend="tiles", clean="pieces", min_rows=2)
    assert isinstance(plan, FlashPiecesPartial)
    assert any(not p.causal and p.q_stop - p.q_start > B for p in plan.pieces), plan.pieces
