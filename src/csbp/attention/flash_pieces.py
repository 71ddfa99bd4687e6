"""Clean-context partials run as fused flash-attention pieces plus a small residual (csbp.md §9.1).

``csbp.attention.flash_pieces_plan`` finds, per key run, the dense and causal rectangles a fused flash
kernel runs at full speed (the pieces) and what they leave (the residual, a generic partial whose mask
touches only blocks next to the diagonal, with the noisy block diagonal folded in). This module runs
that plan: each piece through ``csbp.attention.flash_ops`` (FlashAttention-2 or cuDNN on CUDA, ATen's
flash kernel on CPU), each residual through the run's backend (Flex or the tiles).

The split changes no result: every allowed pair is computed once, the partials merge in fp32
(``csbp.attention.merge``) and every piece's backward runs from the final merged ``(out, lse)``. When
one residual runs and no two pieces share a query row (one device's mixed rows), ``kernel_dtype``
calls merge and add each piece onto the residual's own output and dQ in place, rounding once, instead
of through fp32 buffers. When a call's dtype has no fused kernel (CUDA fp32/fp64) the whole partial
runs generically instead, built on first use.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from csbp.attention.flash_ops import flash_backward, flash_forward, flash_kernel
from csbp.attention.flash_pieces_plan import FlashPiece, KeyRunPlan, plan_key_runs
from csbp.attention.kernel import resolve_scale
from csbp.attention.merge import accumulation_dtype, merge_into, merge_into_rounded
from csbp.attention.rows import Rows

__all__ = ["FlashPiece", "FlashPiecesPartial", "KeyRunPlan", "plan_flash_pieces"]


@dataclass(eq=False)
class FlashPiecesPartial:
    """A clean-context partial run as fused flash pieces plus per-run residuals (see the module doc).

    Attributes:
        runs: per key run, its pieces and residual.
        generic: builds the plain generic partial of the whole ``(q_rows, k_rows)``: used instead when a
            call's device/dtype has no fused kernel (built on first use, then kept).
        cuda_kernel: the pieces' fused kernel on CUDA, ``flash`` (FlashAttention-2) or ``cudnn``.
    """

    runs: tuple[KeyRunPlan, ...]
    num_queries: int
    num_keys: int
    generic: Callable[[], object]
    cuda_kernel: str = "flash"  # the pieces' fused kernel on CUDA (csbp.attention.flash_ops): flash or cudnn
    _generic_plan: object | None = field(default=None, repr=False)

    @property
    def pieces(self) -> list[FlashPiece]:
        return [piece for run in self.runs for piece in run.pieces]

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None, kernel_dtype: bool = False
    ) -> tuple[Tensor, Tensor]:
        """``(out [S, Hq, Nq, d], lse [S, Hq, Nq])`` in the accumulation dtype; with ``kernel_dtype``, when
        one residual runs and no two pieces share a query row, ``out`` is the residual's in its kernel's
        dtype with each piece merged into its rows in place, rounding once (``merge.merge_into_rounded``):
        no fp32 buffer to fill, merge into and cast back."""
        self._check(q, k)
        if flash_kernel(q, self.cuda_kernel) is None:
            return self._fallback().forward(q, k, v, scale=scale, kernel_dtype=kernel_dtype)
        scale = resolve_scale(scale, q)
        if kernel_dtype and self.one_residual_and_piece_per_row:
            return self._forward_onto_residual(q, k, v, scale)
        dtype = accumulation_dtype(q, k, v)
        # rows a first piece writes need no zeros / -inf first: only the others are filled
        out = q.new_empty(*q.shape[:-1], v.shape[-1], dtype=dtype)
        lse = q.new_empty(q.shape[:-1], dtype=dtype)
        for start, stop in self.rows_no_first_piece_writes:
            out[:, :, start:stop] = 0.0
            lse[:, :, start:stop] = float("-inf")
        fresh = iter(self.first_over_their_rows)
        for run in self.runs:
            for p in run.pieces:
                rows, keys = slice(p.q_start, p.q_stop), slice(p.k_start, p.k_stop)
                part_out, part_lse = flash_forward(
                    q[:, :, rows], k[:, :, keys], v[:, :, keys], causal=p.causal, scale=scale,
                    cuda_kernel=self.cuda_kernel, kernel_dtype=True,
                )
                if next(fresh):  # merging into zeros / -inf would give the piece itself: write it (cast as written)
                    out[:, :, rows], lse[:, :, rows] = part_out, part_lse
                else:
                    merge_into(out[:, :, rows], lse[:, :, rows], part_out, part_lse)
            if run.residual is not None:
                keys = slice(*run.residual_span)
                # the residual's out as its kernel returns it (bf16 from Flex): merge_into casts it as it reads
                residual = run.residual.forward(q, k[:, :, keys], v[:, :, keys], scale=scale, kernel_dtype=True)
                merge_into(out, lse, *residual)
        return out, lse

    def _forward_onto_residual(self, q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
        """The residual over every row first (its ``out`` in the kernel's dtype), then each piece merged
        into its rows of that ``out`` in place."""
        run = next(run for run in self.runs if run.residual is not None)
        keys = slice(*run.residual_span)
        out, lse = run.residual.forward(q, k[:, :, keys], v[:, :, keys], scale=scale, kernel_dtype=True)
        for p in self.pieces:
            rows, keys = slice(p.q_start, p.q_stop), slice(p.k_start, p.k_stop)
            part_out, part_lse = flash_forward(
                q[:, :, rows], k[:, :, keys], v[:, :, keys], causal=p.causal, scale=scale,
                cuda_kernel=self.cuda_kernel, kernel_dtype=True,
            )
            merge_into_rounded(out[:, :, rows], lse[:, :, rows], part_out, part_lse)
        return out, lse

    @functools.cached_property
    def first_over_their_rows(self) -> tuple[bool, ...]:
        """Per piece (in ``pieces`` order): whether no earlier piece or residual covers any of its rows."""
        return self._first_over(lambda p: (p.q_start, p.q_stop), lambda run: (0, self.num_queries))

    @functools.cached_property
    def rows_no_first_piece_writes(self) -> tuple[tuple[int, int], ...]:
        """``[start, stop)`` ranges of the query rows outside every piece first over its rows: the forward
        starts them at ``out = 0, lse = -inf`` and the backward at ``dq = 0`` (the rest is written)."""
        spans = [(p.q_start, p.q_stop) for p, first in zip(self.pieces, self.first_over_their_rows) if first]
        return _gaps(spans, self.num_queries)

    @functools.cached_property
    def keys_no_first_piece_writes(self) -> tuple[tuple[int, int], ...]:
        """The same for the keys and ``dk = dv = 0``."""
        spans = [(p.k_start, p.k_stop) for p, first in zip(self.pieces, self.first_over_their_keys) if first]
        return _gaps(spans, self.num_keys)

    @functools.cached_property
    def first_over_their_keys(self) -> tuple[bool, ...]:
        """Per piece (in ``pieces`` order): whether no earlier piece or residual covers any of its keys."""
        return self._first_over(lambda p: (p.k_start, p.k_stop), lambda run: run.residual_span)

    def _first_over(
        self, span: Callable[[FlashPiece], tuple[int, int]], residual_span: Callable[[KeyRunPlan], tuple[int, int]]
    ) -> tuple[bool, ...]:
        covered: list[tuple[int, int]] = []
        fresh = []
        for run in self.runs:
            for piece in run.pieces:
                lo, hi = span(piece)
                fresh.append(all(hi <= start or stop <= lo for start, stop in covered))
                covered.append((lo, hi))
            if run.residual is not None:
                covered.append(residual_span(run))
        return tuple(fresh)

    def backward(
        self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, *,
        scale: float | None = None, delta: Tensor | None = None, kernel_dtype: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """``(dq, dk, dv)`` of this key set's share from the final merged ``out``/``lse`` and ``dout``, in
        accumulation-dtype buffers; with ``kernel_dtype``, when one residual runs and no two pieces share a
        query row (the mixed rows of one device), ``dq`` is the residual's in the kernels' dtype with each
        piece's added in place: one fp32 add and one rounding per row, the values of the fp32 buffer cast to
        that dtype, without its three output-sized passes (fill, add, cast)."""
        self._check(q, k)
        if flash_kernel(q, self.cuda_kernel) is None:
            return self._fallback().backward(q, k, v, out, lse, dout, scale=scale, delta=delta, kernel_dtype=kernel_dtype)
        scale = resolve_scale(scale, q)
        dtype = accumulation_dtype(q, k, v)
        onto_residual = kernel_dtype and self.one_residual_and_piece_per_row
        dq = None if onto_residual else torch.empty(q.shape, dtype=dtype, device=q.device)
        dk = torch.empty(k.shape, dtype=dtype, device=k.device)  # zeros only where no first piece writes
        dv = torch.empty(v.shape, dtype=dtype, device=v.device)
        first_residual = None
        if onto_residual:  # the one residual first: its dq is the buffer the pieces add into
            run = next(run for run in self.runs if run.residual is not None)
            first_residual = self._residual_backward(run, q, k, v, out, lse, dout, scale, delta)
            dq = first_residual[0]
        else:
            for start, stop in self.rows_no_first_piece_writes:
                dq[:, :, start:stop] = 0.0
        for start, stop in self.keys_no_first_piece_writes:
            dk[:, :, start:stop] = 0.0
            dv[:, :, start:stop] = 0.0
        first = iter(zip(self.first_over_their_rows, self.first_over_their_keys))
        for run in self.runs:
            for p in run.pieces:
                rows, keys = slice(p.q_start, p.q_stop), slice(p.k_start, p.k_stop)
                dq_p, dk_p, dv_p = flash_backward(
                    q[:, :, rows], k[:, :, keys], v[:, :, keys], out[:, :, rows], lse[:, :, rows],
                    dout[:, :, rows], causal=p.causal, scale=scale, cuda_kernel=self.cuda_kernel, kernel_dtype=True,
                )
                # into the fp32 slices, cast as they are written: a piece first over its rows / keys
                # is copied (adding it to zeros gives it back), the others added
                first_rows, first_keys = next(first)
                _write_or_add(dq[:, :, rows], dq_p, first_rows and not onto_residual)
                _write_or_add(dk[:, :, keys], dk_p, first_keys)
                _write_or_add(dv[:, :, keys], dv_p, first_keys)
            if run.residual is not None:
                keys = slice(*run.residual_span)
                grads = first_residual or self._residual_backward(run, q, k, v, out, lse, dout, scale, delta)
                dq_r, dk_r, dv_r = grads
                if not onto_residual:
                    dq += dq_r
                dk[:, :, keys] += dk_r
                dv[:, :, keys] += dv_r
        return dq, dk, dv

    def _residual_backward(
        self, run: KeyRunPlan, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
        scale: float, delta: Tensor | None,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The residual's gradients in its kernel's dtype (bf16 from Flex), for adding into the buffers."""
        keys = slice(*run.residual_span)
        return run.residual.backward(
            q, k[:, :, keys], v[:, :, keys], out, lse, dout, scale=scale, delta=delta, kernel_dtype=True
        )

    @functools.cached_property
    def one_residual_and_piece_per_row(self) -> bool:
        """Exactly one run has a residual and no two pieces share a query row (the ``kernel_dtype`` backward)."""
        if sum(run.residual is not None for run in self.runs) != 1:
            return False
        spans = sorted((p.q_start, p.q_stop) for p in self.pieces)
        return all(stop <= start for (_, stop), (start, _) in zip(spans, spans[1:]))

    def _fallback(self) -> object:
        if self._generic_plan is None:
            self._generic_plan = self.generic()
        return self._generic_plan

    def _check(self, q: Tensor, k: Tensor) -> None:
        if (q.dim(), k.dim()) != (4, 4) or (q.shape[2], k.shape[2]) != (self.num_queries, self.num_keys):
            raise ValueError(
                f"the flash-pieces partial was built for {self.num_queries} queries x {self.num_keys} keys "
                f"([S, H, N, d] tensors), got q {tuple(q.shape)}, k {tuple(k.shape)}; rebuild it for these rows"
            )


def _gaps(spans: list[tuple[int, int]], total: int) -> tuple[tuple[int, int], ...]:
    """The ``[start, stop)`` ranges of ``[0, total)`` that no span covers."""
    gaps, at = [], 0
    for start, stop in sorted(spans):
        if start > at:
            gaps.append((at, start))
        at = max(at, stop)
    if at < total:
        gaps.append((at, total))
    return tuple(gaps)


def _write_or_add(target: Tensor, grad: Tensor, first: bool) -> None:
    """``target`` (a slice of an accumulation buffer) ``= grad`` or ``+= grad``, in place, cast as it goes."""
    if first:
        target.copy_(grad)
    else:
        target.add_(grad)


def plan_flash_pieces(
    q_rows: Rows, k_rows: Rows, *, min_rows: int, generic: Callable[[Rows, Rows], object], cuda_kernel: str = "flash"
) -> FlashPiecesPartial | None:
    """The flash-pieces plan of ``q_rows`` x ``k_rows`` (``generic(q_rows, k_rows)`` plans a plain partial,
    also for the residuals; ``cuda_kernel`` runs the pieces on CUDA), or None when no piece of
    ``>= min_rows`` rows exists, or queries see noisy keys with another key run between them and every
    run with pieces (the caller then plans one generic partial; ``flash_pieces_plan.plan_key_runs``)."""
    runs = plan_key_runs(q_rows, k_rows, min_rows=min_rows, generic=generic)
    if runs is None:
        return None
    return FlashPiecesPartial(runs, len(q_rows), len(k_rows), lambda: generic(q_rows, k_rows), cuda_kernel)
