"""The ``model`` section of a run config: the decoder's family and shape, or the local Hugging
Face checkpoint it starts from (:class:`csbp.config.schema.RunConfig` holds it)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from csbp.config.rope_section import RopeScalingSection
from csbp.config.rules import SHAPE_FIELDS, ConfigRuleError
from csbp.config.section_base import _Section, path_field

_ARCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3": {"rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6, "qk_norm": True, "tie_embeddings": False},
    "llama": {"rope_theta": 500_000.0, "rms_norm_eps": 1e-5, "qk_norm": False, "tie_embeddings": False},
    "qwen2": {"rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6, "qk_norm": False, "tie_embeddings": False},
    # Mistral-7B-v0.3's and Mistral-Nemo's
    "mistral": {"rope_theta": 1_000_000.0, "rms_norm_eps": 1e-5, "qk_norm": False, "tie_embeddings": False},
}


FLOAT32_MAX = 3.4028234663852886e38
"""The largest float32: a model number above it is inf in the float32 weights and RoPE tables."""


class ModelSection(_Section):
    """The decoder. Either built from the shape fields, or loaded from a local HF checkpoint
    (``init_from``), in which case every field left unset is read from that checkpoint and the
    model loader checks the fields given against it, except ``rope_theta`` and ``rope_scaling``,
    which replace the checkpoint's (extending RoPE is how a short-context model is trained long). For ``objective.name: dflash`` the trained
    model is the drafter, shaped by the target and ``objective.dflash``: only ``dtype`` (of the
    exported drafter) may be set."""

    arch: Literal["qwen3", "llama", "qwen2", "mistral"] = Field(
        "qwen3", description="Decoder family: qwen3 (QK-norm), llama, qwen2 (q/k/v biases), or mistral (no biases; "
        "exported with sliding_window: null)."
    )
    init_from: str | None = path_field(
        None, description="Local Hugging Face checkpoint directory to initialise from (no downloads)."
    )
    vocab_size: int | None = Field(
        None, gt=0, description="Embedding rows; unset: the data artifact's vocabulary (or init_from)."
    )
    hidden_size: int | None = Field(None, gt=0, description="Residual stream width.")
    intermediate_size: int | None = Field(None, gt=0, description="SwiGLU MLP inner width.")
    num_layers: int | None = Field(None, gt=0, description="Number of decoder layers.")
    num_heads: int | None = Field(None, gt=0, description="Query heads per layer.")
    num_kv_heads: int | None = Field(None, gt=0, description="Key/value heads per layer (GQA).")
    head_dim: int | None = Field(None, gt=0, description="Width of one attention head (even, for RoPE).")
    rope_theta: float | None = Field(  # 1e-300 is 0 in the float32 tables: a NaN first step, blamed on optim.lr
        None, ge=1.0, le=FLOAT32_MAX,
        description="RoPE base, from 1 (below, the channels meant for long range turn fastest) to 3.4e38 (above, "
        "inf in float32: no channel but the first turns); unset: 1e6 for qwen3/qwen2/mistral, 5e5 for llama, or init_from's "
        "(set: replaces it).",
    )
    rope_scaling: RopeScalingSection | None = Field(
        None,
        description="RoPE scaling, e.g. {type: yarn, factor: 4, original_max_position_embeddings: 32768}; "
        "unset: none (or init_from's; set: replaces it).",
    )
    rms_norm_eps: float | None = Field(
        None, gt=0, le=FLOAT32_MAX,
        description="RMSNorm epsilon, at most 3.4e38 (above, inf in float32: every norm outputs 0); unset: "
        "1e-6 for qwen3/qwen2, 1e-5 for llama/mistral, or init_from's.",
    )
    qk_norm: bool | None = Field(
        None, description="RMSNorm on queries and keys per head: true for qwen3, false for llama, qwen2 and mistral "
        "(each family's HF layout; unset: that)."
    )
    tie_embeddings: bool | None = Field(
        None, description="Share the input embedding with the LM head; unset: false (or init_from)."
    )
    dtype: Literal["float32", "bfloat16", "float64"] = Field(
        "float32", description="Dtype of the exported final/ checkpoint; training keeps float32 master weights "
        "and optimizer state (float64 with train.precision: fp64, which needs float64 here).",
    )

    @model_validator(mode="before")
    @classmethod
    def _fill_arch_defaults(cls, data: Any) -> Any:
        """From-scratch models take the arch's defaults for unset rope/norm/tying fields (a section
        without any shape field describes no decoder: a dflash run's, or an incomplete one)."""
        if not isinstance(data, dict) or data.get("init_from") is not None:
            return data
        if all(data.get(name) is None for name in SHAPE_FIELDS):
            return data
        arch = data.get("arch", "qwen3")
        defaults = _ARCH_DEFAULTS.get(arch) if isinstance(arch, str) else None  # a list or mapping: unhashable
        if defaults is None:
            return data  # the Literal check reports the bad arch
        filled = dict(data)
        for key, value in defaults.items():
            if filled.get(key) is None:
                filled[key] = value
        return filled

    @model_validator(mode="after")
    def _check_shapes(self) -> ModelSection:
        """Head and RoPE shape consistency (which fields are required depends on the objective:
        :func:`csbp.config.rules._model_rules`)."""
        violations = []
        if (
            self.num_heads is not None
            and self.num_kv_heads is not None
            and self.num_heads % self.num_kv_heads
        ):
            violations.append(
                (
                    "num_kv_heads",
                    f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}",
                    "choose num_kv_heads dividing num_heads",
                )
            )
        if self.head_dim is not None and self.head_dim % 2:
            violations.append(("head_dim", f"head_dim={self.head_dim} is odd", "use an even head_dim (RoPE)"))
        if violations:
            raise ConfigRuleError(violations)
        return self
