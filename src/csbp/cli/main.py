"""The ``csbp`` command: an argparse root whose subcommands live in one module each.

Every module in :data:`SUBCOMMAND_MODULES` exposes ``register(subparsers) -> None``, which adds its
parser(s) and sets ``func`` (``(args: argparse.Namespace) -> int``, the exit code) through
``set_defaults``. Subcommands stay thin: they parse arguments and call library functions.

User errors (``ValueError``, including :class:`csbp.config.ConfigError`, ``FileNotFoundError``
and other ``OSError``s such as a ``--out`` path inside a file) print one ``csbp: error: <message>``
line per problem to stderr and exit with code 2, without a traceback; ``csbp --debug ...``
re-raises them to show the traceback. Ctrl-C and ``SIGTERM`` print ``csbp: interrupted`` and exit
with 130 and 143 (a Ctrl-C while the command's modules import, torch among them, takes effect once
they are imported: raised inside them, it could be swallowed or leave a module half initialised). When the reader of stdout goes away (``csbp plan ... | head -3``) the command
stops quietly with exit status 141, as a Unix tool stopped by ``SIGPIPE`` does.

Usage::

    csbp --version
    csbp config validate demo --set optim.lr=1e-3
    csbp recipes list
    csbp doctor
"""

from __future__ import annotations

import argparse
import copy
import difflib
import importlib
import os
import re
import select
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from csbp import __version__
from csbp.cli.options import LARGEST_INT_OPTION
from csbp.interrupts import Interrupted, sigint_deferred, sigterm_raises

SUBCOMMAND_MODULES: tuple[str, ...] = (
    "csbp.cli.config_cmd",
    "csbp.cli.recipes_cmd",
    "csbp.cli.doctor_cmd",
    "csbp.cli.data_cmd",
    "csbp.cli.train_cmd",
    "csbp.cli.verify_cmd",
    "csbp.cli.generate_cmd",
    "csbp.cli.eval_cmd",
    "csbp.cli.export_cmd",
    "csbp.cli.dflash_cmd",
    "csbp.cli.bench_cmd",
    "csbp.cli.compare_cmd",
    "csbp.cli.plan_cmd",
)
"""Modules registering subcommands, in ``csbp --help`` order. A missing module is an ImportError."""

USER_ERROR_EXIT_CODE = 2

OVERRIDE_WORD = re.compile(r"^[A-Za-z_]\w*(\.\w+)+=")
"""A ``section.key=value`` word: a ``--set`` override that lost its flag."""

CLOSED_OUTPUT_EXIT_CODE = 141
"""128 + SIGPIPE: the status the shell reports for ``seq 1000000 | head -1``'s writer. Not 0: under
``set -o pipefail`` a script learns the output was cut short, as it would from any Unix tool."""


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Help that shows each option's default, ``(default: X)``, unless its text already names one or
    the default is unset (``None``, ``False``, an empty list such as repeatable ``--set``'s)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or default is None
            or default is False
            or (isinstance(default, (list, tuple)) and not default)
            or default is argparse.SUPPRESS
            or "default" in text
        ):
            return action.help
        shown = " ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})".lstrip()

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        """Text with line breaks of its own (an ``examples:`` epilog) as written; else wrapped."""
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)

    def _format_action(self, action: argparse.Action) -> str:
        if action.help is None and action.option_strings:  # argparse prints no help line for these
            action = copy.copy(action)
            action.help = ""
            action.help = self._get_help_string(action) or None
        return super()._format_action(action)


NEGATIVE_VALUE = re.compile(r"^-(\.?\d[\w.+-]*|inf|nan)$", re.IGNORECASE)  # -256K, -1e-3, -0.5, -.5, -inf


class OneLineErrorParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line (``csbp train: error: ... (see ... --help)``)
    and whose help shows defaults (:class:`DefaultsHelpFormatter`); sub-parsers inherit the class."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", DefaultsHelpFormatter)
        super().__init__(*args, **kwargs)
        # argparse takes only plain numbers (-5, -.5) for values: "--seq-len -256K" would be "expected one
        # argument"; as a value it reaches the flag's own check ("must be positive"). No csbp flag looks so.
        self._negative_number_matcher = NEGATIVE_VALUE

    def _get_value(self, action: argparse.Action, arg_string: str) -> Any:
        value = super()._get_value(action, arg_string)
        # every integer flag, `type=int` ones included: a 10**30 reached torch (OverflowError tracebacks)
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > LARGEST_INT_OPTION:
            raise argparse.ArgumentError(action, f"{arg_string} is too large (at most 2^63 - 1)")
        return value

    def error(self, message: str) -> NoReturn:
        message = with_suggestion(message)
        self.exit(USER_ERROR_EXIT_CODE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


INVALID_CHOICE = re.compile(r"invalid choice: '?(?P<given>[^'(]*?)'? \(choose from (?P<choices>.*)\)$")


def with_suggestion(message: str) -> str:
    """argparse's ``invalid choice: 'trian' (choose from ...)`` with the nearest choice appended
    (``; did you mean train?``), as config keys and recipe names get one."""
    match = INVALID_CHOICE.search(message)
    if match is None:
        return message
    choices = [choice.strip().strip("'") for choice in match["choices"].split(",")]
    close = difflib.get_close_matches(match["given"], choices, n=1)
    return f"{message}; did you mean {close[0]}?" if close else message


ROOT_EXAMPLES = """\
examples:
  csbp recipes list                                  # the packaged run configs
  csbp config validate demo --print                  # a config with every default
  csbp train demo --run-dir runs/demo                # train (the topology's process count)
  csbp verify --nproc 4                              # every layout against one process
  csbp generate --model runs/demo/final --prompt "KING."
  csbp COMMAND --help                                # a command's options
"""


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The root parser with every subcommand registered, or only ``command``'s when a module
    ``csbp.cli.<command>_cmd`` registers it (``main`` passes the command it is given, so e.g.
    ``csbp plan`` does not import the training stack and torch; ``csbp --help`` lists all)."""
    parser = OneLineErrorParser(
        prog="csbp",
        description="Context-sharded block parallelism: train block-diffusion language models.",
        epilog=ROOT_EXAMPLES,
    )
    parser.add_argument("--version", action="version", version=f"csbp {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks for user errors")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    only = f"csbp.cli.{command}_cmd"
    for module_name in (only,) if only in SUBCOMMAND_MODULES else SUBCOMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    _debug_after_the_command(parser)
    return parser


def _debug_after_the_command(parser: argparse.ArgumentParser) -> None:
    """``--debug`` also after a (sub)command (``csbp train run.yaml --debug``), where users type it."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases share their parser
                if not any("--debug" in a.option_strings for a in sub._actions):
                    sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                                     help="show tracebacks for user errors (as csbp --debug)")
                _debug_after_the_command(sub)


