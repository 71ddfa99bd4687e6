"""Scores of sampled completions (csbp.evaluation.sample_scores, ``csbp generate --scorer``).

* The generative perplexity is the scorer's NLL of the completion's tokens given the prompt, as
  transformers' own model computes it from the exported directory (float64; 1e-6: transformers builds its RoPE tables in float32), the prompt encoded
  as ``tokenizer(prompt)`` does (a post-processor's BOS kept) and the completion without specials.
* With no context at all the first completion token is not scored (nothing predicts it).
* The entropy is bd3lms' unigram entropy of the sampled ids; several completions pool NLL over tokens.
* Refused in one line: a scorer without tokenizer.json, a context past its positions (a csbp export's
  trained rows), a csbp export of a block-diffusion or windowed run, ``--chat``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

from csbp.cli import generate_cmd, generate_draws
from csbp.data.tokenizer import train_bpe_tokenizer
from csbp.evaluation.sample_scores import CompletionScore, SampleScorer, pooled, unigram_entropy
from csbp.models.hf_io import export_hf_checkpoint
from test_generate_cli import export_tiny_run
from test_generation import tiny_model

TEXTS = ["the quick brown fox jumps over the lazy dog", "block diffusion samples blocks"] * 4


def export_scorer(directory: Path, *, bos: bool, max_positions: int = 512) -> Path:
    """A tiny float64 causal LM with a BPE tokenizer, whose post-processor adds ``<|bos|>`` if ``bos``."""
    tokenizer = train_bpe_tokenizer(TEXTS, vocab_size=300)
    if bos:
        bos_id = tokenizer.backend.token_to_id("<|endoftext|>")
        tokenizer.backend.post_processor = processors.TemplateProcessing(
            single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", bos_id)]
        )
        tokenizer.json_bytes = tokenizer.backend.to_str().encode()
    source = directory.parent / f"{directory.name}-tokenizer"
    source.mkdir(parents=True)
    tokenizer.save(source)
    model = tiny_model(vocab_size=tokenizer.vocab_size, seed=3)
    return export_hf_checkpoint(
        model, model.config, directory, tokenizer_dir=source, dtype=torch.float64,
        extra_config={"max_position_embeddings": max_positions},
    )


@pytest.fixture(scope="module")
def scorer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_scorer(tmp_path_factory.mktemp("scorer") / "bos", bos=True)


def transformers_nll(directory: Path, ids: list[int], first: int) -> float:
    """The summed NLL of ``ids[first:]`` under transformers' own model of ``directory``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float64).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    log_probs = torch.log_softmax(logits[first - 1 : len(ids) - 1], dim=-1)
    return float(-log_probs.gather(-1, torch.tensor(ids[first:])[:, None]).sum())


def test_the_perplexity_is_the_scorers_nll_of_the_completion_given_the_prompt(scorer_dir: Path) -> None:
    scorer = SampleScorer(scorer_dir, dtype=None, device="cpu")
    bos = scorer.tokenizer.token_to_id("<|endoftext|>")
    context = scorer.context_ids("the quick")
    assert context[0] == bos and context[1:] == scorer.tokenizer.encode("the quick", add_special_tokens=False).ids
    completion = " brown fox jumps over"
    target = scorer.tokenizer.encode(completion, add_special_tokens=False).ids
    score = scorer.score("the quick", completion, [5, 5, 7])
    assert score.tokens == len(target) >= 3
    expected = transformers_nll(scorer_dir, context + target, len(context))
    assert score.nll_sum == pytest.approx(expected, rel=1e-6)
    assert score.perplexity == pytest.approx(math.exp(expected / len(target)), rel=1e-6)
    assert score.entropy == pytest.approx(-(2 / 3) * math.log(2 / 3) - (1 / 3) * math.log(1 / 3))
    empty_prompt = scorer.score("", completion, [1])  # the BOS alone predicts the first token
    assert empty_prompt.tokens == len(target)
    assert empty_prompt.nll_sum == pytest.approx(transformers_nll(scorer_dir, [bos, *target], 1), rel=1e-6)


