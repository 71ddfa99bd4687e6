"""``config.json`` fields read as transformers' own config classes read them: defaults when a field is
absent, ``null``, Qwen's and Mistral's sliding-window rules, for the target reader (``decoder_config_from_hf``) and
the DFlash drafter reader (``dflash_config_from_hf``, whose public reader builds a ``Qwen3Config``).

Each case is read by csbp and by transformers' class; csbp must give the same KV heads, head size and
attention kinds, or refuse in one line, and it must refuse whatever transformers refuses.
Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_hf_config_defaults.py -q``
"""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from types import ModuleType
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest  # noqa: E402

from csbp.dflash.export import dflash_config_from_hf, dflash_hf_config, export_dflash, load_dflash  # noqa: E402
from csbp.dflash.verify import DFlashVerifyCase, build_models  # noqa: E402
from csbp.models.hf_config import decoder_config_from_hf  # noqa: E402

CLASSES = {"qwen3": "Qwen3Config", "qwen2": "Qwen2Config", "llama": "LlamaConfig", "mistral": "MistralConfig"}
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM",
                 "mistral": "MistralForCausalLM"}
ABSENT = object()
# num_key_value_heads, head_dim: absent, null or set; heads 4 (not Qwen's default 32 KV heads) or 32
KV_HEADS = (ABSENT, None, 2)
HEAD_DIMS = (ABSENT, None, 8)
HEADS = (4, 32)  # Mistral's default is 8 KV heads: 4 heads is refused without the field, 32 reads as GQA 4
WINDOWS = (  # use_sliding_window, sliding_window, max_window_layers, layer_types
    {},
    {"use_sliding_window": False, "sliding_window": 3, "max_window_layers": 0},
    {"use_sliding_window": True, "sliding_window": 3},  # max_window_layers 28 >= 3 layers: none slides
    {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 3},
    {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 1},  # layers 1, 2 slide
    {"use_sliding_window": True, "sliding_window": None, "max_window_layers": 0},  # no window: none slides
    {"use_sliding_window": True, "max_window_layers": 2},  # window 4096 on layer 2
    {"use_sliding_window": True, "sliding_window": 3, "layer_types": ["full_attention"] * 3},
    {"use_sliding_window": True, "sliding_window": 3, "layer_types": ["full_attention", "sliding_attention",
                                                                      "full_attention"]},
)
MISTRAL_WINDOWS = (  # every layer slides by sliding_window (absent: 4096) in sequences longer than it
    {},  # 4096 within the default 131072 positions
    {"sliding_window": None},
    {"max_position_embeddings": 4096},  # the default window covers every position
    {"sliding_window": 4096, "max_position_embeddings": 4096},
    {"sliding_window": 4095, "max_position_embeddings": 4096},
    {"sliding_window": 131072},
    {"sliding_window": 131071},
)



def config_dict(heads: int, kv_heads: Any, head_dim: Any, window: dict[str, Any]) -> dict[str, Any]:
    fields: dict[str, Any] = {
        "vocab_size": 64,
        "hidden_size": 16 * heads,
        "intermediate_size": 48,
        "num_hidden_layers": 3,
        "num_attention_heads": heads,
        **window,
    }
    if kv_heads is not ABSENT:
        fields["num_key_value_heads"] = kv_heads
    if head_dim is not ABSENT:
        fields["head_dim"] = head_dim
    return fields


def transformers_reading(transformers: ModuleType, family: str, fields: dict[str, Any]) -> tuple[Any, ...] | None:
    """``(kv heads, head_dim, layer types, sliding_window)`` of transformers' config, None when it refuses
    or its model could not be built (a ``null`` Qwen ``head_dim``)."""
    try:
        config = getattr(transformers, CLASSES[family]).from_dict(dict(fields))
    except Exception:  # noqa: BLE001  (transformers' validation errors have several types)
        return None
    head_dim = getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
    if head_dim is None:  # Qwen2's attention would build heads x None projections
        return None
    layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    if family == "mistral" and window is not None and window < config.max_position_embeddings:
        layer_types = ["sliding_attention"] * config.num_hidden_layers  # MistralModel windows every layer
    return config.num_key_value_heads, head_dim, layer_types, getattr(config, "sliding_window", None)


