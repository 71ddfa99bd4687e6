"""``csbp dflash prepare-features|export|eval``: DFlash drafter data, export and evaluation.

Examples::

    csbp dflash prepare-features --target ckpt/Qwen3-0.6B --data art/ --out feats/ --layer-ids 1 9 17
    csbp dflash export --run-dir runs/drafter --target ckpt/Qwen3-0.6B --out drafter/
    csbp dflash export --drafter other/drafter --target ckpt/Qwen3-0.6B --out drafter/ --dtype bfloat16
    csbp dflash eval --target ckpt/Qwen3-0.6B --drafter drafter/ --data art/ --num-prompts 8 --prompt-len 64
    csbp dflash eval --target ckpt/Qwen3-0.6B --drafter drafter/ --prompts prompts.jsonl --max-new-tokens 128

``prepare-features`` records the fingerprints of the target's config and weight files in the store
(``csbp train`` refuses a store of other weights) and commits its progress at least once a minute:
run the same command again after an interruption and it resumes (``csbp.dflash.feature_writer``).

``export`` reads one of: ``--drafter DIR`` (a drafter in the public format, re-exported after
validation against the target), ``--run-dir RUN`` (``RUN/final`` when it holds a drafter, else the
checkpoint ``RUN/checkpoints/latest`` names) or ``--checkpoint RUN/checkpoints/step_N`` (a
``torch.distributed.checkpoint`` directory whose ``model`` entry is the drafter's state dict; the
shapes come from the checkpoint, ``block_size``/``mask_token_id``/``target_layer_ids`` from the run
config in ``trainer_state.json`` or from ``--block-size``/``--mask-token-id``/``--layer-ids``).
DCP's ``.metadata`` is a pickle: it is read with a restricted unpickler that admits only the DCP
metadata classes, so a crafted checkpoint is refused instead of running code.
The export carries the tokenizer files of a ``--drafter`` directory (a run's ``final/``), or for a
checkpoint those its run's ``final/`` would hold (:func:`csbp.cli.dflash_checkpoint.checkpoint_tokenizer_files`).

``eval`` runs lossless speculative decoding (``csbp.dflash.speculative``) over held-out prompts and,
unless ``--no-check-lossless``, plain greedy decoding too: a prompt whose outputs differ makes the
command exit 1. Its last output line is ``acceptance_length: <value>``. ``--prompts`` also stops at
every ``eos_token_id`` of the target's ``generation_config.json`` (a chat model's end of turn).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from csbp.cli.dflash_checkpoint import (
    checkpoint_context,
    checkpoint_seq_len,
    checkpoint_tokenizer_files,
    drafter_from_checkpoint,
    run_dir_source,
)
from csbp.cli.options import add_deprecated_alias, device_option
from csbp.models.hf_io import read_json_object, tokenizer_files_in, without_auto_map

if TYPE_CHECKING:
    from collections.abc import Sequence

    from csbp.data.artifact import Artifact
    from csbp.dflash.evaluate import EvalPrompt
    from csbp.models.decoder import Decoder

from csbp.dflash.evaluate import DEFAULT_MAX_NEW_TOKENS, DEFAULT_NUM_PROMPTS, DEFAULT_PROMPT_LEN
from csbp.wording import counted

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
FEATURE_DTYPES = ("bfloat16", "float16", "float32")
INCLUSIVE_NOTE = (
    "note: drafter {drafter} was trained with objective.dflash.context: inclusive (context up to and including "
    "the anchor); csbp dflash eval and every DFlash serving loop draft with context strictly before the anchor, "
    "so its acceptance carries that train/serve mismatch (its config.json records it under csbp_training)"
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``dflash`` and its commands."""
    parser = subparsers.add_parser("dflash", help="DFlash drafters: target features, export, evaluation")
    commands = parser.add_subparsers(dest="dflash_command", metavar="COMMAND", required=True)

    prep = commands.add_parser(
        "prepare-features",
        help="capture target features of an artifact split",
        description="Run the frozen target over an artifact split once and store the hidden states of the "
        "layers a drafter fuses (point objective.dflash.features at --out).",
    )
    prep.add_argument("--target", type=Path, required=True, help="HF checkpoint directory of the target")
    prep.add_argument("--data", type=Path, required=True, help="prepared artifact (csbp data prepare)")
    prep.add_argument("--out", type=Path, required=True, help="feature directory to create")
    prep.add_argument("--layer-ids", type=int, nargs="+", default=None, help="0-based target layers to fuse")
    prep.add_argument(
        "--drafter", type=Path, default=None, help="take --layer-ids from this drafter's config"
    )
    prep.add_argument("--num-draft-layers", type=int, default=1, help="for the default layer ids")
    prep.add_argument("--with-last-hidden", action="store_true", help="also store the final hidden (KL loss)")
    prep.add_argument("--split", choices=("train", "val"), default="train", help="artifact split to capture")
    prep.add_argument(
        "--feature-dtype", choices=FEATURE_DTYPES, default="bfloat16", help="dtype of the stored features"
    )
    add_deprecated_alias(prep, "--dtype", current="--feature-dtype", dest="feature_dtype", choices=FEATURE_DTYPES)
    prep.add_argument("--rows-per-batch", type=int, default=1, help="artifact rows per target forward")
    prep.add_argument("--overwrite", action="store_true", help="replace an earlier feature store at --out")
    _device_args(prep, dtype_flag="--model-dtype")  # two dtypes here: both named
    prep.set_defaults(func=run_prepare_features)

    export = commands.add_parser(
        "export",
        help="export a trained drafter in the public DFlash format",
        description="Write a drafter (a drafter directory, a training run's final/ or latest checkpoint, or "
        "one checkpoint) in the public DFlash format.",
    )
    source = export.add_mutually_exclusive_group(required=True)
    source.add_argument("--drafter", type=Path, help="drafter directory (config.json + model.safetensors)")
    source.add_argument("--run-dir", type=Path, help="training run directory (final/ or latest checkpoint)")
    source.add_argument("--checkpoint", type=Path, help="checkpoint directory RUN/checkpoints/step_N")
    export.add_argument("--target", type=Path, required=True, help="HF checkpoint directory of the target")
    export.add_argument("--out", type=Path, required=True, help="directory to write")
    export.add_argument("--dtype", choices=("auto", *DTYPES), default="auto", help="auto: as stored")
    export.add_argument("--block-size", type=int, default=None, help="checkpoints: override the run's")
    export.add_argument("--mask-token-id", type=int, default=None, help="checkpoints: override the run's")
    export.add_argument(
        "--layer-ids", type=int, nargs="+", default=None, help="checkpoints: override the run's"
    )
    export.add_argument("--overwrite", action="store_true", help="replace an earlier export at --out")
    export.set_defaults(func=run_export)

    ev = commands.add_parser(
        "eval",
        help="acceptance length and lossless check of speculative decoding",
        description="Greedy speculative decoding of the target with the drafter: the acceptance length "
        "(tokens committed per verify round), the target forwards saved and, unless --no-check-lossless, "
        "a check that every output equals the target's own greedy output.",
    )
    ev.add_argument("--target", type=Path, required=True, help="HF checkpoint directory of the target")
    ev.add_argument("--drafter", type=Path, required=True, help="drafter directory (csbp dflash export)")
    prompts = ev.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--data", type=Path, help="artifact whose split rows give the prompts")
    prompts.add_argument("--prompts", type=Path, help='JSONL file of {"prompt": ..., "group": ...} lines')
    ev.add_argument("--split", choices=("train", "val"), default=None, help="--data: artifact split (default val)")
    ev.add_argument("--tokenizer", type=Path, default=None, help="--prompts: their tokenizer (default: --target)")
    ev.add_argument("--num-prompts", type=int, default=DEFAULT_NUM_PROMPTS, help="prompts to decode")
    ev.add_argument(
        "--prompt-len",
        type=int,
        default=None,
        help=f"--data: tokens per prompt (default {DEFAULT_PROMPT_LEN}, at most the artifact's seq_len - 1); "
        "--prompts: keep the last P tokens of longer prompts (default: whole prompts)",
    )
    ev.add_argument(
        "--context-lengths",
        type=int,
        nargs="+",
        default=None,
        metavar="P",
        help="--data: one prompt group per context length P (acceptance by context length); not with --prompt-len",
    )
    ev.add_argument("--max-new-tokens", type=int, default=DEFAULT_MAX_NEW_TOKENS, help="tokens generated per prompt")
    ev.add_argument(
        "--eos-id",
        type=int,
        default=None,
        help="the one stop id (default: the artifact's EOS for --data; the tokenizer's EOS and the target's "
        "generation_config.json eos_token_id for --prompts)",
    )
    ev.add_argument(
        "--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens (not with --eos-id)"
    )
    ev.add_argument(
        "--check-lossless",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run plain greedy and require identical outputs (exit 1 otherwise)",
    )
    _device_args(ev)
    ev.set_defaults(func=run_eval)


