"""FlexAttention shape buckets: partials whose size changes from step to step compile a bounded set
of kernels (issue #8: "compiled once per shape bucket, no recompilation per step").

The compiled kernel has static shapes. A packed-document halo (CSBP, cp-aware) and a BP-only rank's
document prefix change their row counts with every batch, so before shape buckets each new batch
compiled a new graph on the GPU (seconds each) until dynamo's limit, then ran the dense eager path.
These tests check on CPU:

* ``flex_shape_bucket``: whole blocks, two buckets per doubling, never more than 1.5x the rows;
* padded partials equal the tiles (forward) and the float64 reference (backward, with a dense
  stand-in for the kernel, as FlexAttention has no CPU backward);
* over many random document draws the kernel sees only bucket shapes, far fewer than the raw sizes;
* the real compiled (inductor, CPU inference) kernel compiles one graph for two sizes in one bucket;
* hitting dynamo's recompile limit is one clear error, not a silent fall back to the eager path;
* the ``mixed-ag`` baseline of ``csbp bench kernels`` (one FlexAttention call under torch's autograd)
  is exact and calls the kernel once.
"""

from __future__ import annotations

import math

import pytest
import torch

import csbp.attention.flex as flex_module
import csbp.attention.flex_backward as flex_backward_module
from csbp.attention.backends import plan_partial
from csbp.attention.documents import random_documents
from csbp.attention.flex import build_flex_partial, flex_autograd_attention, flex_shape_bucket
from csbp.attention.layouts import bd3_rows, bp_only_layout, halo_exchange_plan, rank_layout, reference_layout
from csbp.attention.rows import allow_matrix
from csbp.bench.kernels import _form_step
from csbp.masks import dense_mask
from csbp.topology import Topology
from test_kernel import TOL64, dense_attention_reference, random_qkv, reference_grads

pytestmark = pytest.mark.filterwarnings("ignore:.*flex_attention called without torch.compile.*")


@pytest.mark.parametrize("block", [1, 8, 128])
def test_shape_bucket_is_a_short_ladder_of_whole_blocks(block: int) -> None:
    buckets = [flex_shape_bucket(n, block) for n in range(0, 70 * block + 1)]
    assert buckets[0] == 0
    for n, bucket in enumerate(buckets):
        assert bucket >= n and bucket % block == 0
        assert flex_shape_bucket(bucket, block) == bucket  # a bucket needs no padding
        if n:
            assert bucket <= 1.5 * block * math.ceil(n / block)
    assert buckets == sorted(buckets)
    # two per doubling: 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96 blocks
    assert sorted(set(buckets)) == [block * b for b in (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96)]
    with pytest.raises(ValueError, match="num_rows >= 0"):
        flex_shape_bucket(-1, block)


def test_padded_partial_forward_equals_tiles() -> None:
    """Rows off the bucket ladder (80 x 37 rows, blocks of 8 -> 96 x 48): dead padding rows change
    nothing, also for GQA and rows that see nothing."""
    rows = reference_layout(40, 4, window=7).rows
    keys = rows.select(torch.arange(3, 40))
    partial = build_flex_partial(rows, keys, block=8)
    assert (partial.padded_queries, partial.padded_keys) == (96, 48)
    q, k, v = random_qkv(len(rows), len(keys), seed=3)
    out, lse = partial.forward(q, k, v)
    want_out, want_lse = plan_partial(rows, keys, backend="tiles").forward(q, k, v)
    assert out.shape == want_out.shape and lse.shape == want_lse.shape
    torch.testing.assert_close(out, want_out, **TOL64)
    torch.testing.assert_close(lse, want_lse, **TOL64)


