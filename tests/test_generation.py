"""Block-diffusion sampling (``csbp.generation``) and ``csbp generate``.

A tiny random decoder (hidden 32, 4/2 heads, vocab 64, float64, weights std 0.3 so proposals have
clear confidence gaps) samples with the clean-prefix KV cache and without it (the whole
``[noisy block ; clean prefix]`` layout rebuilt with the BD3 inference mask every step); the two
must agree token for token. The cached denoising rows must also equal the noisy rows of the BD3
*training* layout ``[x_t ; x_0]`` (1e-12), which ties sampling to what the model was trained on.
Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_generation.py -q``
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models

from csbp.attention.layouts import bd3_rows
from csbp.attention.rows import allow_matrix
from csbp.cli import generate_cmd
from csbp.data.corpus import known_word_fraction
from csbp.data.tokenizer import load_tokenizer, train_bpe_tokenizer
from csbp.generation import (
    CachedBlockForward,
    GenerationConfig,
    choose_unmasked,
    generate,
    propose_tokens,
    unmask_count,
)
from csbp.generation.sampler import positions_used
from csbp.models.attention_fns import DenseMaskAttention
from csbp.models.config import DecoderConfig
from csbp.models.decoder import Decoder
from csbp.models.hf_io import export_hf_checkpoint

VOCAB = 64
MASK = 63
BLOCK = 4


def tiny_model(vocab_size: int = VOCAB, seed: int = 0) -> Decoder:
    config = DecoderConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
    )
    model = Decoder(config, dtype=torch.float64, seed=seed)
    model.init_weights(torch.Generator().manual_seed(seed + 1), std=0.3)
    return model.eval()


@pytest.fixture(scope="module")
def model() -> Decoder:
    return tiny_model()


def run(model: Decoder, prompt: list[int], eos_id: int | None = None, **options: object):
    config = GenerationConfig(**{"block_size": BLOCK, "steps_per_block": 3, "max_new_tokens": 21, **options})
    return generate(model, prompt, mask_token_id=MASK, eos_id=eos_id, config=config)


# ----------------------------------------------------------------------------- cache exactness


@pytest.mark.parametrize(
    ("token_shift", "prompt_len"),
    [
        (False, 0),
        (False, 3),
        (False, 8),
        (False, 11),
        (True, 3),
        (True, 8),
        (True, 11),
    ],  # shift needs a prompt
)
def test_cache_equals_recomputation_token_for_token(
    model: Decoder, token_shift: bool, prompt_len: int
) -> None:
    prompt = [(7 * i + 5) % MASK for i in range(prompt_len)]
    for options in ({"temperature": 0.0}, {"temperature": 1.0, "top_k": 20, "seed": 3}):
        cached = run(model, prompt, token_shift=token_shift, use_cache=True, **options)
        recomputed = run(model, prompt, token_shift=token_shift, use_cache=False, **options)
        assert cached.token_ids == recomputed.token_ids
        assert cached.unmask_steps == recomputed.unmask_steps
        assert len(cached.token_ids) == 21


def test_cached_denoise_equals_training_layout_rows(model: Decoder) -> None:
    """Row ``i`` of block ``b`` in the ``[x_t ; x_0]`` training forward equals the cached denoising
    forward of block ``b`` over the clean prefix ``x_0[: b*B]`` (objectives.md §3.4 test oracle)."""
    seq_len, block = 16, 2
    generator = torch.Generator().manual_seed(5)
    clean_1L = torch.randint(0, MASK, (1, seq_len), generator=generator)
    noisy_1L = torch.where(torch.rand(1, seq_len, generator=generator) < 0.5, MASK, clean_1L)
    rows = bd3_rows(torch.arange(seq_len), torch.arange(seq_len), block_size=BLOCK)
    with torch.no_grad():
        training_1RD = model(
            torch.cat((noisy_1L, clean_1L), dim=1), rows.pos, DenseMaskAttention(allow_matrix(rows, rows))
        )
        forward = CachedBlockForward(model, BLOCK)
        forward.prefill(clean_1L[:, : block * BLOCK])
        span = slice(block * BLOCK, (block + 1) * BLOCK)
        denoised_1BD, before_1D = forward.denoise(noisy_1L[:, span], block * BLOCK)
    torch.testing.assert_close(denoised_1BD, training_1RD[:, span], rtol=0, atol=1e-12)
    # the clean row before the block (token-shift source) is the training clean row at b*B - 1
    assert before_1D is not None
    torch.testing.assert_close(before_1D, training_1RD[:, seq_len + block * BLOCK - 1], rtol=0, atol=1e-12)


@pytest.mark.parametrize("window", [3, 6])
def test_windowed_sampling_uses_the_training_window(model: Decoder, window: int) -> None:
    """A model trained with ``topology.window`` is sampled with the windowed BD3 mask: every cached
    denoising and commit row equals the windowed *training* layout's row, the cache equals
    recomputation token for token, and the window changes the samples."""
    seq_len = 16
    generator = torch.Generator().manual_seed(7)
    clean_1L = torch.randint(0, MASK, (1, seq_len), generator=generator)
    noisy_1L = torch.where(torch.rand(1, seq_len, generator=generator) < 0.5, MASK, clean_1L)
    rows = bd3_rows(torch.arange(seq_len), torch.arange(seq_len), block_size=BLOCK, window=window)
    with torch.no_grad():
        training_1RD = model(
            torch.cat((noisy_1L, clean_1L), dim=1), rows.pos, DenseMaskAttention(allow_matrix(rows, rows))
        )
        forward = CachedBlockForward(model, BLOCK, window)
        forward.prefill(clean_1L[:, : 2 * BLOCK])  # two clean blocks at once: token-causal in the window
        for block in (2, 3):
            span = slice(block * BLOCK, (block + 1) * BLOCK)
            denoised_1BD, before_1D = forward.denoise(noisy_1L[:, span], block * BLOCK)
            torch.testing.assert_close(denoised_1BD, training_1RD[:, span], rtol=0, atol=1e-12)
            assert before_1D is not None
            torch.testing.assert_close(
                before_1D, training_1RD[:, seq_len + block * BLOCK - 1], rtol=0, atol=1e-12
            )
            forward.commit(clean_1L[:, span], block * BLOCK)
    prompt = [(5 * i + 2) % MASK for i in range(9)]
    for options in ({"temperature": 0.0}, {"temperature": 1.0, "top_k": 20, "seed": 3}):
        cached = run(model, prompt, window=window, use_cache=True, **options)
        recomputed = run(model, prompt, window=window, use_cache=False, **options)
        assert cached.token_ids == recomputed.token_ids
    unwindowed = run(model, prompt, max_new_tokens=40, temperature=0.0)
    assert run(model, prompt, max_new_tokens=40, temperature=0.0, window=window).token_ids != unwindowed.token_ids
    with pytest.raises(ValueError, match="window"):
        GenerationConfig(window=0)


def test_left_to_right_order_fills_each_block_from_the_left(model: Decoder) -> None:
    prompt = [(3 * i + 1) % MASK for i in range(6)]
    result = run(model, prompt, steps_per_block=2, unmask_order="left_to_right", temperature=0.0)
    filled = [position for step in result.unmask_steps for position, _ in step]
    assert filled == sorted(filled) and filled == list(range(6, 6 + 21))  # leftmost first, in order
    assert run(model, prompt, steps_per_block=2, unmask_order="left_to_right", use_cache=False).token_ids == (
        result.token_ids
    )
    assert result.token_ids != run(model, prompt, steps_per_block=2, temperature=0.0).token_ids
    with pytest.raises(ValueError, match="unmask_order"):
        GenerationConfig(unmask_order="random")


def test_cache_never_recomputes_the_prefix(model: Decoder) -> None:
    prompt = list(range(1, 10))  # 2 whole blocks prefilled, 1 prompt token carried into block 2
    result = run(model, prompt, steps_per_block=2, max_new_tokens=11)
    num_blocks = len(result.block_starts)
    denoise_rows = BLOCK * len(result.unmask_steps)
    commit_rows = BLOCK * (num_blocks - 1)  # the last block is never committed
    assert result.num_model_rows == 8 + denoise_rows + commit_rows
    assert run(model, prompt, steps_per_block=2, max_new_tokens=11, use_cache=False).num_model_rows > 2 * (
        result.num_model_rows
    )


# ----------------------------------------------------------------------------- loop semantics


@pytest.mark.parametrize("prompt_len", [0, 3, 8, 11])
def test_block_structure_and_positions(model: Decoder, prompt_len: int) -> None:
    prompt = [(3 * i + 1) % MASK for i in range(prompt_len)]
    steps, max_new = 3, 18
    result = run(model, prompt, steps_per_block=steps, max_new_tokens=max_new)
    first = prompt_len // BLOCK * BLOCK
    assert result.block_starts == list(range(first, first + BLOCK * len(result.block_starts), BLOCK))
    unmasked = [pair for step in result.unmask_steps for pair in step]
    positions = sorted(pos for pos, _ in unmasked)
    # every generated position exactly once, the carried prompt tokens never
    assert positions == list(range(prompt_len, prompt_len + max_new))
    by_position = dict(unmasked)
    assert result.token_ids == [by_position[p] for p in positions]
    # each step only touches its own block; blocks take at most `steps` steps
    step_blocks = [{pos // BLOCK for pos, _ in step} for step in result.unmask_steps]
    assert all(len(blocks) == 1 for blocks in step_blocks)
    per_block = [
        sum(1 for blocks in step_blocks if blocks == {start // BLOCK}) for start in result.block_starts
    ]
    assert max(per_block) <= steps
    # k = ceil(remaining / remaining_steps): a full block of 4 in 3 steps unmasks 2, 1, 1
    full = [len(step) for step in result.unmask_steps[-steps:]]
    if (prompt_len + max_new) % BLOCK == 0:
        assert full == [2, 1, 1]


def test_mask_token_is_never_generated(model: Decoder) -> None:
    boosted = tiny_model()
    plain_logits = boosted.logits
    bonus = torch.zeros(VOCAB, dtype=torch.float64)
    bonus[MASK] = 50.0  # the mask would win every proposal if it were not excluded
    boosted.logits = lambda hidden: plain_logits(hidden) + bonus  # type: ignore[method-assign]
    for options in ({"temperature": 0.0}, {"temperature": 2.0, "seed": 1}):
        result = run(boosted, [1, 2, 3], max_new_tokens=40, **options)
        assert MASK not in result.token_ids and len(result.token_ids) == 40


def test_eos_stops_generation_after_its_block(model: Decoder) -> None:
    free = run(model, [4, 5], max_new_tokens=24)
    eos = free.token_ids[9]
    cut = free.token_ids.index(eos)
    stopped = run(model, [4, 5], eos_id=eos, max_new_tokens=24)
    assert stopped.stopped_at_eos and stopped.token_ids == free.token_ids[:cut]
    eos_block = (2 + cut) // BLOCK
    assert len(stopped.block_starts) == eos_block + 1


def test_seeded_sampling_is_deterministic(model: Decoder) -> None:
    options = {"temperature": 1.0, "top_k": 16, "top_p": 0.9}
    first = run(model, [1, 2, 3], seed=11, **options)
    again = run(model, [1, 2, 3], seed=11, **options)
    other = run(model, [1, 2, 3], seed=12, **options)
    assert first.token_ids == again.token_ids
    assert first.token_ids != other.token_ids


def test_threshold_zero_unmasks_a_block_in_one_step(model: Decoder) -> None:
    result = run(model, [1, 2, 3, 4], steps_per_block=4, max_new_tokens=12, threshold=0.0)
    assert [len(step) for step in result.unmask_steps] == [BLOCK, BLOCK, BLOCK]


def test_invalid_options_are_rejected(model: Decoder) -> None:
    for options, field in (
        ({"block_size": 0}, "block_size"),
        ({"steps_per_block": 0}, "steps_per_block"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": 0}, "top_k"),
    ):
        with pytest.raises(ValueError, match=field):
            GenerationConfig(**options)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^steps_per_block 5 exceeds block_size 4: .* \(use 1 to 4\)$"):
        GenerationConfig(block_size=4, steps_per_block=5)  # never silently fewer steps than asked
    with pytest.raises(ValueError, match="non-empty prompt"):
        run(model, [], token_shift=True)
    with pytest.raises(ValueError, match="mask token"):
        run(model, [1, MASK])
    # an EOS the sampler can never produce (outside the vocabulary, or the never-proposed mask)
    # silently meant "never stop at EOS"
    for eos_id in (-1, 64, 10**6, MASK):
        with pytest.raises(ValueError, match="eos_id"):
            run(model, [1, 2], eos_id=eos_id)


# ----------------------------------------------------------------------------- token choice


def test_proposals_respect_top_k_top_p_and_exclude_the_mask() -> None:
    logits_RV = torch.tensor([[0.0, 3.0, 2.0, 1.0, 9.0]]).repeat(400, 1)  # id 4 plays the mask
    generator = torch.Generator().manual_seed(0)
    tokens, _ = propose_tokens(logits_RV, mask_token_id=4, temperature=1.0, top_k=2, generator=generator)
    assert set(tokens.tolist()) == {1, 2}
    # p(1) = 0.644, p(2) = 0.237: the nucleus of mass 0.7 is {1, 2}; of mass 0.5 only {1}
    tokens, confidence = propose_tokens(
        logits_RV, mask_token_id=4, temperature=1.0, top_p=0.5, generator=generator
    )
    assert set(tokens.tolist()) == {1} and torch.allclose(confidence, torch.ones(400))
    tokens, _ = propose_tokens(logits_RV, mask_token_id=4, temperature=1.0, top_p=0.7, generator=generator)
    assert set(tokens.tolist()) == {1, 2}
    tokens, confidence = propose_tokens(logits_RV[:1], mask_token_id=4)
    expected = torch.softmax(torch.tensor([0.0, 3.0, 2.0, 1.0]), dim=0)[1]
    assert tokens.tolist() == [1] and abs(float(confidence[0]) - float(expected)) < 1e-6


def test_positions_used_end_at_the_block_after_the_last_new_token(model: Decoder) -> None:
    assert [positions_used(p, n, BLOCK) for p, n in ((5, 3), (5, 4), (0, 1), (3, 18))] == [8, 12, 4, 24]
    for prompt_len in (0, 3, 8):
        result = run(model, list(range(1, prompt_len + 1)), max_new_tokens=9)
        assert result.block_starts[-1] + BLOCK == positions_used(prompt_len, 9, BLOCK)


def test_unmask_schedule() -> None:
    assert [unmask_count(r, s) for r, s in ((16, 16), (16, 3), (5, 2), (1, 4))] == [1, 6, 3, 1]
    confidence = torch.tensor([0.1, 0.9, 0.5, 0.95, 0.2])
    assert choose_unmasked(confidence, remaining_steps=3).tolist() == [3, 1]
    assert choose_unmasked(confidence, remaining_steps=5, threshold=0.4).tolist() == [3, 1, 2]
    assert choose_unmasked(confidence, remaining_steps=1).tolist() == [3, 1, 2, 4, 0]


# ----------------------------------------------------------------------------- CLI


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
    with pytest.raises(ValueError, match="block-size"):
        args = parse(["generate", "--model", str(checkpoint), "--block-size", "0", *base])
        args.func(args)
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
        seen.append(list(prompt_ids))
        return real_generate(model, prompt_ids, **options)  # type: ignore[arg-type]

    real_generate = sampler.generate
    monkeypatch.setattr(sampler, "generate", recording_generate)
    assert parse(argv).func(parse(argv)) == 0
    tokenizer = load_tokenizer(final)
    assert seen == [tokenizer.encode("<user>the fox</user><assistant>")]
    assert "completion: " in capsys.readouterr().out


@pytest.mark.parametrize("temperature", [1e-40, 1e-320])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_tiny_positive_temperature_samples_the_argmax_instead_of_crashing(
    temperature: float, dtype: torch.dtype
) -> None:
    # logits / 1e-40 overflow float32 (1e-320 overflows float64): inf - inf in the softmax was nan
    # and torch.multinomial raised; the limit temperature -> 0 is the arg-max.
    logits_RV = torch.tensor([[0.5, 3.0, -2.0, 1.0, 9.0], [-1.0, -3.0, -0.5, -4.0, 0.0]], dtype=dtype)
    generator = torch.Generator().manual_seed(0)
    for top_k, top_p in ((None, 1.0), (2, 1.0), (None, 0.9)):
        tokens, confidence = propose_tokens(
            logits_RV, mask_token_id=4, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator
        )
        assert tokens.tolist() == [1, 2]
        assert torch.equal(confidence, torch.ones(2, dtype=confidence.dtype))
