"""``csbp generate``'s draws: every (prompt, seed) request in batches of ``--batch-size``, each completion
printed with its counts and scores, and the ``--json`` report.

Requests run prompt by prompt (the order of ``--prompts``), each with seeds ``--seed .. --seed +
--samples - 1``; a batch may hold samples of several prompts (``csbp.generation.generate_batch`` runs
each at its own positions), and each is the completion that prompt and seed give alone. ``--prompts``
is a JSONL file of ``{"prompt": text}`` lines, as ``csbp dflash eval --prompts`` reads.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from csbp.wording import counted

if TYPE_CHECKING:
    from csbp.data.tokenizer import CsbpTokenizer
    from csbp.evaluation.sample_scores import CompletionScore, KnownWords, SampleScorer
    from csbp.generation.sampler import GenerationConfig, GenerationResult
    from csbp.models.decoder import Decoder


@dataclass(frozen=True)
class Prompt:
    """One prompt: its text (as given), where it came from (``--prompt`` or ``FILE:LINE``) and its ids."""

    text: str
    where: str
    ids: list[int]


def read_prompt_file(path: Path) -> list[tuple[str, str]]:
    """``(text, "FILE:LINE")`` of every prompt of a ``--prompts`` JSONL file (:mod:`csbp.data.prompt_file`)."""
    from csbp.data.prompt_file import read_prompt_lines

    return [(line.text, line.where) for line in read_prompt_lines(path)]


@dataclass
class Draws:
    """What the draws produced: one ``--json`` record per completion, the pooled known-word counts and
    every completion's score."""

    records: list[dict[str, Any]] = field(default_factory=list)
    known_words: list[int] = field(default_factory=lambda: [0, 0])
    scores: list[CompletionScore] = field(default_factory=list)


def draw_all(
    model: Decoder,
    prompts: list[Prompt],
    *,
    seeds: range,
    batch_size: int,
    config: GenerationConfig,
    mask_token_id: int,
    stop_ids: list[int],
    tokenizer: CsbpTokenizer,
    objective: str,
    device: str,
    known_words: KnownWords | None,
    scorer: SampleScorer | None,
) -> Draws:
    """Draw, print and record every completion (module docstring); a ``prompt:`` line heads each prompt's."""
    from csbp.generation.sampler import generate_batch

    requests = [(index, seed) for index in range(len(prompts)) for seed in seeds]
    draws = Draws()
    batch_size = min(batch_size, len(requests))
    for first in range(0, len(requests), batch_size):
        batch = requests[first : first + batch_size]
        started = time.perf_counter()
        results = generate_batch(
            model, [prompts[index].ids for index, _ in batch], mask_token_id=mask_token_id, eos_id=stop_ids,
            config=config, seeds=[seed for _, seed in batch],
        )  # fmt: skip
        elapsed = time.perf_counter() - started
        timing = f"{elapsed:.2f} s" + (f" for a batch of {len(batch)}" if batch_size > 1 else "")
        for (index, seed), result in zip(batch, results, strict=True):
            prompt = prompts[index]
            if seed == seeds[0]:
                print(f"prompt: {prompt.text}")
            completion = tokenizer.decode(result.token_ids)
            print(f"completion{f' (seed {seed})' if len(seeds) > 1 else ''}: {completion}")
            stop = "EOS" if result.stopped_at_eos else "max-new-tokens"
            print(
                f"[{objective}, {counted(len(result.token_ids), 'token')}, {counted(len(result.block_starts), 'block')} of "
                f"{config.block_size}, {counted(len(result.unmask_steps), 'denoising step')}, "
                f"{'window ' + str(config.window) + ', ' if config.window else ''}stopped at {stop}, "
                f"{timing} on {device}]"
            )
            record = sample_record(seed, completion, result, elapsed, batch=first // batch_size)
            if len(prompts) > 1:
                record = {"prompt_index": index, **record}
            if known_words is not None:
                counts = known_words.count(completion)
                draws.known_words = [draws.known_words[0] + counts[0], draws.known_words[1] + counts[1]]
                print(known_words.line(*counts))
                record["known_words"] = {"known": counts[0], "total": counts[1]}
            if scorer is not None:
                draws.scores.append(scorer.score(prompt.text, completion, result.token_ids))
                print(scorer.line(draws.scores[-1]))
                record["score"] = score_record(draws.scores[-1])
            draws.records.append(record)
    return draws


def sample_record(seed: int, completion: str, result: GenerationResult, seconds: float, *, batch: int) -> dict[str, Any]:
    """One completion of ``--json``: ``batch`` numbers the batch it was drawn in (0, 1, ...), ``seconds``
    is that batch's wall time."""
    return {
        "seed": seed, "completion": completion, "token_ids": list(result.token_ids),
        "stopped_at": "eos" if result.stopped_at_eos else "max_new_tokens", "blocks": len(result.block_starts),
        "denoising_steps": len(result.unmask_steps), "batch": batch, "seconds": round(seconds, 4),
    }


def score_record(score: CompletionScore) -> dict[str, Any]:
    """A ``CompletionScore`` (or the pooled one) for ``--json``: null where nothing was scored or a value is not
    finite (JSON has no NaN or Infinity)."""

    def finite(value: float) -> float | None:
        return value if math.isfinite(value) else None

    return {
        "tokens": score.tokens, "nll_sum": finite(score.nll_sum), "nll": finite(score.nll),
        "perplexity": finite(score.perplexity), "unigram_entropy": score.entropy,
    }


def generation_settings(config: GenerationConfig) -> dict[str, Any]:
    """The ``GenerationConfig`` fields of ``--json`` (the seed is each sample's)."""
    return {key: value for key, value in asdict(config).items() if key != "seed"}