def command_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)parser of the innermost subcommand ``args`` chose (``csbp data prepare``'s)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = action.choices.get(getattr(args, action.dest, None) or "")
            if chosen is not None:
                return command_parser(chosen, args)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``csbp`` with ``argv`` (default ``sys.argv[1:]``) and return the exit code."""
    try:
        code = _run(argv)
        sys.stdout.flush()  # output still buffered fails here, not at interpreter exit
    except BrokenPipeError:
        if not stdout_reader_gone():
            raise
        # the reader (`| head`) has what it wanted: stop quietly; devnull under stdout keeps the
        # interpreter's own flush at exit from failing a second time ("Exception ignored ...")
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return CLOSED_OUTPUT_EXIT_CODE
    return code


def stdout_reader_gone() -> bool:
    """Whether stdout is a pipe or socket whose reading end is closed (``poll`` reports an error on
    it): a ``BrokenPipeError`` from a socket of the training processes is not the reader's."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by a non-file object (tests' capture)
        return False
    if not hasattr(select, "poll"):  # Windows: trust the error
        return True
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def _run(argv: Sequence[str] | None) -> int:
    words = sys.argv[1:] if argv is None else list(argv)
    try:
        # imports the command's modules (torch: seconds on a loaded machine), so Ctrl-C often lands here
        with sigint_deferred():  # raised after the imports: one inside them may be swallowed
            parser = build_parser(next((w for w in words if not w.startswith("-")), None))
        args, extras = parser.parse_known_args(argv)
        if extras:  # said by the subcommand's parser: "see csbp train --help", not "see csbp --help"
            overrides = [word for word in extras if OVERRIDE_WORD.match(word)]
            hint = f"; each KEY=VALUE needs its own --set: --set {overrides[0]}" if overrides else ""
            command_parser(parser, args).error(f"unrecognized arguments: {' '.join(extras)}{hint}")
    except SystemExit as exc:  # --help, --version and argparse usage errors
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except KeyboardInterrupt:
        print("csbp: interrupted", file=sys.stderr)
        return 130
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help(sys.stderr)
        return USER_ERROR_EXIT_CODE
    try:
        with sigterm_raises():
            return int(func(args))
    except (ValueError, FileNotFoundError) as exc:
        if args.debug:
            raise
        if isinstance(exc, OSError) and exc.errno is not None:  # from the OS: name the file and the fix
            print(f"csbp: error: {describe_os_error(exc)}", file=sys.stderr)
            return USER_ERROR_EXIT_CODE
        for line in str(exc).splitlines() or [type(exc).__name__]:
            print(f"csbp: error: {line}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    except OSError as exc:  # NotADirectoryError, PermissionError, FileExistsError, disk full, ...
        if args.debug or isinstance(exc, BrokenPipeError) and stdout_reader_gone():
            raise  # main() stops quietly when stdout's reader went away
        print(f"csbp: error: {describe_os_error(exc)}", file=sys.stderr)
        return USER_ERROR_EXIT_CODE
    except KeyboardInterrupt:
        print("csbp: interrupted", file=sys.stderr)
        return 130
    except Interrupted as exc:
        print("csbp: interrupted", file=sys.stderr)
        return exc.exit_code


_OS_ERROR_FIXES: dict[type[OSError], str] = {
    FileExistsError: "a file is in the way: choose another path or move it",
    NotADirectoryError: "a file is where a directory is expected: choose another path",
    IsADirectoryError: "a directory is where a file is expected: choose another path",
    PermissionError: "check the path's permissions (ls -l), or choose a path you may read or write",
    ChildProcessError: "a worker process was killed, often for memory: run again, with fewer workers if memory is short",
}


def describe_os_error(exc: OSError) -> str:
    """One line naming the file(s) of an ``OSError``, what went wrong and what to do."""
    reason = exc.strerror or str(exc) or type(exc).__name__
    names = [str(name) for name in (exc.filename, exc.filename2) if name is not None]
    where = " -> ".join(names)
    fix = next((text for kind, text in _OS_ERROR_FIXES.items() if isinstance(exc, kind)), "check the path")
    line = f"{reason} ({type(exc).__name__}) (fix: {fix})"
    return f"{where}: {line}" if where else line


if __name__ == "__main__":
    sys.exit(main())