def _device_args(parser: argparse.ArgumentParser, *, dtype_flag: str = "--dtype") -> None:
    """The model weights' dtype (``--dtype`` as in ``csbp generate``/``eval``/``dflash export``;
    ``--model-dtype`` where the command has a second dtype, and as the old spelling) and device."""
    choices = ("auto", *DTYPES)
    parser.add_argument(
        dtype_flag, dest="model_dtype", choices=choices, default="auto", help="model weights (auto: as stored)"
    )
    if dtype_flag != "--model-dtype":
        add_deprecated_alias(parser, "--model-dtype", current=dtype_flag, dest="model_dtype", choices=choices)
    parser.add_argument(
        "--device", type=device_option, default=None, help="torch device (default: cuda if available, else cpu)"
    )


def _load_target(path: Path, args: argparse.Namespace, *, device: str | None = None) -> Decoder:
    from csbp.models.hf_io import load_hf_checkpoint

    if not path.is_dir():
        raise ValueError(f"--target {path} is not a directory; pass a HF checkpoint directory")
    dtype = None if getattr(args, "model_dtype", "auto") == "auto" else DTYPES[args.model_dtype]
    device = device or getattr(args, "device", None) or ("cuda" if torch.cuda.is_available() else "cpu")
    target, _ = load_hf_checkpoint(path, dtype=dtype, device=device)
    return target.eval()