ALL_CASES = list(itertools.product(HEADS, KV_HEADS, HEAD_DIMS, range(len(WINDOWS))))


def family_windows(family: str) -> tuple[dict[str, Any], ...]:
    return {"llama": ({},) * len(WINDOWS), "mistral": MISTRAL_WINDOWS}.get(family, WINDOWS)


@pytest.mark.parametrize("family", sorted(CLASSES))
def test_target_reader_agrees_with_transformers_or_refuses(transformers: ModuleType, family: str) -> None:
    refused = 0
    cases = list(itertools.product(HEADS, KV_HEADS, HEAD_DIMS, family_windows(family)))
    for heads, kv_heads, head_dim, window in cases:
        fields = config_dict(heads, kv_heads, head_dim, window)
        expected = transformers_reading(transformers, family, fields)
        fields.update(architectures=[ARCHITECTURES[family]])
        try:
            config = decoder_config_from_hf(fields)
        except ValueError as exc:
            refused += 1
            reason = str(exc)
            assert "\n" not in reason
            if expected is not None:  # transformers reads it: csbp may only refuse what it cannot hold
                kv, _, layer_types, _ = expected
                no_kv = "num_key_value_heads" not in fields and kv != heads
                window_named = "sliding-window layers" in reason or "sliding_window=" in reason
                assert (window_named and "sliding_attention" in layer_types) or (
                    "no num_key_value_heads" in reason and no_kv
                ), (fields, reason)
            continue
        assert expected is not None, f"transformers refuses {fields}, csbp read it"
        kv, dim, layer_types, _ = expected
        assert (config.num_kv_heads, config.head_dim) == (kv, dim), fields
        assert set(layer_types) == {"full_attention"}, fields
    assert (refused > 0) == (family != "llama") and refused < len(cases)  # Llama derives what is missing


@pytest.mark.parametrize("family", sorted(CLASSES))
def test_bias_flags_and_norm_eps_are_read_as_transformers_builds_the_model(
    transformers: ModuleType, family: str
) -> None:
    """``attention_bias`` and ``mlp_bias`` set in every family's config.json: csbp's decoder has exactly the
    parameters transformers' model has (Qwen2: q/k/v biases only, whatever attention_bias says; Qwen3: no
    MLP bias; Mistral: none), and an absent ``rms_norm_eps`` is transformers' default."""
    import torch

    from csbp.models.decoder import Decoder

    window = {"sliding_window": None} if family == "mistral" else {}  # Mistral's default window is refused
    fields = {**config_dict(4, 2, 16, window), "attention_bias": True, "mlp_bias": True}
    hf_model = getattr(transformers, ARCHITECTURES[family])(getattr(transformers, CLASSES[family]).from_dict(dict(fields)))
    config = decoder_config_from_hf({**fields, "architectures": [ARCHITECTURES[family]]})
    ours = {f"model.{name}" for name, _ in Decoder(config, device=torch.device("meta")).named_parameters()}
    theirs = {name for name, _ in hf_model.named_parameters() if name != "lm_head.weight"}
    assert ours - {"model.lm_head.weight"} == theirs
    assert config.rms_norm_eps == hf_model.config.rms_norm_eps


def test_drafter_reader_agrees_with_the_public_readers_qwen3_config(transformers: ModuleType) -> None:
    refused = 0
    for heads, kv_heads, head_dim, window in ALL_CASES:
        fields = config_dict(heads, kv_heads, head_dim, WINDOWS[window])
        expected = transformers_reading(transformers, "qwen3", fields)
        fields.update(
            architectures=["DFlashDraftModel"], model_type="qwen3", block_size=4, num_target_layers=6,
            dflash_config={"target_layer_ids": [1, 3], "mask_token_id": 63},
        )
        try:
            config = dflash_config_from_hf(fields)
        except ValueError as exc:
            refused += 1
            assert expected is None or (
                "no num_key_value_heads" in str(exc) and "num_key_value_heads" not in fields
            ), (fields, str(exc))
            continue
        assert expected is not None, f"transformers refuses {fields}, csbp read it"
        kv, dim, layer_types, sliding_window = expected
        assert (config.num_kv_heads, config.head_dim, list(config.layer_types or ())) == (kv, dim, layer_types)
        assert config.sliding_window == (sliding_window if "sliding_attention" in layer_types else None), fields
    assert 0 < refused < len(ALL_CASES)


