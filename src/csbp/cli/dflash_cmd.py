"""``csbp dflash prepare-features|export|eval``: DFlash drafter data, export and evaluation.

Examples::

    csbp dflash prepare-features --target ckpt/Qwen3-0.6B --data art/ --out feats/ --layer-ids 1 9 17
    csbp dflash export --run-dir runs/drafter --target ckpt/Qwen3-0.6B --out drafter/
    csbp dflash export --drafter other/drafter --target ckpt/Qwen3-0.6B --out drafter/ --dtype bfloat16
    csbp dflash eval --target ckpt/Qwen3-0.6B --drafter drafter/ --data art/ --num-prompts 8 --prompt-len 64
    csbp dflash eval --target ckpt/Qwen3-0.6B --drafter drafter/ --prompts prompts.jsonl --max-new-tokens 128

This module builds the three parsers; each command runs in its own module:
:mod:`csbp.cli.dflash_features_cmd` (``prepare-features``: a resumable capture of the target's hidden
states), :mod:`csbp.cli.dflash_export_cmd` (``export``: a drafter directory, a run's ``final/`` or a
training checkpoint in the public DFlash format) and :mod:`csbp.cli.dflash_eval_cmd` (``eval``:
acceptance length and the lossless check); :mod:`csbp.cli.dflash_common` holds what they share.
"""

from __future__ import annotations

import argparse
import math

from csbp.cli.dflash_common import DTYPES
from csbp.cli.dflash_eval_cmd import run_eval
from csbp.cli.dflash_export_cmd import run_export
from csbp.cli.dflash_features_cmd import FEATURE_DTYPES, run_prepare_features
from csbp.cli.options import (
    add_deprecated_alias,
    device_option,
    float_in,
    int_at_least,
    output_file,
    path_option,
    positive_int,
)
from csbp.dflash.evaluate import DEFAULT_MAX_NEW_TOKENS, DEFAULT_NUM_PROMPTS, DEFAULT_PROMPT_LEN

#: help of ``dflash export``'s checkpoint flags
UNRECORDED_ONLY = "checkpoints whose run records none (one contradicting the run's is refused)"


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
    prep.add_argument("--target", type=path_option, required=True, help="HF checkpoint directory of the target")
    prep.add_argument("--data", type=path_option, required=True, help="prepared artifact (csbp data prepare)")
    prep.add_argument("--out", type=path_option, required=True, help="feature directory to create")
    prep.add_argument("--layer-ids", type=int, nargs="+", default=None, help="0-based target layers to fuse")
    prep.add_argument(
        "--drafter", type=path_option, default=None, help="take --layer-ids from this drafter's config"
    )
    prep.add_argument("--num-draft-layers", type=positive_int, default=1, help="for the default layer ids")
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
    source.add_argument("--drafter", type=path_option, help="drafter directory (config.json + model.safetensors)")
    source.add_argument("--run-dir", type=path_option, help="training run directory (final/ or latest checkpoint)")
    source.add_argument("--checkpoint", type=path_option, help="checkpoint directory RUN/checkpoints/step_N")
    export.add_argument("--target", type=path_option, default=None,
                        help="HF checkpoint directory of the target (default: the one a --run-dir or --checkpoint "
                        "recorded; required with --drafter)")
    export.add_argument("--out", type=path_option, required=True, help="directory to write")
    export.add_argument("--dtype", choices=("auto", *DTYPES), default="auto", help="auto: as stored")
    export.add_argument("--block-size", type=int, default=None, help=UNRECORDED_ONLY)
    export.add_argument("--mask-token-id", type=int, default=None, help=UNRECORDED_ONLY)
    export.add_argument("--layer-ids", type=int, nargs="+", default=None, help=UNRECORDED_ONLY)
    export.add_argument("--overwrite", action="store_true", help="replace an earlier export at --out")
    export.set_defaults(func=run_export)

    ev = commands.add_parser(
        "eval",
        help="acceptance length and lossless check of speculative decoding",
        description="Greedy speculative decoding of the target with the drafter: the acceptance length "
        "(tokens committed per verify round), the target forwards saved and, unless --no-check-lossless, "
        "a check that every output equals the target's own greedy output. --temperature T > 0 measures "
        "lossless speculative sampling instead (seeded by --seed).",
    )
    ev.add_argument("--target", type=path_option, required=True, help="HF checkpoint directory of the target")
    ev.add_argument("--drafter", type=path_option, required=True, help="drafter directory (csbp dflash export)")
    prompts = ev.add_mutually_exclusive_group(required=True)
    prompts.add_argument("--data", type=path_option, help="artifact whose split rows give the prompts")
    prompts.add_argument("--prompts", type=path_option, help='JSONL file of {"prompt": ..., "group": ...} lines')
    ev.add_argument("--split", choices=("train", "val"), default=None, help="--data: artifact split (default val)")
    ev.add_argument("--tokenizer", type=path_option, default=None, help="--prompts: their tokenizer (default: --target)")
    ev.add_argument("--num-prompts", type=int, default=DEFAULT_NUM_PROMPTS, help="prompts to decode")
    ev.add_argument(
        "--prompt-len",
        type=int,
        default=None,
        help=f"--data: tokens per prompt, at most the artifact's seq_len (default {DEFAULT_PROMPT_LEN}, or seq_len - 1 "
        "when shorter); "
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
        "--any-target", action="store_true",
        help="measure a --drafter with a --target of other weights than the one it records it was trained against "
        "(a fine-tune of it, say); refused otherwise",
    )
    ev.add_argument(
        "--check-lossless",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also run plain greedy and require identical outputs (exit 1 otherwise); default on at --temperature 0, "
        "off above (sampled outputs equal the target's in distribution, not token for token)",
    )
    ev.add_argument(
        "--temperature", type=float_in(0, math.inf), default=0.0,
        help="0 (default): greedy speculative decoding; above 0: lossless speculative sampling at this temperature "
        "(accept draft x with probability min(1, p(x)/q(x)), resample a rejection from max(0, p - q))",
    )
    ev.add_argument(
        "--top-k", type=positive_int, default=None,
        help="sample both models among their k most likely tokens (needs --temperature > 0)",
    )
    ev.add_argument(
        "--top-p", type=float_in(0, 1, low_open=True), default=1.0,
        help="nucleus mass both models keep, in (0, 1] (default 1; below 1 needs --temperature > 0)",
    )
    ev.add_argument("--seed", type=int_at_least(0), default=0, help="seed of the sampling generator (--temperature > "
                    "0); its low 32 bits seed it, so S and S + 2^32 draw alike, as in csbp generate")
    ev.add_argument("--json", type=output_file, default=None, help="also write the report to this JSON file")
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
