"""Attention backends: how one key set's partial ``(out, lse)`` is computed (csbp.md §9.1, §9.2).

Every transport (local/BP-only, CP-only and CSBP collective or streaming, windowed, DFlash) splits
attention into partials over key subsets, merges them online in fp32 (``csbp.attention.merge``)
and runs each partial's backward from the final merged ``(out, lse)``. A partial is planned once
per step from the row metadata and reused by every layer, forward and backward::

    partial = plan_partial(q_rows, k_rows, backend="flex", causal_in_block=False)
    out, lse = partial.forward(q, k, v)                           # accumulation dtype
    dq, dk, dv = partial.backward(q, k, v, out_final, lse_final, dout)

Backends (``attention.backend`` in the run config, ``--backend`` on ``verify``/``bench``):

* ``tiles``: the pure-PyTorch block-sparse tile kernels of ``csbp.attention.kernel`` (CPU and
  GPU; the noisy block-diagonal part as one batched fused SDPA call, ``csbp.attention.diagonal``);
* ``flex``: FlexAttention over a ``BlockMask`` built from the same rows (``csbp.attention.flex``);
  compiled on CUDA; forward-only (eager) on CPU;
* ``auto``: ``flex`` on CUDA, ``tiles`` otherwise.

Both evaluate one predicate, ``csbp.masks.rows_mask``, so they agree with the dense reference by
construction (and the tests check it on every layout's rows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, get_args

import torch
from torch import Tensor

from csbp.attention.block_diagonal_sdpa import build_sdpa_block_diagonal
from csbp.attention.diagonal import resolve_diagonal
from csbp.attention.flash_pieces import plan_flash_pieces
from csbp.attention.flex import build_flex_partial
from csbp.attention.flex_backward import direct_backward_support
from csbp.attention.kernel import (
    DEFAULT_TILE_ROWS,
    TilePlan,
    block_diagonal_backward,
    block_diagonal_forward,
    build_tile_plan,
    interval_attention_backward,
    interval_attention_forward,
)
from csbp.attention.rows import Rows

BackendName = Literal["auto", "tiles", "flex"]
BACKENDS: tuple[str, ...] = get_args(BackendName)


class PartialPlan(Protocol):
    """One key set's attention partial, planned for fixed query and key rows."""

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None, kernel_dtype: bool = False
    ) -> tuple[Tensor, Tensor]:
        """``(out [S, Hq, Nq, d], lse [S, Hq, Nq])`` in the accumulation dtype; with ``kernel_dtype`` ``out``
        may stay in the kernel's own (bf16 from a fused CUDA kernel), rounded once as a fused kernel's output
        is (a partial of several kernels merges them in fp32 first), for a caller that hands it on in q's
        dtype or merges it into an fp32 result, casting as it reads (the ring transports' remote partials);
        ``lse`` stays in the accumulation dtype."""
        ...

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
        """``(dq, dk, dv)`` of this key set's share from the final merged ``out``/``lse`` and ``dout``, in the
        accumulation dtype; with ``kernel_dtype`` they may stay in the kernel's own dtype (bf16 from a fused
        CUDA kernel), for a caller that adds them into accumulation-dtype buffers, casting as it adds."""
        ...