DRAFTER = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": 4, "num_target_layers": 4,
    "dflash_config": {"target_layer_ids": [0, 2], "mask_token_id": 63}, "vocab_size": 64, "hidden_size": 32,
    "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 8,
}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # each of these loaded before, as something the public reader does not build
        ({"num_key_value_heads": ABSENT}, "no num_key_value_heads: .* as 32 KV heads, not the 4"),  # read as 4
        ({"head_dim": None}, "head_dim is null"),  # read as 32 / 4 = 8
        ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 3},  # window 3, public: none
         "drops sliding_window unless use_sliding_window is true"),
        ({"layer_types": ["full_attention"]}, "must list num_hidden_layers=2 entries"),  # read as given
        ({"block_size": 4.5}, "block_size must be an integer >= 1, got 4.5"),  # read as 4
        ({"hidden_size": "32"}, "hidden_size must be a positive integer"),  # read as 32
        ({"dflash_config": {"target_layer_ids": [0, 2.5], "mask_token_id": 63}}, "list of integers"),  # as [0, 2]
        ({"dflash_config": {"target_layer_ids": [0, 2], "mask_token_id": "63"}}, "mask_token_id must be an integer"),
        ({"rms_norm_eps": "1e-6"}, "rms_norm_eps must be a positive number"),  # read as 1e-6
        ({"attention_bias": "false"}, "attention_bias must be true or false"),
    ],
)
def test_drafter_fields_the_public_reader_reads_otherwise_are_refused(overrides: dict[str, Any], message: str) -> None:
    fields = {**DRAFTER, **overrides}
    fields = {key: value for key, value in fields.items() if value is not ABSENT}
    with pytest.raises(ValueError, match=message):
        dflash_config_from_hf(fields)


def test_drafter_defaults_are_qwen3_configs() -> None:
    """Absent ``head_dim`` is Qwen3Config's 128 (csbp derived hidden / heads = 8), and
    ``use_sliding_window`` with ``max_window_layers`` and no ``layer_types`` slides layers from that index
    on (csbp read every layer as full attention)."""
    no_head_dim = {key: value for key, value in DRAFTER.items() if key != "head_dim"}
    assert dflash_config_from_hf({**no_head_dim, "hidden_size": 512}).head_dim == 128
    derived = dflash_config_from_hf({**DRAFTER, "use_sliding_window": True, "sliding_window": 3, "max_window_layers": 1})
    assert (derived.layer_types, derived.sliding_window) == (("full_attention", "sliding_attention"), 3)
    assert dflash_config_from_hf({**DRAFTER, "num_key_value_heads": None}).num_kv_heads == 4  # null: the heads


def test_qwen_target_with_an_unused_sliding_window_loads() -> None:
    """``use_sliding_window: true`` whose ``max_window_layers`` covers every layer slides no layer in
    transformers: it loads (it was refused); one that leaves layers sliding is refused naming them."""
    fields = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
              "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 3}
    assert decoder_config_from_hf(fields).num_layers == 3
    with pytest.raises(ValueError, match=r"makes layers \[1, 2\] sliding-window layers"):
        decoder_config_from_hf({**fields, "max_window_layers": 1})


