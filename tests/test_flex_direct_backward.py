"""FlexAttention's backward kernel called with the merged statistics (``csbp.attention.flex_backward``).

FlexAttention has no compiled CPU backward, but dynamo traces the direct call of its backward
operator on any device, and ``aot_eager`` runs that operator's exact (dense) implementation. So
these tests run the ``direct`` path the CUDA training uses, minus only the Triton kernel:

* on every layout's rows, partials differentiated from the merged ``(out, lse)`` sum to the float64
  reference gradients, with GQA, padding to the shape bucket, dead rows and rows that see nothing;
* ``direct`` calls the forward kernel never in backward (``recompute`` calls it once per partial);
* new rows of the same bucket reuse the compiled backward graph;
* every ring transport (CP-only, CSBP collective and streaming, windowed) trains on flex with the
  direct backward and gives the tiles' gradients;
* the mode is checked and resolved before any work: ``auto`` picks ``direct`` where torch traces
  it, ``direct`` on a torch that cannot is one line.

On CUDA the same paths run in bf16 (``tests/test_flex_cuda.py``, ``make gpu-check``).
"""

from __future__ import annotations

import math

import pytest
import torch

import csbp.attention.flex as flex_module
import csbp.attention.flex_backward as flex_backward
from csbp.attention.flex import build_flex_partial
from csbp.attention.merge import merge_partials, row_delta
from csbp.attention.rows import Rows, allow_matrix
from test_flex_backend import RING_SETUPS, B, L, _layout_cases
from test_kernel import TOL64, random_qkv, reference_grads

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile.*")

needs_direct = pytest.mark.skipif(
    not flex_backward.direct_backward_support()[0],
    reason=f"this torch cannot trace FlexAttention's backward operator: {flex_backward.direct_backward_support()[1]}",
)


def _merged_backward(
    q_rows: Rows, k_rows: Rows, causal_in_block: bool, mode: str, *, split: int | None = None, seed: int = 0,
    shared_delta: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(dq, dk, dv) of two flex partials over the keys before/after ``split``, merged, each
    differentiated from the merged statistics with ``mode`` (``delta`` formed by each partial, or the
    ``shared_delta`` a ring transport hands them); and the float64 reference's."""
    split = len(k_rows) // 2 if split is None else split
    q, k, v = random_qkv(len(q_rows), len(k_rows), dim=16, seed=seed)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=q.dtype)
    parts = [(slice(0, split), k_rows.select(slice(0, split))), (slice(split, None), k_rows.select(slice(split, None)))]
    plans = [build_flex_partial(q_rows, keys, causal_in_block=causal_in_block, block=8) for _, keys in parts]
    outs = [p.forward(q, k[:, :, s], v[:, :, s]) for p, (s, _) in zip(plans, parts)]
    out, lse = merge_partials(*outs[0], *outs[1])
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    delta = row_delta(dout, out, out.dtype) if shared_delta else None
    with flex_backward.flex_backward_mode(mode):
        for plan, (s, _) in zip(plans, parts):
            dq_p, dk_p, dv_p = plan.backward(q, k[:, :, s], v[:, :, s], out, lse, dout, delta=delta)
            dq += dq_p
            dk[:, :, s] += dk_p
            dv[:, :, s] += dv_p
    allow = allow_matrix(q_rows, k_rows, causal_in_block=causal_in_block)
    _, _, want = reference_grads(q, k, v, allow, 1 / math.sqrt(q.shape[-1]), dout)
    return [dq, dk, dv], want


@pytest.fixture
def flex_trains_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flex_module, "_has_flex_backward", lambda device: True)


