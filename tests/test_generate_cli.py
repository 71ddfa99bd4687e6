"""``csbp generate``: the command line over an exported tiny run (prompt and completion, settings from
the run config, one-line errors, requests refused before sampling, chat prompts). The sampler itself is
tested in ``tests/test_generation.py``, whose tiny model this file shares."""

from __future__ import annotations

import argparse
import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models

from csbp.cli import generate_cmd
from csbp.data.corpus import known_word_fraction
from csbp.data.tokenizer import load_tokenizer, train_bpe_tokenizer
from csbp.generation.sampler import positions_used
from csbp.models.decoder import Decoder
from csbp.models.hf_io import export_hf_checkpoint
from test_generation import tiny_model


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="csbp")
    generate_cmd.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def export_tiny_run(run_dir: Path) -> Path:
    """A tiny model and BPE tokenizer exported as ``run_dir/final`` (what ``csbp train`` writes)."""
    texts = ["the quick brown fox jumps over the lazy dog", "block diffusion samples blocks"] * 4
    tokenizer = train_bpe_tokenizer(texts, vocab_size=300)
    run_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(run_dir)
    model = tiny_model(vocab_size=tokenizer.vocab_size)
    return export_hf_checkpoint(
        model, model.config, run_dir / "final", tokenizer_dir=run_dir, dtype=torch.float32
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_tiny_run(tmp_path_factory.mktemp("run"))


def test_cli_prints_prompt_and_completion(checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "--model", str(checkpoint), "--prompt", "the quick", "--device", "cpu"]
    argv += "--max-new-tokens 10 --block-size 4 --steps-per-block 2".split()
    assert parse(argv).func(parse(argv)) == 0
    first = capsys.readouterr().out
    assert "prompt: the quick" in first and "completion: " in first and "<|mask|>" not in first
    assert "[bd3, 10 tokens" in first and "blocks of 4" in first
    (checkpoint.parent / "known.txt").write_text("the quick brown fox", encoding="utf-8")
    args = parse([*argv, "--known-words", str(checkpoint.parent / "known.txt")])
    assert args.func(args) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert re.fullmatch(rf"words found in {re.escape(str(checkpoint.parent / 'known.txt'))}: \d+/\d+ \(\d+\.\d%\)", line)
    assert known_word_fraction("the fox,  jumps\nthe", {"the", "fox"}) == (2, 4)  # "fox," is not "fox"
    # --samples: seeds 3 and 4 drawn one after the other, as two runs with those seeds draw them, then pooled
    sampling = [*argv, "--temperature", "1.0", "--top-k", "50", "--known-words", str(checkpoint.parent / "known.txt")]
    singles = []
    for seed in (3, 4):
        args = parse([*sampling, "--seed", str(seed)])
        assert args.func(args) == 0
        singles.append(capsys.readouterr().out.splitlines())
    args = parse([*sampling, "--seed", "3", "--samples", "2"])
    assert args.func(args) == 0
    lines = capsys.readouterr().out.splitlines()
    for seed, single in zip((3, 4), singles):
        at = lines.index(single[1].replace("completion: ", f"completion (seed {seed}): ", 1))
        assert lines[at + 2] == single[3]  # the same completion and share
    counts = [tuple(map(int, re.search(r"(\d+)/(\d+)", single[3]).groups())) for single in singles]
    known, total = (sum(c[i] for c in counts) for i in (0, 1))
    assert lines[-1].startswith(f"words found in {checkpoint.parent / 'known.txt'} over 2 samples: {known}/{total} (")
    args = parse([*argv, *"--temperature 0.8 --top-k 5 --seed 2 --objective fast_dllm_v2".split()])
    assert args.func(args) == 0
    assert "[fast_dllm_v2, 10 tokens" in capsys.readouterr().out
    # a model without a training record (no run config.yaml, no csbp_training) says what it assumes
    argv = ["generate", "--model", str(checkpoint), "--prompt", "the", "--device", "cpu", "--max-new-tokens", "2"]
    assert parse(argv).func(parse(argv)) == 0
    assert capsys.readouterr().err == (
        f"csbp generate: {checkpoint} records no training settings; sampling as bd3 with block size 16 "
        "(pass --objective and --block-size to choose)\n"
    )


def test_cli_takes_objective_and_block_size_from_the_run_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    final = export_tiny_run(tmp_path / "run")
    (tmp_path / "run" / "config.yaml").write_text("objective:\n  name: fast_dllm_v2\n  block_size: 8\n")
    args = parse(
        ["generate", "--model", str(final), "--prompt", "the", "--max-new-tokens", "12", "--device", "cpu"]
    )
    assert args.func(args) == 0
    assert "[fast_dllm_v2, 12 tokens, 2 blocks of 8" in capsys.readouterr().out
    (tmp_path / "run" / "config.yaml").write_text(
        "objective:\n  name: bd3\n  block_size: 4\ntopology:\n  window: 6\n"
    )
    assert args.func(args) == 0
    assert "[bd3, 12 tokens, 4 blocks of 4, 12 denoising steps, window 6," in capsys.readouterr().out
    config_file = tmp_path / "run" / "config.yaml"
    other = parse([*sys_argv_of(args, final), "--block-size", "6"])
    with pytest.raises(ValueError) as info:  # a silent override would sample off the trained grid
        other.func(other)
    assert str(info.value) == (
        f"--block-size 6: the model was trained with block size 4 ({config_file}) "
        "(fix: drop --block-size, or add --allow-block-size-change to sample with another block size)"
    )
    assert capsys.readouterr() == ("", "")  # refused before any work
    same = parse([*sys_argv_of(args, final), "--block-size", "4"])
    assert same.func(same) == 0 and capsys.readouterr().err == ""
    allowed = parse([*sys_argv_of(args, final), "--block-size", "6", "--allow-block-size-change"])
    assert allowed.func(allowed) == 0
    out, err = capsys.readouterr()
    assert "blocks of 6" in out
    assert err.splitlines() == [
        f"csbp generate: sampling with block size 6, not the trained 4 ({config_file}; --allow-block-size-change)"
    ]
    other = parse([*sys_argv_of(args, final), "--objective", "fast_dllm_v2"])
    with pytest.raises(ValueError) as info:  # same block grid, other label alignment: never silently
        other.func(other)
    assert str(info.value) == (
        f"--objective fast_dllm_v2: the model was trained with objective bd3 ({config_file}) "
        "(fix: drop --objective, or add --allow-objective-change to sample with another objective)"
    )
    assert capsys.readouterr() == ("", "")
    allowed = parse([*sys_argv_of(args, final), "--objective", "fast_dllm_v2", "--allow-objective-change"])
    assert allowed.func(allowed) == 0
    out, err = capsys.readouterr()
    assert "[fast_dllm_v2, 12 tokens, 4 blocks of 4" in out
    assert err.splitlines() == [
        f"csbp generate: sampling with objective fast_dllm_v2, not the trained bd3 ({config_file}; --allow-objective-change)"
    ]
    (tmp_path / "run" / "config.yaml").write_text("objective:\n  name: ar\n")
    with pytest.raises(ValueError, match="objective 'ar'"):
        args.func(args)


def sys_argv_of(args: argparse.Namespace, final: Path) -> list[str]:
    return ["generate", "--model", str(final), "--prompt", args.prompt, "--max-new-tokens", "12", "--device", "cpu"]


def test_cli_errors(checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--prompt", "hi", "--device", "cpu"]
    with pytest.raises(ValueError, match="--known-words .*nowhere.txt: not a text file"):
        args = parse(["generate", "--model", str(checkpoint), "--known-words", str(tmp_path / "nowhere.txt"), *base])
        args.func(args)
    assert capsys.readouterr().out == ""  # refused before sampling
    with pytest.raises(ValueError, match="not a directory"):
        args = parse(["generate", "--model", str(tmp_path / "missing"), *base])
        args.func(args)
    with pytest.raises(SystemExit):  # argparse: "argument --block-size: 0 must be >= 1"
        parse(["generate", "--model", str(checkpoint), "--block-size", "0", *base])
    assert "argument --block-size: 0 must be >= 1" in capsys.readouterr().err
    no_mask_dir = tmp_path / "no_mask"
    no_mask_dir.mkdir()
    Tokenizer(models.WordLevel({"<|endoftext|>": 0, "hi": 1}, unk_token="<|endoftext|>")).save(
        str(no_mask_dir / "tokenizer.json")
    )
    with pytest.raises(ValueError, match="mask token"):
        args = parse(["generate", "--model", str(checkpoint), "--tokenizer", str(no_mask_dir), *base])
        args.func(args)


def test_cli_refuses_impossible_requests_before_sampling(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    final = export_tiny_run(tmp_path / "run")
    base = ["generate", "--model", str(final), "--prompt", "the quick", "--device", "cpu", "--block-size", "4"]

    def call(*extra: str) -> int:
        args = parse([*base, *extra])
        return int(args.func(args))

    with pytest.raises(ValueError) as info:
        call("--steps-per-block", "100", "--max-new-tokens", "4")
    assert str(info.value) == (
        "--steps-per-block 100: a block of 4 tokens takes 1 to 4 denoising steps (each unmasks at least one "
        "position) (fix: --steps-per-block between 1 and 4, or drop it for 4)"
    )
    with pytest.raises(ValueError, match=r"^--steps-per-block 0: "):
        call("--steps-per-block", "0")
    config_file = final / "config.json"
    hf_config = json.loads(config_file.read_text())
    prompt_len = len(load_tokenizer(final).encode("the quick"))
    with pytest.raises(ValueError) as info:
        call("--max-new-tokens", "100000")
    assert str(info.value) == (
        f"--max-new-tokens 100000: the prompt's {prompt_len} tokens and 100000 new ones fill blocks of 4 up to "
        f"position {positions_used(prompt_len, 100000, 4)}, beyond max_position_embeddings 32768 of {config_file} "
        f"(fix: --max-new-tokens {32768 - prompt_len} or less)"
    )
    assert capsys.readouterr() == ("", "")  # refused before any sampling
    config_file.write_text(json.dumps({**hf_config, "max_position_embeddings": 16}))
    room = 16 - prompt_len
    assert call("--max-new-tokens", str(room)) == 0 and f"[bd3, {room} tokens" in capsys.readouterr().out
    with pytest.raises(ValueError, match=rf"\(fix: --max-new-tokens {room} or less\)$"):
        call("--max-new-tokens", str(room + 1))
    # weights of another model size next to this config.json: the error says what to do
    other_config = replace(tiny_model(vocab_size=load_tokenizer(final).vocab_size).config, hidden_size=64)
    export_hf_checkpoint(Decoder(other_config, dtype=torch.float32), other_config, tmp_path / "big", dtype=torch.float32)
    (final / "model.safetensors").write_bytes((tmp_path / "big" / "model.safetensors").read_bytes())
    with pytest.raises(ValueError) as info:
        call("--max-new-tokens", "2")
    assert str(info.value).startswith(f"checkpoint {final}: tensor 'model.embed_tokens.weight' has shape")
    assert str(info.value).endswith(
        "(fix: keep each model.safetensors with the config.json it was saved with: copy or point at the whole "
        "export directory)"
    )


def test_cli_chat_wraps_the_prompt_as_a_user_turn(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    final = export_tiny_run(tmp_path / "run")
    argv = ["generate", "--model", str(final), "--prompt", "the fox", "--device", "cpu", "--max-new-tokens", "2", "--chat"]
    with pytest.raises(ValueError, match=r"^--chat: tokenizer directory .* has no chat template"):
        parse(argv).func(parse(argv))
    (final / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}",
        encoding="utf-8",
    )
    from csbp.generation import sampler

    seen: list[list[int]] = []

    def recording_generate(model: Decoder, prompt_ids: list[int], **options: object) -> object:
        seen.extend(list(prompt) for prompt in prompt_ids)
        return real_generate(model, prompt_ids, **options)  # type: ignore[arg-type]

    real_generate = sampler.generate_batch
    monkeypatch.setattr(sampler, "generate_batch", recording_generate)
    assert parse(argv).func(parse(argv)) == 0
    tokenizer = load_tokenizer(final)
    assert seen == [tokenizer.encode("<user>the fox</user><assistant>")]
    assert "completion: " in capsys.readouterr().out


def test_cli_refuses_a_prompt_it_cannot_continue_before_loading_the_model(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """They failed in the sampler, after loading, in its Python words ("token_shift=True ...")."""

    def no_loading(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("csbp.models.hf_io.load_hf_checkpoint", no_loading)
    base = ["generate", "--model", str(checkpoint), "--device", "cpu", "--block-size", "4"]
    args = parse([*base, "--prompt", "", "--objective", "fast_dllm_v2"])
    with pytest.raises(ValueError) as info:
        args.func(args)
    assert str(info.value) == (
        "--prompt: empty, but fast_dllm_v2 predicts each token from the one before it (fix: give a prompt)"
    )
    args = parse([*base, "--prompt", "the <|mask|> fox"])
    mask_id = load_tokenizer(checkpoint).mask_token_id
    with pytest.raises(ValueError) as info:
        args.func(args)
    assert str(info.value) == (
        f"--prompt: holds the mask token <|mask|> (id {mask_id}), which the model reads as a position to fill, "
        "not as text (fix: remove it from the prompt)"
    )


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--temperature", "-1", "-1 must be a finite number >= 0"),
        ("--top-k", "0", "0 must be >= 1"),
        ("--top-p", "0", "0 must lie in (0, 1]"),
        ("--threshold", "1.5", "1.5 must lie in [0, 1]"),
        ("--seed", "-1", "-1 must be >= 0"),
        ("--mask-token", "", "an empty name names no token (fix: a token of the tokenizer, e.g. <|mask|>, or drop"),
        ("--eos-token", "", "an empty name names no token (fix: a token of the tokenizer, e.g. <|endoftext|>, or"),
    ],
)
def test_sampling_flags_are_refused_by_their_flag_name(
    flag: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """They were refused by GenerationConfig's field names: "top_k must be >= 1 (or unset), got 0"."""
    with pytest.raises(SystemExit):
        parse(["generate", "--model", "m", "--prompt", "hi", flag, value])
    assert f"argument {flag}: {message}" in capsys.readouterr().err


def test_cli_refuses_a_tokenizer_other_than_the_model_s_own(checkpoint: Path, tmp_path: Path) -> None:
    """--tokenizer with another tokenizer sampled happily: its ids meant other words to the model."""
    other = tmp_path / "other"
    other.mkdir()
    train_bpe_tokenizer(["entirely different words here"] * 8, vocab_size=280).save(other)
    args = parse(["generate", "--model", str(checkpoint), "--tokenizer", str(other), "--prompt", "hi", "--device", "cpu"])
    with pytest.raises(ValueError) as info:
        args.func(args)
    assert str(info.value) == (
        f"--tokenizer {other}: not the tokenizer {checkpoint} was exported with ({checkpoint / 'tokenizer.json'}; "
        "fingerprints differ), so its ids would mean other words to the model (fix: drop --tokenizer to use the "
        "model's own)"
    )
    same = parse(["generate", "--model", str(checkpoint), "--tokenizer", str(checkpoint / "tokenizer.json"),
                  "--prompt", "hi", "--device", "cpu", "--max-new-tokens", "2", "--block-size", "4"])
    assert same.func(same) == 0


def test_cli_notes_positions_past_the_trained_row_length(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Only max_position_embeddings bounded a request: a model trained on 16-token rows sampled 40
    tokens (positions it never attended to) without a word. It stays allowed (length extrapolation
    is an experiment), with one stderr line saying so and how far stays inside."""
    final = export_tiny_run(tmp_path / "run")
    config_file = tmp_path / "run" / "config.yaml"
    config_file.write_text("data:\n  seq_len: 16\nobjective:\n  name: bd3\n  block_size: 4\n")
    prompt_len = len(load_tokenizer(final).encode("the quick"))
    base = ["generate", "--model", str(final), "--prompt", "the quick", "--device", "cpu"]
    inside = parse([*base, "--max-new-tokens", str(16 - prompt_len)])
    assert inside.func(inside) == 0 and capsys.readouterr().err == ""
    past = parse([*base, "--max-new-tokens", "40"])
    assert past.func(past) == 0
    out, err = capsys.readouterr()
    assert "[bd3, 40 tokens" in out
    last = positions_used(prompt_len, 40, 4) - 1
    assert err.splitlines() == [
        f"csbp generate: runs the model at positions up to {last}, past the 16-token rows it was trained on "
        f"({config_file}): it never attended that far, so quality may drop there "
        f"(--max-new-tokens {16 - prompt_len} or less stays inside)"
    ]


def test_cli_refuses_token_ids_outside_the_model_before_loading_it(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mask token id outside the model was refused only after the weights loaded; an EOS id
    outside it in the sampler, in its Python words."""
    model_dir = tmp_path / "model"
    shutil.copytree(checkpoint, model_dir)
    tokenizer = load_tokenizer(checkpoint)
    small = max(tokenizer.mask_token_id, tokenizer.eos_id)  # one of the two ids lies outside
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "vocab_size": small}))

    def no_loading(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("csbp.models.hf_io.load_hf_checkpoint", no_loading)
    args = parse(["generate", "--model", str(model_dir), "--prompt", "", "--device", "cpu", "--block-size", "4"])
    with pytest.raises(ValueError, match=rf"^(mask token id|EOS id) {small} is outside the model vocabulary \[0, {small}\)"):
        args.func(args)


def test_cli_refuses_a_threshold_with_the_left_to_right_order(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_loading(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("csbp.models.hf_io.load_hf_checkpoint", no_loading)
    args = parse(["generate", "--model", str(checkpoint), "--prompt", "the", "--block-size", "4",
                  "--threshold", "0.9", "--unmask-order", "left_to_right"])
    with pytest.raises(ValueError, match=r"^--threshold 0\.9 unmasks the proposals more confident than it, but "):
        args.func(args)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--top-k", "5"], r"^--top-k 5 truncates the sampled distribution, but --temperature 0 is greedy .*"
                           r"\(fix: --temperature above 0 to sample, or drop --top-k\)$"),
        (["--top-k", "5", "--top-p", "0.9", "--temperature", "0"], r"^--top-k 5 and --top-p 0\.9 truncate the .*"
                                                                    r"drop --top-k and --top-p\)$"),
    ],
)
def test_cli_refuses_top_k_or_top_p_with_greedy_decoding(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch, extra: list[str], message: str
) -> None:
    # at --temperature 0 (the default) the proposal is the arg-max: --top-k/--top-p were silently ignored
    def no_loading(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("csbp.models.hf_io.load_hf_checkpoint", no_loading)
    args = parse(["generate", "--model", str(checkpoint), "--prompt", "the", "--block-size", "4", *extra])
    with pytest.raises(ValueError, match=message):
        args.func(args)


def test_cli_sub_blocks(checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    base = ["generate", "--model", str(checkpoint), "--prompt", "the quick", "--device", "cpu", "--block-size", "8",
            "--max-new-tokens", "10"]  # fmt: skip
    args = parse([*base, "--sub-block-size", "4", "--threshold", "0.9"])
    assert args.func(args) == 0 and "[bd3, 10 tokens" in capsys.readouterr().out
    for extra, message in (
        (["--sub-block-size", "3"], r"^--sub-block-size 3 does not divide the block size 8 \(fix: one of \[1, 2, 4, 8\]\)$"),
        (["--sub-block-size", "4", "--steps-per-block", "3"], r"^--steps-per-block 3 does not split evenly over the 2 "),
    ):
        args = parse([*base, *extra])
        with pytest.raises(ValueError, match=message):
            args.func(args)


def test_cli_refuses_a_window_other_than_the_trained_one(tmp_path: Path) -> None:
    """--window overrode the run's topology.window silently: a full-attention model was sampled
    through a window it never saw (or a windowed one without its window)."""
    final = export_tiny_run(tmp_path / "run")
    config_file = tmp_path / "run" / "config.yaml"
    base = ["generate", "--model", str(final), "--prompt", "the", "--max-new-tokens", "4", "--device", "cpu"]
    for recorded, flag, trained in (("", "6", "full attention"), ("topology:\n  window: 6\n", "3", "window 6")):
        config_file.write_text("objective:\n  name: bd3\n  block_size: 4\n" + recorded)
        args = parse([*base, "--window", flag])
        with pytest.raises(ValueError) as info:
            args.func(args)
        assert str(info.value) == (
            f"--window {flag}: the model was trained with {trained} ({config_file}), which csbp generate samples "
            "with (fix: drop --window; it is for checkpoints that record no training settings)"
        )
    same = parse([*base, "--window", "6"])
    assert same.func(same) == 0
    config_file.unlink()  # no training record: --window is how the sampler learns the window
    args = parse([*base, "--window", "3", "--block-size", "4", "--objective", "bd3"])
    assert args.func(args) == 0


def test_cli_stops_at_every_eos_of_the_generation_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chat export lists its end of turn (<|im_end|>) beside the data's EOS in generation_config.json;
    csbp generate stops at either, as Hugging Face generate does (it used to stop at the EOS only)."""
    final = export_tiny_run(tmp_path / "run")
    tokenizer = load_tokenizer(final)
    from csbp.generation import sampler

    seen: list[object] = []
    real_generate = sampler.generate_batch

    def recording_generate(model: Decoder, prompt_ids: list[int], **options: object) -> object:
        seen.append(options["eos_id"])
        return real_generate(model, prompt_ids, **options)  # type: ignore[arg-type]

    monkeypatch.setattr(sampler, "generate_batch", recording_generate)
    config_file = final / "generation_config.json"
    argv = ["generate", "--model", str(final), "--prompt", "the fox", "--device", "cpu", "--max-new-tokens", "2"]
    config_file.write_text(json.dumps({"eos_token_id": [tokenizer.eos_id, 7]}), encoding="utf-8")
    assert parse(argv).func(parse(argv)) == 0
    config_file.write_text(json.dumps({"eos_token_id": 5}), encoding="utf-8")
    assert parse(argv).func(parse(argv)) == 0
    assert seen == [[tokenizer.eos_id, 7], [tokenizer.eos_id, 5]]
    capsys.readouterr()
    for bad, why in ((100000, "is not a token id"), ("7", "is not a token id"), (tokenizer.mask_token_id, "is the mask")):
        config_file.write_text(json.dumps({"eos_token_id": [bad]}), encoding="utf-8")
        with pytest.raises(ValueError, match=rf"generation_config.json: eos_token_id .* {why}"):
            parse(argv).func(parse(argv))


def test_cli_refuses_a_mask_token_other_than_the_run_s(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An explicit --mask-token lost silently to the run's recorded mask_token_id (the flag defaulted to
    <|mask|>, so an explicit value could not be told from the default). Now the flags default to None:
    the run's id is used (the tokenizer need not hold <|mask|>), and a contradicting name is refused."""
    final = export_tiny_run(tmp_path / "run")
    tokenizer = load_tokenizer(final)
    recorded = tokenizer.eos_id + 5  # an ordinary token, not the tokenizer's <|mask|>
    assert recorded != tokenizer.mask_token_id
    config_file = tmp_path / "run" / "config.yaml"
    config_file.write_text(f"objective:\n  name: bd3\n  block_size: 4\n  mask_token_id: {recorded}\n")
    base = ["generate", "--model", str(final), "--prompt", "the", "--max-new-tokens", "4", "--device", "cpu"]
    assert parse(base).mask_token is None and parse(base).eos_token is None
    explicit = parse([*base, "--mask-token", "<|mask|>"])
    with pytest.raises(ValueError) as info:
        explicit.func(explicit)
    name = tokenizer.backend.id_to_token(recorded)
    assert str(info.value) == (
        f"--mask-token <|mask|>: id {tokenizer.mask_token_id} of {final}, but the model was trained with "
        f"mask_token_id {recorded} ({name}) ({config_file}) (fix: drop --mask-token to use the run's)"
    )
    seen: list[object] = []

    def recording_generate(model: Decoder, prompt_ids: list[int], **options: object) -> object:
        seen.append(options["mask_token_id"])
        raise SystemExit(0)

    monkeypatch.setattr("csbp.generation.sampler.generate_batch", recording_generate)
    for argv in (base, [*base, "--mask-token", name]):
        with pytest.raises(SystemExit):
            parse(argv).func(parse(argv))
    assert seen == [recorded, recorded]
