"""``csbp eval``: the likelihood of a trained block-diffusion model on a data split.

Examples::

    csbp eval --model runs/demo/final --data artifacts/demo-4k-64 --split val
    csbp eval --model ckpt/ --data art/ --objective bd3 --block-size 16 --samples 8 --json eval.json

Reports, in nats per token: the unclipped NELBO (noise over ``[1e-3, 1]``, ``1/t`` weights; mean
of ``--samples`` independent noise draws with its standard error) and the perplexity bound
``exp(NELBO)``; and the exact NLL of left-to-right unmasking (the likelihood ``csbp generate
--unmask-order left_to_right`` assigns at temperature 1), ``B`` forwards per batch. See
``csbp.evaluation``. ``--model`` is a HF checkpoint directory (a run's ``final/`` export: objective,
block size, window and document mask default to the run's
``config.yaml`` one directory up, the mask token to the one the model was trained with, read as
``csbp generate`` reads it; the document mask of other checkpoints to the objective's training
default (``--[no-]document-mask`` sets it); ``--objective`` / ``--block-size`` other than the run's are
refused unless ``--allow-objective-change`` / ``--allow-block-size-change``, as in ``csbp
generate``: scoring a bd3-trained model as mdlm is a legitimate experiment, a silent one is not).
Runs on one process; ``--nproc N`` (with ``--cp``/``--bp``; default ``max(cp, bp)``)
scores on ``N`` local processes through the training engine's layouts, with the same numbers.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from csbp.cli.generate_cmd import DTYPES
from csbp.cli.options import (
    check_layout_flags,
    check_model_directory,
    device_option,
    int_at_least,
    output_file,
    path_option,
    positive_int,
)
from csbp.cli.trained_settings import add_override_flags, check_trained_overrides, print_notes


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``eval``."""
    parser = subparsers.add_parser(
        "eval",
        help="NELBO, perplexity bound and exact left-to-right NLL of a model on a data split",
        description=(
            "Evaluate a block-diffusion checkpoint on a prepared data split (one process by default): the unclipped "
            "NELBO per token (t in [1e-3, 1], mean and standard error over --samples noise draws), the "
            "perplexity bound exp(NELBO), and the exact NLL of left-to-right unmasking. All in nats per token. "
            "--nproc/--cp/--bp run the same evaluation on several local processes (CSBP layouts)."
        ),
    )
    parser.add_argument("--model", type=path_option, required=True, help="HF checkpoint directory (e.g. RUN/final)")
    parser.add_argument("--data", type=path_option, required=True, help="prepared data artifact (csbp data prepare)")
    parser.add_argument("--split", choices=("val", "train"), default="val", help="split to score (default val)")
    parser.add_argument(
        "--objective",
        choices=("bd3", "mdlm", "fast_dllm_v2"),
        default=None,
        help="objective the model was trained with (default: the run's config.yaml)",
    )
    parser.add_argument(
        "--block-size", type=positive_int, default=None, help="training block size (default: the run's)"
    )
    add_override_flags(parser, "eval")
    parser.add_argument(
        "--document-mask", action=argparse.BooleanOptionalAction, default=None,
        help="attend within packed documents only (default: the run's data.document_mask, else the objective's "
        "training default: on for fast_dllm_v2, off for bd3/mdlm); one other than the run's is refused",
    )
    parser.add_argument("--samples", type=positive_int, default=4, help="noise draws per batch for the NELBO (default 4)")
    parser.add_argument("--micro-batch-size", type=positive_int, default=8, help="rows per forward (default 8)")
    parser.add_argument("--max-batches", type=positive_int, default=None, help="score at most this many batches")
    parser.add_argument("--no-ltr", action="store_true", help="skip the left-to-right NLL (B forwards per batch)")
    parser.add_argument("--seed", type=int_at_least(0), default=0, help="seed of the noise draws")
    parser.add_argument("--dtype", choices=("auto", *DTYPES), default="auto", help="auto: as stored")
    parser.add_argument(
        "--device", type=device_option, default=None, help="torch device (default: cuda if available, else cpu)"
    )
    parser.add_argument(
        "--nproc", type=positive_int, default=None,
        help="local processes (default max(--cp, --bp), one layout): data parallel over batches, times --cp/--bp per batch",
    )
    parser.add_argument("--cp", type=positive_int, default=1, help="context-parallel ring size per batch (default 1)")
    parser.add_argument("--bp", type=positive_int, default=1, help="block-parallel ranks per batch (default 1)")
    parser.add_argument("--json", type=output_file, default=None, help="also write the report to this JSON file")
    parser.set_defaults(func=run_eval)


def run_eval(args: argparse.Namespace) -> int:
    from csbp.atomic import write_json_atomic
    from csbp.data.artifact import open_artifact
    from csbp.evaluation import EvalOptions, evaluate_model, resolve_settings
    from csbp.evaluation.parallel import eval_topology, evaluate_parallel
    from csbp.evaluation.runner import check_scored_tokens
    from csbp.evaluation.settings import run_config_settings
    from csbp.generation.run_settings import beyond_training_note
    from csbp.models.hf_io import load_hf_checkpoint, read_hf_config

    check_layout_flags(args.cp, args.bp)  # before loading anything
    if args.nproc is None:  # one layout's processes, as csbp train defaults to its topology's world size
        args.nproc = max(args.cp, args.bp)
    model_dir: Path = check_model_directory(args.model)
    trained = run_config_settings(model_dir)
    notes = check_trained_overrides("eval", args, model_dir, trained)
    artifact = open_artifact(args.data)
    if not trained.get("reset_positions"):  # rows of seq_len tokens run positions 0 .. seq_len - 1
        fix = f"data prepared with --seq-len {trained.get('seq_len')} stays inside"
        note = beyond_training_note("eval", trained, artifact.seq_len, fix)
        notes += [note] if note is not None else []
    split = artifact.split(args.split)
    if split.num_rows == 0:
        raise ValueError(f"--split {args.split}: {args.data} has no {args.split} rows (fix: pick the other split)")
    # the settings' checks (block size against the data, vocabulary, mask token) read config.json only:
    # they run before the weights load
    model_config = read_hf_config(model_dir)
    settings = resolve_settings(
        model_dir, model_config, artifact, objective=args.objective, block_size=args.block_size,
        document_mask=args.document_mask,
    )
    topology = eval_topology(args.nproc, args.cp, args.bp, settings, artifact.seq_len)
    options = EvalOptions(
        samples=args.samples,
        micro_batch_size=args.micro_batch_size,
        max_batches=args.max_batches,
        seed=args.seed,
        left_to_right=not args.no_ltr,
    )
    check_scored_tokens(split, settings, options, vocab_size=model_config.vocab_size)  # before the weights load
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = None if args.dtype == "auto" else DTYPES[args.dtype]
    if topology.world_size == 1:
        model, _ = load_hf_checkpoint(model_dir, dtype=dtype, device=device)
        print_notes(notes)
        report = evaluate_model(model, split, settings, options)
    else:  # every rank loads its own copy
        print_notes(notes)
        report = evaluate_parallel(
            model_dir, args.data, args.split, settings, options, topology, dtype=dtype, device=device
        )
    print(report.format())
    if args.json is not None:
        write_json_atomic(args.json, {"model": str(model_dir), "data": str(args.data), **report.to_json()})
    return 0
