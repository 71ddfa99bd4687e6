"""``csbp train CONFIG``: validate a run config, start the processes its topology needs, train.

Usage::

    csbp train demo                                  # a packaged recipe, runs/demo, 4 local processes
    csbp train run.yaml --set optim.lr=1e-3 --max-steps 50
    csbp train run.yaml --resume                     # continue runs/<run.name> from its latest checkpoint
    torchrun --nproc-per-node 4 -m csbp.cli.main train run.yaml     # each rank joins the launch
    csbp train run.yaml --nproc 8 --nnodes 2 --rdzv-endpoint node0:29500 --rdzv-id job1   # per node

``topology: auto`` in the config (or ``--set topology=auto``) asks ``csbp plan`` for the layout of
``--nproc`` processes and prints it with its prediction before launching (``csbp.plan.auto``).

``--max-steps N`` stops after global step N (the learning-rate schedule still spans
``train.max_steps``), so ``--max-steps N`` followed by ``--resume`` reproduces one uninterrupted run.
Everything is validated before any process starts; errors are one line each.
"""

from __future__ import annotations

import argparse
import os
import sys

from csbp.cli.config_cmd import add_override_argument
from csbp.cli.options import (
    check_endpoint_resolves,
    int_at_least,
    path_option,
    positive_int,
    rendezvous_endpoint,
)
from csbp.plan.auto import resolve_auto_topology
from csbp.recipes import load_run_config
from csbp.training.launcher import (
    LaunchOptions,
    TrainingFailed,
    inside_torchrun,
    launch_training,
    node_flag_problem,
)
from csbp.training.stop_request import STOPPED_EXIT_CODE
from csbp.training.worker import skip_teardown_at_exit

TRAIN_EXAMPLES = """\
examples:
  csbp train demo --run-dir runs/demo                     # starts the topology's dp x max(cp, bp) processes
  csbp train run.yaml --set optim.lr=1e-3 --max-steps 50
  csbp train run.yaml --run-dir runs/mine --resume        # continue from the latest checkpoint
  torchrun --nproc-per-node 8 -m csbp train run.yaml      # under your own launcher: this rank

signals:
  SIGUSR1 (a preemption notice, e.g. SLURM --signal=USR1@120): checkpoint after the current step and
  exit 75, not finished (--resume continues it); SIGTERM and Ctrl-C end the run at once (143, 130)
"""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train a model from a run config",
        description="Train from a YAML run config (or packaged recipe); see `csbp config validate`.",
        epilog=TRAIN_EXAMPLES,
    )
    parser.add_argument("config", metavar="CONFIG", help="YAML config file, or a packaged recipe name")
    add_override_argument(parser)
    parser.add_argument(
        "--run-dir", type=path_option, default=None, help="output directory (default: run.run_dir or runs/<run.name>)"
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue from the run directory's latest checkpoint"
    )
    parser.add_argument(
        "--max-steps",
        type=positive_int,
        default=None,
        metavar="N",
        help="stop after global step N <= train.max_steps (the schedule still spans train.max_steps)",
    )
    parser.add_argument(
        "--nproc",
        type=positive_int,
        default=None,
        metavar="N",
        help="processes on this node (default: train.nproc, else the topology's world size)",
    )
    parser.add_argument("--nnodes", type=positive_int, default=1, metavar="N", help="number of nodes (default: 1)")
    parser.add_argument(
        "--node-rank", type=int_at_least(0), default=None, metavar="R", help="this node's rank (static rendezvous)"
    )
    parser.add_argument(
        "--rdzv-endpoint", type=rendezvous_endpoint, default=None, metavar="HOST:PORT", help="rendezvous endpoint (multi-node)"
    )
    parser.add_argument("--rdzv-id", default=None, metavar="ID", help="job id shared by all nodes")
    parser.set_defaults(func=run_train)


def run_train(args: argparse.Namespace) -> int:
    if not inside_torchrun():  # before the config is read (the launcher checks them again, after the data)
        check_process_count_flags(args)
    nproc, nnodes = launched_processes(args)
    overrides = resolve_auto_topology(
        args.config, args.overrides, nproc=nproc, nnodes=nnodes, echo=os.environ.get("RANK", "0") == "0"
    )
    cfg = load_run_config(args.config, overrides)
    options = LaunchOptions(
        nproc=args.nproc,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id,
    )
    try:
        summary = launch_training(
            cfg, run_dir=args.run_dir, resume=args.resume, max_steps=args.max_steps, options=options
        )
    except TrainingFailed as exc:
        if exc.details and (not exc.expected or args.debug):
            print(exc.details.rstrip(), file=sys.stderr)
        print(f"csbp: error: {exc}", file=sys.stderr)
        return 1
    if summary is not None:
        print(summary.format())
    # STOPPED_EXIT_CODE: checkpointed on SIGUSR1, not finished (csbp.training.stop_request)
    code = STOPPED_EXIT_CODE if summary is not None and summary.stopped_by_signal else 0
    if inside_torchrun():
        # this rank succeeded: a gloo teardown abort must not fail the launch (nor turn a stop's 75 into 0)
        skip_teardown_at_exit(code)
    return code


def check_process_count_flags(args: argparse.Namespace) -> None:
    """``ValueError`` for node flags that contradict each other, whatever the config, and for a
    rendezvous host that does not resolve."""
    problem = node_flag_problem(args.nnodes, args.node_rank, args.rdzv_endpoint)
    if problem is not None:
        raise ValueError(problem)
    if args.rdzv_endpoint is not None:
        check_endpoint_resolves(args.rdzv_endpoint)


def launched_processes(args: argparse.Namespace) -> tuple[int | None, int]:
    """``(processes per node, nodes)`` for ``topology: auto``: the flags', or under your own
    ``torchrun`` (no ``--nproc``) its ``LOCAL_WORLD_SIZE`` and ``WORLD_SIZE`` (``topology: auto`` asked
    for ``--nproc`` there, which the launch itself never reads)."""
    if args.nproc is not None or not inside_torchrun():
        return args.nproc, args.nnodes
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return local, max(1, world // local)
