"""``csbp data``: prepare a packed, memory-mapped training artifact, inspect it, summarise it.

Usage::

    csbp data prepare corpus.jsonl more/ --out artifacts/run1 --seq-len 512 \\
        --train-tokenizer --vocab-size 4096 --val-fraction 0.01 --seed 0
    csbp data prepare --demo-corpus --out artifacts/shakespeare --seq-len 256 --tokenizer tok/
    csbp data inspect artifacts/run1 --rows 2 --split val
    csbp data stats artifacts/run1

User errors raise ``ValueError``; ``csbp.cli.main`` prints them as one ``csbp: error:`` line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from csbp.cli.options import float_in, int_at_least, path_option, positive_int
from csbp.data.artifact import SPLITS, open_artifact
from csbp.data.corpus import demo_corpus_files
from csbp.data.prepare import PrepareConfig, prepare_artifact
from csbp.data.report import format_inspect, format_stats
from csbp.data.tokenizer import SpecialTokens


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``data`` with subcommands ``prepare``, ``inspect`` and ``stats``."""
    data = subparsers.add_parser("data", help="prepare, inspect and summarise training data")
    data.set_defaults(func=_print_help(data))
    commands = data.add_subparsers(dest="data_command", metavar="SUBCOMMAND")

    prepare = commands.add_parser(
        "prepare",
        help="tokenize and pack inputs into a memory-mapped artifact",
        description="Tokenize .jsonl/.txt/.parquet inputs once and pack them into rows of --seq-len tokens.",
    )
    prepare.add_argument("inputs", nargs="*", type=path_option, help="input files or directories")
    prepare.add_argument(
        "--demo-corpus", action="store_true", help="add the Shakespeare demo corpus to the inputs"
    )
    prepare.add_argument("--out", type=path_option, required=True, help="artifact directory to create")
    prepare.add_argument("--seq-len", type=int_at_least(2), required=True, help="tokens per packed row")
    source = prepare.add_mutually_exclusive_group(required=True)
    source.add_argument("--tokenizer", type=path_option, help="local tokenizer directory or tokenizer.json")
    source.add_argument(
        "--train-tokenizer", action="store_true", help="train a byte-level BPE on the train split"
    )
    prepare.add_argument(
        "--chat-template",
        default="auto",
        metavar="auto|none|PATH",
        help="format chat records with the tokenizer directory's chat template (auto, the default, falls "
        "back to csbp's role markers when it has none), csbp's role markers (none), or a .jinja file",
    )
    prepare.add_argument(
        "--chat-documents",
        choices=("record", "turn"),
        default="record",
        help="chat records rendered with a chat template: one document per record, every assistant turn "
        "supervised (record, the default; the template must render earlier turns unchanged), or one per "
        "assistant turn, the conversation up to it with only it supervised (turn: for templates that "
        "rewrite earlier turns, such as Qwen3's; tokens grow with the square of a record's turns)",
    )
    prepare.add_argument("--vocab-size", type=positive_int, help="vocabulary size of the trained tokenizer")
    prepare.add_argument(
        "--val-fraction", type=float_in(0, 1, high_open=True), default=0.0,
        help="share of documents held out, in [0, 1) (default 0)",
    )
    prepare.add_argument(
        "--seed", type=int_at_least(0), default=0, help="seed of the train/val document split (default 0)"
    )
    prepare.add_argument(
        "--txt-mode",
        choices=("file", "paragraphs"),
        default="file",
        help=".txt inputs: one document per file (default) or per blank-line-separated paragraph",
    )
    defaults = SpecialTokens()
    for field in ("eos", "mask", "pad"):
        prepare.add_argument(
            f"--{field}-token",
            default=getattr(defaults, field),
            help=f"name of the {field} token (default {getattr(defaults, field)})",
        )
    prepare.add_argument(
        "--workers", type=int_at_least(1), default=1,
        help="processes that render chat templates and tokenize, in chunks (default 1: this process); the "
        "artifact is the same byte for byte for any number",
    )
    prepare.add_argument("--overwrite", action="store_true", help="replace an existing --out directory")
    prepare.set_defaults(func=run_prepare)

    inspect = commands.add_parser("inspect", help="print the manifest and decode the first rows")
    inspect.add_argument("artifact", type=path_option, help="artifact directory")
    inspect.add_argument("--rows", type=int_at_least(0), default=2, help="rows to decode (0: the manifest only)")
    inspect.add_argument("--split", choices=SPLITS, default="train", help="split to show (default train)")
    inspect.add_argument("--verify", action="store_true", help="recompute the content fingerprint first")
    inspect.set_defaults(func=run_inspect)

    stats = commands.add_parser(
        "stats", help="token counts, supervision, documents per row, length histogram"
    )
    stats.add_argument("artifact", type=path_option, help="artifact directory")
    stats.add_argument("--verify", action="store_true", help="recompute the content fingerprint first")
    stats.set_defaults(func=run_stats)


def _print_help(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    def print_help(args: argparse.Namespace) -> int:
        parser.print_help(sys.stderr)
        return 2

    return print_help


def run_prepare(args: argparse.Namespace) -> int:
    inputs = list(args.inputs) + (demo_corpus_files() if args.demo_corpus else [])
    if not inputs:
        raise ValueError("no inputs: give files/directories or --demo-corpus")
    config = PrepareConfig(
        inputs=tuple(inputs),
        out_dir=args.out,
        seq_len=args.seq_len,
        tokenizer_path=args.tokenizer,
        train_tokenizer=args.train_tokenizer,
        vocab_size=args.vocab_size,
        val_fraction=args.val_fraction,
        seed=args.seed,
        txt_mode=args.txt_mode,
        special=SpecialTokens(eos=args.eos_token, mask=args.mask_token, pad=args.pad_token),
        overwrite=args.overwrite,
        chat_template=args.chat_template,
        chat_documents=args.chat_documents,
        workers=args.workers,
    )
    prepare_artifact(config, log=print)
    return 0


def run_inspect(args: argparse.Namespace) -> int:
    artifact = open_artifact(args.artifact, verify=args.verify)
    _say_verified(artifact, args.verify)
    print(format_inspect(artifact, split=args.split, num_rows=args.rows))
    return 0


def run_stats(args: argparse.Namespace) -> int:
    artifact = open_artifact(args.artifact, verify=args.verify)
    _say_verified(artifact, args.verify)
    print(format_stats(artifact))
    return 0


def _say_verified(artifact: object, verified: bool) -> None:
    """With ``--verify``, one line saying the check ran and passed (it printed nothing, as if skipped)."""
    if verified:
        print(f"verified: content fingerprint {artifact.fingerprint[:16]}... matches the manifest")  # type: ignore[attr-defined]