@needs_direct
@pytest.mark.parametrize("shared_delta", [False, True], ids=["own-delta", "shared-delta"])
@pytest.mark.parametrize("case", sorted(_layout_cases()))
def test_direct_backward_from_merged_statistics_is_exact(
    case: str, shared_delta: bool, flex_trains_on_cpu: None
) -> None:
    """Each partial forming ``delta`` from the merged out inside its compiled call (the local transport),
    or handed the one a ring transport forms for all its partials: both the float64 reference."""
    q_rows, k_rows, causal_in_block = _layout_cases()[case]
    got, want = _merged_backward(q_rows, k_rows, causal_in_block, "direct", seed=3, shared_delta=shared_delta)
    for name, g, w in zip("qkv", got, want):
        assert torch.isfinite(g).all(), f"{case}: d{name} has non-finite values"
        torch.testing.assert_close(g, w, **TOL64, msg=lambda m, n=name: f"{case} d{n}: {m}")


def test_the_direct_backward_needs_delta_or_the_out_it_is_formed_from() -> None:
    q = torch.zeros(1, 1, 8, 16)
    with pytest.raises(ValueError, match="needs the merged delta or the merged out"):
        flex_backward.direct_flex_backward(q, q, q, q[..., 0], q, None, None, None,  # type: ignore[arg-type]
                                           mask_predicate=lambda *a: a[2] >= a[3], mask_buffers=())


@needs_direct
def test_direct_and_recompute_agree_and_only_recompute_runs_the_forward(
    monkeypatch: pytest.MonkeyPatch, flex_trains_on_cpu: None
) -> None:
    """The forward kernel here is a dense autograd stand-in (FlexAttention refuses CPU inputs that
    require grad, which ``recompute`` needs); ``direct`` never calls it in backward."""
    from test_flex_backend import dense_flex_call

    calls = []

    def counting(q, k, v, block_mask, scale):
        calls.append(torch.is_grad_enabled())
        return dense_flex_call(q, k, v, block_mask, scale)

    monkeypatch.setattr(flex_module, "_flex_call", counting)
    q_rows, k_rows, causal_in_block = _layout_cases()[sorted(_layout_cases())[0]]
    results = {}
    for mode in ("direct", "recompute"):
        calls.clear()
        results[mode], want = _merged_backward(q_rows, k_rows, causal_in_block, mode, seed=5)
        results[mode + " calls"] = list(calls)
    assert results["direct calls"] == [False, False]  # two forwards, no kernel call in backward
    assert results["recompute calls"] == [False, False, True, True]  # each partial's forward again
    for d, r, w in zip(results["direct"], results["recompute"], want):
        torch.testing.assert_close(d, r, **TOL64)
        torch.testing.assert_close(d, w, **TOL64)


@needs_direct
def test_rows_that_see_nothing_get_zero_gradients(flex_trains_on_cpu: None) -> None:
    """Dead query rows (merged lse -inf) and dead key rows next to live ones: exact zeros, no NaN."""
    q_rows, k_rows, _ = _layout_cases()["mixed_dead_padding"]
    partial = build_flex_partial(q_rows, k_rows, block=8)
    assert partial.block_mask is not None
    q, k, v = random_qkv(len(q_rows), len(k_rows), dim=16, seed=9)
    out, lse = partial.forward(q, k, v)
    blind = torch.isneginf(lse[0, 0])
    assert blind.any() and not blind.all()
    with flex_backward.flex_backward_mode("direct"):
        dq, dk, dv = partial.backward(q, k, v, out, lse, torch.randn_like(q))
    assert torch.equal(dq[:, :, blind], torch.zeros_like(dq[:, :, blind]))
    unseen = ~k_rows.live
    assert unseen.any()
    for g in (dk, dv):
        assert torch.isfinite(g).all() and torch.equal(g[:, :, unseen], torch.zeros_like(g[:, :, unseen]))


