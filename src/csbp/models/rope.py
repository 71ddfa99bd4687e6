"""Rotary position embeddings (RoPE) from explicit per-row positions.

csbp never assumes ``positions == arange(N)``: the packed rows of a rank carry arbitrary RoPE
positions (``Rows.pos``; the noisy and clean halves reuse ``0 … L-1``; DFlash blocks reuse their
anchor's positions). The tables are therefore computed from a positions tensor, once per forward,
and shared by every layer.

Convention: the "rotate-half" layout of Hugging Face Qwen3/Llama: the frequency of channel ``i``
and of channel ``i + d/2`` is ``theta ** (-2i/d)``, and::

    rope(x) = x * cos + rotate_half(x) * sin,    rotate_half([x1, x2]) = [-x2, x1]

The angles are computed in float32 (float64 for float64 models) and cast to the activation dtype
only when applied, as Hugging Face does.

Shape legend: ``S`` samples, ``H`` heads, ``N`` rows, ``d`` head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class RotaryTables:
    """Precomputed ``cos``/``sin`` tables for a set of rows.

    Attributes:
        cos: ``[N, d]`` (positions shared by all samples) or ``[S, N, d]``.
        sin: same shape as ``cos``.
    """

    cos: Tensor
    sin: Tensor

    @property
    def num_rows(self) -> int:
        return int(self.cos.shape[-2])

    def apply(self, x_SHNd: Tensor) -> Tensor:
        """Rotate ``x [S, H, N, d]``; the result has the dtype of ``x``."""
        if x_SHNd.dim() != 4:
            raise ValueError(f"RoPE input must be [S, H, N, d], got shape {tuple(x_SHNd.shape)}")
        if x_SHNd.shape[-2] != self.num_rows or x_SHNd.shape[-1] != self.cos.shape[-1]:
            raise ValueError(
                f"RoPE tables cover {self.num_rows} rows of width {self.cos.shape[-1]}, "
                f"input has shape {tuple(x_SHNd.shape)}"
            )
        cos, sin = self.cos.to(x_SHNd.dtype), self.sin.to(x_SHNd.dtype)
        if cos.dim() == 3:  # [S, N, d] -> [S, 1, N, d], broadcast over heads
            cos, sin = cos[:, None], sin[:, None]
        return x_SHNd * cos + rotate_half(x_SHNd) * sin


def rotate_half(x: Tensor) -> Tensor:
    """``[x1, x2] -> [-x2, x1]`` along the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_inverse_frequencies(head_dim: int, theta: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``[d/2]`` inverse frequencies ``theta ** (-2i/d)``."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).to(dtype) / head_dim
    return 1.0 / (theta**exponents)


def rotary_tables(
    positions: Tensor, *, head_dim: int, theta: float, model_dtype: torch.dtype
) -> RotaryTables:
    """Tables for integer ``positions`` of shape ``[N]`` or ``[S, N]``.

    ``model_dtype`` selects the precision of the angles: float64 for float64 models, float32
    otherwise (bf16 angles would be far too coarse for long contexts).
    """
    if positions.dim() not in (1, 2):
        raise ValueError(f"positions must have shape [N] or [S, N], got {tuple(positions.shape)}")
    if positions.is_floating_point() or positions.is_complex():
        raise ValueError(f"positions must be an integer tensor, got dtype {positions.dtype}")
    angle_dtype = torch.float64 if model_dtype == torch.float64 else torch.float32
    inv_freq = rope_inverse_frequencies(head_dim, theta, angle_dtype, positions.device)
    angles = positions.to(angle_dtype)[..., None] * inv_freq  # [..., N, d/2]
    angles = torch.cat((angles, angles), dim=-1)  # [..., N, d]
    return RotaryTables(cos=angles.cos(), sin=angles.sin())
