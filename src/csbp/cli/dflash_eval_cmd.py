"""``csbp dflash eval``: acceptance length and lossless check of speculative decoding.

It runs lossless speculative decoding (``csbp.dflash.speculative``) over held-out prompts (``--data``:
rows of an artifact split; ``--prompts``: a JSONL file) and, unless ``--no-check-lossless``, plain
greedy decoding too: a prompt whose outputs differ makes the command exit 1. ``--temperature T > 0``
runs lossless speculative sampling instead (``csbp.dflash.sampling``, seeded by ``--seed``; lossless in
distribution, so no token-for-token check). Its last output line is
``acceptance_length: <value>``. ``--prompts`` also stops at every ``eos_token_id`` of the target's
``generation_config.json`` (a chat model's end of turn). Every check reads configs, the data and the
prompts only; the models load once they all pass.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from csbp.cli.dflash_common import (
    INCLUSIVE_NOTE,
    load_target,
    read_target_config,
    require_drafter_directory,
    require_target_tokenizer,
)
from csbp.dflash.evaluate import DEFAULT_PROMPT_LEN
from csbp.wording import counted

if TYPE_CHECKING:
    from collections.abc import Sequence

    from csbp.dflash.evaluate import EvalPrompt
    from csbp.dflash.sampling import Sampling


def _check_eval_positions(target_dir: Path, prompts: Sequence[EvalPrompt], max_new_tokens: int) -> None:
    """``ValueError`` unless the longest prompt and ``max_new_tokens`` fit the target's positions
    (``max_position_embeddings`` of its ``config.json``; none recorded: no limit), as ``csbp generate``
    checks. The kept tokens of a ``P``-token prompt need positions ``0 … P+N−2``; a last verify round
    may run up to ``B−1`` rows further, but those rows only predict tokens that are cut off."""
    from csbp.models.hf_io import read_json_object

    limit = read_json_object(target_dir / "config.json").get("max_position_embeddings")
    if type(limit) is not int:
        return
    longest = max(len(p.token_ids) for p in prompts)
    used = longest + max_new_tokens - 1
    if used <= limit:
        return
    room = limit + 1 - longest
    fix = f"--max-new-tokens {room} or less" if room >= 1 else f"prompts shorter than {limit} tokens"
    raise ValueError(
        f"--max-new-tokens {max_new_tokens}: a {longest}-token prompt and {max_new_tokens} new tokens run the "
        f"target at positions up to {used - 1}, beyond max_position_embeddings {limit} of "
        f"{target_dir / 'config.json'} (fix: {fix})"
    )


def _inputs_record(args: argparse.Namespace, eos_id: int | None) -> dict[str, object]:
    """What chose the prompts and their length (with the target, drafter and settings, the run again)."""
    return {
        "data": None if args.data is None else str(args.data), "split": args.split,
        "prompts": None if args.prompts is None else str(args.prompts),
        "tokenizer": None if args.tokenizer is None else str(args.tokenizer),
        "num_prompts": args.num_prompts, "prompt_len": args.prompt_len, "context_lengths": args.context_lengths,
        "max_new_tokens": args.max_new_tokens, "eos_id": eos_id, "ignore_eos": args.ignore_eos,
    }


def _eval_prompts(args: argparse.Namespace, vocab_size: int) -> tuple[list[EvalPrompt], int | list[int] | None]:
    """The prompts of ``--data`` or ``--prompts`` and the stop id(s): ``--eos-id``; else the artifact's
    EOS for ``--data`` (what training validation stops at); else the tokenizer's EOS and every
    ``eos_token_id`` of ``--target``'s ``generation_config.json`` for ``--prompts`` (a chat model's end
    of turn, as ``csbp generate`` and Hugging Face ``generate`` stop); None with ``--ignore-eos``.
    Each is checked against the target's ``vocab_size``."""
    from csbp.data.artifact import open_artifact
    from csbp.data.tokenizer import load_tokenizer
    from csbp.dflash.evaluate import artifact_prompts, jsonl_prompts
    from csbp.models.hf_io import generation_stop_ids

    if args.data is not None:
        artifact = open_artifact(args.data)
        require_target_tokenizer(args.target, artifact)
        artifact.require_vocab_size(vocab_size)
        split_name = args.split or "val"
        split = artifact.split(split_name)
        default_len = min(DEFAULT_PROMPT_LEN, artifact.seq_len - 1)  # what training validation uses
        lengths = args.context_lengths or [args.prompt_len if args.prompt_len is not None else default_len]
        prompts = [
            prompt
            for length in lengths
            for prompt in artifact_prompts(
                split.tokens,
                split.doc_ids,
                num_prompts=args.num_prompts,
                prompt_len=length,
                group=split_name if args.context_lengths is None else f"{split_name} ctx {length}",
            )
        ]
        eos_id, eos_source = artifact.special_ids["eos"], f"the EOS of {args.data}"
        # its ids are read here, checked once more: the manifest's vocab_size says nothing of a token file
        # changed since csbp data prepare, whose id past the target was refused only after the weights loaded
        outside = next((p for p in prompts if max(p.token_ids) >= vocab_size), None)
        if outside is not None:
            raise ValueError(
                f"--data {args.data} {outside.name}: token id {max(outside.token_ids)} is outside the target "
                f"vocabulary [0, {vocab_size}) (fix: its token files changed since csbp data prepare: check with "
                "csbp data inspect --verify)"
            )
    else:
        tokenizer = load_tokenizer(args.tokenizer if args.tokenizer is not None else args.target)
        prompts = jsonl_prompts(  # whole prompts unless --prompt-len asks to keep their last tokens
            args.prompts, tokenizer.encode, num_prompts=args.num_prompts, prompt_len=args.prompt_len
        )
        eos_id, eos_source = tokenizer.eos_id, "the tokenizer's EOS"
        too_big = [p.name for p in prompts if max(p.token_ids) >= vocab_size]
        if too_big:
            raise ValueError(
                f"{args.prompts} {too_big[0]}: token ids exceed the target vocabulary; "
                "is --tokenizer the target's?"
            )
    if args.ignore_eos:
        return prompts, None
    if args.eos_id is not None:
        eos_id, eos_source = args.eos_id, "--eos-id"
    if eos_id is not None and not 0 <= eos_id < vocab_size:
        raise ValueError(
            f"{eos_source} {eos_id} is outside the target vocabulary [0, {vocab_size}): it could never be "
            "generated (fix: pass --eos-id of the target's tokenizer, or --ignore-eos)"
        )
    if args.prompts is None or args.eos_id is not None:
        return prompts, eos_id
    stops = [] if eos_id is None else [eos_id]
    stops += [t for t in generation_stop_ids(args.target, vocab_size) if t not in stops]
    return prompts, stops[0] if len(stops) == 1 else stops or None


