"""``csbp plan``: the best layout for a model, a context length and a cluster, from a calibrated
cost model (``csbp.plan``); ``csbp plan calibrate``: fit the model to your own benchmarks.

Usage::

    csbp plan --model nemotron-14b --seq-len 256K --gpus 16 --gpu h200
    csbp plan --model dflash2-qwen3.8 --seq-len 1M --gpus 8 --gpu h100 --top 5 --json plan.json
    csbp plan --model run.yaml --seq-len 4096 --gpus 4 --gpu cpu --topology dp1/cp4 dp1/cp4/bp4
    csbp plan --model nemotron-8b --seq-len 1M --gpus 32 --gpu h200 --doc-length 8192  # packed documents
    csbp plan --model nemotron-8b --gpus 8 --gpu h200 --data artifacts/demo-4k-64  # its real documents
    csbp plan --model run.yaml --gpus 8 --gpu h200  # with data.document_mask: data.train's documents

``csbp plan calibrate`` (its parser and run) is :mod:`csbp.cli.plan_calibrate_cmd`; what ``csbp plan``
prints and writes is :mod:`csbp.cli.plan_output`.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from csbp.atomic import write_json_atomic
from csbp.cli.options import add_override_argument, int_at_least, output_file, path_option, positive_int
from csbp.cli.plan_calibrate_cmd import register_calibrate
from csbp.cli.plan_output import format_plan, plan_json
from csbp.plan.artifact_documents import (
    SAMPLE_ROWS,
    SAMPLE_TOKENS,
    artifact_documents,
    run_config_documents,
)
from csbp.plan.auto import load_plannable_config, run_search
from csbp.plan.calibration import Calibration, load_calibration, packaged_calibration
from csbp.plan.hardware import PRESETS, hardware
from csbp.plan.layout import MAX_DEVICES, Layout, parse_topology
from csbp.plan.planner_memory import check_planner_memory
from csbp.plan.remedy import Search, nothing_fits
from csbp.plan.run_config_workload import run_config_workload
from csbp.plan.search import (
    Plan,
    candidate_layouts,
    no_layout_reason,
    rank,
    schedules_for,
    sequence_problem,
    transports_for,
)
from csbp.plan.target_pass import TARGET_PASSES
from csbp.plan.workload import OBJECTIVES, Workload, hf_workload, preset_names, preset_workload

if TYPE_CHECKING:
    from csbp.config.schema import RunConfig

_LENGTH = re.compile(r"^(\d+)([kKmM]?)$")


def parse_length(text: str) -> int:
    """``4096``, ``256K`` (x1024) or ``1M`` (x2^20)."""
    match = _LENGTH.match(text.strip())
    if match is None or int(match.group(1)) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a length: use e.g. 4096, 256K or 1M")
    scale = {"": 1, "k": 1024, "m": 1 << 20}[match.group(2).lower()]
    return int(match.group(1)) * scale


def model_spec(text: str) -> str:
    """``--model``: a preset name or a path, never empty (``--model ''`` read the working directory)."""
    path_option(text)
    return text


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="rank the layouts of a model, context length and cluster by predicted speed and memory",
        description="Predict step time, tokens/s, K/V traffic and peak memory of every layout csbp can run "
        "and rank them (the cost model of csbp.plan); `csbp plan calibrate` fits it to your benchmarks.",
    )
    parser.add_argument(
        "--model", type=model_spec, help=f"run config, HF config.json (or folder), or preset: {', '.join(preset_names())}"
    )
    parser.add_argument(
        "--seq-len",
        type=parse_length,
        help="tokens per sample, e.g. 4096, 256K, 1M (default: a run config's)",
    )
    parser.add_argument(
        "--gpus", type=int_at_least(1, high=MAX_DEVICES, why="torch.distributed and NCCL number ranks with a C int"),
        help="devices of the job",
    )
    parser.add_argument(
        "--gpus-per-node", type=int, default=None, help="devices per node (default: the preset's)"
    )
    parser.add_argument(
        "--gpu", choices=tuple(PRESETS), default="h100", help="hardware preset (default h100)"
    )
    parser.add_argument(
        "--objective", choices=OBJECTIVES, default=None, help="override the model's objective"
    )
    parser.add_argument("--block-size", type=int, default=None, help="diffusion block size B")
    parser.add_argument("--window", type=int, default=None, help="sliding attention window of every layer")
    parser.add_argument("--anchors", type=int, default=None, help="DFlash anchors per sample")
    parser.add_argument(
        "--drafter-context",
        choices=("all", "windows"),
        default=None,
        help="target-feature rows a drafter rank projects: all it holds (csbp) or its anchors' windows "
        "(the published reference; the presets' default)",
    )
    parser.add_argument(
        "--target-pass",
        choices=TARGET_PASSES,
        default=None,
        help="a drafter's target features: offline (captured ahead of time: no target in the step; the "
        "presets' default, as the published runs), or the online frozen-target pass, sharded (each CP ring "
        "member runs its L/cp rows, K/V all-gathered per layer) or replicated (the full row on every rank), "
        "as objective.dflash.target_capture; a run config's default is what it runs",
    )
    parser.add_argument(
        "--target-config",
        type=path_option,
        default=None,
        metavar="PATH",
        help="the frozen target's HF config.json (or folder) for --target-pass sharded|replicated on a preset "
        "(every target layer run); a run config's objective.dflash.target names its own",
    )
    parser.add_argument(
        "--doc-length",
        type=int,
        default=None,
        metavar="N",
        help="rows pack documents of mean length N under the document mask (geometric lengths, the last "
        "one cut at the row's end: what `csbp bench --doc-length N` packs); adds CP-only cp-aware",
    )
    parser.add_argument(
        "--data",
        type=path_option,
        default=None,
        metavar="ARTIFACT",
        help="plan the real documents of a `csbp data prepare` artifact under the document mask (rows of "
        f"L consecutive tokens of its stream, {SAMPLE_ROWS} (at most {SAMPLE_TOKENS >> 20}M tokens) spread over "
        "the split, predictions averaged; "
        "default L: the artifact's seq_len); adds cp-aware and the balanced schedule",
    )
    parser.add_argument(
        "--split", choices=("train", "val"), default="train", help="the --data split planned (default train)"
    )
    parser.add_argument(
        "--data-rows",
        type=positive_int,
        default=None,
        metavar="N",
        help=f"rows of --data planned (default {SAMPLE_ROWS}, fewer past {SAMPLE_TOKENS >> 20}M tokens)",
    )
    parser.add_argument(
        "--global-batch", type=positive_int, default=None, help="samples per optimizer step (default dp)"
    )
    parser.add_argument(
        "--checkpointing", choices=("full", "selective", "none", "both"), default=None,
        help="activation checkpointing of the layouts planned (default: both, full and none; selective keeps "
        "each layer's attention results and recomputes the rest; a DFlash drafter is planned without, the "
        "only setting its cost model prices)",
    )
    parser.add_argument(
        "--placement",
        choices=("packed", "striped"),
        default="packed",
        help="CP rings inside a node when they fit (csbp's rank order) or striped across nodes",
    )
    parser.add_argument(
        "--sharding",
        choices=("fsdp2", "zero2", "ddp"),
        default=None,
        help="optimizer/gradient/weight sharding (default: a run config's train.fsdp, fsdp2 or ddp; else fsdp2)",
    )
    parser.add_argument(
        "--topology",
        nargs="+",
        default=None,
        metavar="dpA/cpB/bpC",
        help="evaluate these layouts instead of searching",
    )
    parser.add_argument(
        "--calibration",
        type=path_option,
        default=None,
        help="calibration JSON (default: packaged, fitted on published runs; cpu: fitted here)",
    )
    parser.add_argument("--top", type=positive_int, default=10, help="feasible layouts shown (default 10)")
    parser.add_argument("--json", type=output_file, default=None, help="write the full ranking to this JSON file")
    add_override_argument(parser)
    parser.set_defaults(func=run_plan)
    sub = parser.add_subparsers(dest="plan_command", metavar="[calibrate]", title="optional subcommand")
    register_calibrate(sub)


def resolve_workload(spec: str, overrides: list[str] | None = None) -> tuple[Workload, RunConfig | None]:
    """A preset name, a HF ``config.json`` (or folder), or a run config / packaged recipe (with
    ``--set`` overrides), and that run config (else None)."""
    if spec in preset_names():
        workload = preset_workload(spec)
    elif Path(spec).is_dir() or (Path(spec).suffix == ".json" and os.path.lexists(spec)):
        workload = hf_workload(Path(spec))
    else:
        if not os.path.lexists(spec):
            _check_recipe_name(spec)  # imports the config stack (and torch) only here: presets stay torch-free
        cfg = load_plannable_config(spec, overrides or [])  # topology: auto is what the planner chooses
        return run_config_workload(cfg), cfg
    if overrides:
        raise ValueError("--set applies to run configs only: --model here is a preset or a HF config.json")
    return workload, None


def _check_recipe_name(spec: str) -> None:
    """``ValueError`` unless ``spec``, naming no file, is a packaged recipe: a path says it is missing
    (not which kinds of --model there are), a bare word lists them with the closest name."""
    from csbp.recipes import list_recipes

    recipes = list_recipes()
    if spec in recipes:
        return
    if any(sep in spec for sep in ("/", os.sep)) or Path(spec).suffix in (".yaml", ".yml", ".json"):
        raise ValueError(
            f"--model {spec}: no such file or directory (fix: check the path, or name a preset "
            f"({', '.join(preset_names())}) or recipe ({', '.join(recipes)}))"
        )
    close = difflib.get_close_matches(spec, [*preset_names(), *recipes], n=1)
    raise ValueError(
        f"--model {spec!r} is no preset ({', '.join(preset_names())}), recipe ({', '.join(recipes)}), "
        "run config file or HF config.json (or folder holding one)" + (f" (fix: did you mean {close[0]}?)" if close else "")
    )


def run_plan(args: argparse.Namespace) -> int:
    if args.model is None or args.gpus is None:
        raise ValueError(
            "csbp plan needs --model and --gpus (e.g. --model nemotron-14b --seq-len 256K --gpus 16)"
        )
    if args.data is not None and args.doc_length is not None:
        raise ValueError("--data and --doc-length both say what the rows pack: give one of the two")
    if args.data is None and (args.data_rows is not None or args.split != "train"):
        raise ValueError("--split and --data-rows choose the rows of --data ARTIFACT: add --data")
    workload, run_config = resolve_workload(args.model, args.overrides)
    workload = workload.with_options(
        objective=args.objective,
        block_size=args.block_size,
        window=args.window,
        anchors=args.anchors,
        drafter_context=args.drafter_context,
        doc_length=args.doc_length,
    ).with_target_pass(args.target_pass, args.target_config)
    args.seq_len = args.seq_len or (run_config.data.seq_len if run_config is not None else None)
    if run_config is not None and args.data is None and args.doc_length is None:
        workload = _run_documents(args, workload, run_config)
    if args.data is not None:
        if args.seq_len is None:
            from csbp.data.artifact import open_artifact

            args.seq_len = open_artifact(args.data).seq_len
        sample = artifact_documents(args.data, args.seq_len, split=args.split, rows=args.data_rows)
        workload = replace(workload, doc_length=sample)
        if run_config is not None and not run_config.document_mask:  # it plans a run the config would not train
            print(f"note: --data plans {args.data}'s documents under the document mask, but {args.model} trains "
                  "with data.document_mask false (set it true to train what is planned)")
    if run_config is not None and run_config.train.compile != "none":  # predicted as eager (plan calibrate)
        print(f"note: {args.model} sets train.compile: {run_config.train.compile}; the times and memory below are "
              "the eager step's (the cost model is fitted on eager runs only)")
    if args.seq_len is None:
        raise ValueError("csbp plan needs --seq-len for a preset or HF model (e.g. --seq-len 256K)")
    check_planner_memory(args.seq_len, workload)
    hw = hardware(args.gpu, gpus=args.gpus, gpus_per_node=args.gpus_per_node)
    cal = load_calibration(args.calibration) if args.calibration else packaged_calibration(args.gpu)
    if workload.objective.is_drafter and args.checkpointing not in (None, "none"):
        raise ValueError(
            f"--checkpointing {args.checkpointing}: csbp plan prices a DFlash drafter without activation "
            "checkpointing only (its drafter memory and time model is fitted on such runs) (fix: drop --checkpointing)"
        )
    args.checkpointing = args.checkpointing or "both"
    ckpts = ("full", "none") if args.checkpointing == "both" else (args.checkpointing,)
    # a run config fixes what topology: auto keeps (its sharding, micro-batch and accumulation), so
    # the table's first row is auto's pick; --sharding and --global-batch override it
    search = run_search(run_config) if run_config is not None else None
    args.sharding = args.sharding or (search.sharding if search is not None else "fsdp2")
    micro_batches, accum = (1, 2, 4), 1
    if search is not None and args.global_batch is None:
        micro_batches, accum = (search.micro_batch,), search.grad_accum
        print(
            f"run config: train.micro_batch_size {search.micro_batch} x train.grad_accum {accum} per replica, "
            f"sharding {args.sharding} ({'--sharding' if args.sharding != search.sharding else 'train.fsdp'}), "
            "as topology: auto plans it"
        )
    if args.topology:
        layouts = _given_layouts(args, workload, ckpts, micro_batches[0])
    else:
        layouts = candidate_layouts(
            workload,
            args.gpus,
            args.seq_len,
            global_batch=args.global_batch,
            checkpointing=ckpts,
            placement=args.placement,
            sharding=args.sharding,
            micro_batches=micro_batches,
        )
        if not layouts:
            raise ValueError(no_layout_reason(workload, args.gpus, args.seq_len, global_batch=args.global_batch))
    plan = rank(workload, layouts, args.seq_len, hw, cal, global_batch=args.global_batch, grad_accum=accum)
    print(format_plan(plan, workload, args.seq_len, args.gpus, hw, cal, top=args.top))
    # nothing fits: the table shows what was tried, then one error line (exit 2), so that
    # `csbp plan ... && torchrun ...` stops here
    failure = None if plan.best is not None else _nothing_fits(args, plan, workload, cal, hw.name, micro_batches, accum)
    if args.json is not None:
        write_json_atomic(args.json, plan_json(plan, workload, args.seq_len, args.gpus, hw, cal, error=failure))
        print(f"wrote {args.json}")
    if failure is not None:
        raise ValueError(failure)
    return 0


def _nothing_fits(
    args: argparse.Namespace, plan: Plan, workload: Workload, cal: Calibration, hw_name: str,
    micro_batches: tuple[int, ...], accum: int,
) -> str:
    """The one line (with the fixes the planner checked) for a plan none of whose layouts fits."""
    search = Search(
        workload, args.gpus, args.seq_len, args.gpu, cal, gpus_per_node=args.gpus_per_node,
        checkpointing=("full", "none") if args.checkpointing == "both" else (args.checkpointing,),
        sharding=args.sharding, placement=args.placement, micro_batches=micro_batches,
        global_batch=args.global_batch, grad_accum=accum,
    )
    return nothing_fits(plan, search, hardware_name=hw_name, given=args.topology or ())


def _run_documents(args: argparse.Namespace, workload: Workload, run_config: RunConfig) -> Workload:
    """A run config with ``data.document_mask`` plans ``data.train``'s documents (as ``topology: auto``)."""
    try:
        sample = run_config_documents(run_config, args.seq_len)
    except ValueError as exc:
        raise ValueError(
            f"--model {args.model} has data.document_mask, so csbp plan plans data.train's documents: {exc} "
            "(or pass --doc-length N / --data ARTIFACT)"
        ) from None
    if sample is None:
        return workload
    print(f"documents: data.train of {args.model} (data.document_mask; --doc-length N or --data ARTIFACT overrides)")
    return replace(workload, doc_length=sample)


