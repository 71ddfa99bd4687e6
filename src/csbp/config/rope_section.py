"""The ``model.rope_scaling`` section of a run config: RoPE scaling set on the run, e.g. to train a
short-context checkpoint (``model.init_from``) on longer sequences::

    model:
      init_from: /ckpt/Qwen2.5-7B-Instruct
      rope_scaling: {type: yarn, factor: 4, original_max_position_embeddings: 32768}

Key names are those of a Hugging Face ``rope_scaling`` dict (``type`` or ``rope_type``); the rule
itself, its defaults and its checks are :class:`csbp.models.rope.RopeScaling`'s.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from csbp.config.rules import ConfigRuleError
from csbp.config.section_base import _Section
from csbp.models.rope import RopeScaling


class RopeScalingSection(_Section):
    """RoPE scaling of the trained model; replaces the ``init_from`` checkpoint's own (if any) and is
    written into the exported ``config.json``."""

    type: Literal["linear", "llama3", "yarn"] = Field(
        description="linear (position interpolation), llama3 (Llama 3.1 frequency bands) or yarn (YaRN); "
        "dynamic and longrope are not supported."
    )
    factor: float = Field(ge=1.0, description="Context extension factor.")
    original_max_position_embeddings: int | None = Field(
        None, gt=0, description="Context length before the extension (llama3, yarn: required)."
    )
    low_freq_factor: float | None = Field(None, gt=0, description="llama3: long-wavelength bound (Llama 3.1: 1).")
    high_freq_factor: float | None = Field(None, gt=0, description="llama3: short-wavelength bound (Llama 3.1: 4).")
    beta_fast: float | None = Field(None, gt=0, description="yarn: ramp bound in rotations; unset: 32.")
    beta_slow: float | None = Field(None, gt=0, description="yarn: ramp bound in rotations; unset: 1.")
    mscale: float | None = Field(None, description="yarn: attention-factor coefficient (with mscale_all_dim).")
    mscale_all_dim: float | None = Field(None, description="yarn: attention-factor denominator coefficient.")
    attention_factor: float | None = Field(
        None, gt=0, description="yarn: cos/sin multiplier; unset: 0.1 ln(factor) + 1."
    )
    truncate: bool | None = Field(None, description="yarn: round the ramp bounds to whole channels; unset: true.")

    @model_validator(mode="before")
    @classmethod
    def _accept_rope_type(cls, data: Any) -> Any:
        """``rope_type`` (the current HF key) is accepted as a synonym of ``type``."""
        if isinstance(data, dict) and "rope_type" in data:
            data = dict(data)
            rope_type = data.pop("rope_type")
            if data.setdefault("type", rope_type) != rope_type:
                raise ConfigRuleError([("rope_type", f"{rope_type!r} differs from type={data['type']!r}", "keep one")])
        return data

    @model_validator(mode="after")
    def _check_rule(self) -> RopeScalingSection:
        """Which keys each type needs or allows (:class:`RopeScaling`)."""
        try:
            self.to_rope_scaling()
        except ValueError as exc:
            field, _, message = str(exc).partition(" ")
            if not field.startswith("rope_scaling."):
                raise ConfigRuleError([("", str(exc), "")]) from None
            name = field.split(".", 1)[1]
            raise ConfigRuleError([(name, message.removeprefix("is "), _fix(name, message))]) from None
        return self

    def to_rope_scaling(self) -> RopeScaling:
        """The model-level rule."""
        values = self.model_dump(exclude={"type"})
        return RopeScaling(rope_type=self.type, **values)


_ORDER_FIXES = {
    "beta_fast": "set beta_fast above beta_slow (unset: 32 and 1)",
    "high_freq_factor": "set high_freq_factor above low_freq_factor (Llama 3.1: 4 and 1)",
}


def _fix(name: str, message: str) -> str:
    """The ``(fix: ...)`` of a :class:`RopeScaling` refusal of ``name`` (its messages say only what is wrong)."""
    if message.startswith("does not apply"):
        return f"remove model.rope_scaling.{name}"
    if message.startswith("must exceed") and name in _ORDER_FIXES:
        return _ORDER_FIXES[name]
    info = RopeScalingSection.model_fields.get(name)
    what = f": {info.description.rstrip('.')}" if info is not None and info.description else ""
    return f"set model.rope_scaling.{name}{what}"
