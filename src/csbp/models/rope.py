"""Rotary position embeddings (RoPE) from explicit per-row positions, with RoPE scaling.

csbp never assumes ``positions == arange(N)``: the packed rows of a rank carry arbitrary RoPE
positions (``Rows.pos``; the noisy and clean halves reuse ``0 … L-1``; DFlash blocks reuse their
anchor's positions). The tables are therefore computed from a positions tensor, once per forward,
and shared by every layer.

Convention: the "rotate-half" layout of Hugging Face Qwen/Llama: the frequency of channel ``i``
and of channel ``i + d/2`` is ``inv_freq[i]`` (``theta ** (-2i/d)`` without scaling), and::

    rope(x) = x * a*cos + rotate_half(x) * a*sin,    rotate_half([x1, x2]) = [-x2, x1]

where ``a`` is the attention factor (1 except for YaRN).

RoPE scaling (``RopeScaling``) follows the semantics of transformers' ``modeling_rope_utils``
(``rope_type`` and key names as in a HF ``config.json``):

* ``linear`` (position interpolation): every frequency divided by ``factor``.
* ``llama3`` (Llama 3.1+): wavelengths longer than ``original / low_freq_factor`` are divided by
  ``factor``, shorter than ``original / high_freq_factor`` are kept, and in between blended with
  ``s = (original / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)``.
* ``yarn``: per channel a ramp between interpolated (``inv_freq / factor``) and original
  frequencies over the channels whose number of rotations within ``original`` positions lies
  between ``beta_slow`` and ``beta_fast`` (bounds floored/ceiled unless ``truncate: false``), and
  cos/sin multiplied by the attention factor: ``attention_factor`` if given, else
  ``mscale(factor, mscale) / mscale(factor, mscale_all_dim)`` if both are set (non-zero), else
  ``mscale(factor) = 0.1 ln(factor) + 1``.

``dynamic``, ``longrope`` and other types are rejected (``ValueError`` naming the field).

The angles are computed in float32 (float64 for float64 models) and cast to the activation dtype
only when applied, as Hugging Face does.

Shape legend: ``S`` samples, ``H`` heads, ``N`` rows, ``d`` head dim.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn")
"""The ``rope_type`` values csbp implements (``default``: no scaling)."""

# Which optional keys each scaled type accepts besides ``factor`` (all others must stay unset).
_KEYS_BY_TYPE: dict[str, frozenset[str]] = {
    "linear": frozenset(),
    "llama3": frozenset({"original_max_position_embeddings", "low_freq_factor", "high_freq_factor"}),
    "yarn": frozenset(
        {
            "original_max_position_embeddings",
            "beta_fast",
            "beta_slow",
            "mscale",
            "mscale_all_dim",
            "attention_factor",
            "truncate",
        }
    ),
}
_REQUIRED_BY_TYPE: dict[str, tuple[str, ...]] = {
    "linear": (),
    "llama3": ("original_max_position_embeddings", "low_freq_factor", "high_freq_factor"),
    "yarn": ("original_max_position_embeddings",),
}


@dataclass(frozen=True)
class RopeScaling:
    """A RoPE scaling rule (module docstring); field names are those of a HF ``rope_scaling`` dict.

    Unset optional fields (None) take HF's defaults (``beta_fast`` 32, ``beta_slow`` 1,
    ``truncate`` true, attention factor from ``factor``) and are not written back on export, so a
    checkpoint's ``config.json`` round-trips unchanged.

    Attributes:
        rope_type: ``linear``, ``llama3`` or ``yarn``.
        factor: context extension factor (>= 1).
        original_max_position_embeddings: pre-extension context length (llama3, yarn).
        low_freq_factor / high_freq_factor: llama3 wavelength bounds (``high > low > 0``).
        beta_fast / beta_slow: yarn ramp bounds in rotations (``beta_fast > beta_slow > 0``).
        mscale / mscale_all_dim: yarn attention-factor coefficients (DeepSeek style).
        attention_factor: yarn cos/sin multiplier, overriding the derived one.
        truncate: yarn rounds the ramp bounds to whole channels.
    """

    rope_type: str
    factor: float
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rope_type, str) or self.rope_type not in _KEYS_BY_TYPE:
            raise ValueError(_unsupported_type_message(self.rope_type))
        factor = _number("factor", self.factor)
        if factor is None or not factor >= 1.0:
            raise ValueError(f"rope_scaling.factor must be a number >= 1, got {self.factor!r}")
        object.__setattr__(self, "factor", factor)
        allowed = _KEYS_BY_TYPE[self.rope_type]
        for name in _OPTIONAL_FIELDS:
            if getattr(self, name) is not None and name not in allowed:
                raise ValueError(
                    f"rope_scaling.{name} does not apply to rope_type={self.rope_type!r} "
                    f"(it takes {sorted({'factor', *allowed})})"
                )
        for name in _REQUIRED_BY_TYPE[self.rope_type]:
            if getattr(self, name) is None:
                raise ValueError(f"rope_scaling.{name} is required for rope_type={self.rope_type!r}")
        original = self.original_max_position_embeddings
        if original is not None and (isinstance(original, bool) or not isinstance(original, int) or original < 1):
            raise ValueError(
                f"rope_scaling.original_max_position_embeddings must be a positive integer, got {original!r}"
            )
        for name in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
                     "attention_factor"):
            object.__setattr__(self, name, _number(name, getattr(self, name)))
        for name in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor"):
            value = getattr(self, name)
            if value is not None and not value > 0.0:
                raise ValueError(f"rope_scaling.{name} must be positive, got {value!r}")
        if self.rope_type == "llama3":
            assert self.low_freq_factor is not None and self.high_freq_factor is not None
            if not self.high_freq_factor > self.low_freq_factor:
                raise ValueError(
                    f"rope_scaling.high_freq_factor must exceed low_freq_factor, got {self.high_freq_factor} "
                    f"<= {self.low_freq_factor}"
                )
        if self.rope_type == "yarn" and not self.yarn_betas[0] > self.yarn_betas[1]:
            raise ValueError(
                f"rope_scaling.beta_fast must exceed beta_slow, got {self.yarn_betas[0]} <= {self.yarn_betas[1]}"
            )
        if self.truncate is not None and not isinstance(self.truncate, bool):
            raise ValueError(f"rope_scaling.truncate must be true or false, got {self.truncate!r}")

    @property
    def yarn_betas(self) -> tuple[float, float]:
        """``(beta_fast, beta_slow)`` with HF's defaults 32 and 1."""
        return (self.beta_fast or 32.0, self.beta_slow or 1.0)

    @classmethod
    def from_dict(cls, params: Mapping[str, Any], *, where: str = "rope_scaling") -> RopeScaling | None:
        """Parse a HF-style dict (``rope_type`` or legacy ``type``); ``default`` gives None.

        ``rope_theta`` and ``partial_rotary_factor`` are the caller's business and must be removed
        first; any other unknown key is a ``ValueError`` naming ``where``.
        """
        values = dict(params)
        rope_type = values.pop("rope_type", None)
        legacy = values.pop("type", None)
        if rope_type is not None and legacy is not None and rope_type != legacy:
            raise ValueError(f"{where} has rope_type={rope_type!r} but type={legacy!r}; keep one")
        rope_type = rope_type if rope_type is not None else (legacy if legacy is not None else "default")
        if rope_type == "default":
            if values:
                raise ValueError(f"{where}: rope_type 'default' takes no {sorted(values)}")
            return None
        if not isinstance(rope_type, str) or rope_type not in _KEYS_BY_TYPE:  # a list: unhashable, not a TypeError
            raise ValueError(f"{where}: " + _unsupported_type_message(rope_type))
        unknown = sorted(set(values) - {"factor", *_OPTIONAL_FIELDS})
        if unknown:
            raise ValueError(f"{where} has unknown key {unknown[0]!r} for rope_type={rope_type!r}")
        if values.get("factor") is None:
            raise ValueError(f"{where}.factor is required for rope_type={rope_type!r}")
        try:
            return cls(rope_type=rope_type, **values)
        except ValueError as exc:
            raise ValueError(str(exc).replace("rope_scaling", where, 1)) from None

    def to_dict(self) -> dict[str, Any]:
        """The HF ``rope_scaling`` dict: ``rope_type``, ``factor`` and every field that is set."""
        out: dict[str, Any] = {"rope_type": self.rope_type, "factor": self.factor}
        out.update({name: getattr(self, name) for name in _OPTIONAL_FIELDS if getattr(self, name) is not None})
        return out

    @property
    def attention_scale(self) -> float:
        """The cos/sin multiplier (1 except for yarn)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return _yarn_mscale(self.factor, self.mscale) / _yarn_mscale(self.factor, self.mscale_all_dim)
        return _yarn_mscale(self.factor, 1.0)


_OPTIONAL_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(RopeScaling))[2:]


def _unsupported_type_message(rope_type: object) -> str:
    return (
        f"rope_type={rope_type!r} is not supported; csbp implements {list(ROPE_TYPES)} "
        "(dynamic NTK and longrope change with the sequence length, which packed rows do not have)"
    )


def _number(name: str, value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"rope_scaling.{name} must be a finite number, got {value!r}")
    return float(value)


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0


# ----------------------------------------------------------------------------- tables


@dataclass(frozen=True)
class RotaryTables:
    """Precomputed ``cos``/``sin`` tables for a set of rows (attention factor included).

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


