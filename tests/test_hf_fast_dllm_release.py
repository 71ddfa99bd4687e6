"""Fast-dLLM v2 release checkpoints (``csbp.models.hf_release``): a tiny directory shaped like NVlabs'
``Fast_dLLM_v2_1.5B`` (a Qwen2 ``config.json`` patched to ``Fast_dLLM_Qwen`` with ``bd_size`` and an
``auto_map``, Qwen2 safetensors, a tokenizer adding ``|<MASK>|``) loads as the Qwen2 family with
transformers' Qwen2 logits, trains from ``model.init_from``, and samples / scores as ``fast_dllm_v2`` at
block size ``bd_size`` with its ``|<MASK>|``; a bad ``bd_size``, a sliding ``layer_types`` entry or a
half-patched config is refused in one line. Its remote code is never imported. Before, csbp refused the
directory for its ``model_type``.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_hf_fast_dllm_release.py -q``
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from types import ModuleType
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402

from csbp.cli import generate_cmd  # noqa: E402
from csbp.cli.main import main  # noqa: E402
from csbp.data import open_artifact  # noqa: E402
from csbp.data.prepare import PrepareConfig, prepare_artifact  # noqa: E402
from csbp.data.tokenizer import SpecialTokens  # noqa: E402
from csbp.evaluation.settings import resolve_settings  # noqa: E402
from csbp.models import load_hf_checkpoint  # noqa: E402
from csbp.models.hf_config import decoder_config_from_hf  # noqa: E402
from test_hf_rope import csbp_logits, hf_logits, perturb_  # noqa: E402
from test_rope_config import _from  # noqa: E402
from test_training_run import WORDS, tiny_config, train  # noqa: E402

MASK = "|<MASK>|"
VOCAB = 320  # the tokenizer's 300 ids and |<MASK>|, padded as Qwen pads its embedding
LAYERS = 2
SENTINEL = "remote_code_ran"
RELEASE_PATCH: dict[str, Any] = {
    "model_type": "Fast_dLLM_Qwen",
    "architectures": ["Fast_dLLM_QwenForCausalLM"],
    "bd_size": 32,
    "auto_map": {
        "AutoConfig": "configuration.Fast_dLLM_QwenConfig",
        "AutoModelForCausalLM": "modeling.Fast_dLLM_QwenForCausalLM",
    },
    "layer_types": ["full_attention"] * LAYERS,
}


def release_tokenizer(directory: Path) -> int:
    """A byte-level BPE over the test words with ``<|endoftext|>``, then ``|<MASK>|`` added after its ids
    (as the release adds it to Qwen's); the mask id."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator([" ".join(WORDS)] * 4, trainer=trainer)
    backend.add_special_tokens([MASK])
    backend.save(str(directory / "tokenizer.json"))
    mask_id = backend.token_to_id(MASK)
    assert mask_id == backend.get_vocab_size() - 1 < VOCAB
    return mask_id


def make_release(transformers: ModuleType, directory: Path, **edits: Any) -> Any:
    """A tiny release-shaped directory (module docstring), its config.json edited by ``edits`` (None
    removes a field); the float64 transformers ``Qwen2ForCausalLM`` whose weights it holds. Its remote code files
    leave a sentinel file behind when imported."""
    config = transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rope_theta=5000.0, tie_word_embeddings=False,
        attn_implementation="eager",
    )
    model = transformers.Qwen2ForCausalLM(config).to(torch.float64)
    perturb_(model, seed=3)
    model.save_pretrained(directory, safe_serialization=True)
    release_tokenizer(directory)
    for name in ("configuration.py", "modeling.py"):
        (directory / name).write_text(f"open({str(directory / SENTINEL)!r}, 'w').close()\nraise ImportError\n")
    edit_config(directory, **{**RELEASE_PATCH, **edits})
    return model.eval()


def edit_config(directory: Path, **edits: Any) -> None:
    file = directory / "config.json"
    config = json.loads(file.read_text())
    config.update(edits)
    file.write_text(json.dumps({k: v for k, v in config.items() if v is not None}, indent=2))