def test_csbp_drafter_exports_read_back_unchanged(tmp_path: Path, transformers: ModuleType) -> None:
    """Every drafter csbp writes is read back as the same config (sliding, bidirectional, DFlash2), and
    transformers' Qwen3Config (what the public reader builds) sees the same shapes and windows."""
    for options in ({}, {"layer_types": ("sliding_attention", "full_attention"), "sliding_window": 5},
                    {"layer_types": ("sliding_attention", "sliding_attention"), "sliding_window": 2,
                     "sliding_window_causal": False, "conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 4,
                     "selector_top_k": 8}):
        target, drafter = build_models(DFlashVerifyCase(drafter_options=options))
        written = json.loads(json.dumps(dflash_hf_config(drafter.config, dtype=drafter.fc.weight.dtype)))
        assert dflash_config_from_hf(written) == drafter.config
        kv, dim, layer_types, window = transformers_reading(transformers, "qwen3", written)  # type: ignore[misc]
        assert (kv, dim, tuple(layer_types)) == (drafter.config.num_kv_heads, drafter.config.head_dim,
                                                 drafter.config.layer_types)
        assert window == drafter.config.sliding_window
        out = export_dflash(drafter, tmp_path / f"d{len(options)}")
        assert load_dflash(out, target).config == drafter.config


def test_a_window_below_the_block_size_is_noted_for_the_public_reader() -> None:
    """z-lab's reader windows the block itself (|j - j'| < W); csbp's mask windows the context only, so
    the two agree only for ``sliding_window >= block_size`` (block_size is 4 here)."""
    from csbp.dflash.export import public_reader_window_note

    sliding = {"layer_types": ("sliding_attention", "full_attention")}
    for window, noted in ((3, True), (4, False), (9, False)):
        _, drafter = build_models(DFlashVerifyCase(drafter_options={**sliding, "sliding_window": window}))
        note = public_reader_window_note(drafter.config, "D")
        assert (note is not None) == noted and (note is None or "sliding_window 3 < block_size 4" in note)
    _, full = build_models(DFlashVerifyCase())
    assert public_reader_window_note(full.config, "D") is None


def test_dflash_export_cli_prints_the_window_note(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    from csbp.cli import main as cli_main
    from csbp.models import export_hf_checkpoint

    options = {"layer_types": ("sliding_attention", "full_attention"), "sliding_window": 3}
    target, drafter = build_models(DFlashVerifyCase(drafter_options=options), dtype=torch.float32)
    target_dir = export_hf_checkpoint(target, target.config, tmp_path / "target")
    drafter_dir = export_dflash(drafter, tmp_path / "drafter")
    argv = ["dflash", "export", "--drafter", str(drafter_dir), "--target", str(target_dir), "--out", str(tmp_path / "o")]
    assert cli_main.main(argv) == 0
    assert "has sliding_window 3 < block_size 4; the public DFlash reader" in capsys.readouterr().err


def test_llama_sizes_transformers_refuses_are_refused_on_import_and_export(tmp_path: Path) -> None:
    """transformers 5's LlamaConfig refuses a hidden_size its heads do not divide, head_dim or not: csbp
    read such a config, and exported one that transformers then could not load."""
    from csbp.models import Decoder, DecoderConfig, export_hf_checkpoint

    fields = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
              "num_hidden_layers": 1, "num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": 8}
    with pytest.raises(ValueError, match="hidden_size=32 is not a multiple of num_attention_heads=3"):
        decoder_config_from_hf(fields)
    config = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=3,
                           num_kv_heads=1, head_dim=8, arch="llama", qk_norm=False)
    with pytest.raises(ValueError, match="arch='llama' export: hidden_size=32 is not a multiple of num_heads=3"):
        export_hf_checkpoint(Decoder(config), config, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    qwen3 = decoder_config_from_hf({**fields, "architectures": ["Qwen3ForCausalLM"]})  # Qwen3Config has no such rule
    assert (qwen3.hidden_size, qwen3.num_heads, qwen3.head_dim) == (32, 3, 8)


def test_a_drafter_config_error_names_the_file_and_one_fix(tmp_path: Path) -> None:
    from csbp.dflash.export import read_drafter_config
    from csbp.dflash.verify import TARGET_CONFIG

    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in DRAFTER.items() if k != "num_key_value_heads"}))
    with pytest.raises(ValueError) as caught:
        read_drafter_config(tmp_path, TARGET_CONFIG)
    message = str(caught.value)
    assert message.startswith(f"{tmp_path / 'config.json'}: ") and message.count("(fix:") == 1
    assert "(fix: add num_key_value_heads" in message