@needs_direct
def test_kernel_dtype_grads_are_the_kernels_own_before_the_cast(flex_trains_on_cpu: None) -> None:
    """``kernel_dtype``: q's dtype (bf16), the leading rows of a padded result as a view, the same values
    as the accumulation-dtype grads, which a caller adds into its fp32 buffers casting as it adds."""
    q_rows, k_rows, _ = _layout_cases()["mixed_dead_padding"]
    partial = build_flex_partial(q_rows, k_rows, block=8)
    assert partial.padded_queries > len(q_rows)  # the padded path: rows sliced off
    q, k, v = (x.to(torch.bfloat16) for x in random_qkv(len(q_rows), len(k_rows), dim=16, seed=11))
    out, lse = partial.forward(q, k, v)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    with flex_backward.flex_backward_mode("direct"):  # recompute: CUDA only (FlexAttention's own autograd)
        accumulated = partial.backward(q, k, v, out, lse, dout)
        own = partial.backward(q, k, v, out, lse, dout, kernel_dtype=True)
    for a, b, x in zip(accumulated, own, (q, k, v)):
        assert a.dtype == torch.float32 and b.dtype == torch.bfloat16 and b.shape == x.shape
        assert torch.equal(b.float(), a)


def _count_compiled_graphs(monkeypatch: pytest.MonkeyPatch) -> list[object]:
    """A fresh compile of the direct backward (aot_eager) for this test; returns the list its graphs go to."""
    aot_eager = torch._dynamo.lookup_backend("aot_eager")
    graphs: list[object] = []

    def counting_backend(gm, example_inputs):  # noqa: ANN001, ANN202
        graphs.append(gm)
        return aot_eager(gm, example_inputs)

    compiled = torch.compile(flex_backward._backward_from_statistics, backend=counting_backend, dynamic=False,
                             fullgraph=True)
    monkeypatch.setattr(flex_backward, "_compiled_backward", lambda backend: compiled)
    return graphs


@needs_direct
def test_direct_backward_compiles_once_per_bucket(monkeypatch: pytest.MonkeyPatch, flex_trains_on_cpu: None) -> None:
    """Two row sets of different sizes in one shape bucket (and new row values) share one graph."""
    graphs = _count_compiled_graphs(monkeypatch)
    rows = _layout_cases()["reference"][0]
    for num_queries in (len(rows), len(rows) - 8):
        q_rows = rows.select(slice(0, num_queries))
        got, want = _merged_backward(q_rows, rows, False, "direct", seed=num_queries)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, **TOL64)
    # two partials (key halves of one bucket) x two query counts of one bucket: one graph
    assert len(graphs) == 1


@needs_direct
def test_every_new_shape_and_mask_compiles_on_the_graphs_kept_from_the_first(
    monkeypatch: pytest.MonkeyPatch, flex_trains_on_cpu: None
) -> None:
    """The score and mask graphs are traced once and handed to every compile; dynamo marks a graph it
    installed as static, so without csbp unmarking them the second shape's compile refused them
    (``failed to handle argument for FlexAttentionBackward HOP``)."""
    graphs = _count_compiled_graphs(monkeypatch)
    for case in ("reference", "causal_in_block", "dflash_context"):  # new buckets and a new mask graph
        q_rows, k_rows, causal_in_block = _layout_cases()[case]
        got, want = _merged_backward(q_rows, k_rows, causal_in_block, "direct", seed=11)
        for name, g, w in zip("qkv", got, want):
            torch.testing.assert_close(g, w, **TOL64, msg=lambda m, c=case, n=name: f"{c} d{n}: {m}")
    assert len(graphs) >= 2


def test_mode_is_checked_and_resolved(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"attention.flex_backward must be one of \('auto', 'direct', 'recompute'\)"):
        flex_backward.set_flex_backward("fast")
    with flex_backward.flex_backward_mode("recompute") as resolved:
        assert resolved == "recompute" and flex_backward.current_flex_backward() == "recompute"
    assert flex_backward.current_flex_backward() == ("direct" if flex_backward.direct_backward_support()[0]
                                                     else "recompute")
    monkeypatch.setattr(flex_backward, "direct_backward_support", lambda: (False, "Unsupported: no tracing"))
    assert flex_backward.resolve_flex_backward("auto") == "recompute"
    with pytest.raises(ValueError) as error:
        flex_backward.set_flex_backward("direct")
    message = str(error.value)
    assert "\n" not in message and "attention.flex_backward=direct needs a torch" in message
    assert "Unsupported: no tracing" in message and "set attention.flex_backward to auto or recompute" in message


