"""Configuration of a DFlash / DFlash2 drafter (architecture) and of its training objective.

``DFlashConfig`` is everything the drafter's weights and ``config.json`` depend on (objectives.md
§5.1-§5.2, §6, §8); ``DFlashObjectiveConfig`` is everything the loss depends on (anchor sampling,
mask convention, weights, normalisation, DFlash2 loss options; objectives.md §5.3-§5.6, §6).
Both are frozen dataclasses validated on construction with one-line ``ValueError``s.

Usage::

    config = DFlashConfig.from_target(target.config, num_layers=2, block_size=4, mask_token_id=63,
                                      target_layer_ids=(0, 2))
    objective = DFlashObjectiveConfig(max_anchors=8, gamma=7.0)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from csbp.models.config import DecoderConfig
from csbp.models.rope import RopeScaling, rope_inverse_frequencies

LayerType = Literal["full_attention", "sliding_attention"]
LAYER_TYPES: tuple[str, ...] = get_args(LayerType)
WEIGHTINGS: tuple[str, ...] = (
    "decay",
    "dpace",
    "dpace-cumulative-confidence-only",
    "dpace-continuation-value-only",
)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The DFlash default (objectives.md §5.1): ``[L // 2]`` for one draft layer, otherwise ``K`` ids
    ``round(1 + i·(L−4)/(K−1))`` on ``[1, L−3]`` (36 layers, K = 5 -> 1, 9, 17, 25, 33).

    ``round`` is Python's (halves to even) on the same float expression as the public DFlash readers
    (z-lab, SpecForge, SGLang), which fill these ids in when a checkpoint's ``dflash_config`` has none:
    ``38`` layers, ``K = 5`` give ``1, 10, 18, 26, 35`` (rounding halves up gave ``27`` for ``26.5``)."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    ids = tuple(
        int(round(1 + (i * (num_target_layers - 4)) / (num_draft_layers - 1)))
        for i in range(num_draft_layers)
    )
    if num_target_layers < 4 or len(set(ids)) != len(ids):
        raise ValueError(
            f"num_target_layers={num_target_layers} is too shallow for the default target_layer_ids of "
            f"{num_draft_layers} draft layers (got {list(ids)}); set target_layer_ids explicitly"
        )
    return ids


@dataclass(frozen=True)
class DFlashConfig:
    """Drafter hyper-parameters.

    Attributes:
        vocab_size: the target's vocabulary (rows of its embedding and LM head, shared by reference).
        hidden_size: residual width; must equal the target's hidden size.
        intermediate_size: SwiGLU inner width of the draft MLPs (free).
        num_layers: draft decoder layers.
        num_heads / num_kv_heads / head_dim: attention shape of the draft layers.
        num_target_layers: depth of the target (``config.json`` needs it top-level).
        mask_token_id: the ``[M]`` id filling the ``B−1`` draft slots of a block.
        block_size: ``B``, tokens per block including the anchor.
        target_layer_ids: fused target layers (0-based; layer ``i`` is HF ``hidden_states[i+1]``);
            None: the default of ``default_target_layer_ids``.
        rope_theta / rms_norm_eps: as in the target family.
        rope_scaling: the target's RoPE scaling (the drafter rotates at the target's positions).
        layer_types: per draft layer ``full_attention`` or ``sliding_attention``; None: all full.
        sliding_window: ``W`` of the sliding layers (counts the query itself).
        sliding_window_causal: sliding layers are causal inside the block (``j(k) <= j(q)``).
        conv_kernel_size: DFlash2 dynamic block convolution taps ``T`` (0 = no convolution).
        conv_group_size: channels per convolution group.
        selector_rank: DFlash2 low-rank candidate selector rank ``r`` (0 = no selector).
        selector_top_k: candidates ``K`` per slot of the selector.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_target_layers: int
    mask_token_id: int
    block_size: int = 16
    target_layer_ids: tuple[int, ...] | None = None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    rope_scaling: RopeScaling | None = None
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    sliding_window_causal: bool = True
    conv_kernel_size: int = 0
    conv_group_size: int = 16
    selector_rank: int = 0
    selector_top_k: int = 16

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "num_target_layers",
            "block_size",
            "conv_group_size",
            "selector_top_k",
        ):
            _require_int(name, getattr(self, name), minimum=1)
        for name in ("conv_kernel_size", "selector_rank", "mask_token_id"):
            _require_int(name, getattr(self, name), minimum=0)
        if self.mask_token_id >= self.vocab_size:
            raise ValueError(
                f"DFlashConfig.mask_token_id={self.mask_token_id} is outside the vocabulary "
                f"[0, {self.vocab_size}); "
                "use an unused embedding row of the target"
            )
        if self.num_heads % self.num_kv_heads != 0 or self.head_dim % 2 != 0:
            raise ValueError(
                f"DFlashConfig: num_heads={self.num_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads} "
                f"and head_dim={self.head_dim} even"
            )
        ids = self.target_layer_ids
        if ids is None:
            ids = default_target_layer_ids(self.num_target_layers, self.num_layers)
        ids = tuple(int(i) for i in ids)
        if not ids or any(not 0 <= i < self.num_target_layers for i in ids) or len(set(ids)) != len(ids):
            raise ValueError(
                f"DFlashConfig.target_layer_ids={list(ids)} must be distinct ids in [0, num_target_layers="
                f"{self.num_target_layers})"
            )
        object.__setattr__(self, "target_layer_ids", ids)
        types = (
            tuple(self.layer_types) if self.layer_types is not None else ("full_attention",) * self.num_layers
        )
        if len(types) != self.num_layers or any(t not in LAYER_TYPES for t in types):
            raise ValueError(
                f"DFlashConfig.layer_types must list {self.num_layers} entries of {LAYER_TYPES}, "
                f"got {list(types)}"
            )
        object.__setattr__(self, "layer_types", types)
        if "sliding_attention" in types:
            _require_int("sliding_window", self.sliding_window, minimum=1)
        if self.conv_kernel_size and self.hidden_size % self.conv_group_size != 0:
            raise ValueError(
                f"DFlashConfig.hidden_size={self.hidden_size} must be a multiple of conv_group_size="
                f"{self.conv_group_size}"
            )
        if self.selector_rank and self.selector_top_k > self.vocab_size:
            raise ValueError(
                f"DFlashConfig.selector_top_k={self.selector_top_k} exceeds vocab_size={self.vocab_size}"
            )
        object.__setattr__(self, "rope_theta", float(self.rope_theta))
        object.__setattr__(self, "rms_norm_eps", float(self.rms_norm_eps))

    @property
    def is_dflash2(self) -> bool:
        """True when a DFlash2 module (convolution or selector) is enabled."""
        return self.conv_kernel_size > 0 or self.selector_rank > 0

    @property
    def feature_width(self) -> int:
        """Width ``K·H`` of the fused target features."""
        assert self.target_layer_ids is not None
        return len(self.target_layer_ids) * self.hidden_size

    def decoder_config(self) -> DecoderConfig:
        """The ``DecoderConfig`` of one draft layer (used to build its attention and MLP modules)."""
        return DecoderConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            rms_norm_eps=self.rms_norm_eps,
            qk_norm=True,
        )

    @staticmethod
    def from_target(
        target: DecoderConfig,
        *,
        num_layers: int,
        block_size: int,
        mask_token_id: int,
        intermediate_size: int | None = None,
        **options: object,
    ) -> DFlashConfig:
        """A drafter shaped like ``target`` (hidden size, heads, RoPE, vocabulary); ``options`` are
        the remaining ``DFlashConfig`` fields (``target_layer_ids``, ``layer_types``, DFlash2 ...)."""
        return DFlashConfig(
            vocab_size=target.vocab_size,
            hidden_size=target.hidden_size,
            intermediate_size=intermediate_size or target.intermediate_size,
            num_layers=num_layers,
            num_heads=target.num_heads,
            num_kv_heads=target.num_kv_heads,
            head_dim=target.head_dim,
            num_target_layers=target.num_layers,
            mask_token_id=mask_token_id,
            block_size=block_size,
            rope_theta=target.rope_theta,
            rope_scaling=target.rope_scaling,
            rms_norm_eps=target.rms_norm_eps,
            **options,  # type: ignore[arg-type]
        )


