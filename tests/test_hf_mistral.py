"""The Mistral family (``MistralForCausalLM``) against transformers' own classes.

What ``tests/test_hf_rope.py`` (logits in float64 both ways, explicit ``head_dim`` 12 != hidden / heads)
and ``tests/test_hf_config_defaults.py`` (absent and ``null`` fields against ``MistralConfig``) do not
show: where the sliding window starts to matter in transformers' Mistral (the boundary of the rule csbp
loads by: ``sliding_window: null`` or at least ``max_position_embeddings``), ``head_dim``/window fields
left out of a config.json or ``null`` read as transformers reads them (logits), the real Mistral-7B and
Nemo shapes, and a run from a Mistral checkpoint exported by ``csbp export`` that transformers loads as
``MistralForCausalLM`` with csbp's logits.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_hf_mistral.py -q``
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

from csbp.cli.main import main  # noqa: E402
from csbp.data import open_artifact  # noqa: E402
from csbp.models import load_hf_checkpoint  # noqa: E402
from csbp.models.hf_config import decoder_config_from_hf  # noqa: E402
from csbp.training.model_factory import decoder_config_for_run  # noqa: E402
from test_hf_rope import ATOL, VOCAB, csbp_logits, hf_logits, perturb_  # noqa: E402
from test_rope_config import _from  # noqa: E402
from test_training_run import make_artifact, tiny_config, train  # noqa: E402

ABSENT = object()



def make_mistral(transformers: ModuleType, *, vocab: int = VOCAB, dtype: torch.dtype = torch.float64,
                 **fields: Any) -> Any:
    config: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, sliding_window=None, attn_implementation="eager",
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    )
    config.update(fields)
    model = transformers.MistralForCausalLM(transformers.MistralConfig(**config)).to(dtype)
    perturb_(model, seed=11)
    return model.eval()


def edit_config(directory: Path, **fields: Any) -> None:
    """Set (``ABSENT``: remove) fields of ``directory/config.json``."""
    written = json.loads((directory / "config.json").read_text())
    for key, value in fields.items():
        if value is ABSENT:
            written.pop(key, None)
        else:
            written[key] = value
    (directory / "config.json").write_text(json.dumps(written))


def ids_of(length: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(1))


def test_the_window_changes_nothing_up_to_its_length(transformers: ModuleType, tmp_path: Path) -> None:
    """transformers' Mistral with ``sliding_window`` 8 equals full attention on 8 tokens and differs on 9,
    so a window of at least ``max_position_embeddings`` loads (same logits as transformers' windowed model
    at that length) and one smaller is refused in one line naming both fields and the fix."""
    windowed = make_mistral(transformers, sliding_window=8, max_position_embeddings=8)
    full = make_mistral(transformers)
    full.load_state_dict(windowed.state_dict())
    for length, changed in ((8, False), (9, True)):
        ids, positions = ids_of(length), torch.arange(length)
        difference = (hf_logits(transformers, windowed, ids, positions) - hf_logits(transformers, full, ids, positions))
        assert bool(difference.abs().max() > 1e-3) == changed, length
    windowed.save_pretrained(tmp_path, safe_serialization=True)
    model, config = load_hf_checkpoint(tmp_path)
    assert (config.arch, config.head_dim, config.num_kv_heads) == ("mistral", 8, 2)
    ids, positions = ids_of(8), torch.arange(8)
    torch.testing.assert_close(csbp_logits(model, ids, positions), hf_logits(transformers, windowed, ids, positions),
                               rtol=0, atol=ATOL)
    edit_config(tmp_path, max_position_embeddings=9)
    with pytest.raises(ValueError) as caught:
        load_hf_checkpoint(tmp_path)
    message = str(caught.value)
    assert message.startswith("config.json sliding_window=8 is below max_position_embeddings=9: transformers' "
                              "Mistral attends only to the last 8 tokens")
    assert "\n" not in message and message.count("(fix: set sliding_window: null") == 1
    assert "max_position_embeddings: 8 to use it only where the window changes nothing" in message


@pytest.mark.parametrize(
    "fields",
    [
        {"head_dim": ABSENT},  # hidden / heads = 8
        {"head_dim": None},
        {"sliding_window": ABSENT, "max_position_embeddings": 4096},  # MistralConfig's 4096 covers every position
        {"num_key_value_heads": ABSENT, "num_attention_heads": 8, "head_dim": 4},  # MistralConfig's 8 KV heads
    ],
    ids=["head_dim-absent", "head_dim-null", "window-absent-covering", "kv-heads-absent"],
)
def test_fields_left_out_load_as_transformers_reads_them(
    transformers: ModuleType, tmp_path: Path, fields: dict[str, Any]
) -> None:
    """The same ``config.json`` read by transformers (the reference model is loaded from it) and by csbp."""
    heads = fields.get("num_attention_heads", 4)
    kv_heads = 8 if fields.get("num_key_value_heads") is ABSENT else 2
    make_mistral(transformers, num_attention_heads=heads, num_key_value_heads=kv_heads).save_pretrained(
        tmp_path, safe_serialization=True
    )
    edit_config(tmp_path, **fields)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager", dtype=torch.float64, local_files_only=True
    ).eval()
    model, config = load_hf_checkpoint(tmp_path)
    assert (config.num_kv_heads, config.head_dim) == (reference.config.num_key_value_heads, 32 // heads)
    ids, positions = ids_of(11), 40 + torch.arange(11)
    torch.testing.assert_close(csbp_logits(model, ids, positions), hf_logits(transformers, reference, ids, positions),
                               rtol=0, atol=ATOL)


MISTRAL_7B_V03 = {  # the fields of mistralai/Mistral-7B-v0.3's config.json
    "architectures": ["MistralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32768,
}
MISTRAL_NEMO = {  # mistralai/Mistral-Nemo-Base-2407's: head_dim 128, not 5120 / 32 = 160
    **MISTRAL_7B_V03, "head_dim": 128, "hidden_size": 5120, "max_position_embeddings": 1024000,
    "num_hidden_layers": 40, "vocab_size": 131072,
}
MISTRAL_7B_V01 = {**MISTRAL_7B_V03, "rope_theta": 10000.0, "sliding_window": 4096, "vocab_size": 32000}


@pytest.mark.parametrize(("fields", "head_dim"), [(MISTRAL_7B_V03, 128), (MISTRAL_NEMO, 128)], ids=["v0.3", "nemo"])
def test_real_mistral_configs_load_with_transformers_shapes(
    transformers: ModuleType, fields: dict[str, Any], head_dim: int
) -> None:
    config = decoder_config_from_hf(dict(fields))
    assert (config.arch, config.head_dim, config.num_kv_heads, config.rope_theta, config.rms_norm_eps) == (
        "mistral", head_dim, 8, 1e6, 1e-5)
    assert not (config.qk_norm or config.attention_bias or config.qkv_bias or config.mlp_bias or config.tie_embeddings)
    with torch.device("meta"):  # every parameter transformers builds, counted without allocating 12B
        hf_model = transformers.MistralForCausalLM(transformers.MistralConfig.from_dict(dict(fields)))
    assert config.num_parameters() == sum(p.numel() for p in hf_model.parameters())


def test_mistral_7b_v01_whose_window_slides_is_refused() -> None:
    with pytest.raises(ValueError) as caught:
        decoder_config_from_hf(dict(MISTRAL_7B_V01))
    assert str(caught.value).startswith("config.json sliding_window=4096 is below max_position_embeddings=32768")
    assert "(fix: set sliding_window: null if the checkpoint attends fully" in str(caught.value)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_artifact(tmp_path_factory.mktemp("data") / "art")


def test_a_run_from_a_mistral_checkpoint_exports_a_mistral(
    transformers: ModuleType, artifact: Path, tmp_path: Path
) -> None:
    """``model.init_from`` a transformers-saved Mistral, two steps of training, ``csbp export`` of the run:
    transformers loads the export as ``MistralForCausalLM`` (no window) with the logits csbp computes."""
    vocab = open_artifact(artifact).vocab_size
    source = make_mistral(transformers, vocab=vocab, dtype=torch.float32, head_dim=12, max_position_embeddings=64)
    source.save_pretrained(tmp_path / "hf", safe_serialization=True)
    cfg = tiny_config(artifact, **_from(tmp_path / "hf"))
    assert decoder_config_for_run(cfg, open_artifact(artifact)).arch == "mistral"
    run_dir = tmp_path / "run"
    train(cfg, run_dir=run_dir, max_steps=2)
    assert main(["export", str(run_dir), "--out", str(tmp_path / "out")]) == 0
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (written["architectures"], written["model_type"], written["sliding_window"]) == (
        ["MistralForCausalLM"], "mistral", None)
    exported = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager", dtype=torch.float32, local_files_only=True
    ).eval()
    assert type(exported).__name__ == "MistralForCausalLM" and exported.config.sliding_window is None
    model, config = load_hf_checkpoint(tmp_path / "out")
    assert (config.arch, config.head_dim) == ("mistral", 12)
    ids = torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        theirs = exported(input_ids=ids).logits
        trained_away = (source(input_ids=ids).logits - theirs).abs().max()
    assert trained_away > 1e-4  # the export holds the trained weights, not the source's
    torch.testing.assert_close(csbp_logits(model, ids, torch.arange(32)), theirs, rtol=0, atol=1e-5)


def test_a_from_scratch_mistral_takes_the_family_layout(artifact: Path) -> None:
    config = decoder_config_for_run(tiny_config(artifact, **{"model.arch": "mistral"}), open_artifact(artifact))
    assert (config.arch, config.qk_norm, config.qkv_bias, config.attention_bias, config.rope_theta,
            config.rms_norm_eps) == ("mistral", False, False, False, 1e6, 1e-5)


def test_generate_and_eval_bound_positions_by_mistral_configs_default(transformers: ModuleType, tmp_path: Path) -> None:
    """A Mistral config.json without max_position_embeddings has MistralConfig's 131072 (not Qwen3's 32768)."""
    from csbp.generation.run_settings import position_limit

    (tmp_path / "config.json").write_text(json.dumps(MISTRAL_7B_V03))
    edit_config(tmp_path, max_position_embeddings=ABSENT)
    limit, where = position_limit(tmp_path)
    assert limit == transformers.MistralConfig().max_position_embeddings == 131072
    assert where.startswith("(transformers' MistralConfig default")