def test_this_torch_traces_the_direct_backward() -> None:
    """csbp pins torch 2.13; the device image runs 2.11. Dynamo traces the direct call on both, with
    the score and mask graphs handed as FX graphs (torch 2.11's handler of the operator refuses plain
    functions: measured, ``Unsupported: failed to handle argument for FlexAttentionBackward HOP``)."""
    major_minor = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
    supported, reason = flex_backward.direct_backward_support()
    if major_minor >= (2, 11):
        assert supported, reason


# ----------------------------------------------------------------------------- ring transports


def _ring_gradients(rank: int, world_size: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Worker: every ring setup's forward and backward on flex (direct backward) and on the tiles."""
    from csbp.attention.layouts import rank_layout
    from csbp.attention.transports.factory import build_attention
    from csbp.parallel.comm import Comm, TrafficCounter
    from csbp.parallel.groups import build_process_groups

    flex_module._has_flex_backward = lambda device: True  # this worker only: the CPU runs aot_eager
    flex_backward.set_flex_backward("direct")
    results = []
    for topology, transport, window in RING_SETUPS:
        groups = build_process_groups(topology)
        layout = rank_layout(topology, groups.coords.local_rank, L, B, window=window)
        q, k, v = random_qkv(len(layout.rows), len(layout.rows), dim=16, seed=21 + rank)
        dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(rank), dtype=q.dtype)
        grads = []
        for backend in ("flex", "tiles"):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            attention = build_attention(
                topology, groups.coords.local_rank, layout, Comm(groups.ring, TrafficCounter()),
                block_size=B, transport=transport, window=window, backend=backend,
            )
            (attention(*leaves, 0) * dout).sum().backward()
            grads.append([t.grad for t in leaves])
        results.append(list(zip(*grads)))
    return results


@needs_direct
@pytest.mark.slow
@pytest.mark.multiprocess
def test_ring_transports_train_on_flex_with_the_direct_backward() -> None:
    from csbp.parallel.launch import run_local

    for rank_results in run_local(_ring_gradients, 2, timeout_s=300.0):
        for pairs, setup in zip(rank_results, RING_SETUPS):
            for name, (flex_grad, tiles_grad) in zip("qkv", pairs):
                torch.testing.assert_close(flex_grad, tiles_grad, **TOL64, msg=lambda m, s=setup, n=name: f"{s} d{n}: {m}")



@needs_direct
def test_a_compiler_failure_of_the_direct_backward_is_one_line_with_the_way_out(
    monkeypatch: pytest.MonkeyPatch, flex_trains_on_cpu: None
) -> None:
    """Inductor failing on the direct call (never run on a GPU in this repository's CI) names the
    switch back to recompute; out of memory and other errors pass through unchanged."""

    class LoweringFailed(Exception):
        pass

    LoweringFailed.__module__ = "torch._inductor.exc"
    q_rows, k_rows, _ = _layout_cases()["reference"]
    partial = build_flex_partial(q_rows, k_rows, block=8)
    q, k, v = random_qkv(len(q_rows), len(k_rows), dim=16, seed=2)
    out, lse = partial.forward(q, k, v)
    for raised, expected in ((LoweringFailed("LoweringException: no template\nstack"), RuntimeError),
                             (torch.OutOfMemoryError("CUDA out of memory"), torch.OutOfMemoryError)):
        def failing(*args, error=raised, **kwargs):
            raise error

        monkeypatch.setattr(flex_backward, "_compiled_backward", lambda backend, fn=failing: fn)
        with pytest.raises(expected) as error, flex_backward.flex_backward_mode("direct"):
            partial.backward(q, k, v, out, lse, torch.randn_like(q))
        if expected is RuntimeError:
            message = str(error.value)
            assert "\n" not in message and "LoweringFailed: LoweringException: no template" in message
            assert message.endswith("set attention.flex_backward: recompute")
        else:
            assert error.value is raised