def test_the_completion_is_tokenized_inside_the_joint_text(tmp_path: Path) -> None:
    """A Llama-2-style tokenizer (a ``▁`` prepended to the text, spaces as ``▁``) reads " brown" alone as
    ``▁ ▁brown``: encoded apart, the completion would score a ``▁`` token the joint text does not have."""
    vocab = {"[UNK]": 0, "▁the": 1, "▁quick": 2, "▁brown": 3, "▁": 4, "▁fox": 5}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    source = tmp_path / "tokenizer"
    source.mkdir()
    backend.save(str(source / "tokenizer.json"))
    model = tiny_model(vocab_size=8, seed=3)
    directory = export_hf_checkpoint(model, model.config, tmp_path / "scorer", tokenizer_dir=source, dtype=torch.float64)
    scorer = SampleScorer(directory, dtype=None, device="cpu")
    assert backend.encode(" brown fox").ids == [4, 3, 5]  # apart: a spurious ▁
    assert scorer.encode_pair("the quick", " brown fox") == ([1, 2], [1, 2, 3, 5])
    assert scorer.encode_pair("the quick ", "brown fox") == ([1, 2], [1, 2, 3, 5])  # the trailing space moves over
    score = scorer.score("the quick", " brown fox", [1])
    assert score.tokens == 2 and score.nll_sum == pytest.approx(transformers_nll(directory, [1, 2, 3, 5], 2), rel=1e-6)


def test_without_any_context_the_first_completion_token_is_not_scored(tmp_path: Path) -> None:
    scorer = SampleScorer(export_scorer(tmp_path / "plain", bos=False), dtype=None, device="cpu")
    assert scorer.context_ids("the quick") == scorer.tokenizer.encode("the quick", add_special_tokens=False).ids
    target = scorer.tokenizer.encode(" lazy dog", add_special_tokens=False).ids
    score = scorer.score("", " lazy dog", [1, 2])
    assert score.tokens == len(target) - 1
    assert score.nll_sum == pytest.approx(transformers_nll(tmp_path / "plain", target, 1), rel=1e-6)
    nothing = scorer.score("", "", [])
    assert (nothing.tokens, nothing.entropy) == (0, 0.0) and math.isnan(nothing.perplexity)
    assert "no completion token to score" in scorer.line(nothing)


@pytest.mark.parametrize(
    ("template", "kept"), [("<|endoftext|> $A <|endoftext|>", 1), ("$A <|endoftext|>", 0), ("<|endoftext|> $A", 1)]
)
def test_specials_after_the_prompt_are_dropped_also_for_an_empty_prompt(
    scorer_dir: Path, template: str, kept: int
) -> None:
    scorer = SampleScorer(scorer_dir, dtype=None, device="cpu")
    special = scorer.tokenizer.token_to_id("<|endoftext|>")
    scorer.tokenizer.post_processor = processors.TemplateProcessing(
        single=template, special_tokens=[("<|endoftext|>", special)]
    )
    plain = scorer.tokenizer.encode("the quick", add_special_tokens=False).ids
    assert scorer.context_ids("the quick") == [special] * kept + plain
    assert scorer.context_ids("") == [special] * kept  # an unconditional sample: no EOS before its first token


def test_entropy_is_bd3lms_unigram_entropy_and_completions_pool_over_tokens() -> None:
    assert unigram_entropy([4, 4, 4, 4]) == 0.0
    assert unigram_entropy([1, 2, 3, 4]) == pytest.approx(math.log(4))
    assert unigram_entropy([9, 9, 2, 3]) == pytest.approx(-0.5 * math.log(0.5) - 2 * 0.25 * math.log(0.25))
    both = pooled([CompletionScore(2.0, 1, 1.0), CompletionScore(6.0, 3, 2.0)])
    assert (both.nll, both.entropy) == (2.0, 1.5)  # 8 nats over 4 tokens, not the mean of 2 and 2
    assert both.perplexity == pytest.approx(math.exp(2.0))
    assert pooled([CompletionScore(2.0, 1, 1.25)]) == CompletionScore(2.0, 1, 1.25)  # one sample is itself
    huge = CompletionScore(800.0, 1, 0.0)  # exp(800) is past float range: inf, not an OverflowError traceback
    assert huge.perplexity == math.inf and generate_draws.score_record(huge)["perplexity"] is None


