"""Which kernel runs the noisy block-diagonal partial (``backends.plan_block_diagonal``).

The block-diagonal part of the BD3 mask (noisy rows x their own block) has four kernels:

* ``matmul``: batched dense ``[B, B]`` matmuls and an explicit softmax (``csbp.attention.kernel``);
* ``sdpa``: one batched fused SDPA call over ``[nb, S*H, B, d]`` (``csbp.attention.block_diagonal_sdpa``:
  ATen's CPU flash kernel, FlashAttention-2 on CUDA), GQA native;
* ``sdpa_fold``: the same call with the query heads of a KV head folded into the rows of
  bidirectional blocks (``[nb, S*Hkv, G*B, d]``: fuller GPU tiles at small ``B``);
* ``flex``: FlexAttention over a ``BlockMask`` of the same rows (the ``flex`` backend only).

``auto`` picks per backend: on ``tiles`` ``sdpa`` for blocks of ``B >= 16`` rows and ``matmul``
below (measured on CPU, one thread, the block-diagonal partial alone: sdpa 1.0-2.2x the matmuls at
B = 16..64, 0.7-1.3x at B = 4..8, where the fused call's fixed cost shows; see docs/benchmarks.md), and
``flex`` on ``flex`` (FlexAttention's block-sparse kernel; the CUDA default is chosen from the
``kernels`` stage of ``make gpu-check``, which measures ``flex`` and ``sdpa`` side by side; ``sdpa_fold`` is
left to a direct ``csbp bench kernels --diagonals`` run, to keep the stage in its budget). On the
``flex`` backend a diagonal other than ``flex`` also makes the local transport split its rows into
this partial plus the clean-interval partial (CSBP's decomposed form) instead of one Flex call
over the mixed mask.

The choice is the run config's ``attention.diagonal`` (next to ``attention.backend``), threaded
like the backend to every transport; ``csbp verify`` and ``csbp bench attention`` / ``train`` take
``--diagonal`` and ``csbp bench kernels`` ``--diagonals``. ``check_diagonal_backend`` refuses the
combinations no device can run (``flex`` with ``tiles``) when the config is read.
"""

from __future__ import annotations

from typing import Literal, get_args

DiagonalName = Literal["auto", "matmul", "sdpa", "sdpa_fold", "flex"]
DIAGONALS: tuple[str, ...] = get_args(DiagonalName)
SDPA_MIN_BLOCK = 16
"""Smallest block size for which ``auto`` runs the ``sdpa`` kernel on ``tiles`` (module doc)."""


def check_diagonal(name: str, *, where: str = "diagonal") -> str:
    """``name`` if it is a diagonal kernel name, else one clear ``ValueError``."""
    if name not in DIAGONALS:
        raise ValueError(f"{where} must be one of {DIAGONALS}, got {name!r}")
    return name


def check_diagonal_backend(diagonal: str, backend: str, *, where: str = "attention.diagonal") -> str:
    """``diagonal`` if some device can run it with ``backend`` (``auto``, ``tiles`` or ``flex``), else one
    clear ``ValueError``: the ``flex`` diagonal is a FlexAttention call, so it needs the ``flex`` backend
    (or ``auto``, which is ``flex`` on CUDA; on CPU ``resolve_diagonal`` refuses it when planning)."""
    check_diagonal(diagonal, where=where)
    if diagonal == "flex" and backend == "tiles":
        raise ValueError(
            f"{where}=flex needs attention.backend flex (or auto on CUDA), got tiles; "
            "use diagonal auto, matmul, sdpa or sdpa_fold with tiles"
        )
    return diagonal


def resolve_diagonal(name: str, backend: str, block_size: int | None = None) -> str:
    """The concrete kernel (``matmul``, ``sdpa``, ``sdpa_fold`` or ``flex``) of ``name`` on the concrete
    ``backend`` (``tiles`` or ``flex``) for blocks of ``block_size`` rows (without ``block_size``,
    ``auto`` on tiles names ``sdpa``)."""
    check_diagonal(name)
    if name == "auto" and backend == "flex":
        name = "flex"
    elif name == "auto":
        name = "sdpa" if block_size is None or block_size >= SDPA_MIN_BLOCK else "matmul"
    if name == "flex" and backend != "flex":
        raise ValueError(f"diagonal=flex needs attention.backend=flex (got {backend}); use matmul or sdpa")
    return name
