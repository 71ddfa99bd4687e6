"""The ``csbp`` command: an argparse root whose subcommands live in one module each.

Every module in :data:`SUBCOMMAND_MODULES` exposes ``register(subparsers) -> None``, which adds its
parser(s) and sets ``func`` (``(args: argparse.Namespace) -> int``, the exit code) through
``set_defaults``. Subcommands stay thin: they parse arguments and call library functions.

User errors (``ValueError``, including :class:`csbp.config.ConfigError`, and
``FileNotFoundError``) print one ``csbp: error: <message>`` line per problem to stderr and exit
with code 2, without a traceback; ``csbp --debug ...`` re-raises them to show the traceback.

Usage::

    csbp --version
    csbp config validate demo --set optim.lr=1e-3
    csbp recipes list
    csbp doctor
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from csbp import __version__

SUBCOMMAND_MODULES: tuple[str, ...] = (
    "csbp.cli.config_cmd",
    "csbp.cli.recipes_cmd",
    "csbp.cli.doctor_cmd",
    "csbp.cli.data_cmd",
    "csbp.cli.train_cmd",
    "csbp.cli.verify_cmd",
    "csbp.cli.generate_cmd",
    "csbp.cli.dflash_cmd",
    "csbp.cli.bench_cmd",
    "csbp.cli.compare_cmd",
    "csbp.cli.plan_cmd",
)
"""Modules registering subcommands, in ``csbp --help`` order. A missing module is an ImportError."""

USER_ERROR_EXIT_CODE = 2


def build_parser() -> argparse.ArgumentParser:
    """The root parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="csbp",
        description="Context-sharded block parallelism: train block-diffusion language models.",
    )
    parser.add_argument("--version", action="version", version=f"csbp {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``csbp`` with ``argv`` (default ``sys.argv[1:]``) and return the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version and argparse usage errors
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return USER_ERROR_EXIT_CODE
    try:
        return int(func(args))
    except (ValueError, FileNotFoundError) as exc:
        if args.debug:
            raise
        for line in str(exc).splitlines() or [type(exc).__name__]:
            print(f"csbp: error: {line}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    except KeyboardInterrupt:
        print("csbp: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
