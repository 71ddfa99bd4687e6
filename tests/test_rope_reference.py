"""RoPE scaling tables against transformers' own rope-init functions, on the corners the model tests miss.

``test_hf_rope.py`` compares whole models at one geometry (theta 5000, original 64, head_dim 8-16),
where the yarn ramp's lower bound is negative (so flooring it cannot matter) and its upper bound is
far below the head dim (so clipping it cannot matter). Here the inverse frequencies and the
attention factor come straight from ``transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS`` for
geometries that reach those branches: a ramp starting at a fractional channel (Qwen-style theta and
original), a ramp clipped at ``head_dim - 1`` (small theta, long original), yarn with ``mscale``
alone or ``mscale_all_dim`` alone, Llama 3.1's own values, and factor 1. Then the boundary values
``RopeScaling`` must refuse (a zero bound, equal bounds, a zero original length), each of which would
divide by zero or make an empty ramp.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_rope_reference.py -q``
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from csbp.models.rope import RopeScaling, rope_inverse_frequencies  # noqa: E402


def hf_tables(transformers: ModuleType, head_dim: int, theta: float, rope: dict[str, Any]) -> tuple[torch.Tensor,
                                                                                                     float]:
    """transformers' float32 inverse frequencies and attention factor for a tiny Llama config."""
    config = transformers.LlamaConfig(
        vocab_size=8, hidden_size=head_dim * 2, num_attention_heads=2, num_key_value_heads=2, head_dim=head_dim,
        num_hidden_layers=1, intermediate_size=8, max_position_embeddings=1 << 16,
        rope_parameters={"rope_theta": theta, **rope},
    )
    init = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS[rope["rope_type"]]
    inv_freq, scale = init(config, torch.device("cpu"))
    return inv_freq.to(torch.float64), float(scale)


YARN_QWEN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
CASES = [
    # low bound 10.5 -> floor 10 (ceil 11 differs on channel 10), high bound 22.5 -> 23
    pytest.param(64, 10000.0, YARN_QWEN, id="yarn-ramp-from-a-fractional-channel"),
    pytest.param(64, 1e6, {**YARN_QWEN, "factor": 2.5, "beta_fast": 16.0, "beta_slow": 1.5}, id="yarn-betas"),
    # theta 10, original 1024: the ramp runs from channel 5.6 to 17.7, past head_dim - 1 = 15, clipped there
    pytest.param(16, 10.0, {**YARN_QWEN, "original_max_position_embeddings": 1024}, id="yarn-ramp-clipped"),
    pytest.param(16, 10.0, {**YARN_QWEN, "original_max_position_embeddings": 1024, "truncate": False},
                 id="yarn-untruncated-clipped"),
    # attention factor: mscale alone or mscale_all_dim alone fall back to mscale(factor) = 0.1 ln(factor) + 1
    pytest.param(32, 10000.0, {**YARN_QWEN, "mscale": 0.707}, id="yarn-mscale-alone"),
    pytest.param(32, 10000.0, {**YARN_QWEN, "mscale_all_dim": 0.5}, id="yarn-mscale-all-dim-alone"),
    pytest.param(32, 10000.0, {**YARN_QWEN, "mscale": 1.0, "mscale_all_dim": 0.5}, id="yarn-mscale-ratio"),
    pytest.param(32, 10000.0, {**YARN_QWEN, "factor": 1.0}, id="yarn-factor-1"),
    # Llama-3.1-8B's rope_scaling and head dim: all three wavelength bands are populated
    pytest.param(128, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, id="llama3.1"),
    pytest.param(64, 10000.0, {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 2.0,
                               "high_freq_factor": 8.0, "original_max_position_embeddings": 1024}, id="llama3-other"),
    pytest.param(32, 10000.0, {"rope_type": "linear", "factor": 1.0}, id="linear-factor-1"),
    pytest.param(32, 10000.0, {"rope_type": "linear", "factor": 3.0}, id="linear"),
]


@pytest.mark.parametrize(("head_dim", "theta", "rope"), CASES)
def test_inverse_frequencies_and_attention_factor_match_transformers(
    transformers: ModuleType, head_dim: int, theta: float, rope: dict[str, Any]
) -> None:
    reference, reference_scale = hf_tables(transformers, head_dim, theta, rope)
    scaling = RopeScaling.from_dict(rope)
    assert scaling is not None
    ours = rope_inverse_frequencies(head_dim, theta, torch.float64, torch.device("cpu"), scaling)
    torch.testing.assert_close(ours, reference, rtol=2e-6, atol=0)  # transformers computes in float32
    assert scaling.attention_scale == pytest.approx(reference_scale, rel=1e-12)
    unscaled = rope_inverse_frequencies(head_dim, theta, torch.float64, torch.device("cpu"))
    if rope["factor"] > 1.0:  # the case exercises the scaling, not only the unscaled table
        assert (ours - unscaled).abs().max() > 1e-3 * unscaled.min()


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        ({"rope_type": "linear", "factor": 1.0}, None),  # factor 1 is a valid no-op (some configs carry it)
        ({**YARN_QWEN, "beta_fast": 0.0}, "rope_scaling.beta_fast must be positive, got 0.0"),
        ({**YARN_QWEN, "beta_slow": 0.0}, "rope_scaling.beta_slow must be positive, got 0.0"),
        ({**YARN_QWEN, "attention_factor": 0.0}, "rope_scaling.attention_factor must be positive, got 0.0"),
        ({**YARN_QWEN, "beta_fast": 2.0, "beta_slow": 2.0}, "rope_scaling.beta_fast must exceed beta_slow"),
        ({**YARN_QWEN, "original_max_position_embeddings": 0},
         "rope_scaling.original_max_position_embeddings must be a positive integer, got 0"),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 0.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}, "rope_scaling.low_freq_factor must be positive, got 0.0"),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}, "rope_scaling.high_freq_factor must exceed low_freq_factor"),
        ({**YARN_QWEN, "type": "linear"}, "rope_scaling has rope_type='yarn' but type='linear'; keep one"),
    ],
)
def test_boundary_values_are_refused_or_kept(rope: dict[str, Any], message: str | None) -> None:
    if message is None:
        scaling = RopeScaling.from_dict(rope)
        assert scaling is not None and scaling.factor == 1.0
        return
    with pytest.raises(ValueError) as caught:
        RopeScaling.from_dict(rope)
    assert str(caught.value).startswith(message), caught.value