def validate_drafter_target(config: DFlashConfig, target: DecoderConfig) -> None:
    """``ValueError`` when a drafter cannot run on ``target`` (shared embedding/head, layer ids)."""
    if config.hidden_size != target.hidden_size:
        raise ValueError(
            f"drafter hidden_size={config.hidden_size} differs from the target's {target.hidden_size}: "
            "the drafter shares the target's embedding and LM head"
        )
    if config.vocab_size != target.vocab_size:
        raise ValueError(
            f"drafter vocab_size={config.vocab_size} differs from the target's {target.vocab_size}; "
            "build the drafter with DFlashConfig.from_target"
        )
    if config.num_target_layers != target.num_layers:
        raise ValueError(
            f"drafter num_target_layers={config.num_target_layers} differs from the target's "
            f"{target.num_layers} layers"
        )
    assert config.target_layer_ids is not None
    bad = [i for i in config.target_layer_ids if not 0 <= i < target.num_layers]
    if bad:
        raise ValueError(f"target_layer_ids {bad} are outside the target's layers [0, {target.num_layers})")
    if not 0 <= config.mask_token_id < target.vocab_size:
        raise ValueError(
            f"mask_token_id={config.mask_token_id} is not a row of the target embedding "
            f"(vocab {target.vocab_size})"
        )
    if not same_rope(config.head_dim, (config.rope_theta, config.rope_scaling), (target.rope_theta, target.rope_scaling)):
        raise ValueError(
            f"drafter RoPE {describe_rope(config.rope_theta, config.rope_scaling)} differs from the target's "
            f"{describe_rope(target.rope_theta, target.rope_scaling)}: the drafter rotates its queries and the "
            "target's context at the target's positions with the target's RoPE"
        )


