"""``config.json`` RoPE fallbacks and field checks read against transformers' own models (mutation audit).

``decoder_config_from_hf`` takes a top-level ``original_max_position_embeddings`` over the RoPE dict's
(Phi-3 style), derives a yarn ``factor: null`` as ``max_position_embeddings / original`` (DeepSeek
style) and drops a ``partial_rotary_factor: 1.0`` from the RoPE dict; each case here builds the
transformers model from the same ``config.json`` and compares its rotary ``inv_freq`` and attention
scaling with csbp's tables. The other cases pin refusals no test pinned: a JSON ``true`` as a size, a
zero ``rms_norm_eps``, per-layer-type RoPE, and a Qwen3 export with MLP biases (which transformers'
Qwen3 MLP has no place for), plus the ``max_position_embeddings`` a yarn export writes and the factor
``yarn_context_problem`` suggests, against hand-computed values.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_hf_config_reference.py -q``
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import ModuleType
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

from csbp.models import Decoder, DecoderConfig, export_hf_checkpoint  # noqa: E402
from csbp.models.hf_config import decoder_config_from_hf, yarn_context_problem  # noqa: E402
from csbp.models.rope import RopeScaling, rope_inverse_frequencies  # noqa: E402

ARCH = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}



def config_json(arch: str, **fields: Any) -> dict[str, Any]:
    return {"architectures": [ARCH[arch]], "model_type": arch, "vocab_size": 64, "hidden_size": 128,
            "intermediate_size": 48, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
            "head_dim": 64, "rope_theta": 10000.0, **fields}


@pytest.mark.parametrize(
    ("arch", "fields", "original", "factor"),
    [
        # Phi-3 style: the top-level original length wins over the dict's, and over max_position_embeddings
        ("qwen3", {"max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
                   "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, 4096, 4.0),
        ("qwen2", {"max_position_embeddings": 131072, "original_max_position_embeddings": 4096,
                   "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}},
         4096, 4.0),
        ("llama", {"max_position_embeddings": 131072, "original_max_position_embeddings": 2048,
                   "rope_scaling": {**LLAMA3, "original_max_position_embeddings": 8192}}, 2048, 8.0),
        # DeepSeek style: a null yarn factor is max_position_embeddings / original = 32
        ("qwen3", {"max_position_embeddings": 131072,
                   "rope_scaling": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 4096}},
         4096, 32.0),
        # a partial_rotary_factor of 1.0 inside the RoPE dict is the default, not an unknown yarn key
        ("qwen3", {"max_position_embeddings": 32768, "rope_parameters": {
            "rope_type": "yarn", "factor": 2.0, "partial_rotary_factor": 1.0, "rope_theta": 1e6,
            "original_max_position_embeddings": 16384}}, 16384, 2.0),
    ],
)
def test_rope_fallbacks_match_the_transformers_model(
    transformers: ModuleType, tmp_path: Path, arch: str, fields: dict[str, Any], original: int, factor: float
) -> None:
    written = config_json(arch, **fields)
    (tmp_path / "config.json").write_text(json.dumps(written))
    hf_model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path))
    rotary = hf_model.model.rotary_emb
    config = decoder_config_from_hf(written)
    assert config.rope_scaling is not None
    assert (config.rope_scaling.original_max_position_embeddings, config.rope_scaling.factor) == (original, factor)
    ours = rope_inverse_frequencies(config.head_dim, config.rope_theta, torch.float32, torch.device("cpu"),
                                    config.rope_scaling)
    torch.testing.assert_close(ours, rotary.inv_freq, rtol=1e-6, atol=0)
    assert config.rope_scaling.attention_scale == pytest.approx(rotary.attention_scaling, rel=1e-6)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"num_key_value_heads": True}, "config.json num_key_value_heads must be a positive integer, got True"),
        ({"vocab_size": True}, "config.json vocab_size must be a positive integer, got True"),
        ({"rms_norm_eps": 0.0}, "config.json rms_norm_eps must be a positive number, got 0.0"),
        ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
         "config.json rope_parameters must be one flat dict; per-layer-type RoPE is not supported"),
    ],
)
def test_config_json_fields_are_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as caught:
        decoder_config_from_hf(config_json("qwen3", **fields))
    assert str(caught.value) == message


def test_a_qwen3_export_with_mlp_biases_is_refused(transformers: ModuleType, tmp_path: Path) -> None:
    hf_names = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=8, hidden_size=16, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=2, head_dim=8)).state_dict()
    assert not any("mlp" in name and name.endswith("bias") for name in hf_names)  # nowhere to load them
    config = DecoderConfig(vocab_size=8, hidden_size=16, intermediate_size=8, num_layers=1, num_heads=2,
                           num_kv_heads=2, head_dim=8, arch="qwen3", mlp_bias=True)
    with pytest.raises(ValueError, match=r"arch='qwen3' export needs qk_norm=True, mlp_bias=False"):
        export_hf_checkpoint(Decoder(config), config, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_yarn_export_writes_factor_times_original_only_when_whole(tmp_path: Path) -> None:
    def written(factor: float, original: int) -> int:
        config = DecoderConfig(vocab_size=8, hidden_size=16, intermediate_size=8, num_layers=1, num_heads=2,
                               num_kv_heads=2, head_dim=8, rope_scaling=RopeScaling("yarn", factor, original))
        out = export_hf_checkpoint(Decoder(config), config, tmp_path / f"{factor}-{original}",
                                   extra_config={"max_position_embeddings": 1000})
        return json.loads((out / "config.json").read_text())["max_position_embeddings"]

    assert written(2.5, 32) == 80  # 2.5 x 32
    assert written(2.5, 33) == 1000  # 82.5 is no length: the given value stays (not 82)


def test_yarn_context_problem_suggests_the_smallest_covering_factor() -> None:
    yarn = RopeScaling("yarn", 2.0, 32)  # covers 64 positions
    assert yarn_context_problem(yarn, 64) is None
    gap = yarn_context_problem(yarn, 100)  # 100 / 32 = 3.125: factor 4 (128 positions), 3 covers only 96
    assert gap is not None and (gap.factor, gap.longest) == (4, 64)
    gap = yarn_context_problem(yarn, 96)
    assert gap is not None and (gap.factor, gap.longest) == (3, 64)
    gap = yarn_context_problem(RopeScaling("yarn", 2.5, 33), 64)  # 82.5 positions: no whole number
    assert gap is not None and (gap.factor, gap.longest) == (3, None)