def _require_target_tokenizer(target_dir: Path, artifact: Artifact) -> None:
    """As ``csbp train`` checks a dflash run's data: ``--data`` must be tokenized with ``--target``'s
    ``tokenizer.json`` (when it ships one), or its prompts and features are other tokens."""
    from csbp.training.dflash_inputs import check_target_tokenizer

    try:
        check_target_tokenizer(target_dir, artifact)
    except ValueError as exc:
        raise ValueError(
            f"--data: {exc} (fix: pass the artifact prepared with the target's tokenizer, or prepare it with "
            f"csbp data prepare --tokenizer {target_dir})"
        ) from None


# ----------------------------------------------------------------------------- prepare-features


def run_prepare_features(args: argparse.Namespace) -> int:
    from csbp.data.artifact import open_artifact
    from csbp.dflash.config import default_target_layer_ids, validate_drafter_target
    from csbp.dflash.export import dflash_config_from_hf
    from csbp.dflash.feature_writer import check_output, prepare_features
    from csbp.dflash.target_fingerprint import checkpoint_identity
    from csbp.models.hf_io import read_hf_config

    # Every check reads configs only: a large target's weights are loaded (minutes) once they all pass.
    if args.layer_ids is not None and args.drafter is not None:
        raise ValueError("give --layer-ids or --drafter, not both")
    if args.rows_per_batch < 1:
        raise ValueError(f"--rows-per-batch {args.rows_per_batch}: must be >= 1")
    check_output(args.out, overwrite=args.overwrite)
    artifact = open_artifact(args.data)
    _require_target_tokenizer(args.target, artifact)
    if not args.target.is_dir():
        raise ValueError(f"--target {args.target} is not a directory; pass a HF checkpoint directory")
    target_config = read_hf_config(args.target)
    artifact.require_vocab_size(target_config.vocab_size)
    if args.drafter is not None:
        drafter_config = dflash_config_from_hf(read_json_object(args.drafter / "config.json"))
        try:  # features for a drafter of another target (shape or RoPE) would train it on the wrong states
            validate_drafter_target(drafter_config, target_config)
        except ValueError as exc:
            raise ValueError(
                f"--drafter {args.drafter}: {exc} (fix: pass the --target it was trained against, or --layer-ids)"
            ) from None
        layer_ids = drafter_config.target_layer_ids
    elif args.layer_ids is not None:
        layer_ids = tuple(args.layer_ids)
    else:
        layer_ids = default_target_layer_ids(target_config.num_layers, args.num_draft_layers)
    bad = [i for i in layer_ids or () if not 0 <= i < target_config.num_layers]
    if bad:
        raise ValueError(f"--layer-ids {bad} are outside the target's layers [0, {target_config.num_layers})")
    target = _load_target(args.target, args)
    split = artifact.split(args.split)
    print(
        f"capturing layers {list(layer_ids or ())} of {args.target} for {split.num_rows} {args.split} rows",
        flush=True,
    )
    target_weights, target_files = checkpoint_identity(args.target)
    out = prepare_features(
        target,
        split,
        args.out,
        layer_ids=layer_ids or (),
        target_weights=target_weights,
        target_files=target_files,
        with_last_hidden=args.with_last_hidden,
        dtype=args.feature_dtype,
        rows_per_batch=args.rows_per_batch,
        overwrite=args.overwrite,
        progress=True,
    )
    print(f"wrote {out}")
    return 0