def describe_rope(theta: float, scaling: RopeScaling | None) -> str:
    """``(theta=10000, no scaling)`` or ``(theta=10000, yarn: factor=4.0, ...)``: a RoPE for messages."""
    if scaling is None:
        return f"(theta={theta:g}, no scaling)"
    fields = ", ".join(f"{key}={value}" for key, value in scaling.to_dict().items() if key != "rope_type")
    return f"(theta={theta:g}, {scaling.rope_type}: {fields})"


def same_rope(
    head_dim: int, first: tuple[float, RopeScaling | None], second: tuple[float, RopeScaling | None]
) -> bool:
    """Whether two (theta, scaling) pairs rotate identically: the same inverse frequencies and
    attention factor (so ``beta_fast: 32`` equals an unset ``beta_fast``)."""
    def tables(theta: float, scaling: RopeScaling | None) -> tuple[torch.Tensor, float]:
        inv_freq = rope_inverse_frequencies(head_dim, theta, torch.float64, torch.device("cpu"), scaling)
        return inv_freq, 1.0 if scaling is None else scaling.attention_scale

    (freq_a, scale_a), (freq_b, scale_b) = tables(*first), tables(*second)
    return scale_a == scale_b and torch.equal(freq_a, freq_b)


@dataclass(frozen=True)
class DFlashObjectiveConfig:
    """Training-objective options (objectives.md §5.3-§5.6 and §6).

    Attributes:
        max_anchors: anchor blocks sampled per sequence (``min(max_anchors, valid)`` are drawn).
        anchor_sampling: ``uniform`` (distinct, without replacement) or ``locality`` (random cyclic
            start plus a stride coprime with the candidate count).
        context: ``strict`` (context ``[doc_start, a)``, the inference-consistent default) or
            ``inclusive`` (``[doc_start, a]``, to reproduce drafters trained that way).
        gamma: decay ``exp(-(j-1)/gamma)`` over block slots; None: no decay.
        loss: ``ce`` (hard CE against the data token) or ``kl`` (forward KL against the target's
            next-token distribution one position earlier).
        weighting: ``decay`` (fixed weights, per-sample global supervised-slot count as
            denominator) or a D-PACE kind (detached adaptive weights, per-sample global weight sum).
        dpace_alpha: ``α`` of ``s_j = α + (1-α)·p_draft(y_j)``.
        lk_loss_type: per-token loss with ``loss='ce'``: ``ce``, ``tv`` (``1 - p``) or ``lambda``
            (``c·CE + (1-c)·TV``, ``c = kl_scale·exp(-kl_decay·acceptance)``).
        kl_scale / kl_decay: the ``lambda`` mix coefficients (``kl_scale`` in ``(0, 1]``).
        selector_alpha: ``α`` of ``L = L_DF + α·L_sel`` after warm-up.
        selector_warmup_ratio / selector_ramp_ratio: fraction of training with ``α = 0``, then the
            fraction over which it ramps linearly to ``selector_alpha``.
        selector_stop_gradient: detach the backbone hidden state and unary logits in the selector.
        min_anchor_bucket: smallest power-of-two anchor packet of a BP rank; None:
            ``min(128, max_anchors // bp)``.
        ce_chunk_rows: rows per chunk of the LM-head loss (bounds ``[rows, V]`` logits).
        target_capture: online target features under CP (``cp > 1``): ``sharded`` (each ring member
            runs the target on its context rows, K/V all-gathered per layer;
            ``csbp.dflash.target_shard``) or ``replicated`` (the full sequence on every rank).
    """

    max_anchors: int = 512
    anchor_sampling: Literal["uniform", "locality"] = "uniform"
    context: Literal["strict", "inclusive"] = "strict"
    gamma: float | None = None
    loss: Literal["ce", "kl"] = "ce"
    weighting: Literal[
        "decay", "dpace", "dpace-cumulative-confidence-only", "dpace-continuation-value-only"
    ] = "decay"
    dpace_alpha: float = 0.5
    lk_loss_type: Literal["ce", "tv", "lambda"] = "ce"
    kl_scale: float = 1.0
    kl_decay: float = 1.0
    selector_alpha: float = 1.0
    selector_warmup_ratio: float = 0.0
    selector_ramp_ratio: float = 0.0
    selector_stop_gradient: bool = False
    min_anchor_bucket: int | None = None
    ce_chunk_rows: int = 1024
    target_capture: Literal["sharded", "replicated"] = "sharded"

    def __post_init__(self) -> None:
        _require_int("max_anchors", self.max_anchors, minimum=1)
        _require_int("ce_chunk_rows", self.ce_chunk_rows, minimum=1)
        if self.min_anchor_bucket is not None:
            _require_int("min_anchor_bucket", self.min_anchor_bucket, minimum=1)
        choices = {
            "anchor_sampling": ("uniform", "locality"),
            "context": ("strict", "inclusive"),
            "loss": ("ce", "kl"),
            "weighting": WEIGHTINGS,
            "lk_loss_type": ("ce", "tv", "lambda"),
            "target_capture": ("sharded", "replicated"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"DFlashObjectiveConfig.{name}={getattr(self, name)!r} must be one of {allowed}"
                )
        if self.gamma is not None and not self.gamma > 0:
            raise ValueError(
                f"DFlashObjectiveConfig.gamma={self.gamma} must be positive (or None for no decay)"
            )
        if not 0.0 <= self.dpace_alpha <= 1.0:
            raise ValueError(f"DFlashObjectiveConfig.dpace_alpha={self.dpace_alpha} must be in [0, 1]")
        if self.loss == "kl" and self.lk_loss_type != "ce":
            raise ValueError(
                f"DFlashObjectiveConfig.lk_loss_type={self.lk_loss_type!r} needs loss='ce'; "
                "with loss='kl' use 'ce'"
            )
        if not 0.0 < self.kl_scale <= 1.0 or self.kl_decay < 0.0:
            raise ValueError(
                f"DFlashObjectiveConfig: kl_scale={self.kl_scale} must be in (0, 1] and "
                f"kl_decay={self.kl_decay} >= 0"
            )
        for name in ("selector_warmup_ratio", "selector_ramp_ratio"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"DFlashObjectiveConfig.{name}={getattr(self, name)} must be in [0, 1]")
        if self.selector_alpha < 0.0:
            raise ValueError(f"DFlashObjectiveConfig.selector_alpha={self.selector_alpha} must be >= 0")

    def anchor_bucket_minimum(self, num_owners: int) -> int:
        """Smallest anchor packet of one of ``num_owners`` BP ranks."""
        if self.min_anchor_bucket is not None:
            return self.min_anchor_bucket
        return max(1, min(128, self.max_anchors // num_owners))


def _require_int(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
