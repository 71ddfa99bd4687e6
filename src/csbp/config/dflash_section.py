"""The ``objective.dflash`` section of a run config: the frozen target, the drafter's shape and the
DFlash / DFlash2 loss options (objectives.md §5-§6)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from csbp.config.rules import ConfigRuleError
from csbp.config.section_base import _Section, path_field
from csbp.wording import counted


class DFlashSection(_Section):
    """DFlash / DFlash2 drafter training against a frozen target model (objectives.md §5-§6).

    The drafter's width, heads, RoPE and vocabulary come from the target (``DFlashConfig.from_target``);
    its block size is ``objective.block_size`` and its ``[M]`` token ``objective.mask_token_id`` (unset:
    the data artifact's mask token). ``init_from`` starts it from a drafter directory in the public format
    (:mod:`csbp.training.dflash_init`), which must have that architecture.
    """

    target: str = path_field(description="Local HF checkpoint directory of the frozen target model.")
    features: str | None = path_field(
        None,
        description="Offline target-feature store of data.train (`csbp dflash prepare-features`); it must "
        "match the target's weights (sha256 fingerprint) and the data's tokens, or the run is refused; "
        "unset: capture the target's features online in every step.",
    )
    init_from: str | None = path_field(
        None,
        description="Drafter directory to start from instead of a random drafter: a `csbp dflash export` or a "
        "published DFlash/DFlash2 drafter (config.json + model.safetensors; safetensors only, no remote code). Its "
        "architecture must be the one this section, objective.block_size and the target give, or the run is refused.",
    )
    num_draft_layers: int = Field(1, gt=0, description="Decoder layers of the drafter.")
    intermediate_size: int | None = Field(
        None, gt=0, description="SwiGLU inner width of the draft layers; unset: the target's."
    )
    target_layer_ids: list[int] | None = Field(
        None,
        min_length=1,
        description="Target layers whose outputs are fused (0-based); unset: the DFlash default.",
    )
    layer_types: list[Literal["full_attention", "sliding_attention"]] | None = Field(
        None, description="Per draft layer full or sliding attention; unset: all full_attention."
    )
    sliding_window: int | None = Field(
        None, gt=0, description="Window W of the sliding draft layers (counts the query itself); needs a sliding_attention layer."
    )
    sliding_window_causal: bool = Field(True, description="Sliding layers are causal inside the block (set only with a sliding_attention layer).")
    max_anchors: int = Field(512, gt=0, description="Anchor blocks sampled per sequence.")
    anchor_sampling: Literal["uniform", "locality"] = Field(
        "uniform", description="uniform: random distinct anchors; locality: random start plus a stride."
    )
    context: Literal["strict", "inclusive"] = Field(
        "strict",
        description="Context visible to an anchor block: strictly before the anchor, or including it.",
    )
    gamma: float | None = Field(
        None, gt=0, description="Loss decay exp(-(k-1)/gamma) over block slots; unset: no decay (SpecForge's default "
        "too; its published recipes set 7 for block_size 16, ModelOpt/speculators 4 for block_size 8). A dpace weighting "
        "replaces it, so there only the selector loss uses it."
    )
    loss: Literal["ce", "kl"] = Field("ce", description="ce: against data tokens; kl: against the target.")
    weighting: Literal[
        "decay", "dpace", "dpace-cumulative-confidence-only", "dpace-continuation-value-only"
    ] = Field("decay", description="Slot weights: fixed decay (gamma) or detached D-PACE confidence weights.")
    dpace_alpha: float = Field(0.5, ge=0.0, le=1.0, description="D-PACE s_j = alpha + (1 - alpha) p_draft (dpace weightings only).")
    lk_loss_type: Literal["ce", "tv", "lambda"] = Field(
        "ce", description="Per-token loss with loss: ce: ce, tv (1 - p) or lambda (CE/TV mix)."
    )
    kl_scale: float = Field(1.0, gt=0.0, le=1.0, description="lambda mix: c = kl_scale exp(-kl_decay acc) (lk_loss_type: lambda only).")
    kl_decay: float = Field(1.0, ge=0.0, description="lambda mix decay over the acceptance estimate (lk_loss_type: lambda only).")
    conv_kernel_size: int = Field(0, ge=0, description="DFlash2 block convolution taps; 0 disables it.")
    conv_group_size: int = Field(16, gt=0, description="Channels per DFlash2 convolution group (needs conv_kernel_size > 0).")
    selector_rank: int = Field(0, ge=0, description="DFlash2 candidate-selector rank; 0 disables it.")
    selector_top_k: int = Field(16, gt=0, description="Candidates per slot of the DFlash2 selector (needs selector_rank > 0).")
    selector_alpha: float = Field(1.0, ge=0.0, description="Weight of the selector loss after warm-up (needs selector_rank > 0).")
    selector_warmup_ratio: float = Field(
        0.0, ge=0.0, le=1.0, description="Fraction of training with the selector loss off."
    )
    selector_ramp_ratio: float = Field(
        0.0, ge=0.0, le=1.0, description="Fraction of training over which the selector loss ramps up."
    )
    selector_stop_gradient: bool = Field(
        False, description="Detach the backbone hidden state and unary logits inside the selector."
    )
    target_capture: Literal["sharded", "replicated"] = Field(
        "sharded",
        description="Online target features under CP: sharded (each ring member runs the target on its "
        "context rows, K/V all-gathered per layer) or replicated (the full sequence on every rank).",
    )
    eval_prompts: int = Field(
        8,
        ge=0,
        description="Validation also runs lossless speculative decoding (csbp dflash eval) on this many "
        "validation prompts and logs val_acceptance_length; 0 turns it off.",
    )
    eval_new_tokens: int = Field(64, gt=0, description="New tokens per speculative-decoding validation prompt.")

    @model_validator(mode="after")
    def _check_dflash(self) -> DFlashSection:
        violations = []
        if self.loss == "kl" and self.lk_loss_type != "ce":
            violations.append(
                ("lk_loss_type", f"{self.lk_loss_type} mixes with the hard CE only", "use ce with loss: kl")
            )
        if self.layer_types is not None and len(self.layer_types) != self.num_draft_layers:
            violations.append(
                (
                    "layer_types",
                    f"lists {counted(len(self.layer_types), 'layer')}, num_draft_layers={self.num_draft_layers}",
                    "give one entry per draft layer",
                )
            )
        if self.layer_types is not None and "sliding_attention" in self.layer_types and not self.sliding_window:
            violations.append(
                ("sliding_window", "required by sliding_attention layers", "set objective.dflash.sliding_window")
            )
        if self.target_layer_ids is not None and len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            violations.append(("target_layer_ids", "ids must be distinct", "remove the repeated ids"))
        if self.target_layer_ids is not None and any(i < 0 for i in self.target_layer_ids):
            violations.append(("target_layer_ids", "ids are 0-based layer indices", "use ids >= 0"))
        violations += self._inert_option_violations()
        if violations:
            raise ConfigRuleError(violations)
        return self

    def _inert_option_violations(self) -> list[tuple[str, str, str]]:
        """Options changed from their default while the switch they depend on is off: the run would
        silently train without them (``selector_alpha`` without ``selector_rank`` trains plain DFlash).
        Compared with the defaults, not with the keys written, so a saved ``config.yaml`` (every field
        written out) still loads."""
        sliding = self.layer_types is not None and "sliding_attention" in self.layer_types
        groups = (
            (self.selector_rank > 0, "the DFlash2 selector is off (selector_rank: 0)",
             ("selector_top_k", "selector_alpha", "selector_warmup_ratio", "selector_ramp_ratio",
              "selector_stop_gradient"), "set selector_rank > 0"),
            (self.conv_kernel_size > 0, "the DFlash2 convolution is off (conv_kernel_size: 0)",
             ("conv_group_size",), "set conv_kernel_size > 0"),
            (sliding, "no draft layer is sliding_attention",
             ("sliding_window", "sliding_window_causal"), "list sliding_attention in layer_types"),
            (self.weighting != "decay", "weighting: decay uses fixed weights",
             ("dpace_alpha",), "set a dpace weighting"),
            (self.lk_loss_type == "lambda", f"lk_loss_type: {self.lk_loss_type} is not the mix",
             ("kl_scale", "kl_decay"), "set lk_loss_type: lambda"),
            (self.weighting == "decay" or self.selector_rank > 0,
             f"weighting: {self.weighting} replaces the decay and no selector loss uses it", ("gamma",),
             "set weighting: decay or selector_rank > 0"),
        )
        violations = []
        for on, why, dependents, enable in groups:
            inert = [name for name in dependents if not on and getattr(self, name) != _default(name)]
            if inert:
                also = f" (nor {', '.join(inert[1:])})" if len(inert) > 1 else ""
                violations.append((inert[0], f"has no effect{also}: {why}", f"{enable}, or remove {', '.join(inert)}"))
        return violations


def _default(name: str) -> object:
    return DFlashSection.model_fields[name].default