@pytest.mark.parametrize("mode", ["recompute", "direct"])
def test_padded_partial_backward_is_exact(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """The backward of a padded partial (dense autograd stand-in for the forward kernel, which sees the
    padded rows; ``direct``: FlexAttention's backward operator under aot_eager) sliced back to the real
    rows equals the float64 reference."""
    from test_flex_backend import dense_flex_call, pin_flex_backward

    pin_flex_backward(monkeypatch, mode)
    monkeypatch.setattr(flex_module, "_flex_call", dense_flex_call)
    monkeypatch.setattr(flex_module, "_has_flex_backward", lambda device: True)
    rows = reference_layout(40, 4, window=7).rows
    partial = build_flex_partial(rows, rows, block=8)
    assert partial.padded_queries > len(rows)
    q, k, v = random_qkv(len(rows), len(rows), dim=16, seed=5)
    out, lse = partial.forward(q, k, v)
    dout = torch.randn_like(q)
    grads = partial.backward(q, k, v, out, lse, dout)
    _, _, want = reference_grads(q, k, v, allow_matrix(rows, rows), 1 / math.sqrt(16), dout)
    for got, ref in zip(grads, want):
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, **TOL64)


def _kernel_shapes(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Record ``(Nq, Nk)`` of every kernel call (the real eager flex still runs)."""
    seen: list[tuple[int, int]] = []
    real = flex_module._flex_call

    def recording(q, k, v, block_mask, scale):
        seen.append((q.shape[2], k.shape[2]))
        return real(q, k, v, block_mask, scale)

    monkeypatch.setattr(flex_module, "_flex_call", recording)
    return seen


def test_changing_documents_reuse_a_few_kernel_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """24 document draws: a BP-only rank's rows (noisy blocks + document prefix) and a CSBP ring
    member's halo (the clean rows its queries may see) change size with every draw; the kernel sees
    only bucket shapes, far fewer than the raw sizes (a run compiles each once)."""
    seq_len, block_size = 512, 8
    seen = _kernel_shapes(monkeypatch)
    raw: set[tuple[int, int]] = set()
    for seed in range(24):
        documents = random_documents(seq_len, 48, torch.Generator().manual_seed(seed))
        rows = bp_only_layout(seq_len, block_size, 4, 1, documents=documents).rows
        plan = halo_exchange_plan(seq_len, block_size, 2, 2, 0, documents=documents)
        member = rank_layout(Topology(cp=2, bp=2), 1, seq_len, block_size, documents=documents).rows
        halo = bd3_rows(torch.zeros(0, dtype=torch.long), plan.recv_positions(1), block_size=block_size)
        for queries, keys in ((rows, rows), (member, halo)):
            raw.add((len(queries), len(keys)))
            q, k, v = random_qkv(len(queries), len(keys), samples=1, dtype=torch.float32, seed=seed)
            plan_partial(queries, keys, backend="flex").forward(q, k, v)
    shapes = set(seen)
    assert len(raw) >= 12, raw  # the sizes really change (else the test proves nothing)
    assert len(shapes) <= 5, shapes
    assert all(flex_shape_bucket(n) == n for shape in shapes for n in shape)


def test_compiled_kernel_compiles_once_per_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real block-sparse kernel (inductor on CPU, inference: no lse) behind ``FlexPartial``: two
    row sets of different sizes in one bucket run one compiled graph."""
    from torch.nn.attention.flex_attention import flex_attention

    compiled = torch.compile(flex_attention, dynamic=False)

    def compiled_call(q, k, v, block_mask, scale):
        out = compiled(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        return out, q.new_zeros(q.shape[:3])  # no lse on CPU; the forward's out is what is checked

    monkeypatch.setattr(flex_module, "_flex_call", compiled_call)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for seq_len in (40, 44):  # 80 and 88 rows: one bucket of 96 (blocks of 16)
        rows = reference_layout(seq_len, 4).rows
        q, k, v = random_qkv(len(rows), len(rows), dtype=torch.float32, seed=seq_len)
        partial = build_flex_partial(rows, rows, block=16)
        assert partial.padded_queries == 96
        with torch.no_grad():
            out, _ = partial.forward(q, k, v)
        want, _ = plan_partial(rows, rows, backend="tiles").forward(q, k, v)
        torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_recompile_limit_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the recompile limit dynamo would run the dense eager path (out of memory at long
    context); csbp asks dynamo to fail instead and names the cause and the fix."""
    from torch._dynamo.exc import FailOnRecompileLimitHit

    def over_the_limit(*args, **kwargs):
        raise FailOnRecompileLimitHit("Hard failure due to fail_on_recompile_limit_hit")

    monkeypatch.setattr(flex_module, "_kernel", lambda device, dtype: over_the_limit)
    rows = reference_layout(8, 4).rows
    q, k, v = random_qkv(len(rows), len(rows), seed=1)
    with pytest.raises(RuntimeError, match="more than .* compiled shapes.*attention.backend: tiles"):
        build_flex_partial(rows, rows).forward(q, k, v)


def test_compiled_flex_fails_instead_of_falling_back() -> None:
    """The compiled entry point raises dynamo's limit to ``FLEX_RECOMPILE_LIMIT`` and turns the
    silent eager fall back past it into an error."""
    config = torch._dynamo.config
    saved = (config.recompile_limit, config.fail_on_recompile_limit_hit)
    flex_module._compiled_flex.cache_clear()
    try:
        flex_module._compiled_flex()
        assert config.recompile_limit >= flex_backward_module.FLEX_RECOMPILE_LIMIT
        assert config.fail_on_recompile_limit_hit is True
    finally:
        config.recompile_limit, config.fail_on_recompile_limit_hit = saved
        flex_module._compiled_flex.cache_clear()


def _dense_stand_in_kernel(q, k, v, *, block_mask, scale, enable_gqa, return_aux=None):
    """FlexAttention's call signature over a dense autograd softmax of the BlockMask's ``mask_mod``
    (FlexAttention has no CPU backward)."""
    allow = dense_mask(block_mask.mask_mod, q.shape[2], k.shape[2])
    out, lse = dense_attention_reference(q, k, v, allow, 1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if return_aux is None:
        return out
    return out, type("Aux", (), {"lse": lse})()


def test_autograd_baseline_is_one_exact_flex_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """``flex_autograd_attention`` (``csbp bench kernels``' ``mixed-ag`` baseline: one call, torch's
    autograd, no recomputed forward) over padded rows equals the float64 reference, and the bench
    step runs it once forward and once backward."""
    calls = []

    def counting_kernel(*args, **kwargs):
        calls.append(kwargs.get("return_aux") is not None)
        return _dense_stand_in_kernel(*args, **kwargs)

    monkeypatch.setattr(flex_module, "_kernel", lambda device, dtype: counting_kernel)
    rows = reference_layout(40, 4).rows
    partial = build_flex_partial(rows, rows)
    assert partial.padded_queries == 128 > len(rows)
    q, k, v = random_qkv(len(rows), len(rows), dim=16, seed=9)
    dout = torch.randn_like(q)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = flex_autograd_attention(*leaves, partial)
    out.backward(dout)
    allow = allow_matrix(rows, rows)
    want_out, _, want_grads = reference_grads(q, k, v, allow, 1 / math.sqrt(16), dout)
    torch.testing.assert_close(out.detach(), want_out, **TOL64)
    for leaf, want in zip(leaves, want_grads):
        torch.testing.assert_close(leaf.grad, want, **TOL64)
    assert calls == [True]  # one call (with lse: the same compiled graph as a partial's backward)
    calls.clear()
    _form_step(q, k, v, dout, rows, 40, 4, "flex", "mixed-ag", "-", "-")()
    assert calls == [True]
    with pytest.raises(ValueError, match="mixed-ag form is one FlexAttention call"):
        _form_step(q, k, v, dout, rows, 40, 4, "tiles", "mixed-ag", "-", "-")


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_one_flex_partial_runs_under_autograd_without_a_recomputed_forward(
    monkeypatch: pytest.MonkeyPatch, checkpointed: bool
) -> None:
    """The local transport on flex with the flex diagonal (the CUDA default: one BlockMask over the
    mixed mask) has nothing to merge, so it runs FlexAttention under torch's autograd: exact in
    float64, one kernel call per forward and none in the backward (the transport path recomputed
    the forward there), also under non-reentrant activation checkpointing (one recompute there)."""
    from torch.utils.checkpoint import checkpoint

    import csbp.attention.transports.local as local_module
    from csbp.attention.transports.local import LocalAttentionFn

    calls = []

    def counting_kernel(*args, **kwargs):
        calls.append("lse" if kwargs.get("return_aux") is not None else "out")
        return _dense_stand_in_kernel(*args, **kwargs)

    monkeypatch.setattr(flex_module, "_kernel", lambda device, dtype: counting_kernel)
    monkeypatch.setattr(local_module, "_flex_autograd_runs_on", lambda device: True)  # the stand-in differentiates
    monkeypatch.setattr(flex_backward_module, "_mode", "recompute")  # the transport path would call it again
    rows = reference_layout(40, 4, window=9).rows
    attention = LocalAttentionFn(rows, num_noisy=40, backend="flex", diagonal="flex")
    q, k, v = random_qkv(len(rows), len(rows), dim=16, seed=4)
    dout = torch.randn_like(q)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    out = checkpoint(attention, *leaves, use_reentrant=False) if checkpointed else attention(*leaves)
    assert calls == ["lse"]
    out.backward(dout)
    assert calls == ["lse"] * (2 if checkpointed else 1)
    want_out, _, want_grads = reference_grads(q, k, v, allow_matrix(rows, rows), 1 / math.sqrt(16), dout)
    torch.testing.assert_close(out.detach(), want_out, **TOL64)
    for leaf, want in zip(leaves, want_grads):
        torch.testing.assert_close(leaf.grad, want, **TOL64)


def test_empty_flex_partial_under_autograd_gives_zeros_and_zero_gradients() -> None:
    rows = reference_layout(8, 4).rows
    dead = rows.select(torch.arange(len(rows)))
    dead = type(dead)(dead.pos, dead.clean, dead.block, dead.ctx_start, dead.ctx_stop, torch.zeros_like(dead.live))
    partial = build_flex_partial(dead, dead)
    assert partial.block_mask is None
    leaves = [t.requires_grad_(True) for t in random_qkv(len(rows), len(rows), seed=2)]
    out = flex_autograd_attention(*leaves, partial)
    out.sum().backward()
    assert not out.detach().any() and all(not leaf.grad.any() for leaf in leaves)


@pytest.mark.slow
def test_compiled_kernel_honours_padded_block_masks_of_every_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real block-sparse kernel (inductor on CPU, inference) skips what the BlockMask says is
    empty and applies no ``mask_mod`` in blocks it says are full (the eager path the other CPU tests
    run evaluates ``mask_mod`` everywhere): on every layout's rows, padded to their shape bucket in
    blocks of 16, it equals the tiles (rows that see nothing give zeros in both)."""
    from torch.nn.attention.flex_attention import flex_attention

    from test_flex_backend import CASES

    compiled = torch.compile(flex_attention, dynamic=False)

    def compiled_call(q, k, v, block_mask, scale):
        out = compiled(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
        return out, q.new_zeros(q.shape[:3])

    monkeypatch.setattr(flex_module, "_flex_call", compiled_call)
    padded = 0
    for name, (q_rows, k_rows, causal) in CASES.items():
        partial = build_flex_partial(q_rows, k_rows, causal_in_block=causal, block=16)
        padded += (partial.padded_queries, partial.padded_keys) != (len(q_rows), len(k_rows))
        q, k, v = random_qkv(len(q_rows), len(k_rows), dim=16, dtype=torch.float32, seed=7)
        with torch.no_grad():
            out, _ = partial.forward(q, k, v)
        want, _ = plan_partial(q_rows, k_rows, backend="tiles", causal_in_block=causal).forward(q, k, v)
        torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert padded >= 3  # several cases exercise the padding