def run_eval(args: argparse.Namespace) -> int:
    """Evaluate ``--drafter`` against ``--target`` on the prompts (module docstring); 1 on a lossless mismatch."""
    from csbp.atomic import write_json_atomic
    from csbp.dflash.evaluate import evaluate_drafter, format_report, sampling_label, summary_json
    from csbp.dflash.export import drafter_context, load_dflash, read_drafter_config
    from csbp.dflash.target_record import check_trained_target

    # Every check reads configs, the data and the prompts only: the models load once they all pass.
    if args.ignore_eos and args.eos_id is not None:  # one would silently win over the other
        raise ValueError(
            f"--ignore-eos and --eos-id {args.eos_id} contradict: --ignore-eos never stops at an EOS "
            "(fix: drop --ignore-eos to stop at that id, or drop --eos-id to generate --max-new-tokens tokens)"
        )
    # flags of the other prompt source, or two prompt lengths: one would be silently ignored
    if args.context_lengths is not None and args.prompt_len is not None:
        raise ValueError(
            "--context-lengths and --prompt-len both set the prompt length (fix: give one; --context-lengths "
            "evaluates one prompt group per length)"
        )
    for flag, value, used_with in (("--split", args.split, "--data"), ("--tokenizer", args.tokenizer, "--prompts")):
        if value is not None and (args.data is None) == (used_with == "--data"):
            given = "--prompts" if used_with == "--data" else "--data"
            raise ValueError(f"{flag} applies to {used_with}, not {given} (fix: drop {flag})")
    if args.max_new_tokens < 1 or args.num_prompts < 1 or (args.prompt_len is not None and args.prompt_len < 1):
        raise ValueError("--max-new-tokens, --num-prompts and --prompt-len must be >= 1")
    if args.context_lengths is not None and (args.data is None or min(args.context_lengths) < 1):
        raise ValueError("--context-lengths: needs --data and lengths >= 1 (e.g. --context-lengths 32 128 255)")
    sampling = _eval_sampling(args)
    target_config = read_target_config(args.target)
    require_drafter_directory(args.drafter)
    if read_drafter_config(args.drafter, target_config).selector_rank and sampling is not None:
        raise ValueError(
            f"--temperature {args.temperature:g}: {args.drafter} is a DFlash2 drafter with a candidate selector, "
            "which drafts by a greedy walk with no per-slot distribution to sample (fix: --temperature 0)"
        )
    other_target = check_trained_target(args.drafter, args.target, any_target=args.any_target)
    prompts, eos_id = _eval_prompts(args, target_config.vocab_size)
    _check_eval_positions(args.target, prompts, args.max_new_tokens)
    target = load_target(args.target, args)
    drafter = load_dflash(
        args.drafter, target, dtype=target.embed_tokens.weight.dtype, device=target.embed_tokens.weight.device
    )
    drafter.eval()
    if other_target is not None:
        print(other_target, file=sys.stderr)
    if drafter_context(args.drafter) == "inclusive":
        print(INCLUSIVE_NOTE.format(drafter=args.drafter), file=sys.stderr)
    cfg = drafter.config
    check_lossless = args.check_lossless
    print(
        f"csbp dflash eval: {counted(len(prompts), 'prompt')}, max {args.max_new_tokens} new tokens, "
        f"block_size {cfg.block_size}, target layers {list(cfg.target_layer_ids or ())}, eos {eos_id}, "
        f"lossless check {'on' if check_lossless else 'off'}"
        + ("" if sampling is None else f", speculative sampling at {sampling_label(sampling)}, seed {args.seed}"),
        flush=True,
    )
    summary = evaluate_drafter(
        target,
        drafter,
        prompts,
        max_new_tokens=args.max_new_tokens,
        eos_id=eos_id,
        check_lossless=check_lossless,
        sampling=sampling,
        seed=args.seed,
    )
    for mismatch in summary.mismatches:
        print(
            f"csbp: error: lossless check failed for {mismatch.prompt.name}: speculative output differs "
            f"from plain greedy at new token {mismatch.first_mismatch()}",
            file=sys.stderr,
        )
    print(format_report(summary))
    if args.json is not None:
        record = {"target": str(args.target), "drafter": str(args.drafter), **summary_json(summary)}
        write_json_atomic(args.json, {**record, "seed": args.seed, "inputs": _inputs_record(args, eos_id)})
    return 1 if summary.mismatches else 0


def _eval_sampling(args: argparse.Namespace) -> Sampling | None:
    """The :class:`Sampling` of ``--temperature/--top-k/--top-p`` (None: greedy), and
    ``args.check_lossless`` resolved (on at temperature 0 unless turned off; refused above it)."""
    from csbp.dflash.sampling import Sampling

    cuts = [f"--top-k {args.top_k}"] * (args.top_k is not None) + [f"--top-p {args.top_p:g}"] * (args.top_p < 1)
    if args.temperature == 0:
        if cuts:  # greedy takes the arg-max: a truncation would be silently ignored
            one = len(cuts) == 1
            raise ValueError(
                f"{' and '.join(cuts)} only shape{'s' * one} sampled tokens, but --temperature 0 is greedy (fix: "
                f"--temperature above 0, e.g. --temperature 1, or drop {'it' if one else 'them'})"
            )
        args.check_lossless = args.check_lossless is not False
        return None
    if args.check_lossless:
        raise ValueError(
            f"--check-lossless compares with plain greedy decoding token for token, but --temperature "
            f"{args.temperature:g} samples (fix: drop --check-lossless, or --temperature 0)"
        )
    args.check_lossless = False
    return Sampling(args.temperature, args.top_k, args.top_p)