# ----------------------------------------------------------------------------- export


def run_export(args: argparse.Namespace) -> int:
    from csbp.dflash.export import drafter_context, export_dflash, load_dflash, public_reader_window_note
    from csbp.training.export import check_out_outside_checkpoints, checkpoints_root

    drafter_dir = args.drafter
    checkpoint = args.checkpoint
    if args.run_dir is not None:
        drafter_dir, checkpoint = run_dir_source(args.run_dir)
        check_out_outside_checkpoints(args.out, args.run_dir / "checkpoints")
    else:
        check_out_outside_checkpoints(args.out, checkpoints_root(checkpoint) if checkpoint is not None else None)
    overrides = [flag for flag, value in (("--block-size", args.block_size), ("--mask-token-id", args.mask_token_id),
                                          ("--layer-ids", args.layer_ids)) if value is not None]
    if drafter_dir is not None and overrides:  # a drafter's config.json records them: they were ignored
        raise ValueError(
            f"{' and '.join(overrides)} override a checkpoint's run settings, but {drafter_dir} is a drafter "
            f"directory whose config.json records them (fix: drop {' and '.join(overrides)}, or export a --checkpoint)"
        )
    target = _load_target(args.target, args, device="cpu")  # only validates shapes and ids
    dtype = None if args.dtype == "auto" else DTYPES[args.dtype]
    seq_len = None  # the training length: a drafter directory records none
    if drafter_dir is not None:
        if not (drafter_dir / "config.json").is_file():
            raise ValueError(f"{drafter_dir} is not a DFlash drafter directory: config.json not found")
        drafter = load_dflash(drafter_dir, target, dtype=dtype)
        source, context = str(drafter_dir), drafter_context(drafter_dir)  # carried through
        tokenizer, dropped = without_auto_map(tokenizer_files_in(drafter_dir))  # carried through (final/ has them)
        if dropped:
            print(
                f"note: {drafter_dir / 'tokenizer_config.json'} names remote code (auto_map); the export leaves it "
                "out (csbp runs none; the tokenizer is tokenizer.json)",
                file=sys.stderr,
            )
    else:
        drafter = drafter_from_checkpoint(checkpoint, target, args)
        source, context = f"checkpoint {checkpoint}", checkpoint_context(checkpoint)
        tokenizer = checkpoint_tokenizer_files(checkpoint, drafter.config.mask_token_id)
        seq_len = checkpoint_seq_len(checkpoint)
    out = export_dflash(
        drafter, args.out, dtype=dtype, overwrite=args.overwrite, context=context, tokenizer_files=tokenizer,
        seq_len=seq_len,
    )
    reloaded = load_dflash(out, target)  # validate what was written
    cfg = reloaded.config
    count = sum(p.numel() for p in reloaded.parameters())
    print(
        f"exported {source} -> {out}: {'DFlash2' if cfg.is_dflash2 else 'DFlash'} drafter, {cfg.num_layers} "
        f"layers, block_size {cfg.block_size}, target_layer_ids {list(cfg.target_layer_ids or ())}, "
        f"mask_token_id {cfg.mask_token_id}, {count} parameters, context {context or 'not recorded'}, "
        f"{len(tokenizer)} tokenizer files"
    )
    if context == "inclusive":
        print(INCLUSIVE_NOTE.format(drafter=out), file=sys.stderr)
    window_note = public_reader_window_note(cfg, out)
    if window_note is not None:
        print(window_note, file=sys.stderr)
    return 0


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
        _require_target_tokenizer(args.target, artifact)
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
    from csbp.dflash.evaluate import evaluate_drafter, format_report
    from csbp.dflash.export import drafter_context, load_dflash, read_drafter_config
    from csbp.models.hf_io import read_hf_config

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
    if not args.target.is_dir():
        raise ValueError(f"--target {args.target} is not a directory; pass a HF checkpoint directory")
    target_config = read_hf_config(args.target)
    if not args.drafter.is_dir():
        raise ValueError(f"--drafter {args.drafter} is not a directory; pass a csbp dflash export directory")
    read_drafter_config(args.drafter, target_config)
    prompts, eos_id = _eval_prompts(args, target_config.vocab_size)
    _check_eval_positions(args.target, prompts, args.max_new_tokens)
    target = _load_target(args.target, args)
    drafter = load_dflash(
        args.drafter, target, dtype=target.embed_tokens.weight.dtype, device=target.embed_tokens.weight.device
    )
    drafter.eval()
    if drafter_context(args.drafter) == "inclusive":
        print(INCLUSIVE_NOTE.format(drafter=args.drafter), file=sys.stderr)
    cfg = drafter.config
    print(
        f"csbp dflash eval: {counted(len(prompts), 'prompt')}, max {args.max_new_tokens} new tokens, "
        f"block_size {cfg.block_size}, target layers {list(cfg.target_layer_ids or ())}, eos {eos_id}, "
        f"lossless check {'on' if args.check_lossless else 'off'}",
        flush=True,
    )
    summary = evaluate_drafter(
        target,
        drafter,
        prompts,
        max_new_tokens=args.max_new_tokens,
        eos_id=eos_id,
        check_lossless=args.check_lossless,
    )
    for mismatch in summary.mismatches:
        print(
            f"csbp: error: lossless check failed for {mismatch.prompt.name}: speculative output differs "
            f"from plain greedy at new token {mismatch.first_mismatch()}",
            file=sys.stderr,
        )
    print(format_report(summary))
    return 1 if summary.mismatches else 0
