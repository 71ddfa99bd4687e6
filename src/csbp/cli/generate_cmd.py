"""``csbp generate``: block-diffusion sampling from a trained model.

Examples::

    csbp generate --model runs/demo/final --prompt "To be, or not to be"
    csbp generate --model ckpt/ --tokenizer tok/ --prompt "Once" --block-size 16 --steps-per-block 8 \\
        --temperature 0.8 --top-k 50 --seed 1 --max-new-tokens 64
    csbp generate --model ckpt/ --prompt "Hi" --objective fast_dllm_v2 --block-size 32 --threshold 0.9
    csbp generate --model ckpt/ --prompts prompts.jsonl --samples 4 --temperature 1 --batch-size 16 --json out.json

``--model`` is a Hugging Face checkpoint directory (a run's ``final/`` export or any local
Qwen3/Qwen2/Llama/Mistral checkpoint ``csbp.models.hf_io.load_hf_checkpoint`` reads); its tokenizer is read
from the same directory unless ``--tokenizer`` names another one. The mask token is the recorded
``mask_token_id`` (``csbp.generation.run_settings.trained_mask_token``, which ``csbp eval`` reads too:
the export's ``csbp_training``, then the run's ``config.yaml``, then ``config.json``'s
``mask_token_id``, then a Fast-dLLM v2 release's ``|<MASK>|``; records that disagree are refused), else the
tokenizer's ``<|mask|>``;
``--mask-token`` names another for a checkpoint that records none, and one that is not the recorded
id is refused.

The sampler must use the block size and label alignment the model was trained with. For a run's
``final/`` export they default to ``objective.name``/``block_size`` of the run's
``config.yaml`` (one directory up), for an export moved elsewhere to the same fields its
``config.json`` records (``csbp_training``), for a Fast-dLLM v2 release to ``fast_dllm_v2`` at its
``bd_size`` (``csbp.models.hf_release``); otherwise to ``bd3`` with ``B = 16``. ``--objective`` or ``--block-size`` other than the run's is refused unless
``--allow-objective-change`` / ``--allow-block-size-change`` (an experiment: the model never saw
that attention pattern or block grid), which then notes the change on stderr
(``csbp.cli.trained_settings``, shared with ``csbp eval``).
``fast_dllm_v2`` decodes with token shift (position ``i`` predicted from row ``i-1``; a block's
first position is committed from the finished previous block before the block is denoised); an
``mdlm`` model is one block of ``B = seq_len``. A model trained with a sliding window
(``topology.window``) is sampled with the same windowed mask (``--window`` for other checkpoints). See ``csbp.generation.sampler`` for how the prompt
is aligned to the block grid. ``--chat`` formats the prompt with the tokenizer directory's chat
template (a user turn, then the opened assistant turn), as ``csbp data prepare`` formatted the chat
records the model was adapted on. The completion ends at the tokenizer's EOS or at any
``eos_token_id`` of the model's ``generation_config.json`` (a chat export lists its end of turn,
``<|im_end|>``, there), as Hugging Face ``generate`` stops. What is refused before the model is
loaded (samples, positions, the prompt, the tokenizer, the EOS) is :mod:`csbp.cli.generate_checks`;
drawing the completions in batches (``--batch-size``, ``--prompts``) and the ``--json`` report,
:mod:`csbp.cli.generate_draws`.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from csbp.cli.generate_checks import (
    check_block_size,
    check_eos_token,
    check_positions,
    check_prompt,
    check_same_tokenizer,
    check_samples,
)
from csbp.cli.generate_draws import Prompt, draw_all, generation_settings, read_prompt_file, score_record
from csbp.cli.options import (
    check_model_directory,
    device_option,
    float_in,
    int_at_least,
    output_file,
    path_option,
    positive_int,
    token_name,
)
from csbp.cli.trained_settings import add_override_flags, check_trained_overrides, print_notes
from csbp.generation.run_settings import (
    TOKEN_SHIFT_OBJECTIVES,
    NotBlockDiffusionError,
    beyond_training_note,
    run_objective_settings,
    trained_mask_token,
)
from csbp.plan.layout import divisors

if TYPE_CHECKING:
    from csbp.data.tokenizer import CsbpTokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
DEFAULT_OBJECTIVE, DEFAULT_BLOCK_SIZE = "bd3", 16


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``generate``."""
    parser = subparsers.add_parser(
        "generate",
        help="sample a completion from a block-diffusion model",
        description="Block-diffusion sampling with a clean-prefix KV cache and confidence-based unmasking.",
    )
    parser.add_argument("--model", type=path_option, required=True, help="HF checkpoint directory (e.g. RUN/final)")
    prompt = parser.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text")
    prompt.add_argument(
        "--prompts", type=path_option, metavar="FILE.jsonl",
        help='a JSONL file of {"prompt": "..."} lines: --samples completions of each, batched across prompts too '
        "(--batch-size)",
    )
    parser.add_argument("--tokenizer", type=path_option, default=None, help="tokenizer directory (default: --model)")
    parser.add_argument(
        "--chat",
        action="store_true",
        help="wrap each prompt as a user turn of the tokenizer directory's chat template, with the assistant "
        "turn opened (for models adapted on chat data prepared with that template)",
    )
    parser.add_argument(
        "--mask-token", type=token_name("<|mask|>"), default=None,
        help="name of the mask token in the tokenizer (default: the model's recorded mask_token_id, else "
        "<|mask|>); one other than the recorded id is refused",
    )
    parser.add_argument(
        "--eos-token", type=token_name("<|endoftext|>"), default=None,
        help="name of the EOS token in the tokenizer (default: <|endoftext|>); one that is neither the run's "
        "recorded EOS nor a stop of the model's generation_config.json is refused",
    )
    parser.add_argument(
        "--objective",
        choices=tuple(TOKEN_SHIFT_OBJECTIVES),
        default=None,
        help="objective the model was trained with (default: the run's, else bd3)",
    )
    parser.add_argument("--max-new-tokens", type=positive_int, default=128)
    parser.add_argument(
        "--block-size", type=positive_int, default=None, help="training block size (default: the run's, else 16)"
    )
    add_override_flags(parser, "generate")
    parser.add_argument(
        "--steps-per-block", type=int, default=None, help="denoising steps per block (default B)"
    )
    parser.add_argument(
        "--window", type=positive_int, default=None,
        help="sliding attention window of a checkpoint that records none (default: the run's topology.window)",
    )
    parser.add_argument("--temperature", type=float_in(0, math.inf), default=0.0, help="0 = greedy")
    parser.add_argument(
        "--top-k", type=positive_int, default=None, help="sample among the k most likely tokens (needs --temperature > 0)"
    )
    parser.add_argument(
        "--top-p", type=float_in(0, 1, low_open=True), default=1.0,
        help="nucleus mass kept, in (0, 1] (default 1; below 1 needs --temperature > 0)",
    )
    parser.add_argument(
        "--threshold", type=float_in(0, 1), default=None,
        help="also unmask every proposal more confident than this (a probability; with --unmask-order confidence)",
    )
    parser.add_argument(
        "--unmask-order",
        choices=("confidence", "left_to_right", "random"),
        default="confidence",
        help="which masked positions of a block to fill first: the most confident (default), the leftmost, "
        "or random ones (the masked diffusion reverse process; bd3lms' first-hitting sampler at one step per position)",
    )
    parser.add_argument(
        "--sub-block-size",
        type=positive_int,
        default=None,
        help="fill each block one sub-block of this many positions after the other, left to right (Fast-dLLM v2 "
        "decodes blocks of 32 in sub-blocks of 8); a divisor of the block size (default: the whole block)",
    )
    parser.add_argument("--seed", type=int_at_least(0), default=0)
    parser.add_argument(
        "--samples", type=positive_int, default=1,
        help="completions to draw (needs --temperature > 0), with seeds --seed, --seed+1, ...; with --known-words the "
        "share is also given over all of them (one draw's share varies widely from seed to seed)",
    )
    parser.add_argument(
        "--batch-size", type=positive_int, default=1, metavar="N",
        help="draw up to N completions at once, as one batch through the model (a prompt is prefilled once for its "
        "samples); each makes the same choices as when drawn alone, up to the rounding of batched matmuls "
        "(default 1: one at a time)",
    )
    parser.add_argument("--dtype", choices=("auto", *DTYPES), default="auto", help="auto: as stored")
    parser.add_argument(
        "--device", type=device_option, default=None, help="torch device (default: cuda if available, else cpu)"
    )
    parser.add_argument("--no-cache", action="store_true", help="recompute the clean prefix every step")
    parser.add_argument(
        "--known-words",
        default=None,
        metavar="TEXT|demo-corpus",
        help="also print how many words of the completion occur in this text file (or the demo corpus)",
    )
    parser.add_argument(
        "--json", type=output_file, default=None,
        help="also write every completion (text, token ids, stop reason, time, and the --known-words and --scorer "
        "numbers) and the settings it was drawn with to this JSON file",
    )
    parser.add_argument(
        "--scorer",
        type=path_option,
        default=None,
        metavar="DIR",
        help="also score each completion with this autoregressive HF model directory (config.json, safetensors, "
        "tokenizer.json): its generative perplexity given the prompt, as MDLM and BD3-LMs report under GPT-2 Large, "
        "and the completion's unigram entropy (a low one flags repetitive samples); pooled over --samples",
    )
    parser.set_defaults(func=run_generate)


