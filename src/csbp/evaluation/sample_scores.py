"""Quality scores of sampled completions: generative perplexity under an autoregressive scorer, and
the completion's unigram entropy (``csbp generate --scorer DIR``).

Likelihood bounds (``csbp eval``) say how well a diffusion model fits data; they say nothing of its
samples. Masked and block diffusion papers (MDLM, BD3-LMs) therefore also score what the sampler
writes: the **generative perplexity** of samples under a fixed autoregressive model (GPT-2 Large in
bd3lms), next to their **unigram entropy**, since a sampler that repeats a few likely tokens reaches a
low perplexity with degenerate text. Both are needed to read either.

What is computed, per completion:

* the scorer reads the completion's *text* with its own ``tokenizer.json`` (the diffusion model's
  tokenizer may differ; bd3lms retokenizes likewise), after the prompt's text as context: prompt and
  completion are encoded as one text, as transformers' ``tokenizer(text)`` does (with the special
  tokens its post-processor puts before the text, such as Llama's BOS; none after it), and the
  completion's tokens are those after the prompt's own (lm-evaluation-harness' ``_encode_pair``, the
  prompt's trailing whitespace moved to the completion); the NLL is summed over them only, each predicted
  from everything before it under causal attention (an empty context leaves the first completion
  token unscored: nothing predicts it, as in bd3lms, which scores from the second token). The
  completion ends before its EOS, so the EOS is not scored (bd3lms scores up to its first EOS).
* the unigram entropy ``-sum_v p_v ln p_v`` (nats) of the completion's token ids in the diffusion
  model's own tokenizer, ``p_v`` the share of id ``v`` (bd3lms' ``_compute_entropy``).

Over several completions the generative perplexity is ``exp(sum NLL / sum tokens)``, pooled over
tokens as torchmetrics' ``Perplexity`` accumulates it in bd3lms, and the entropy the mean per
completion. The scorer is any local Hugging Face causal LM directory csbp reads (safetensors weights,
a family of :mod:`csbp.models.hf_config`), loaded with no remote code; a context past its
``max_position_embeddings`` (or, for a csbp export, past the ``data.seq_len`` it trained on) is refused
in one line rather than scored out of range, and so is a csbp export of a block-diffusion or windowed run.

:class:`KnownWords` is the cheap check for models too small for any scorer (``--known-words``): the
share of a completion's words that occur in a text, such as the corpus a toy model was trained on.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from csbp.models.attention_fns import CausalAttention
from csbp.models.decoder import Decoder


@dataclass(frozen=True)
class CompletionScore:
    """The scorer's summed NLL over ``tokens`` completion tokens, and the completion's unigram entropy."""

    nll_sum: float
    tokens: int
    entropy: float

    @property
    def nll(self) -> float:
        """Mean NLL per scored token (nats; NaN when no token was scored)."""
        return self.nll_sum / self.tokens if self.tokens else math.nan

    @property
    def perplexity(self) -> float:
        """``exp(nll)``: NaN when no token was scored, inf past float range (a mean NLL above ~709 nats)."""
        if not self.tokens:
            return math.nan
        return math.exp(self.nll) if self.nll < 700 else math.inf


def unigram_entropy(token_ids: Sequence[int]) -> float:
    """``-sum_v p_v ln p_v`` over the ids' frequencies (nats); 0 for no ids."""
    if not token_ids:
        return 0.0
    _, counts = torch.unique(torch.tensor(list(token_ids)), return_counts=True)
    shares = counts.double() / counts.sum()
    return float(torch.special.entr(shares).sum())


def pooled(scores: Sequence[CompletionScore]) -> CompletionScore:
    """The completions' NLLs and tokens summed and their entropies averaged (module docstring)."""
    return CompletionScore(
        nll_sum=sum(s.nll_sum for s in scores),
        tokens=sum(s.tokens for s in scores),
        entropy=sum(s.entropy for s in scores) / max(len(scores), 1),
    )