def check_backend(name: str) -> str:
    """``name`` if it is a backend name, else one clear ``ValueError``."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {name!r}")
    return name


def resolve_backend(name: str, device: torch.device | str) -> str:
    """The concrete backend (``tiles`` or ``flex``) of ``name`` on ``device`` (``auto``: flex on CUDA)."""
    check_backend(name)
    if name != "auto":
        return name
    return "flex" if torch.device(device).type == "cuda" else "tiles"


def check_backend_trains_on(
    name: str,
    device: torch.device | str,
    *,
    where: str = "attention.backend",
    verification: bool = False,
    float64: bool = False,
) -> str:
    """The concrete backend of ``name`` on ``device``; one clear ``ValueError`` when it cannot run a
    backward there (``flex`` off CUDA: FlexAttention has no compiled CPU backward; ``flex`` in
    float64 on CUDA outside verification: the compiled kernel has no float64 form and the eager one
    materialises every score, see ``csbp.attention.flex._kernel``).

    ``verification``: ``csbp verify`` may run ``flex`` on the CPU where the direct flex backward is
    available (``csbp.attention.flex_backward``): FlexAttention's exact dense implementations forward
    and backward, O(rows^2) memory, for checking the flex path at small sizes, never for training."""
    backend = resolve_backend(name, device)
    kind = torch.device(device).type
    if backend == "flex" and kind == "cuda" and float64 and not verification:
        raise ValueError(
            f"{where}={name} runs FlexAttention on CUDA, which cannot train in float64 (its compiled kernel has "
            f"no float64 form); set {where} to tiles, or train.precision to fp32 or bf16"
        )
    if backend == "flex" and kind != "cuda":
        if verification and kind == "cpu":
            supported, reason = direct_backward_support()
            if supported:
                return backend
            raise ValueError(
                f"{where}=flex on cpu needs FlexAttention's direct backward, which this torch's compiler cannot "
                f"trace ({reason}); use {where} tiles, torch 2.11 or later, or a CUDA device"
            )
        raise ValueError(
            f"{where}=flex cannot train on {kind} (FlexAttention has no compiled CPU backward); "
            f"set {where} to auto or tiles"
        )
    return backend


@dataclass(frozen=True, eq=False)
class TilesPartial:
    """The tiled interval kernel over a prebuilt ``TilePlan``."""

    q_rows: Rows
    k_rows: Rows
    tile_plan: TilePlan
    causal_in_block: bool

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None, kernel_dtype: bool = False
    ) -> tuple[Tensor, Tensor]:
        return interval_attention_forward(  # the tiles compute in the accumulation dtype
            q, k, v, self.q_rows, self.k_rows, scale=scale, causal_in_block=self.causal_in_block, plan=self.tile_plan
        )

    def backward(
        self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, *,
        scale: float | None = None, delta: Tensor | None = None, kernel_dtype: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor]:
        return interval_attention_backward(  # the tiles compute in the accumulation dtype
            q, k, v, self.q_rows, self.k_rows, out, lse, dout,
            scale=scale, causal_in_block=self.causal_in_block, plan=self.tile_plan, delta=delta,
        )


@dataclass(frozen=True, eq=False)
class BlockDiagonalPartial:
    """Whole blocks of ``block_size`` rows attending to their own block: batched dense matmuls."""

    block_size: int
    causal_in_block: bool

    def forward(
        self, q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None, kernel_dtype: bool = False
    ) -> tuple[Tensor, Tensor]:
        return block_diagonal_forward(q, k, v, block_size=self.block_size, scale=scale, causal=self.causal_in_block)

    def backward(
        self, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor, *,
        scale: float | None = None, delta: Tensor | None = None, kernel_dtype: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor]:
        return block_diagonal_backward(  # batched matmuls in the accumulation dtype
            q, k, v, out, lse, dout, block_size=self.block_size, scale=scale, causal=self.causal_in_block, delta=delta
        )


CleanKernel = Literal["generic", "pieces", "pieces-cudnn"]
CLEAN_KERNELS: tuple[str, ...] = get_args(CleanKernel)
"""How a clean-context partial runs: ``generic`` (one ``backend`` partial), ``pieces`` (fused flash
pieces plus a residual, ``csbp.attention.flash_pieces``; FlashAttention-2 on CUDA) or ``pieces-cudnn``
(the same with cuDNN's fused attention on CUDA)."""

def check_clean(name: str, *, where: str = "clean") -> str:
    """``name`` if it is a clean-context kernel (``CLEAN_KERNELS``), else one clear ``ValueError``."""
    if name not in CLEAN_KERNELS:
        raise ValueError(f"{where} must be one of {CLEAN_KERNELS}, got {name!r}")
    return name


FLASH_PIECE_MIN_ROWS = {"cpu": 16, "cuda": 128}
"""Default ``min_rows`` of a flash piece per device type (``csbp.attention.flash_pieces``): on CUDA a
FlashAttention query tile (128 rows), so a piece never runs a mostly empty tile."""


def plan_partial(
    q_rows: Rows,
    k_rows: Rows,
    *,
    backend: str = "tiles",
    causal_in_block: bool = False,
    tile_rows: int = DEFAULT_TILE_ROWS,
    clean: str = "generic",
    min_rows: int | None = None,
) -> PartialPlan:
    """The partial of ``q_rows`` x ``k_rows`` under the interval predicate on ``backend`` (``auto`` is
    resolved on the rows' device). Build once per step; every layer reuses it.

    With ``clean`` ``pieces`` or ``pieces-cudnn`` (``CLEAN_KERNELS``), a clean-context partial is cut
    into fused flash-attention pieces of ``>= min_rows`` rows (default ``FLASH_PIECE_MIN_ROWS`` of the
    device) plus a residual on ``backend`` (``csbp.attention.flash_pieces``); other partials are one
    ``backend`` partial. Pieces are off by default: on CPU it measured 0.71-0.96x the speed of the tiles (``csbp bench kernels --clean-kernels``;
    the tiles already run ATen's flash kernel per tile), and on CUDA it awaits ``make gpu-check``."""
    concrete = resolve_backend(backend, q_rows.pos.device)

    def generic(q: Rows, k: Rows) -> PartialPlan:
        if concrete == "flex":
            return build_flex_partial(q, k, causal_in_block=causal_in_block)
        tile_plan = build_tile_plan(q, k, tile_rows=tile_rows)
        tile_plan.tile_strips(causal_in_block)  # the masks every layer reuses, built now (part of the plan cost)
        return TilesPartial(q, k, tile_plan, causal_in_block)

    if check_clean(clean, where="clean-context kernel") != "generic":
        if min_rows is None:
            min_rows = FLASH_PIECE_MIN_ROWS.get(q_rows.pos.device.type, FLASH_PIECE_MIN_ROWS["cuda"])
        cuda_kernel = "cudnn" if clean == "pieces-cudnn" else "flash"
        pieces = plan_flash_pieces(q_rows, k_rows, min_rows=min_rows, generic=generic, cuda_kernel=cuda_kernel)
        if pieces is not None:
            return pieces
    return generic(q_rows, k_rows)


def plan_block_diagonal(
    rows: Rows,
    *,
    block_size: int,
    backend: str = "tiles",
    causal_in_block: bool = False,
    diagonal: str = "auto",
) -> PartialPlan:
    """The partial of whole noisy blocks ``rows`` (``block_size`` rows each) over themselves, run by the
    ``diagonal`` kernel (``csbp.attention.diagonal``; ``auto``: ``sdpa`` on tiles for B >= 16, else
    ``matmul``; ``flex`` on flex):
    ``matmul`` batched dense blocks, ``sdpa`` (``sdpa_fold``) one batched fused SDPA call, ``flex`` a FlexAttention
    BlockMask of the same rows. Dead rows see nothing on ``flex`` and ``sdpa`` (whole dead blocks); on
    ``matmul`` the caller masks them (``block_diagonal_forward`` sees blocks only)."""
    kernel = resolve_diagonal(diagonal, resolve_backend(backend, rows.pos.device), block_size)
    if kernel == "flex":
        return build_flex_partial(rows, rows, causal_in_block=causal_in_block)
    if kernel in ("sdpa", "sdpa_fold"):
        return build_sdpa_block_diagonal(
            rows, block_size=block_size, causal_in_block=causal_in_block, fold_groups=kernel == "sdpa_fold"
        )
    return BlockDiagonalPartial(block_size, causal_in_block)