def chat_prompt(tokenizer_dir: Path, prompt: str, where: str = "--prompt") -> str:
    """``prompt`` as the one user turn of ``tokenizer_dir``'s chat template, assistant turn opened."""
    from csbp.data.chat_template import resolve_chat_template

    template = resolve_chat_template("auto", tokenizer_dir, without="drop --chat")
    if template is None:
        raise ValueError(
            f"--chat: tokenizer directory {tokenizer_dir} has no chat template (chat_template.jinja or "
            "tokenizer_config.json 'chat_template') (fix: pass --tokenizer DIR of the chat model, or drop --chat)"
        )
    return template.render(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, where=where, without="drop --chat"
    )


def load_generation_tokenizer(args: argparse.Namespace, tokenizer_dir: Path, model_dir: Path) -> CsbpTokenizer:
    """The tokenizer, its mask token the model's recorded ``mask_token_id`` (:func:`trained_mask_token`,
    as ``csbp eval`` reads it) unless ``--mask-token`` names one (then it must be that same id: the
    model learnt to fill that one), else ``<|mask|>``."""
    from csbp.data.tokenizer import SpecialTokens, load_tokenizer

    found = trained_mask_token(model_dir)
    recorded, source = found if found is not None else (None, None)
    default = SpecialTokens()
    special = SpecialTokens(mask=args.mask_token or default.mask, eos=args.eos_token or default.eos)
    if args.tokenizer is None and not any((model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise ValueError(  # the loader's own fix named no flag
            f"--model {model_dir} holds no tokenizer (tokenizer.json or tokenizer_config.json) (fix: --tokenizer DIR, "
            "the tokenizer the model was trained with)"
        )
    tokenizer = load_tokenizer(tokenizer_dir, special=special, mask_id=recorded if args.mask_token is None else None)
    if recorded is not None and args.mask_token is not None and tokenizer.mask_token_id != recorded:
        trained = tokenizer.backend.id_to_token(recorded)
        raise ValueError(
            f"--mask-token {args.mask_token}: id {tokenizer.mask_token_id} of {tokenizer_dir}, but the model was "
            f"trained with mask_token_id {recorded}{f' ({trained})' if trained else ''} ({source}) "
            "(fix: drop --mask-token to use the run's)"
        )
    return tokenizer


def run_generate(args: argparse.Namespace) -> int:
    from csbp.atomic import write_json_atomic
    from csbp.evaluation.sample_scores import KnownWords, SampleScorer
    from csbp.evaluation.sample_scores import pooled as pooled_scores
    from csbp.generation.sampler import GenerationConfig, positions_used
    from csbp.models.hf_io import generation_stop_ids, load_hf_checkpoint, read_hf_config, stop_token_ids

    if args.threshold is not None and args.unmask_order != "confidence":
        raise ValueError(
            f"--threshold {args.threshold} unmasks the proposals more confident than it, but --unmask-order "
            f"{args.unmask_order} would unmask as many other positions instead (fix: drop one of the two)"
        )
    truncations = [f"--top-k {args.top_k}"] * (args.top_k is not None) + [f"--top-p {args.top_p:g}"] * (args.top_p < 1)
    if args.temperature == 0 and truncations:  # greedy takes the arg-max: a truncation would be ignored
        raise ValueError(
            f"{' and '.join(truncations)} truncate{'s' * (len(truncations) == 1)} the sampled distribution, but --temperature 0 is greedy (the "
            "arg-max token), which they do not change (fix: --temperature above 0 to sample, or drop "
            f"{' and '.join(t.split()[0] for t in truncations)})"
        )
    check_samples(args.samples, args.seed, args.temperature)
    if args.scorer is not None and args.chat:
        raise ValueError(
            "--scorer with --chat: the scorer would read the chat template's turn markers as plain text, so its "
            "perplexity would not be the completion's (fix: drop --chat or --scorer)"
        )
    known_words = None if args.known_words is None else KnownWords.load(args.known_words)
    model_dir: Path = check_model_directory(args.model)
    try:
        run_settings = run_objective_settings(model_dir)
    except NotBlockDiffusionError as error:
        raise ValueError(f"{error}, which csbp generate samples (fix: --model the export of a block-diffusion run)") from None
    notes = check_trained_overrides("generate", args, model_dir, run_settings)
    trained_window = run_settings.get("window")
    if run_settings and args.window is not None and args.window != trained_window:
        trained = f"window {trained_window}" if trained_window is not None else "full attention"
        raise ValueError(
            f"--window {args.window}: the model was trained with {trained} ({run_settings['source']}), which "
            "csbp generate samples with (fix: drop --window; it is for checkpoints that record no training settings)"
        )
    if not run_settings and (args.objective is None or args.block_size is None):
        notes.append(  # a model csbp did not train (no run config, no csbp_training record)
            f"csbp generate: {model_dir} records no training settings; sampling as "
            f"{args.objective or DEFAULT_OBJECTIVE} with block size {args.block_size or DEFAULT_BLOCK_SIZE} "
            "(pass --objective and --block-size to choose)"
        )
    objective = args.objective or run_settings.get("objective", DEFAULT_OBJECTIVE)
    block_size = args.block_size or run_settings.get("block_size", DEFAULT_BLOCK_SIZE)
    check_block_size(model_dir, block_size, given=args.block_size is not None)
    steps_per_block = args.steps_per_block if args.steps_per_block is not None else block_size
    if not 1 <= steps_per_block <= block_size:
        raise ValueError(
            f"--steps-per-block {steps_per_block}: a block of {block_size} tokens takes 1 to {block_size} denoising "
            f"steps (each unmasks at least one position) (fix: --steps-per-block between 1 and {block_size}, or "
            f"drop it for {block_size})"
        )
    sub_block = args.sub_block_size
    if sub_block is not None and block_size % sub_block:
        block_divisors = divisors(block_size) if block_size <= 2**16 else None
        raise ValueError(  # a block size no max_position_embeddings bounds: no loop over its numbers
            f"--sub-block-size {sub_block} does not divide the block size {block_size} "
            f"(fix: {f'one of {block_divisors}' if block_divisors else f'a divisor of {block_size}'})"
        )
    if sub_block is not None and steps_per_block % (block_size // sub_block):
        count = block_size // sub_block
        raise ValueError(
            f"--steps-per-block {steps_per_block} does not split evenly over the {count} sub-blocks of "
            f"--sub-block-size {sub_block} (fix: --steps-per-block a multiple of {count}, or drop it for {block_size})"
        )
    tokenizer_dir: Path = args.tokenizer if args.tokenizer is not None else model_dir
    if not tokenizer_dir.exists():
        raise ValueError(
            f"--tokenizer {tokenizer_dir} does not exist (fix: a tokenizer directory or tokenizer.json file, or drop "
            "--tokenizer to use the model's own)"
        )
    tokenizer = load_generation_tokenizer(args, tokenizer_dir, model_dir)
    check_same_tokenizer(model_dir, args.tokenizer, tokenizer.fingerprint)
    mask_token_id = tokenizer.mask_token_id
    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens,
        block_size=block_size,
        steps_per_block=steps_per_block,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        threshold=args.threshold,
        seed=args.seed,
        token_shift=TOKEN_SHIFT_OBJECTIVES[objective],
        use_cache=not args.no_cache,
        window=args.window if args.window is not None else run_settings.get("window"),
        unmask_order=args.unmask_order,
        sub_block_size=args.sub_block_size,
    )
    prompts = read_prompts(args, tokenizer, tokenizer_dir, objective, mask_token_id)
    longest = max(prompts, key=lambda prompt: len(prompt.ids))
    check_positions(model_dir, len(longest.ids), args.max_new_tokens, block_size, where=longest.where)
    vocab_size = read_hf_config(model_dir).vocab_size
    for what, token_id in (("mask token id", mask_token_id), ("EOS id", tokenizer.eos_id)):
        if token_id is not None and not 0 <= token_id < vocab_size:
            raise ValueError(
                f"{what} {token_id} is outside the model vocabulary [0, {vocab_size}) of {model_dir} "
                "(fix: pass --tokenizer of the model, or --mask-token/--eos-token naming its tokens)"
            )
    stop_ids = stop_token_ids(model_dir, tokenizer.eos_id, vocab_size, mask_token_id)
    check_eos_token(args, tokenizer, model_dir, run_settings, generation_stop_ids(model_dir, vocab_size, mask_token_id=mask_token_id))
    used = positions_used(len(longest.ids), args.max_new_tokens, block_size)
    room = run_settings.get("seq_len", 0) // block_size * block_size - len(longest.ids)
    fix = f"--max-new-tokens {room} or less stays inside" if room >= 1 else "a shorter prompt stays inside"
    note = beyond_training_note("generate", run_settings, used, fix)
    if note is not None:
        notes.append(note)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = None if args.dtype == "auto" else DTYPES[args.dtype]
    scorer = None if args.scorer is None else SampleScorer(args.scorer, dtype=dtype, device=device)  # its refusals first
    model, _ = load_hf_checkpoint(model_dir, dtype=dtype, device=device)
    model.eval()
    print_notes(notes)
    seeds = range(args.seed, args.seed + args.samples)
    draws = draw_all(
        model, prompts, seeds=seeds, batch_size=args.batch_size, config=config, mask_token_id=mask_token_id,
        stop_ids=stop_ids, tokenizer=tokenizer, objective=objective, device=str(device), known_words=known_words,
        scorer=scorer,
    )
    completions = len(draws.records)
    if known_words is not None and completions > 1:
        print(known_words.line(*draws.known_words, samples=completions))
    if scorer is not None and completions > 1:
        print(scorer.line(pooled_scores(draws.scores), samples=completions))
    if args.json is not None:
        report: dict[str, Any] = {"model": str(model_dir)}
        if args.prompts is None:
            report.update({"prompt": args.prompt, "prompt_ids": prompts[0].ids})
        else:
            report["prompts"] = [{"prompt": p.text, "where": p.where, "prompt_ids": p.ids} for p in prompts]
        report.update({
            "objective": objective, "device": str(device), "settings": generation_settings(config),
            "batch_size": min(args.batch_size, completions), "samples": draws.records,
        })
        if known_words is not None:
            report["known_words"] = {"source": known_words.source, "known": draws.known_words[0], "total": draws.known_words[1]}
        if scorer is not None:
            report["scorer"] = {"model": str(args.scorer), **score_record(pooled_scores(draws.scores))}
        write_json_atomic(args.json, report)
    return 0


def read_prompts(
    args: argparse.Namespace, tokenizer: CsbpTokenizer, tokenizer_dir: Path, objective: str, mask_token_id: int
) -> list[Prompt]:
    """``--prompt``, or every prompt of ``--prompts``, encoded (in ``--chat``'s template) and checked."""
    given = [(args.prompt, "--prompt")] if args.prompts is None else read_prompt_file(args.prompts)
    prompts = []
    for text, where in given:
        ids = tokenizer.encode(chat_prompt(tokenizer_dir, text, where) if args.chat else text)
        check_prompt(ids, objective, mask_token_id, tokenizer.special_names["mask"], where=where)
        prompts.append(Prompt(text, where, ids))
    return prompts