@pytest.fixture(scope="module")
def release(transformers: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    directory = tmp_path_factory.mktemp("Fast_dLLM_v2_tiny")
    return directory, make_release(transformers, directory)


@pytest.fixture(scope="module")
def artifact(release: tuple[Path, Any], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Data prepared with the release's tokenizer and its mask token, as docs/training.md says."""
    root = tmp_path_factory.mktemp("data")
    generator = torch.Generator().manual_seed(0)
    lines = []
    for _ in range(40):
        picks = torch.randint(0, len(WORDS), (int(torch.randint(8, 30, (1,), generator=generator)),), generator=generator)
        lines.append(json.dumps({"text": " ".join(WORDS[i] for i in picks.tolist())}))
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    prepare_artifact(PrepareConfig(
        inputs=(root / "docs.jsonl",), out_dir=root / "art", seq_len=32, tokenizer_path=release[0] / "tokenizer.json",
        special=SpecialTokens(mask=MASK), val_fraction=0.1,
    ))  # fmt: skip
    return root / "art"


def test_a_release_loads_as_qwen2_with_transformers_logits(transformers: ModuleType, release: tuple[Path, Any]) -> None:
    directory, hf_model = release
    model, config = load_hf_checkpoint(directory, dtype=torch.float64)
    assert (config.arch, config.qkv_bias, config.qk_norm, config.num_layers, config.vocab_size) == (
        "qwen2", True, False, LAYERS, VOCAB)
    ids = torch.randint(0, VOCAB, (2, 40), generator=torch.Generator().manual_seed(1))
    reference = hf_logits(transformers, hf_model, ids, torch.arange(40))  # its float32 upcasts made float64
    assert reference.abs().max() > 0.5  # not a comparison of near-zero logits
    torch.testing.assert_close(csbp_logits(model, ids, torch.arange(40)), reference, rtol=0, atol=1e-10)
    assert not (directory / SENTINEL).exists()  # the auto_map's code was never imported


def test_init_from_a_release_trains(release: tuple[Path, Any], artifact: Path, tmp_path: Path) -> None:
    cfg = tiny_config(artifact, **_from(release[0], **{"model.arch": None, "objective.name": "fast_dllm_v2",
                                                       "objective.block_size": 8}))
    train(cfg, run_dir=tmp_path / "run", max_steps=1)
    written = json.loads((tmp_path / "run" / "final" / "config.json").read_text())
    # exported as the plain Qwen2 it is (the release's own layout needs its remote code)
    assert (written["model_type"], written["architectures"], "auto_map" in written, "bd_size" in written) == (
        "qwen2", ["Qwen2ForCausalLM"], False, False)
    assert written["csbp_training"]["objective"]["mask_token_id"] == open_artifact(artifact).mask_token_id
    assert not (release[0] / SENTINEL).exists()


def test_generate_samples_a_release_as_fast_dllm_v2_at_its_bd_size(
    release: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    directory = release[0]
    mask_ids = []
    draw_all = generate_cmd.draw_all

    def recording(*args: Any, **kwargs: Any) -> Any:
        mask_ids.append(kwargs["mask_token_id"])
        return draw_all(*args, **kwargs)

    monkeypatch.setattr(generate_cmd, "draw_all", recording)
    args = ["generate", "--model", str(directory), "--prompt", "the quick", "--max-new-tokens", "8", "--device", "cpu"]
    assert main([*args, "--json", str(tmp_path / "out.json")]) == 0
    printed = capsys.readouterr()
    assert "records no training settings" not in printed.err and MASK not in printed.out
    report = json.loads((tmp_path / "out.json").read_text())
    assert (report["objective"], report["settings"]["block_size"], report["settings"]["token_shift"]) == (
        "fast_dllm_v2", 32, True)
    assert mask_ids == [Tokenizer.from_file(str(directory / "tokenizer.json")).token_to_id(MASK)]  # |<MASK>|
    assert main([*args, "--mask-token", MASK, "--objective", "fast_dllm_v2", "--block-size", "32"]) == 0  # its own
    capsys.readouterr()
    config_file = directory / "config.json"
    assert main([*args, "--block-size", "16"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"csbp: error: --block-size 16: the model was trained with block size 32 ({config_file}) "
        "(fix: drop --block-size, or add --allow-block-size-change to sample with another block size)"
    )
    assert main([*args, "--block-size", "16", "--allow-block-size-change"]) == 0
    assert (
        f"csbp generate: sampling with block size 16, not the trained 32 ({config_file}; --allow-block-size-change)"
        in capsys.readouterr().err
    )


def test_eval_scores_a_release_as_fast_dllm_v2_at_its_bd_size(
    release: tuple[Path, Any], artifact: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = release[0]
    config = decoder_config_from_hf(json.loads((directory / "config.json").read_text()))
    settings = resolve_settings(directory, config, open_artifact(artifact))
    assert (settings.objective, settings.block_size, settings.mask_token_id, settings.document_mask) == (
        "fast_dllm_v2", 32, open_artifact(artifact).mask_token_id, True)
    args = ["eval", "--model", str(directory), "--data", str(artifact), "--samples", "1", "--no-ltr", "--max-batches",
            "1", "--micro-batch-size", "2"]
    assert main([*args, "--json", str(tmp_path / "eval.json")]) == 0
    report = json.loads((tmp_path / "eval.json").read_text())
    assert (report["objective"], report["block_size"], report["document_mask"]) == ("fast_dllm_v2", 32, True)
    capsys.readouterr()
    assert main([*args, "--block-size", "16"]) == 2
    assert capsys.readouterr().err.strip() == (
        f"csbp: error: --block-size 16: the model was trained with block size 32 ({directory / 'config.json'}) "
        "(fix: drop --block-size, or add --allow-block-size-change to evaluate with another block size)"
    )


@pytest.mark.parametrize(
    ("edits", "message"),
    [
        ({"bd_size": 0}, "bd_size is 0: a Fast-dLLM v2 release's bd_size is the block size"),
        ({"bd_size": "32"}, "bd_size is '32'"),
        ({"bd_size": True}, "bd_size is True"),
        ({"bd_size": None}, "bd_size is None"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types holds ['sliding_attention']"),
        ({"model_type": "qwen2"}, "model_type='qwen2' with architectures=['Fast_dLLM_QwenForCausalLM']"),
        ({"architectures": ["Qwen2ForCausalLM"]}, "a Fast-dLLM v2 release names model_type 'Fast_dLLM_Qwen'"),
    ],
)
def test_a_bad_release_config_is_refused_in_one_line(
    transformers: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str], edits: dict[str, Any], message: str
) -> None:
    make_release(transformers, tmp_path / "rel", **edits)
    config_file = tmp_path / "rel" / "config.json"
    with pytest.raises(ValueError, match=re.escape(message)) as refused:
        decoder_config_from_hf(json.loads(config_file.read_text()))
    assert str(refused.value).startswith("config.json ")
    assert main(["generate", "--model", str(tmp_path / "rel"), "--prompt", "the", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"csbp: error: {config_file} ") and message in err[0], err
    assert not (tmp_path / "rel" / SENTINEL).exists()
