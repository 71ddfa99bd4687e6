"""The noisy block-diagonal partial as ONE batched fused SDPA call (csbp.md §9.1, §9.2).

BD3's noisy rows attend only to their own block of ``B`` rows, so the block-diagonal part of the
mask is a batch of small *dense* attentions: ``q [S, Hq, nb*B, d]`` is viewed (no copy) as
``[nb, S*Hq, B, d]``, the blocks as the batch and samples x heads as the heads (GQA stays native:
query head ``s*Hq + h`` meets KV head ``(s*Hq + h) // G``), and one fused flash-attention call
computes every block, with ``is_causal`` for the lower-triangular ``causal_in_block`` variant.
No mask is built or applied.
``SdpaBlockDiagonalPartial.kernel(q)`` names the kernel a call uses.

``fold_groups`` (the ``sdpa_fold`` diagonal) instead folds the ``G`` query heads of a KV head into the
rows of bidirectional blocks, ``q [nb, S*Hkv, G*B, d]`` against ``k [nb, S*Hkv, B, d]``: GPU kernels
tile 64-128 query rows, so ``B = 16`` alone fills an eighth of a tile and ``G*B = 64`` half of it.
On CPU it is slower (0.6-0.9x, the copies; CPU flash runs GQA natively), so it is no default: the
``make gpu-check``'s ``kernels`` stage leaves it out (its budget): ``csbp bench kernels --diagonals sdpa
sdpa_fold`` measures it on CUDA.

Kernels (the fused calls live in ``csbp.attention.flash_ops``):

* ``cpu-flash``: ATen's CPU flash-attention kernel in the accumulation dtype (fp32 for bf16
  inputs, fp64 for fp64), GQA native (K/V never repeated);
* ``flash`` (CUDA, fp16/bf16, head dim a multiple of 8 up to 256, sm80+): FlashAttention-2, GQA
  native (its backward sums dK/dV over the group itself); batches beyond CUDA's 65535 grid rows
  run in chunks of blocks;
* ``matmul``: anything else (CUDA fp32/fp64, other head dims): the batched-matmul kernels of
  ``csbp.attention.kernel`` (``block_diagonal_forward``/``_backward``), the tiles' path. The
  efficient (cutlass) kernel is not used for fp32: it has no GQA, so K/V would be repeated.

**Backward from the merged statistics.** Both fused backwards take ``out`` and ``lse`` as inputs
and compute ``P = exp(scale*QK^T - lse)``, ``D = rowsum(dout*out)``: handed the *final* merged
``(out, lse)`` they return exactly this partial's share of the gradients (the explicit backward of
``csbp.attention.kernel``; ``delta`` is recomputed inside the kernel). Rows whose merged ``lse`` is
``-inf`` (they see nothing) get ``lse = +inf`` so that ``P = 0``: zero gradients, never NaN.

**Rows.** ``build_sdpa_block_diagonal`` checks once per step that the rows are whole blocks:
``len(rows)`` a multiple of ``B`` (a partial last block fails, as ``block_diagonal_forward``
does), each group of ``B`` consecutive rows noisy with one block id that no other group has, and
positions increasing inside a block when ``causal_in_block``. Liveness must be uniform per block
(DFlash's padding anchors are whole dead blocks): dead blocks give ``out = 0``, ``lse = -inf``
and zero gradients, as the flex partial's predicate does. Results are in the accumulation dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from csbp.attention.flash_ops import flash_backward, flash_forward, flash_kernel
from csbp.attention.kernel import block_diagonal_backward, block_diagonal_forward, resolve_scale
from csbp.attention.rows import Rows


@dataclass(frozen=True, eq=False)
class SdpaBlockDiagonalPartial:
    """Whole noisy blocks attending to themselves, one fused SDPA call; build with
    ``build_sdpa_block_diagonal``.

    Attributes:
        block_size: rows per block ``B``.
        num_rows: rows the partial was built for (``nb * B``).
        causal_in_block: lower-triangular blocks (``is_causal``).
        dead_rows: ``[num_rows]`` bool, rows of dead blocks; None when every block is live.
        fold_groups: bidirectional blocks only: the ``G`` query heads of a KV head become ``G*B`` rows
            of one ``[nb, S*Hkv, G*B, d]`` call (fewer, fuller kernel tiles for small ``B``; costs a
            copy of q, out and dout). Causal blocks keep ``[B, B]`` (``is_causal``) and native GQA.
    """

    block_size: int
    num_rows: int
    causal_in_block: bool
    dead_rows: Tensor | None
    fold_groups: bool = False

    def kernel(self, q: Tensor) -> str:
        """``cpu-flash``, ``flash`` or ``matmul``: the kernel a call on ``q`` runs (see the module doc)."""
        return flash_kernel(q) or "matmul"

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None, kernel_dtype: bool = False
    ) -> tuple[Tensor, Tensor]:
        """``(out [S, Hq, N, d], lse [S, Hq, N])`` in the accumulation dtype (whatever ``kernel_dtype``)."""
        self._check(q, k, v)
        scale = resolve_scale(scale, q)
        if self.kernel(q) == "matmul":
            out, lse = block_diagonal_forward(
                q, k, v, block_size=self.block_size, scale=scale, causal=self.causal_in_block
            )
        else:
            group = self._fold(q, k)
            out_b, lse_b = flash_forward(
                self._blocked(q, group), self._blocked(k), self._blocked(v), causal=self.causal_in_block, scale=scale
            )
            out = self._unblocked(out_b, q.shape[0], group)
            lse = self._unblocked(lse_b.unsqueeze(-1), q.shape[0], group).squeeze(-1)
        if self.dead_rows is not None:
            out = out.masked_fill(self.dead_rows[:, None], 0.0)
            lse = lse.masked_fill(self.dead_rows, float("-inf"))
        return out, lse

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
        """``(dq, dk, dv)`` of this key set's share from the final merged ``out``/``lse`` and ``dout``
        (accumulation dtype; the fused kernel's own with ``kernel_dtype``); ``delta`` is used by the
        ``matmul`` kernel, recomputed by the fused ones."""
        self._check(q, k, v)
        scale = resolve_scale(scale, q)
        if self.kernel(q) == "matmul":
            return block_diagonal_backward(
                q, k, v, out, lse, dout, block_size=self.block_size, scale=scale,
                causal=self.causal_in_block, delta=delta,
            )
        num_samples, group = q.shape[0], self._fold(q, k)
        q_b, out_b, dout_b = (self._blocked(t, group) for t in (q, out, dout))
        lse_b = self._blocked(lse.unsqueeze(-1), group).squeeze(-1)
        dq_b, dk_b, dv_b = flash_backward(
            q_b, self._blocked(k), self._blocked(v), out_b, lse_b, dout_b, causal=self.causal_in_block, scale=scale,
            kernel_dtype=kernel_dtype,
        )
        dq = self._unblocked(dq_b, num_samples, group)
        return dq, self._unblocked(dk_b, num_samples), self._unblocked(dv_b, num_samples)

    # ------------------------------------------------------------------------- layouts

    def _fold(self, q: Tensor, k: Tensor) -> int:
        """Query heads per KV head folded into the rows of one call (``G`` with ``fold_groups`` on
        bidirectional blocks, else 1: the kernels run GQA natively)."""
        return q.shape[1] // k.shape[1] if self.fold_groups and not self.causal_in_block else 1

    def _blocked(self, x: Tensor, group: int = 1) -> Tensor:
        """``[S, H, nb*B, d]`` -> ``[nb, S*H/group, group*B, d]``: blocks are the batch, samples x heads the
        heads (GQA stays native: query head ``s*H + h`` meets KV head ``(s*H + h) // G``); with ``group``,
        query head ``j*group + g`` becomes rows ``[g*B, (g+1)*B)`` of head ``j``. A view when ``group == 1``."""
        num_samples, heads, rows, dim = x.shape
        x = x.reshape(num_samples * heads // group, group, rows // self.block_size, self.block_size, dim)
        x = x.permute(2, 0, 1, 3, 4)  # [nb, S*H/g, g, B, d]
        return x.reshape(x.shape[0], x.shape[1], group * self.block_size, dim)

    def _unblocked(self, x_b: Tensor, num_samples: int, group: int = 1) -> Tensor:
        """``[nb, S*H/group, group*B, d]`` -> ``[S, H, nb*B, d]``."""
        x = x_b.unflatten(2, (group, self.block_size)).permute(1, 2, 0, 3, 4)  # [S*H/g, g, nb, B, d]
        return x.reshape(num_samples, -1, x.shape[2] * self.block_size, x.shape[-1])

    def _check(self, q: Tensor, k: Tensor, v: Tensor) -> None:
        if q.dim() != 4 or k.dim() != 4 or k.shape[:3] != v.shape[:3] or q.shape[1] % k.shape[1] != 0:
            raise ValueError(
                f"attention expects q [S, Hq, N, d] and k, v [S, Hkv, N, d] with Hq % Hkv == 0, got q "
                f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
            )
        if q.shape[2] != self.num_rows or k.shape[2] != self.num_rows or (q.shape[0], q.shape[3]) != (
            k.shape[0], k.shape[3]
        ):
            raise ValueError(
                f"the block-diagonal partial was built for {self.num_rows} rows (S and d shared by q and k), "
                f"got q {tuple(q.shape)}, k {tuple(k.shape)}; rebuild it for these rows"
            )
        if self.dead_rows is not None and self.dead_rows.device != q.device:
            raise ValueError(f"rows are on {self.dead_rows.device} but q on {q.device}; use Rows.to(q.device)")


def build_sdpa_block_diagonal(
    rows: Rows, *, block_size: int, causal_in_block: bool = False, fold_groups: bool = False
) -> SdpaBlockDiagonalPartial:
    """The fused-SDPA block-diagonal partial of ``rows`` (whole noisy blocks of ``block_size`` rows);
    one clear ``ValueError`` when the rows are not whole blocks (see the module doc)."""
    num_rows = len(rows)
    if block_size < 1 or num_rows % block_size != 0:
        raise ValueError(
            f"the sdpa block diagonal needs whole blocks: block_size={block_size} must be >= 1 and divide the "
            f"{num_rows} rows (a partial last block needs the flex or tiles partial)"
        )
    if num_rows == 0:
        return SdpaBlockDiagonalPartial(block_size, 0, causal_in_block, None, fold_groups)
    if bool(rows.clean.any()):
        raise ValueError("the sdpa block diagonal takes noisy rows only (clean=False); pass rows[:num_noisy]")
    block = rows.block.view(-1, block_size)
    if not bool((block == block[:, :1]).all()):
        raise ValueError(f"every {block_size} consecutive rows must share one block id (whole blocks in order)")
    if torch.unique(block[:, 0]).shape[0] != block.shape[0]:
        raise ValueError("each block id must occur in one group of rows only (every block once)")
    if causal_in_block and not bool((rows.pos.view(-1, block_size).diff(dim=1) > 0).all()):
        raise ValueError("causal_in_block needs increasing positions inside every block (row order = pos order)")
    live = rows.live.view(-1, block_size)
    if not bool((live == live[:, :1]).all()):
        raise ValueError("the sdpa block diagonal needs uniform liveness per block (whole dead blocks only)")
    dead = None if bool(rows.live.all()) else ~rows.live
    return SdpaBlockDiagonalPartial(block_size, num_rows, causal_in_block, dead, fold_groups)
