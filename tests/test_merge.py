"""Online-softmax merge (csbp.md §9.2, §18.3): merging partials over any key partition equals one
softmax over the union; empty rows give 0 / -inf without NaN; the shard chain rule matches
autograd. Tolerances: float64 ``atol = rtol = 1e-10``."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from csbp.attention.merge import (
    accumulation_dtype,
    merge_many,
    merge_partials,
    partial_grads_from_merged,
    row_delta,
)

TOL64 = {"atol": 1e-10, "rtol": 1e-10}


def softmax_partial(scores: Tensor, values: Tensor, allow: Tensor) -> tuple[Tensor, Tensor]:
    """Partial ``(out [R, d], lse [R])`` of ``scores [R, K]`` over the allowed keys (tests' own oracle)."""
    has_key = allow.any(-1)
    masked = scores.masked_fill(~allow, float("-inf")).masked_fill(~has_key[:, None], 0.0)
    out = torch.softmax(masked, -1) @ values * has_key[:, None]
    return out, torch.logsumexp(masked, -1).masked_fill(~has_key, float("-inf"))


def random_problem(rows: int = 6, keys: int = 10, dim: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    scores = 3 * torch.randn(rows, keys, generator=gen, dtype=torch.float64)
    values = torch.randn(keys, dim, generator=gen, dtype=torch.float64)
    allow = torch.rand(rows, keys, generator=gen) < 0.6
    allow[0] = False  # a row that sees nothing at all
    allow[1, :] = False
    allow[1, 7] = True  # a row that sees exactly one key (in the last subset only)
    return scores, values, allow


def split(keys: int, num_parts: int, seed: int) -> list[Tensor]:
    owner = torch.randint(0, num_parts, (keys,), generator=torch.Generator().manual_seed(seed))
    owner[7] = num_parts - 1
    return [owner == part for part in range(num_parts)]


@pytest.mark.parametrize("num_parts", [2, 3, 5])
def test_merge_over_arbitrary_partition_equals_union(num_parts: int) -> None:
    scores, values, allow = random_problem()
    out_ref, lse_ref = softmax_partial(scores, values, allow)
    partials = [softmax_partial(scores, values, allow & part[None, :]) for part in split(10, num_parts, 3)]
    out, lse = merge_many(partials)
    torch.testing.assert_close(out, out_ref, **TOL64)
    torch.testing.assert_close(lse, lse_ref, **TOL64)
    assert bool((out[0] == 0).all()) and float(lse[0]) == float("-inf")
    assert not out.isnan().any()
    out_reversed, lse_reversed = merge_many(partials[::-1])
    torch.testing.assert_close(out_reversed, out_ref, **TOL64)
    torch.testing.assert_close(lse_reversed, lse_ref, **TOL64)


def test_merge_with_empty_partials_is_identity() -> None:
    scores, values, allow = random_problem(seed=1)
    out_ref, lse_ref = softmax_partial(scores, values, allow)
    empty = (torch.zeros_like(out_ref), torch.full_like(lse_ref, float("-inf")))
    out, lse = merge_partials(*empty, out_ref, lse_ref)
    torch.testing.assert_close(out, out_ref, **TOL64)
    torch.testing.assert_close(lse, lse_ref, **TOL64)
    out, lse = merge_partials(*empty, *empty)
    assert bool((out == 0).all()) and bool((lse == float("-inf")).all())


def test_merge_is_stable_for_large_scores() -> None:
    scores, values, allow = random_problem(seed=2)
    scores = scores + 1e4  # exp would overflow without the log-sum-exp form
    out_ref, lse_ref = softmax_partial(scores, values, allow)
    out, lse = merge_many(
        [softmax_partial(scores, values, allow & part[None, :]) for part in split(10, 2, 4)]
    )
    torch.testing.assert_close(out, out_ref, **TOL64)
    torch.testing.assert_close(lse, lse_ref, atol=1e-10, rtol=1e-14)


def test_partial_grads_from_merged_match_autograd() -> None:
    scores, values, allow = random_problem(seed=5)
    parts = split(10, 3, 6)
    partials = [softmax_partial(scores, values, allow & part[None, :]) for part in parts]
    leaves = [(out.clone().requires_grad_(True), lse.clone().requires_grad_(True)) for out, lse in partials]
    out, lse = merge_many(leaves)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    (out * dout).sum().backward()
    for (out_part, lse_part), (leaf_out, leaf_lse) in zip(partials, leaves):
        dout_part, dlse_part = partial_grads_from_merged(out_part, lse_part, out.detach(), lse.detach(), dout)
        has_key = torch.isfinite(lse.detach())  # autograd through an all-empty row is 0 as well
        torch.testing.assert_close(dout_part[has_key], leaf_out.grad[has_key], **TOL64)
        torch.testing.assert_close(dlse_part[has_key], leaf_lse.grad[has_key], **TOL64)
        assert not dout_part.isnan().any() and not dlse_part.isnan().any()
        assert not leaf_out.grad.isnan().any() and not leaf_lse.grad.isnan().any()
        assert bool((dout_part[~has_key] == 0).all()) and bool((dlse_part[~has_key] == 0).all())


class _OutputSizedOps(TorchDispatchMode):
    """The aten ops run inside it that return a tensor of ``numel`` elements (output-sized passes)."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.ops = numel, []

    def __enter__(self) -> list[str]:  # type: ignore[override]
        super().__enter__()
        return self.ops

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        result = func(*args, **(kwargs or {}))
        if isinstance(result, Tensor) and result.numel() == self.numel:
            self.ops.append(str(func))
        return result


def test_merge_passes_over_the_outputs_once_and_keeps_one_sided_rows_exactly() -> None:
    """The merge is memory-bound on a GPU: one op writes an output-sized tensor (a lerp by the second
    weight; the two scalings and the sum it replaced were three), and a row that only one partial
    sees gets that partial's output bit for bit."""
    gen = torch.Generator().manual_seed(4)
    out1, out2 = torch.randn(2, 3, 8, 16, generator=gen), torch.randn(2, 3, 8, 16, generator=gen)
    lse1, lse2 = torch.randn(2, 3, 8, generator=gen), torch.randn(2, 3, 8, generator=gen)
    lse1[..., 0], lse2[..., 1] = float("-inf"), float("-inf")
    out1[..., 0, :] = 0.0
    out2[..., 1, :] = 0.0
    with _OutputSizedOps(out1.numel()) as full_size:
        out, lse = merge_partials(out1, lse1, out2, lse2)
    assert len(full_size) == 1, full_size
    assert torch.equal(out[..., 0, :], out2[..., 0, :]) and torch.equal(out[..., 1, :], out1[..., 1, :])
    assert torch.equal(lse[..., 0], lse2[..., 0]) and torch.equal(lse[..., 1], lse1[..., 1])


def test_row_delta_promotes_dout_inside_the_product() -> None:
    """``rowsum(dout * out)`` with a bf16 ``dout`` and the fp32 merged ``out``: bit for bit the values of
    casting ``dout`` first, without that cast's output-sized pass (one product, then the row sum)."""
    gen = torch.Generator().manual_seed(5)
    out = torch.randn(2, 3, 8, 16, generator=gen)
    dout = torch.randn(2, 3, 8, 16, generator=gen).to(torch.bfloat16)
    with _OutputSizedOps(out.numel()) as full_size:
        delta = row_delta(dout, out, torch.float32)
    assert full_size == ["aten.mul.Tensor"], full_size
    assert delta.dtype == torch.float32 and torch.equal(delta, (dout.float() * out).sum(-1))
    assert row_delta(dout, out.double(), torch.float64).dtype == torch.float64


def test_merge_into_a_slice_in_place_equals_merge_partials() -> None:
    from csbp.attention.merge import merge_into

    gen = torch.Generator().manual_seed(6)
    out, out2 = torch.randn(2, 3, 10, 4, generator=gen, dtype=torch.float64), torch.randn(2, 3, 4, 4, generator=gen)
    lse, lse2 = torch.randn(2, 3, 10, generator=gen, dtype=torch.float64), torch.randn(2, 3, 4, generator=gen)
    lse[..., 3], lse2[..., 1] = float("-inf"), float("-inf")
    out[..., 3, :] = 0.0
    want_out, want_lse = merge_partials(out[:, :, 2:6], lse[:, :, 2:6], out2, lse2)
    before_out, before_lse = out.clone(), lse.clone()
    merge_into(out[:, :, 2:6], lse[:, :, 2:6], out2, lse2)
    torch.testing.assert_close(out[:, :, 2:6], want_out, **TOL64)
    torch.testing.assert_close(lse[:, :, 2:6], want_lse, **TOL64)
    outside = [0, 1, 6, 7, 8, 9]
    assert torch.equal(out[:, :, outside], before_out[:, :, outside])
    assert torch.equal(lse[:, :, outside], before_lse[:, :, outside])
    with pytest.raises(ValueError, match="must be in the accumulation dtype torch.float32"):
        merge_into(out2.bfloat16(), lse2, out2, lse2)


def test_accumulation_dtype_and_low_precision_inputs() -> None:
    scores, values, allow = random_problem(seed=8)
    (out1, lse1), (out2, lse2) = (
        softmax_partial(scores, values, allow & p[None, :]) for p in split(10, 2, 9)
    )
    out, _ = merge_partials(out1.float(), lse1.float(), out2, lse2)
    assert out.dtype == torch.float64
    out_bf, lse_bf = merge_partials(out1.bfloat16(), lse1.float(), out2.bfloat16(), lse2.float())
    assert out_bf.dtype == torch.float32 and lse_bf.dtype == torch.float32
    assert accumulation_dtype(out1.half()) == torch.float32


def test_invalid_merges_raise() -> None:
    with pytest.raises(ValueError, match="at least one"):
        merge_many([])
    out, lse = torch.zeros(3, 4), torch.zeros(3)
    with pytest.raises(ValueError, match="out"):
        merge_partials(out, lse, torch.zeros(3, 5), lse)


def _merge_rows(fn_name: str, gen: torch.Generator, rows: slice) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """Arguments for ``fn_name`` over ``rows`` of a 64-row buffer, and a copy of them for the eager call."""
    num_rows = rows.stop - rows.start
    if fn_name == "_row_delta":
        dout, out = torch.randn(1, 4, num_rows, 16, generator=gen).to(torch.bfloat16), torch.randn(1, 4, 64, 16, generator=gen)
        return (dout, out[:, :, rows], torch.float32), (dout, out[:, :, rows].clone(), torch.float32)
    out_dtype = torch.bfloat16 if fn_name == "_rounded_merge" else torch.float32
    out, lse = torch.randn(1, 4, 64, 16, generator=gen).to(out_dtype), torch.randn(1, 4, 64, generator=gen)
    out2 = torch.randn(1, 4, num_rows, 16, generator=gen).to(torch.bfloat16)  # a kernel's output
    lse2 = torch.randn(1, 4, num_rows, generator=gen)
    lse[..., rows.start] = float("-inf")  # a row the first partial does not see: the second's, exactly
    return (out[:, :, rows], lse[:, :, rows], out2, lse2), (out[:, :, rows].clone(), lse[:, :, rows].clone(), out2, lse2)


@pytest.mark.parametrize("fn_name", ["_rounded_merge", "_merge_in_place", "_row_delta"])
def test_the_compiled_passes_trace_whole_and_serve_every_row_count(fn_name: str) -> None:
    """On CUDA the merges into a buffer and ``row_delta`` run compiled once (``merge.compiled``: fullgraph,
    dynamic shapes). Tracing and graph breaks do not depend on the device, so the CPU checks that
    compilation: row slices of two different counts (the pieces' rows) through one compiled function,
    in place where it merges, against the eager function (equal up to rounding: Inductor's exp, lerp and
    sums are not bit-identical to ATen's)."""
    import torch._dynamo

    from csbp.attention import merge as merge_module

    fn = getattr(merge_module, fn_name)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    merge_module.compiled.cache_clear()
    gen = torch.Generator().manual_seed(7)
    for rows in (slice(3, 40), slice(40, 64)):
        args, eager_args = _merge_rows(fn_name, gen, rows)
        got, want = merge_module.compiled(fn)(*args), fn(*eager_args)
        if fn_name == "_row_delta":
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            continue
        tol = {"atol": 1e-2, "rtol": 1e-2} if args[0].dtype == torch.bfloat16 else {"atol": 1e-6, "rtol": 1e-6}
        torch.testing.assert_close(args[0].float(), eager_args[0].float(), **tol)
        torch.testing.assert_close(args[1], eager_args[1], atol=1e-6, rtol=1e-6)
        assert torch.equal(args[0][:, :, 0], args[2][:, :, 0].to(args[0].dtype))
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs == 1, f"{graphs} graphs: {fn_name} recompiled for a new row count or broke its graph"


def test_merges_and_row_delta_run_compiled_only_for_fp32_on_cuda() -> None:
    """Compiled for fp32 work on CUDA; eager on the CPU and for float64 (exactness checks) on CUDA."""
    from types import SimpleNamespace

    from csbp.attention import merge as merge_module

    fn = merge_module._row_delta
    on_cuda = SimpleNamespace(device=torch.device("cuda"))  # only the device type is read: no GPU needed
    assert merge_module._on_cuda_compiled(fn, on_cuda, torch.float32) is merge_module.compiled(fn)  # type: ignore[arg-type]
    assert merge_module._on_cuda_compiled(fn, on_cuda, torch.float64) is fn  # type: ignore[arg-type]
    assert merge_module._on_cuda_compiled(fn, torch.zeros(1), torch.float32) is fn