def test_scorers_that_cannot_score_are_refused_in_one_line(scorer_dir: Path, tmp_path: Path) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((scorer_dir / "config.json").read_text())
    with pytest.raises(ValueError, match=r"holds no tokenizer.json \(fix: a Hugging Face causal LM directory"):
        SampleScorer(bare, dtype=None, device="cpu")
    (bare / "tokenizer.json").write_text((scorer_dir / "tokenizer.json").read_text())
    (bare / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 300}))
    with pytest.raises(ValueError, match=r"^--scorer .*bare: unsupported architectures \['GPT2LMHeadModel'\] .* \(fix: a Qwen3, Qwen2"):
        SampleScorer(bare, dtype=None, device="cpu")  # bd3lms' GPT-2: the option named, and what to pass instead
    small = tmp_path / "small"
    shutil.copytree(scorer_dir, small)
    config = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": 10}))
    with pytest.raises(ValueError, match=r"its tokenizer has \d+ tokens, its model's vocabulary 10 \(fix: the tokenizer.json"):
        SampleScorer(small, dtype=None, device="cpu")  # refused before the weights (shaped for another vocabulary) load
    vocab = SampleScorer(scorer_dir, dtype=None, device="cpu").tokenizer.get_vocab_size(with_added_tokens=True)
    (small / "config.json").write_text(json.dumps({**config, "vocab_size": vocab - 1}))
    with pytest.raises(ValueError, match=rf"its tokenizer has {vocab} tokens, its model's vocabulary {vocab - 1} "):
        SampleScorer(small, dtype=None, device="cpu")  # one token past it is enough
    short = SampleScorer(export_scorer(tmp_path / "short", bos=True, max_positions=4), dtype=None, device="cpu")
    with pytest.raises(ValueError, match=r"past the 4 positions it may use of .*config.json \(fix: a lower --max-new-tokens"):
        short.score("the quick", " brown fox jumps over the lazy dog", [1])


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"objective": {"name": "bd3", "block_size": 4}}, r"trained objective 'bd3', a block-diffusion model whose next-token"),
        ({"objective": {"name": "ar"}, "topology": {"window": 8}}, r"trained with topology.window 8, which the scorer"),
    ],
)
def test_a_csbp_export_that_is_no_full_attention_causal_lm_is_refused(
    scorer_dir: Path, tmp_path: Path, record: dict, message: str
) -> None:
    copy = tmp_path / "scorer"
    shutil.copytree(scorer_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "csbp_training": record}))
    with pytest.raises(ValueError, match=message):
        SampleScorer(copy, dtype=None, device="cpu")


def test_a_csbp_ar_export_is_scored_only_inside_the_rows_it_trained_on(scorer_dir: Path, tmp_path: Path) -> None:
    copy = tmp_path / "scorer"
    shutil.copytree(scorer_dir, copy)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "csbp_training": {"objective": {"name": "ar"}, "data": {"seq_len": 6}}}))
    scorer = SampleScorer(copy, dtype=None, device="cpu")
    assert scorer.score("the", " quick", [1]).tokens >= 1
    with pytest.raises(ValueError, match=r"past the 6 positions it may use \(the rows it trained on, data.seq_len of "):
        scorer.score("the quick", " brown fox jumps over the lazy dog", [1])
    text = " quick brown fox jumps over the lazy dog"
    fitting = next(  # a context and completion of exactly the 6 trained positions is scored
        text[:end] for end in range(len(text) + 1)
        if len(scorer.context_ids("the") + scorer.tokenizer.encode(text[:end], add_special_tokens=False).ids) == 6
    )
    assert scorer.score("the", fitting, [1]).tokens == 4


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="csbp")
    generate_cmd.register(parser.add_subparsers(dest="command"))
    return parser.parse_args(argv)