def _given_layouts(
    args: argparse.Namespace, workload: Workload, ckpts: tuple[str, ...], micro_batch: int
) -> list[Layout]:
    layouts = []
    for text in args.topology:
        dp, cp, bp = parse_topology(text, name="--topology")
        local = max(cp, bp)
        if dp * local != args.gpus:
            scaled = Layout(args.gpus // local, cp, bp).name if args.gpus % local == 0 else None
            other = f", or --topology {scaled}" if scaled is not None else ""
            raise ValueError(
                f"--topology {text} uses {dp * local} devices, not --gpus {args.gpus} (fix: --gpus {dp * local}{other})"
            )
        if args.global_batch is not None and args.global_batch % (dp * micro_batch):
            unit = dp * micro_batch
            raise ValueError(
                f"--global-batch {args.global_batch} is not a multiple of dp x micro-batch = {unit} of --topology "
                f"{text} (fix: --global-batch {-(-args.global_batch // unit) * unit}, a multiple of {unit})"
            )
        base = Layout(dp, cp, bp, micro_batch=micro_batch, placement=args.placement, sharding=args.sharding)
        problem = sequence_problem(workload, base, args.seq_len)
        if problem is not None:
            raise ValueError(f"--topology {text}: {problem[0]} (fix: {problem[1]}, or another --topology)")
        if workload.objective.is_drafter:
            ckpts = ("none",)
        for transport in transports_for(workload, base):
            for ckpt in ckpts:
                for schedule in schedules_for(workload, base):
                    layouts.append(replace(base, transport=transport, checkpointing=ckpt, schedule=schedule))  # type: ignore[arg-type]
    return layouts