class SampleScorer:
    """An autoregressive model that scores completions (module docstring); loaded once, used for all."""

    def __init__(self, directory: Path, *, dtype: torch.dtype | None, device: torch.device | str) -> None:
        from csbp.generation.run_settings import position_limit
        from csbp.models.hf_io import load_hf_checkpoint, read_hf_config

        tokenizer_file = directory / "tokenizer.json"
        if not (directory / "config.json").is_file() or not tokenizer_file.is_file():
            missing = "config.json" if not (directory / "config.json").is_file() else "tokenizer.json"
            raise ValueError(
                f"--scorer {directory}: holds no {missing} (fix: a Hugging Face causal LM directory with "
                "config.json, safetensors weights and tokenizer.json)"
            )
        try:
            self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the tokenizers library raises a bare Exception for a malformed file
            raise ValueError(f"--scorer {tokenizer_file}: not a tokenizer file the tokenizers library reads ({exc})") from None
        self.directory = directory
        self.max_positions, self._limit_source = position_limit(directory)
        self._check_trained_causally(directory)
        try:
            model_vocab = read_hf_config(directory).vocab_size
        except ValueError as error:  # such as GPT-2's config, the scorer of bd3lms: name the option and a fix
            fix = "" if "(fix:" in str(error) else " (fix: a Qwen3, Qwen2, Llama or Mistral causal LM directory)"
            raise ValueError(f"--scorer {directory}: {error}{fix}") from None
        vocab = self.tokenizer.get_vocab_size(with_added_tokens=True)
        if vocab > model_vocab:  # before the weights load
            raise ValueError(
                f"--scorer {directory}: its tokenizer has {vocab} tokens, its model's vocabulary {model_vocab} "
                "(fix: the tokenizer.json the model was trained with)"
            )
        self.model: Decoder = load_hf_checkpoint(directory, dtype=dtype, device=device)[0].eval()
        self.device = torch.device(device)

    def _check_trained_causally(self, directory: Path) -> None:
        """Refuse a csbp export that is not a full-attention causal LM (a block-diffusion model never trained
        its next-token predictions; a windowed one would be scored with full attention), and lower the
        position limit to the rows it trained on (:func:`csbp.generation.run_settings.training_record`)."""
        from csbp.generation.run_settings import TOKEN_SHIFT_OBJECTIVES, training_record

        found = training_record(directory)
        if found is None:
            return
        record, source = found
        objective = record.get("objective") if isinstance(record.get("objective"), dict) else {}
        name = objective.get("name")
        if name in TOKEN_SHIFT_OBJECTIVES:
            raise ValueError(
                f"--scorer {directory}: {source} trained objective {name!r}, a block-diffusion model whose next-token "
                "predictions were never trained (fix: an autoregressive model, such as a csbp 'ar' run's final/ or a "
                "pretrained causal LM)"
            )
        topology = record.get("topology") if isinstance(record.get("topology"), dict) else {}
        if topology.get("window") is not None:
            raise ValueError(
                f"--scorer {directory}: {source} trained with topology.window {topology['window']}, which the scorer's "
                "full causal attention would not reproduce (fix: a scorer trained with full attention)"
            )
        data = record.get("data") if isinstance(record.get("data"), dict) else {}
        if type(data.get("seq_len")) is int and data["seq_len"] < self.max_positions:
            self.max_positions, self._limit_source = data["seq_len"], f"(the rows it trained on, data.seq_len of {source})"

    def context_ids(self, prompt: str) -> list[int]:
        """The prompt as transformers' ``tokenizer(prompt)`` encodes it, less special tokens after the text."""
        plain = self.tokenizer.encode(prompt, add_special_tokens=False).ids
        if not plain:  # no text to tell the specials before it from those after (BOS, EOS): a probe's leading ones
            probe = self.tokenizer.encode("a", add_special_tokens=False).ids
            return self.context_ids("a")[: -len(probe)] if probe else []
        special = self.tokenizer.encode(prompt, add_special_tokens=True).ids
        leading = len(special) - len(plain)
        if leading > 0 and special[leading:] == plain:
            return list(special)
        for start in range(len(special) - len(plain) + 1):  # specials after the text as well: keep those before
            if special[start : start + len(plain)] == plain:
                return list(special[: start + len(plain)])
        return list(plain)

    def encode_pair(self, prompt: str, completion: str) -> tuple[list[int], list[int]]:
        """``(context, ids)``: the prompt's tokens and those of prompt and completion encoded as one text, as
        lm-evaluation-harness' ``_encode_pair`` does (the prompt's trailing whitespace moves to the completion;
        the completion is what follows the prompt's tokens). Encoded apart, a tokenizer that marks word starts
        (SentencePiece's ``▁``: Llama 2, Mistral) would read the completion's first word as the start of a text
        and score a token the joint text does not have."""
        spaces = len(prompt) - len(prompt.rstrip())
        if spaces:
            prompt, completion = prompt[:-spaces], prompt[-spaces:] + completion
        return self.context_ids(prompt), self.context_ids(prompt + completion)

    @torch.no_grad()
    def score(self, prompt: str, completion: str, completion_ids: Sequence[int]) -> CompletionScore:
        """Score ``completion`` (text) after ``prompt``; ``completion_ids``: its ids in the sampled model's
        tokenizer, for the entropy."""
        context, ids = self.encode_pair(prompt, completion)
        if len(ids) > self.max_positions:
            raise ValueError(
                f"--scorer {self.directory}: prompt and completion are {len(ids)} of its tokens, past the "
                f"{self.max_positions} positions it may use {self._limit_source} (fix: a lower --max-new-tokens "
                "or a shorter prompt)"
            )
        entropy = unigram_entropy(completion_ids)
        first = max(len(context), 1)  # the first position with a token before it to predict from
        if first >= len(ids):
            return CompletionScore(0.0, 0, entropy)
        input_ids = torch.tensor([ids], device=self.device)
        hidden = self.model(input_ids, torch.arange(len(ids), device=self.device), CausalAttention())
        logits = self.model.logits(hidden[0, first - 1 : len(ids) - 1]).double()
        nll = F.cross_entropy(logits, input_ids[0, first:], reduction="sum")
        return CompletionScore(float(nll), len(ids) - first, entropy)

    def line(self, score: CompletionScore, *, samples: int = 1) -> str:
        """``gen ppl under DIR: P (nll N nats/token over T tokens), unigram entropy E nats`` (``over S samples``,
        ``mean unigram entropy`` for pooled scores)."""
        over = f" over {samples} samples" if samples > 1 else ""
        mean = "mean " if samples > 1 else ""
        if score.tokens == 0:
            return f"gen ppl under {self.directory}{over}: no completion token to score; {mean}unigram entropy {score.entropy:.3f} nats"
        return (
            f"gen ppl under {self.directory}{over}: {score.perplexity:.2f} (nll {score.nll:.4f} nats/token over "
            f"{score.tokens} tokens); {mean}unigram entropy {score.entropy:.3f} nats"
        )


@dataclass(frozen=True)
class KnownWords:
    """The words of ``--known-words`` (a text file or ``demo-corpus``), read before any sampling."""

    source: str
    words: set[str]

    @classmethod
    def load(cls, source: str) -> KnownWords:
        from csbp.data.corpus import corpus_words, demo_corpus_files

        if source == "demo-corpus":
            files = demo_corpus_files()
        elif Path(source).is_file():
            files = [Path(source)]
        else:
            raise ValueError(f"--known-words {source}: not a text file (fix: pass a text file or demo-corpus)")
        return cls(source, corpus_words(files))

    def count(self, completion: str) -> tuple[int, int]:
        """``(known, total)`` of the completion's whitespace-separated words."""
        from csbp.data.corpus import known_word_fraction

        return known_word_fraction(completion, self.words)

    def line(self, known: int, total: int, *, samples: int = 1) -> str:
        """``words found in <source>: k/n (p%)`` for ``known`` of ``total`` words of a completion
        (``... in <source> over N samples: ...`` for those of ``samples`` completions)."""
        over = f" over {samples} samples" if samples > 1 else ""
        return f"words found in {self.source}{over}: {known}/{total} ({100.0 * known / max(total, 1):.1f}%)"