def test_generate_scores_every_sample_and_pools_them(
    scorer_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = export_tiny_run(tmp_path / "run")
    argv = ["generate", "--model", str(checkpoint), "--prompt", "the quick", "--device", "cpu", "--scorer", str(scorer_dir)]
    argv += "--max-new-tokens 8 --block-size 4 --temperature 1 --samples 3".split()
    args = parse([*argv, "--json", str(tmp_path / "samples.json"), "--known-words", "demo-corpus"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    completions = re.findall(r"completion \(seed \d\): (.*)", out)
    rows = [tuple(map(float, m)) for m in re.findall(r"gen ppl under \S+: ([\d.]+) \(nll ([\d.]+) nats/token over (\d+) tokens\)", out)]
    assert len(completions) == len(rows) == 3
    scorer = SampleScorer(scorer_dir, dtype=None, device="cpu")
    for completion, (_, nll, tokens) in zip(completions, rows, strict=True):
        expected = scorer.score("the quick", completion, [0])
        assert (nll, tokens) == (pytest.approx(expected.nll, abs=6e-5), expected.tokens)
    total = re.search(r"over 3 samples: ([\d.]+) \(nll ([\d.]+) nats/token over (\d+) tokens\); mean unigram entropy", out)
    assert total is not None and int(total[3]) == sum(int(r[2]) for r in rows)
    assert float(total[2]) == pytest.approx(sum(r[1] * r[2] for r in rows) / int(total[3]), abs=1e-4)
    report = json.loads((tmp_path / "samples.json").read_text())
    assert [r["completion"] for r in report["samples"]] == completions and [r["seed"] for r in report["samples"]] == [0, 1, 2]
    assert all(r["score"]["nll"] == pytest.approx(row[1], abs=6e-5) for r, row in zip(report["samples"], rows, strict=True))
    assert report["scorer"]["tokens"] == int(total[3]) and report["scorer"]["nll"] == pytest.approx(float(total[2]), abs=6e-5)
    assert (report["settings"]["block_size"], report["settings"]["temperature"], report["objective"]) == (4, 1.0, "bd3")
    assert all(len(r["token_ids"]) <= 8 and r["stopped_at"] in ("eos", "max_new_tokens") for r in report["samples"])
    printed = re.findall(r"\[bd3, (\d+) tokens, (\d+) blocks? of 4, (\d+) denoising steps?, stopped at (\S+), ", out)
    words = [tuple(map(int, m)) for m in re.findall(r"words found in demo-corpus: (\d+)/(\d+)", out)]
    for r, (tokens, blocks, steps, stop), (known, total) in zip(report["samples"], printed, words, strict=True):
        assert (len(r["token_ids"]), r["blocks"], r["denoising_steps"]) == (int(tokens), int(blocks), int(steps))
        assert r["stopped_at"] == {"EOS": "eos", "max-new-tokens": "max_new_tokens"}[stop]
        assert r["known_words"] == {"known": known, "total": total}
        assert r["score"]["nll_sum"] == pytest.approx(r["score"]["nll"] * r["score"]["tokens"])
        assert r["score"]["unigram_entropy"] == pytest.approx(unigram_entropy(r["token_ids"]))
    assert report["known_words"] == {"source": "demo-corpus", "known": sum(k for k, _ in words), "total": sum(t for _, t in words)}
    entropies = [r["score"]["unigram_entropy"] for r in report["samples"]]
    assert report["scorer"]["unigram_entropy"] == pytest.approx(sum(entropies) / 3)
    assert generate_draws.score_record(CompletionScore(0.0, 0, 0.0))["perplexity"] is None  # JSON has no NaN
    chat = parse([*argv, "--chat"])
    with pytest.raises(ValueError, match=r"^--scorer with --chat: .* \(fix: drop --chat or --scorer\)$"):
        chat.func(chat)
