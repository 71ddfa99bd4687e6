"""FlexAttention partials over interval row metadata: the accelerator backend (csbp.md §9.1, §9.2).

The mask is ``csbp.masks.rows_mask(q_rows, k_rows)``, the same predicate the tiled kernels and
the dense reference evaluate; its ``BlockMask`` is built from the row intervals, never from a dense
mask (``csbp.attention.flex_block_mask``).

``FlexPartial`` is one key set's partial ``(out, lse)``:

* forward: ``flex_attention(..., enable_gqa=True, return_aux=AuxRequest(lse=True))``; K/V are
  never repeated for GQA. On CUDA the call is ``torch.compile``-d with static shapes: dynamo keeps
  one graph per shape, and the row tensors are lifted as buffers, so new rows of the same shapes do
  not recompile. Query and key rows are padded with dead rows to a **shape bucket**
  (``flex_shape_bucket``: whole blocks, ``2^k`` or ``1.5 * 2^k`` of them), because some partials
  change size from step to step (a packed-document halo, a BP-only rank's document prefix): without
  buckets each new size compiled a new graph (seconds on a GPU) until dynamo's limit, past which it
  would silently run the unfused path; csbp makes that limit an error instead. On CPU the compiled
  kernel is inference-only and has no ``lse``, so the eager (dense, unfused) FlexAttention runs:
  correct, for tests and debugging, not fast. Heads narrower than 16 (the verification model's 8),
  which the CUDA kernel refuses, run zero-padded to 16 on every device (exact; ``pad_head_dim``).
* backward (CUDA only: FlexAttention has no compiled CPU backward), from the merged ``(out, lse)``
  (``csbp.attention.flex_backward``): ``direct``, FlexAttention's backward kernel called with the
  merged statistics (no forward; torch 2.11, 2.13 and 2.14.1), or ``recompute``, the partial recomputed with autograd
  and differentiated with the chain rule through the merge (``merge.partial_grads_from_merged``:
  ``dout_p = w·dout``, ``dlse_p = w·<dout, out_p - out>``, ``w = exp(lse_p - lse)``). Both equal the
  explicit backward from the merged statistics.

Outputs are in the accumulation dtype (float32 for bf16 inputs), like the tiled kernels.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from csbp.attention.flex_backward import (
    FLEX_MIN_HEAD_DIM,
    configure_recompile_limits,
    current_flex_backward,
    direct_flex_backward,
    pad_head_dim,
    recompile_limit_error,
)
from csbp.attention.flex_block_mask import DEFAULT_FLEX_BLOCK, rows_block_mask
from csbp.attention.merge import accumulation_dtype, partial_grads_from_merged
from csbp.attention.rows import Rows
from csbp.masks.predicates import rows_mask_buffers, rows_predicate

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask


@dataclass(frozen=True, eq=False)
class FlexPartial:
    """Attention of ``q_rows`` over ``k_rows`` with FlexAttention; build with ``build_flex_partial``.

    Attributes:
        q_rows, k_rows: the row metadata (on the compute device).
        causal_in_block: lower-triangular block-diagonal part.
        block_mask: the ``BlockMask`` of the rows padded to ``padded_queries`` x ``padded_keys``
            (None when no pair is allowed: the partial is empty).
        padded_queries, padded_keys: the kernel's row counts (``flex_shape_bucket`` of the rows').
        mask_buffers: the padded rows' tensors the mask reads (``masks.rows_mask_buffers``), handed
            to the direct backward as the mask's buffers.
    """

    q_rows: Rows
    k_rows: Rows
    causal_in_block: bool
    block_mask: BlockMask | None
    padded_queries: int
    padded_keys: int
    mask_buffers: tuple[Tensor, ...]

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None, kernel_dtype: bool = False
    ) -> tuple[Tensor, Tensor]:
        """``(out [S, Hq, Nq, d], lse [S, Hq, Nq])`` in the accumulation dtype (``out`` in q's with
        ``kernel_dtype``: the kernel's result, its leading rows as a view when padded)."""
        _check_shapes(q, k, v, self)
        dtype = accumulation_dtype(q, k, v)
        if self.block_mask is None:
            return _empty_partial(q, v, dtype)
        with torch.no_grad():  # detached: FlexAttention refuses CPU inputs that require grad, even here
            out, lse = _flex_call(*self._padded(q.detach(), k.detach(), v.detach()), self.block_mask, scale)
        if kernel_dtype:
            return out[:, :, : q.shape[2]], _leading_rows(lse, q.shape[2]).to(dtype)
        return _leading_rows(out, q.shape[2]).to(dtype), _leading_rows(lse, q.shape[2]).to(dtype)

    def backward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        out: Tensor,
        lse: Tensor,
        dout: Tensor,
        *,
        scale: float | None = None,
        delta: Tensor | None = None,
        kernel_dtype: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(dq, dk, dv)`` of this key set's share, from the final merged ``out``/``lse`` and ``dout``, in the
        accumulation dtype (with ``kernel_dtype`` in the kernel's, q's: no cast pass and no copy of a padded
        result; ``delta = <dout, out>``, computed here when not given), by the process's flex backward
        (``csbp.attention.flex_backward``): the kernel's backward from the merged statistics
        (``direct``) or the partial recomputed under autograd (``recompute``)."""
        _check_shapes(q, k, v, self)
        dtype = accumulation_dtype(q, k, v)
        if self.block_mask is None:
            return q.new_zeros(q.shape, dtype=dtype), k.new_zeros(k.shape, dtype=dtype), v.new_zeros(v.shape, dtype=dtype)
        if not _has_flex_backward(q.device):
            raise NotImplementedError(
                "attention.backend=flex cannot train on CPU (FlexAttention has no CPU backward); "
                "use attention.backend: tiles (or auto) on CPU"
            )
        if current_flex_backward() == "direct" and not _eager_on_cuda(q, k, v):
            extra = self.padded_queries - q.shape[2]
            grads = direct_flex_backward(  # no delta given: formed from out inside the compiled call
                *self._padded(q.detach(), k.detach(), v.detach()),
                torch.nn.functional.pad(lse, (0, extra), value=float("-inf")),
                _pad_rows(dout, self.padded_queries),
                None if delta is None else torch.nn.functional.pad(delta, (0, extra)),
                self.block_mask,
                scale,
                mask_predicate=rows_predicate(self.causal_in_block),
                mask_buffers=self.mask_buffers,
                out=None if delta is not None else _pad_rows(out, self.padded_queries),
            )
        else:
            grads = self._recomputed_backward(q, k, v, out, lse, dout, scale)
        if kernel_dtype:
            return tuple(g[:, :, : x.shape[2]] for g, x in zip(grads, (q, k, v)))  # type: ignore[return-value]
        return tuple(  # type: ignore[return-value]
            _leading_rows(g, x.shape[2]).to(dtype) for g, x in zip(grads, (q, k, v))
        )

    def _recomputed_backward(
        self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, scale: float | None
    ) -> tuple[Tensor, ...]:
        """The partial's forward again under autograd, and the chain rule through the merge."""
        with torch.enable_grad():
            inputs = [x.requires_grad_() for x in self._padded(q.detach(), k.detach(), v.detach())]
            out_part, lse_part = _flex_call(*inputs, self.block_mask, scale)
            out_part, lse_part = out_part[:, :, : q.shape[2]], lse_part[:, :, : q.shape[2]]
            dout_part, dlse_part = partial_grads_from_merged(out_part.detach(), lse_part.detach(), out, lse, dout)
            return torch.autograd.grad(
                (out_part, lse_part), inputs, (dout_part.to(out_part.dtype), dlse_part.to(lse_part.dtype))
            )

    def _padded(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v with zero rows appended up to the kernel's shape bucket, in one dtype (the widest of
        theirs: FlexAttention's backward refuses mixed dtypes; the decoder already hands one dtype)."""
        dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
        q, k, v = (x.to(dtype) for x in (q, k, v))
        return _pad_rows(q, self.padded_queries), _pad_rows(k, self.padded_keys), _pad_rows(v, self.padded_keys)


def build_flex_partial(
    q_rows: Rows,
    k_rows: Rows,
    *,
    causal_in_block: bool = False,
    block: int = DEFAULT_FLEX_BLOCK,
) -> FlexPartial:
    """The FlexAttention partial of ``q_rows`` x ``k_rows``; build once per step, reuse in every layer.
    The kernel runs on the rows padded with dead rows to ``flex_shape_bucket`` of their counts. No
    device sync: ``csbp bench kernels`` times the build itself (``mask ms``)."""
    padded_queries, padded_keys = flex_shape_bucket(len(q_rows), block), flex_shape_bucket(len(k_rows), block)
    q_padded, k_padded = q_rows.padded(padded_queries), k_rows.padded(padded_keys)
    block_mask = rows_block_mask(q_padded, k_padded, causal_in_block=causal_in_block, block=block)
    return FlexPartial(q_rows, k_rows, causal_in_block, block_mask, padded_queries, padded_keys,
                       rows_mask_buffers(q_padded, k_padded))


def flex_autograd_attention(
    q: Tensor, k: Tensor, v: Tensor, partial: FlexPartial, *, scale: float | None = None
) -> Tensor:
    """``out [S, Hq, Nq, d]`` (q's dtype) of one FlexAttention call over ``partial``'s BlockMask under
    torch's own autograd: the field's standard single call, whose backward reuses the ``out``/``lse``
    its forward saved. csbp's transports merge several partials, so ``FlexPartial.backward`` is
    handed the merged statistics and recomputes its partial's forward first (one extra forward per
    backward). With nothing to merge the local transport runs this call instead (one flex partial:
    the CUDA default on one GPU, BP-only and data-parallel ranks), and ``csbp bench kernels`` times it
    as the mixed form's strongest baseline (``mixed-ag``). Differentiable on CUDA only, like every
    FlexAttention backward."""
    _check_shapes(q, k, v, partial)
    if partial.block_mask is None:  # no allowed pair: zeros, still on the graph (zero gradients)
        return q.new_zeros(*q.shape[:-1], v.shape[-1]) + 0 * (q.sum() + k.sum() + v.sum())
    # lse asked for though unused: the same compiled training graph as FlexPartial.backward's call
    out, _ = _flex_call(*partial._padded(q, k, v), partial.block_mask, scale)
    return _leading_rows(out, q.shape[2])


def flex_shape_bucket(num_rows: int, block: int = DEFAULT_FLEX_BLOCK) -> int:
    """The row count a FlexAttention call over ``num_rows`` rows is padded to: a whole number of
    ``block``s, ``2^k`` or ``3 * 2^(k-1)`` of them (two buckets per doubling, at most 1.5x the rows).

    The compiled kernel has static shapes, so every distinct count is a graph to compile. Padding rows
    are dead (``live = False``): dead key blocks are never scheduled and dead query blocks have no key
    block, so padding costs a copy of q/k/v but no attention work."""
    if num_rows < 0 or block < 1:
        raise ValueError(f"flex_shape_bucket needs num_rows >= 0 and block >= 1, got {num_rows}, {block}")
    blocks = -(-num_rows // block)
    power = 1 << max(blocks - 1, 0).bit_length()  # the smallest 2^k >= blocks (1 for 0 or 1 block)
    three_halves = 3 * power // 4
    if power % 4 == 0 and three_halves >= blocks:
        return block * three_halves
    return block * power if blocks > 0 else 0


# ----------------------------------------------------------------------------- the kernel call


@functools.lru_cache(maxsize=1)
def _compiled_flex() -> Any:
    """``torch.compile(flex_attention)``: dynamo keeps one graph per shape bucket (dynamic=False)."""
    from torch.nn.attention.flex_attention import flex_attention

    configure_recompile_limits()
    return torch.compile(flex_attention, dynamic=False)


def _flex_call(q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask, scale: float | None) -> tuple[Tensor, Tensor]:
    """``(out [S, Hq, Nq, d] in q's dtype, lse [S, Hq, Nq] float32, natural log)``; heads narrower than
    ``FLEX_MIN_HEAD_DIM`` run zero-padded to it (``pad_head_dim``)."""
    from torch.nn.attention.flex_attention import AuxRequest

    value_dim = v.shape[-1]
    if q.shape[-1] < FLEX_MIN_HEAD_DIM or value_dim < FLEX_MIN_HEAD_DIM:
        scale = q.shape[-1] ** -0.5 if scale is None else scale  # the real head dim's, not the padded one's
        q, k, v = (pad_head_dim(x) for x in (q, k, v))
    try:
        out, aux = _kernel(q.device, q.dtype)(
            q,
            k,
            v,
            block_mask=block_mask,
            scale=scale,
            enable_gqa=q.shape[1] != k.shape[1],
            return_aux=AuxRequest(lse=True),
        )
    except Exception as error:
        replacement = recompile_limit_error(error, q, k)
        if replacement is None:
            raise
        raise replacement from error
    return (out if out.shape[-1] == value_dim else out[..., :value_dim].contiguous()), aux.lse


def _kernel(device: torch.device, dtype: torch.dtype) -> Any:
    """The compiled kernel on CUDA; the eager (dense) FlexAttention elsewhere (CPU: tests and ``csbp
    verify``) and for float64 on CUDA, which the compiled kernel cannot build (its Triton template
    accumulates in float32; measured on an H200, torch 2.11: a compilation error) while the eager
    form is exact (1e-15 against a float64 reference). Float64 flex on CUDA is for exactness checks
    at small sizes (``csbp verify --device cuda``): training refuses it (``check_backend_trains_on``)."""
    return _compiled_flex() if device.type == "cuda" and dtype != torch.float64 else _eager_flex


def _eager_on_cuda(*tensors: Tensor) -> bool:
    """Float64 on CUDA runs the eager FlexAttention (``_kernel``), whose backward is its recomputed
    forward under autograd: the direct call would compile a float64 kernel."""
    return tensors[0].device.type == "cuda" and any(t.dtype == torch.float64 for t in tensors)


def _eager_flex(*args: Any, **kwargs: Any) -> Any:
    """FlexAttention's eager (dense) implementation, without its advice to compile: on the CPU csbp
    runs it on purpose, for exactness checks at small sizes."""
    from torch.nn.attention.flex_attention import flex_attention

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(*args, **kwargs)


def _has_flex_backward(device: torch.device) -> bool:
    """Whether a flex partial can run its backward on ``device``: on CUDA; on the CPU only with the
    direct backward (dynamo-traced, run by aot_eager: the operator's exact dense implementation, for
    ``csbp verify``; FlexAttention has no compiled CPU backward in torch 2.13)."""
    return device.type == "cuda" or (device.type == "cpu" and current_flex_backward() == "direct")


def _pad_rows(x: Tensor, num_rows: int) -> Tensor:
    """``x [S, H, N, d]`` with zero rows appended along N up to ``num_rows``."""
    missing = num_rows - x.shape[2]
    if missing == 0:
        return x
    return torch.nn.functional.pad(x, (0, 0, 0, missing))


def _leading_rows(x: Tensor, num_rows: int) -> Tensor:
    """The first ``num_rows`` rows (dim 2) of a padded kernel result, contiguous; ``x`` itself when
    nothing was padded."""
    return x if x.shape[2] == num_rows else x[:, :, :num_rows].contiguous()


def _empty_partial(q: Tensor, v: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    out = q.new_zeros(*q.shape[:-1], v.shape[-1], dtype=dtype)
    return out, q.new_full(q.shape[:-1], float("-inf"), dtype=dtype)


def _check_shapes(q: Tensor, k: Tensor, v: Tensor, partial: FlexPartial) -> None:
    if q.dim() != 4 or k.dim() != 4 or k.shape[:3] != v.shape[:3] or q.shape[1] % k.shape[1] != 0:
        raise ValueError(
            f"attention expects q [S, Hq, Nq, d] and k, v [S, Hkv, Nk, d] with Hq % Hkv == 0, got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if (q.shape[2], k.shape[2]) != (len(partial.q_rows), len(partial.k_rows)):
        raise ValueError(
            f"flex partial was built for {len(partial.q_rows)} queries x {len(partial.k_rows)} keys, got "
            f"{q.shape[2]} x {k.shape[2]}; rebuild it for these rows"
        )

