"""``csbp generate``: requests no model could serve, refused by the flag at fault before the model is
loaded (a CLI fuzz found them blaming another flag, or starting work that would not end)."""

from __future__ import annotations

from pathlib import Path

import pytest

from test_generate_cli import export_tiny_run, parse


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_tiny_run(tmp_path_factory.mktemp("run"))


@pytest.fixture(autouse=True)
def _no_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_loading(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("csbp.models.hf_io.load_hf_checkpoint", no_loading)


def refusal(checkpoint: Path, *extra: str) -> str:
    args = parse(["generate", "--model", str(checkpoint), "--prompt", "the quick", "--device", "cpu", *extra])
    with pytest.raises(ValueError) as info:
        args.func(args)
    return str(info.value)


def test_a_block_longer_than_the_model_s_positions_is_refused_by_block_size(checkpoint: Path) -> None:
    """It blamed --max-new-tokens, with the fix "a prompt shorter than 0 tokens"; with --sub-block-size
    its divisors were listed by a loop over every number up to the block size (10**12: no end)."""
    for size, extra in (("100000", ()), (str(10**12), ("--sub-block-size", "7"))):
        assert refusal(checkpoint, "--block-size", size, *extra) == (
            f"--block-size {size}: the sampler runs whole blocks, and one block of {size} positions is past "
            f"max_position_embeddings 32768 of {checkpoint / 'config.json'} (fix: the block size the model was "
            "trained with, at most 32768)"
        )


def test_a_samples_count_that_cannot_be_meaningful_is_refused(checkpoint: Path) -> None:
    """--samples 100000 started 100000 greedy draws of the same completion."""
    assert refusal(checkpoint, "--samples", "100000") == (
        "--samples 100000: --temperature 0 is greedy, so every sample would be the same completion (fix: "
        "--temperature above 0 to draw different ones, or drop --samples)"
    )
    assert refusal(checkpoint, "--samples", str(2**32 + 1), "--temperature", "1") == (
        f"--samples {2**32 + 1}: the sampler's generator reads a seed's low 32 bits, so only 2^32 seeds draw "
        f"differently and the rest would repeat them (fix: --samples {2**32} or less)"
    )
    largest = 2**63 - 1
    assert refusal(checkpoint, "--samples", "3", "--temperature", "1", "--seed", str(largest - 1)) == (
        f"--seed {largest - 1} --samples 3: the last sample's seed {largest + 1} is past 2^63 - 1, the largest "
        f"--seed takes, so it could not be drawn again (fix: --seed {largest - 2} or less)"
    )


def test_the_sampler_s_seeds_repeat_past_2_to_the_32() -> None:
    """Why --samples stops at 2^32: the generator the sampler seeds draws alike from s and s + 2^32."""
    import torch

    draws = [torch.rand(4, generator=torch.Generator(device="cpu").manual_seed(s)) for s in (7, 7 + 2**32, 8)]
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], draws[2])


def test_every_refusal_names_its_fix(checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A fuzz of generate's refusals found these without one: --block-size/--window 0 ("must be a positive
    integer, got 0"), a --tokenizer that does not exist, a model directory without a tokenizer (the hint came
    after the loader's fix, which named no flag), an ar run and a directory without weights."""
    from csbp.cli.main import main

    for flag in ("--block-size", "--window"):
        assert main(["generate", "--model", str(checkpoint), "--prompt", "a", flag, "0"]) == 2
        assert f"argument {flag}: 0 must be >= 1" in capsys.readouterr().err
    assert refusal(checkpoint, "--tokenizer", str(tmp_path / "none")) == (
        f"--tokenizer {tmp_path / 'none'} does not exist (fix: a tokenizer directory or tokenizer.json file, or drop "
        "--tokenizer to use the model's own)"
    )
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_bytes((checkpoint / "config.json").read_bytes())
    assert refusal(bare) == (
        f"--model {bare} holds no tokenizer (tokenizer.json or tokenizer_config.json) (fix: --tokenizer DIR, the "
        "tokenizer the model was trained with)"
    )
    (tmp_path / "ar" / "final").mkdir(parents=True)
    (tmp_path / "ar" / "final" / "config.json").write_bytes((checkpoint / "config.json").read_bytes())
    (tmp_path / "ar" / "config.yaml").write_text("objective: {name: ar}\n", encoding="utf-8")
    assert refusal(tmp_path / "ar" / "final").endswith(
        "which csbp generate samples (fix: --model the export of a block-diffusion run)"
    )


def test_a_directory_without_weights_names_the_fix(tmp_path: Path) -> None:
    from csbp.models.hf_io import weight_files

    with pytest.raises(ValueError, match=r"pickled \*\.bin weights are never loaded \(fix: pass the directory that "):
        weight_files(tmp_path)


def test_a_config_without_max_position_embeddings_is_bounded_by_transformers_default(
    checkpoint: Path, tmp_path: Path
) -> None:
    """Without the field nothing bounded --block-size or --max-new-tokens: --block-size 10**9 was an
    allocation traceback after loading, --max-new-tokens 10**12 sampled without end. transformers reads
    its config class's default (Qwen3Config 32768, LlamaConfig 2048), so csbp does too."""
    import json
    import shutil

    bare = tmp_path / "final"
    shutil.copytree(checkpoint, bare)
    config = json.loads((bare / "config.json").read_text())
    del config["max_position_embeddings"]
    (bare / "config.json").write_text(json.dumps(config))
    source = f"(transformers' Qwen3Config default: {bare / 'config.json'} sets none)"
    assert refusal(bare, "--block-size", str(10**9)).endswith(
        f"one block of {10**9} positions is past max_position_embeddings 32768 {source} (fix: the block size the "
        "model was trained with, at most 32768)"
    )
    assert refusal(bare, "--block-size", "4", "--max-new-tokens", str(10**12)).endswith(
        f"beyond max_position_embeddings 32768 {source} (fix: --max-new-tokens 32765 or less)"
    )
    (bare / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    assert "max_position_embeddings 2048 (transformers' LlamaConfig default" in refusal(bare, "--block-size", "4096")


def test_a_failing_chat_template_names_the_fix_generate_has(checkpoint: Path) -> None:
    """It named ``--chat-template none``, a flag of ``csbp data prepare`` that ``csbp generate`` lacks."""
    template = checkpoint / "chat_template.jinja"
    messages = []
    try:
        for text in ("{{ 1 / 0 }}", "{{ messages[0]['content'] | nonexistent_filter }}"):  # fails rendering, compiling
            template.write_text(text, encoding="utf-8")
            messages.append(refusal(checkpoint, "--chat"))
    finally:
        template.unlink()
    assert messages[0].startswith("--prompt: chat template ")
    assert messages[0].endswith("(fix: repair the record, or drop --chat, or use another template)")
    assert messages[1].endswith("No filter named 'nonexistent_filter'. (fix: repair the template, or drop --chat)")
    assert not any("--chat-template" in message for message in messages)
