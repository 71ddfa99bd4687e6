"""Drafter evaluation: acceptance length, its histogram, target-forward savings and a lossless check
over a set of prompts (objectives.md §7, the metric of the DFlash paper and of z-lab's benchmark).

Per prompt :func:`evaluate_drafter` runs :func:`csbp.dflash.speculative.speculative_generate` and,
with ``check_lossless``, the target's plain greedy decoding, and compares them token for token.

* **acceptance length**: the mean over prompts of each prompt's mean ``τ_r`` (prompts without a
  verify round, e.g. EOS straight after the prefill, are left out);
* **histogram**: how many rounds accepted ``τ = 1 … B`` tokens;
* **per-position acceptance** ``α_k`` (``k = 1 … B−1``): the fraction of verify rounds whose
  ``k``-th draft was accepted (``τ_r >= k + 1``). ``1 + Σ_k α_k`` is the round-weighted mean ``τ``;
  the conditional rate ``α_k / α_{k−1}`` is how often draft ``k`` survives once ``k − 1`` did;
* **target forwards**: speculative ``1 + rounds`` per prompt versus plain greedy's one per new token
  (the same tokens, so the same count as the kept output); ``reduction`` is their ratio;
* wall-clock seconds of both loops (informational: on a CPU with tiny models drafting costs as
  much as verifying).

The same numbers are what training validation reports for a DFlash run (``val_acceptance_length``,
``val_accept_rate_k``) and what ``csbp compare`` plots: :func:`split_acceptance` runs this
evaluation on the first rows of a split with the defaults of ``csbp dflash eval``
(:data:`DEFAULT_NUM_PROMPTS` prompts of :data:`DEFAULT_PROMPT_LEN` tokens, :data:`DEFAULT_MAX_NEW_TOKENS`
new tokens, the artifact's EOS), so a run's last validation equals ``csbp dflash eval`` of its export.
Training validation stays greedy (temperature 0): deterministic, so two validations differ only by
the weights, and comparable with ``csbp dflash eval``'s default. ``csbp dflash eval --temperature T``
measures speculative sampling (``sampling``; :mod:`csbp.dflash.sampling`) with a seeded generator.

Prompts come from a prepared artifact (:func:`artifact_prompts`: the first ``P`` tokens of rows of
a split; one group per context length with ``csbp dflash eval --context-lengths``) or a JSONL file of ``{"prompt": text, "group": name}`` lines (:func:`jsonl_prompts`; the
group is optional and only groups the printed tables).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from csbp.data.artifact import ArtifactSplit
from csbp.dflash.drafter import DFlashDrafter
from csbp.dflash.sampling import Sampling
from csbp.dflash.speculative import StopIds, greedy_generate, speculative_generate
from csbp.models.decoder import Decoder
from csbp.wording import counted

DEFAULT_NUM_PROMPTS = 8
DEFAULT_PROMPT_LEN = 64
DEFAULT_MAX_NEW_TOKENS = 64


@dataclass(frozen=True)
class EvalPrompt:
    """One prompt: a display ``name``, its ``group`` and its token ids."""

    name: str
    group: str
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class PromptEval:
    """Results of one prompt (``greedy_tokens`` is None without the lossless check)."""

    prompt: EvalPrompt
    tokens: list[int]
    acceptance_lengths: list[int]
    target_forwards: int
    spec_seconds: float
    greedy_tokens: list[int] | None
    greedy_seconds: float | None

    @property
    def rounds(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def mean_acceptance_length(self) -> float:
        return sum(self.acceptance_lengths) / self.rounds if self.rounds else float("nan")

    @property
    def greedy_forwards(self) -> int:
        """Plain greedy runs one target forward per new token."""
        return len(self.tokens)

    @property
    def lossless(self) -> bool | None:
        return None if self.greedy_tokens is None else self.greedy_tokens == self.tokens

    def first_mismatch(self) -> int | None:
        """Index of the first differing token (or the shorter length), None when equal/unchecked."""
        if self.greedy_tokens is None or self.greedy_tokens == self.tokens:
            return None
        for index, (a, b) in enumerate(zip(self.tokens, self.greedy_tokens)):
            if a != b:
                return index
        return min(len(self.tokens), len(self.greedy_tokens))


@dataclass(frozen=True)
class EvalSummary:
    """All prompts of one evaluation and the aggregate metrics (module docstring)."""

    block_size: int
    prompts: list[PromptEval]
    sampling: Sampling | None = None  # None: greedy speculative decoding
    seed: int | None = None  # of the generator that sampling drew from

    @property
    def acceptance_length(self) -> float:
        means = [p.mean_acceptance_length for p in self.prompts if p.rounds]
        return sum(means) / len(means) if means else float("nan")

    @property
    def histogram(self) -> list[int]:
        """Rounds with ``τ = 1 … B`` (index ``τ − 1``)."""
        counts = [0] * self.block_size
        for prompt in self.prompts:
            for tau in prompt.acceptance_lengths:
                counts[tau - 1] += 1
        return counts

    @property
    def position_acceptance(self) -> list[float]:
        """``α_k`` for ``k = 1 … B−1``: the fraction of verify rounds that accepted draft ``k``."""
        histogram = self.histogram
        rounds = sum(histogram)
        if not rounds:
            return [float("nan")] * (self.block_size - 1)
        return [sum(histogram[k:]) / rounds for k in range(1, self.block_size)]

    def metrics(self) -> dict[str, float]:
        """``acceptance_length`` and ``accept_rate_<k>`` (the names training validation logs)."""
        out = {"acceptance_length": self.acceptance_length}
        out.update({f"accept_rate_{k}": rate for k, rate in enumerate(self.position_acceptance, start=1)})
        return out

    @property
    def target_forwards(self) -> int:
        return sum(p.target_forwards for p in self.prompts)

    @property
    def greedy_forwards(self) -> int:
        return sum(p.greedy_forwards for p in self.prompts)

    @property
    def reduction(self) -> float:
        """Plain-greedy target forwards divided by speculative ones."""
        return self.greedy_forwards / self.target_forwards if self.target_forwards else float("nan")

    @property
    def mismatches(self) -> list[PromptEval]:
        return [p for p in self.prompts if p.lossless is False]


def evaluate_drafter(
    target: Decoder,
    drafter: DFlashDrafter,
    prompts: Sequence[EvalPrompt],
    *,
    max_new_tokens: int,
    eos_id: StopIds = None,
    check_lossless: bool = True,
    sampling: Sampling | None = None,
    seed: int = 0,
) -> EvalSummary:
    """Speculative decoding (and plain greedy with ``check_lossless``) of every prompt; with
    ``sampling``, speculative sampling drawing from one generator seeded with ``seed``, the prompts in
    order (no token-for-token check: a sampled output equals the target's only in distribution)."""
    if not prompts:
        raise ValueError("no prompts to evaluate: pass at least one prompt")
    if sampling is not None and check_lossless:
        raise ValueError("check_lossless compares with plain greedy decoding: it needs sampling=None")
    generator = None if sampling is None else torch.Generator().manual_seed(seed)
    results = []
    for prompt in prompts:
        started = time.perf_counter()
        spec = speculative_generate(
            target,
            drafter,
            prompt.token_ids,
            max_new_tokens=max_new_tokens,
            eos_id=eos_id,
            sampling=sampling,
            generator=generator,
        )
        spec_seconds = time.perf_counter() - started
        greedy_tokens, greedy_seconds = None, None
        if check_lossless:
            started = time.perf_counter()
            greedy_tokens = greedy_generate(
                target, prompt.token_ids, max_new_tokens=max_new_tokens, eos_id=eos_id
            ).tokens
            greedy_seconds = time.perf_counter() - started
        result = PromptEval(
            prompt,
            spec.tokens,
            spec.acceptance_lengths,
            spec.target_forwards,
            spec_seconds,
            greedy_tokens,
            greedy_seconds,
        )
        results.append(result)
    return EvalSummary(drafter.config.block_size, results, sampling, None if sampling is None else seed)


def split_acceptance(
    target: Decoder,
    drafter: DFlashDrafter,
    split: ArtifactSplit,
    *,
    eos_id: StopIds,
    num_prompts: int = DEFAULT_NUM_PROMPTS,
    prompt_len: int = DEFAULT_PROMPT_LEN,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    check_lossless: bool = False,
) -> EvalSummary:
    """:func:`evaluate_drafter` on the first rows of ``split`` (``csbp dflash eval --data`` defaults);
    the drafter is put in eval mode for the call and restored after."""
    prompts = artifact_prompts(
        split.tokens,
        split.doc_ids,
        num_prompts=num_prompts,
        prompt_len=min(prompt_len, int(split.tokens.shape[1]) - 1),
        group=split.name,
    )
    was_training = drafter.training
    drafter.eval()
    try:
        return evaluate_drafter(
            target, drafter, prompts, max_new_tokens=max_new_tokens, eos_id=eos_id, check_lossless=check_lossless
        )
    finally:
        drafter.train(was_training)


# ----------------------------------------------------------------------------- prompts


def artifact_prompts(
    tokens_RL: np.ndarray, doc_ids_RL: np.ndarray, *, num_prompts: int, prompt_len: int, group: str = "val"
) -> list[EvalPrompt]:
    """The first ``prompt_len`` tokens of the first ``num_prompts`` rows whose prefix holds no padding."""
    if num_prompts < 1 or prompt_len < 1:
        raise ValueError(f"num_prompts ({num_prompts}) and prompt_len ({prompt_len}) must be >= 1")
    num_rows, seq_len = tokens_RL.shape
    if num_rows == 0:
        raise ValueError(f"the artifact's {group} split has no rows; pick another --split")
    if prompt_len > seq_len:
        raise ValueError(f"--prompt-len {prompt_len} exceeds the artifact's seq_len {seq_len} (fix: --prompt-len {seq_len} or less)")
    prompts = []
    for row in range(num_rows):
        if (np.asarray(doc_ids_RL[row, :prompt_len]) < 0).any():
            continue
        ids = tuple(int(t) for t in np.asarray(tokens_RL[row, :prompt_len]))
        prompts.append(EvalPrompt(f"row {row}", group, ids))
        if len(prompts) == num_prompts:
            break
    if not prompts:
        raise ValueError(f"no row of the split has {prompt_len} unpadded tokens; lower --prompt-len")
    return prompts


def jsonl_prompts(
    path: Path,
    encode: Callable[[str], list[int]],
    *,
    num_prompts: int | None = None,
    prompt_len: int | None = None,
) -> list[EvalPrompt]:
    """Prompts of a JSONL file (``{"prompt": text}`` per line, optional ``"group"``), tokenized with
    ``encode``; ``prompt_len`` keeps the last tokens of longer prompts."""
    from csbp.data.prompt_file import read_prompt_lines

    prompts = []
    for line in read_prompt_lines(path):
        ids = encode(line.text)
        if not ids:
            raise ValueError(f"{line.where}: the prompt encodes to no tokens")
        if prompt_len is not None:
            ids = ids[-prompt_len:]
        prompts.append(EvalPrompt(f"line {line.number}", str(line.record.get("group", "prompts")), tuple(ids)))
        if num_prompts is not None and len(prompts) == num_prompts:
            break
    return prompts


# ----------------------------------------------------------------------------- report


def _fmt(value: float) -> str:
    return "nan" if math.isnan(value) else f"{value:.3f}"


def format_prompt_tables(summary: EvalSummary) -> str:
    """One table per prompt group: a row per prompt and the group's mean acceptance length."""
    lines = []
    header = (
        f"{'prompt':<12} {'P':>5} {'new':>5} {'rounds':>6} {'tau':>6} {'fwd spec':>8} {'fwd greedy':>10} "
        f"{'lossless':>8}"
    )
    groups = list(dict.fromkeys(p.prompt.group for p in summary.prompts))
    for group in groups:
        members = [p for p in summary.prompts if p.prompt.group == group]
        lines += [f"[{group}]", header, "-" * len(header)]
        for p in members:
            lossless = "-" if p.lossless is None else ("yes" if p.lossless else "NO")
            lines.append(
                f"{p.prompt.name:<12} {len(p.prompt.token_ids):>5} {len(p.tokens):>5} {p.rounds:>6} "
                f"{_fmt(p.mean_acceptance_length):>6} {p.target_forwards:>8} {p.greedy_forwards:>10} "
                f"{lossless:>8}"
            )
        group_summary = EvalSummary(summary.block_size, members)
        rates = " ".join(_fmt(rate) for rate in group_summary.position_acceptance)
        lines.append(
            f"group {group}: {counted(len(members), 'prompt')}, acceptance length {_fmt(group_summary.acceptance_length)}, "
            f"per-position acceptance [{rates}]"
        )
        lines.append("")
    return "\n".join(lines)


def format_report(summary: EvalSummary) -> str:
    """Tables, histogram, forward counts and timing; the last line is ``acceptance_length: <value>``."""
    lines = [format_prompt_tables(summary)]
    histogram = summary.histogram
    total = sum(histogram) or 1
    lines.append(f"acceptance histogram over {sum(histogram)} verify rounds (tau = accepted drafts + 1):")
    for tau, count in enumerate(histogram, start=1):
        lines.append(
            f"  tau={tau:<3} {count:>6}  {100.0 * count / total:5.1f}%  {'#' * round(40 * count / total)}"
        )
    rates = summary.position_acceptance
    plain = "greedy" if summary.sampling is None else "sampling"  # one target forward per token either way
    lines.append("acceptance rate per draft position (fraction of rounds accepting draft k):")
    lines.append("  " + "  ".join(f"k={k}: {_fmt(rate)}" for k, rate in enumerate(rates, start=1)))
    lines.append(
        f"target forwards: speculative {summary.target_forwards} vs plain {plain} {summary.greedy_forwards} "
        f"(reduction {summary.reduction:.2f}x)"
    )
    spec_s = sum(p.spec_seconds for p in summary.prompts)
    greedy = [p.greedy_seconds for p in summary.prompts if p.greedy_seconds is not None]
    if len(greedy) == len(summary.prompts):
        lines.append(
            f"wall time: speculative {spec_s:.2f} s vs plain greedy {sum(greedy):.2f} s "
            "(informational; tiny CPU models spend as long drafting as verifying)"
        )
        verdict = "FAILED" if summary.mismatches else "passed"
        identical = len(summary.prompts) - len(summary.mismatches)
        lines.append(f"lossless check {verdict}: {identical}/{len(summary.prompts)} identical")
    else:
        lines.append(f"wall time: speculative {spec_s:.2f} s (lossless check skipped)")
    if summary.sampling is not None:
        lines.append(
            f"speculative sampling at {sampling_label(summary.sampling)}, seed {summary.seed}: lossless in "
            "distribution (the target's own sampling), so no token-for-token check"
        )
    lines.append(f"acceptance_length: {_fmt(summary.acceptance_length)}")
    return "\n".join(lines)


def sampling_label(sampling: Sampling | None) -> str:
    """``temperature 1`` (``, top_k 50, top_p 0.9`` where set); ``temperature 0`` for greedy."""
    if sampling is None:
        return "temperature 0"
    cuts = [f"top_k {sampling.top_k}"] * (sampling.top_k is not None) + [f"top_p {sampling.top_p:g}"] * (sampling.top_p < 1)
    return ", ".join([f"temperature {sampling.temperature:g}", *cuts])


def _number(value: float) -> float | None:
    return None if math.isnan(value) else value


def summary_json(summary: EvalSummary) -> dict[str, object]:
    """The ``--json`` record of an evaluation: the sampling settings, the metrics and each prompt's."""
    sampling = summary.sampling
    return {
        "temperature": 0.0 if sampling is None else sampling.temperature,
        "top_k": None if sampling is None else sampling.top_k,
        "top_p": 1.0 if sampling is None else sampling.top_p,
        "seed": summary.seed,
        "block_size": summary.block_size,
        "acceptance_length": _number(summary.acceptance_length),
        "accept_rates": [_number(rate) for rate in summary.position_acceptance],
        "histogram": summary.histogram,
        "target_forwards": summary.target_forwards,
        "plain_forwards": summary.greedy_forwards,
        "reduction": _number(summary.reduction),
        "lossless": None if any(p.lossless is None for p in summary.prompts) else not summary.mismatches,
        "prompts": [
            {
                "name": p.prompt.name,
                "group": p.prompt.group,
                "prompt_len": len(p.prompt.token_ids),
                "new_tokens": len(p.tokens),
                "acceptance_lengths": p.acceptance_lengths,
                "lossless": p.lossless,
            }
            for p in summary.prompts
        ],
    }