def rope_inverse_frequencies(
    head_dim: int,
    theta: float,
    dtype: torch.dtype,
    device: torch.device,
    scaling: RopeScaling | None = None,
) -> Tensor:
    """``[d/2]`` inverse frequencies: ``theta ** (-2i/d)``, rescaled by ``scaling`` (module docstring)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).to(dtype) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3_frequencies(inv_freq, scaling)
    return _yarn_frequencies(inv_freq, head_dim, theta, scaling)


def _llama3_frequencies(inv_freq: Tensor, scaling: RopeScaling) -> Tensor:
    assert scaling.original_max_position_embeddings and scaling.low_freq_factor and scaling.high_freq_factor
    original, low, high = scaling.original_max_position_embeddings, scaling.low_freq_factor, scaling.high_freq_factor
    wavelength = 2 * math.pi / inv_freq
    long_waves = wavelength > original / low  # interpolated fully
    short_waves = wavelength < original / high  # kept
    blend = (original / wavelength - low) / (high - low)  # 0 at the long bound, 1 at the short bound
    blended = (1 - blend) * inv_freq / scaling.factor + blend * inv_freq
    return torch.where(long_waves, inv_freq / scaling.factor, torch.where(short_waves, inv_freq, blended))


def _yarn_frequencies(inv_freq: Tensor, head_dim: int, theta: float, scaling: RopeScaling) -> Tensor:
    assert scaling.original_max_position_embeddings is not None
    original = scaling.original_max_position_embeddings
    beta_fast, beta_slow = scaling.yarn_betas

    def channel_of(rotations: float) -> float:  # channel pair completing `rotations` turns in `original`
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = channel_of(beta_fast), channel_of(beta_slow)
    if scaling.truncate is not False:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    channels = torch.arange(head_dim // 2, dtype=inv_freq.dtype, device=inv_freq.device)
    ramp = ((channels - low) / (high - low)).clamp(0.0, 1.0)  # 0: keep (fast channels), 1: interpolate
    return (inv_freq / scaling.factor) * ramp + inv_freq * (1 - ramp)


def rotary_tables(
    positions: Tensor,
    *,
    head_dim: int,
    theta: float,
    model_dtype: torch.dtype,
    scaling: RopeScaling | None = None,
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
    inv_freq = rope_inverse_frequencies(head_dim, theta, angle_dtype, positions.device, scaling)
    angles = positions.to(angle_dtype)[..., None] * inv_freq  # [..., N, d/2]
    angles = torch.cat((angles, angles), dim=-1)  # [..., N, d]
    scale = 1.0 if scaling is None else scaling.attention_scale
    if scale == 1.0:
        return RotaryTables(cos=angles.cos(), sin=angles.sin())
    return RotaryTables(cos=angles.cos() * scale, sin=angles.sin() * scale)
