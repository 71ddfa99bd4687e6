"""README.md and docs/*.md stay in step with the ``csbp`` command and with each other: every
``csbp`` command line in a code block parses with the real parser (no flag that was renamed or
removed, no missing value), every ``--flag`` named in an inline ``csbp ...`` span exists on that
subcommand, and every relative link and ``#anchor`` between the documents resolves.

Nothing is run: the commands are parsed, as ``csbp`` parses them before doing anything. A command
holding a ``...`` placeholder (``csbp plan --model ... --calibration cal.json``) is only checked
for its flags, since the placeholder stands for words the reader fills in.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from csbp.cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_OPERATORS = {"|", "||", "&&", ";", ">", ">>", "2>&1", "&"}
COMMAND_START = re.compile(r"^(?P<prompt>\$ )?(?:\S*/)?csbp (?P<rest>[a-z].*)$")
OUTPUT_LINE = re.compile(r"^[a-z-]+(?: [a-z-]+)?:")  # `csbp verify: L=32 ...`, `csbp: error: ...`
INLINE = re.compile(r"`(?:\S*/)?csbp (?P<rest>[^`]+)`")


def block_commands(text: str) -> list[tuple[int, str]]:
    """``(line, words after csbp)`` of each command in a fenced block, continuation lines joined; in a
    ``text`` block (a command with its output) only the ``$ ``-prompted lines are commands."""
    found: list[tuple[int, str]] = []
    fence, pending, start = None, "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip().startswith("```"):
            fence, pending = (line.strip()[3:] if fence is None else None), ""
            continue
        if fence is None:
            continue
        stripped = line.strip()
        if pending:
            pending += " " + stripped
        else:
            match = COMMAND_START.match(stripped)
            if match is None or OUTPUT_LINE.match(match["rest"]) or (fence == "text" and not match["prompt"]):
                continue
            pending, start = match["rest"], number
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        found.append((start, pending))
        pending = ""
    return found


def inline_commands(text: str) -> list[tuple[int, str]]:
    """``(line, words after csbp)`` of each inline ``csbp ...`` code span outside fenced blocks."""
    found: list[tuple[int, str]] = []
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            found += [(number, match["rest"]) for match in INLINE.finditer(line)]
    return found


def words_of(command: str) -> list[str]:
    """The command's words up to its first shell operator, without a trailing comment; ``$$`` (a
    Makefile's ``$``) as the shell reads it."""
    command = re.sub(r"\s+#.*$", "", command).replace("$$", "$")
    words = shlex.split(command)
    cut = next((i for i, word in enumerate(words) if word in SHELL_OPERATORS), len(words))
    return words[:cut]


def subcommand_parsers(parser: argparse.ArgumentParser, words: list[str]) -> list[argparse.ArgumentParser]:
    """The innermost parsers ``words`` select; ``train|attention`` (a doc's alternatives) selects
    each, and a ``...`` standing for the subcommand none."""
    for action in parser._actions:
        if not isinstance(action, argparse._SubParsersAction):
            continue
        position = next((i for i, word in enumerate(words) if not word.startswith("-")), None)
        if position is None:
            return [parser]
        if words[position] == "...":
            return []
        names = [name for name in words[position].split("|") if name in action.choices]
        if not names:
            return [parser]
        return [p for name in names for p in subcommand_parsers(action.choices[name], words[position + 1 :])]
    return [parser]


def unknown_flags(words: list[str]) -> list[str]:
    """The ``--flags`` in ``words`` that the selected subcommand (each of its alternatives) lacks."""
    unknown: list[str] = []
    for parser in subcommand_parsers(build_parser(), words):
        known = {"--debug", "--version"} | {option for action in parser._actions for option in action.option_strings}
        unknown += [w for w in words if w.startswith("--") and w.split("=")[0] not in known and w not in unknown]
    return unknown


def parse_problem(words: list[str]) -> str | None:
    """What ``csbp`` would say about ``words`` before running anything, or None if they parse."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            _, extras = build_parser().parse_known_args(words)
    except SystemExit as exc:
        return err.getvalue().strip() if exc.code else None
    return f"unrecognized arguments: {extras}" if extras else None


def doc_cases(kind: str) -> list[tuple[str, int, str]]:
    finder = block_commands if kind == "block" else inline_commands
    return [
        (path.relative_to(ROOT).as_posix(), line, command)
        for path in DOCS
        for line, command in finder(path.read_text(encoding="utf-8"))
    ]


def test_the_documents_hold_commands_to_check() -> None:
    blocks, inline = doc_cases("block"), doc_cases("inline")
    assert len(blocks) > 100 and len(inline) > 150, (len(blocks), len(inline))
    readme = {command.split()[0] for file, _, command in blocks if file == "README.md"}
    assert {"verify", "train", "generate", "eval", "data", "plan", "compare", "bench"} <= readme


def test_every_command_in_a_code_block_parses() -> None:
    problems = []
    for file, line, command in doc_cases("block"):
        words = words_of(command)
        problem = None if "..." in words else parse_problem(words)
        problem = problem or (f"unknown flags {unknown_flags(words)}" if unknown_flags(words) else None)
        if problem:
            problems.append(f"{file}:{line}: csbp {command}\n    {problem}")
    assert not problems, "\n".join(problems)


def test_every_flag_named_inline_exists() -> None:
    problems = [
        f"{file}:{line}: `csbp {command}`: {unknown_flags(words_of(command))}"
        for file, line, command in doc_cases("inline")
        if unknown_flags(words_of(command))
    ]
    assert not problems, "\n".join(problems)


def help_pages(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    pages = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            pages += [page for sub in action.choices.values() for page in help_pages(sub)]
    return pages


def test_every_example_in_a_help_page_parses() -> None:
    """The ``examples:`` of ``csbp --help`` and ``csbp train --help`` are commands too."""
    examples = [
        line.strip().split("csbp ", 1)[1]
        for page in help_pages(build_parser())
        for line in (page.epilog or "").splitlines()
        if "csbp " in line and "COMMAND" not in line
    ]
    assert len(examples) >= 8
    problems = [f"csbp {e}: {parse_problem(words_of(e)) or unknown_flags(words_of(e))}" for e in examples
                if parse_problem(words_of(e)) or unknown_flags(words_of(e))]
    assert not problems, "\n".join(problems)


def test_the_checks_catch_a_stale_flag() -> None:
    """The checks above can fail: a renamed flag, a missing value and a flag of another command."""
    assert unknown_flags(["train", "run.yaml", "--nprocs", "8"]) == ["--nprocs"]
    assert "expected one argument" in (parse_problem(["train", "run.yaml", "--run-dir"]) or "")
    assert unknown_flags(["bench", "train|dflash", "--anchors", "8"]) == ["--anchors"]  # train lacks it
    assert unknown_flags(["bench", "train|attention|dflash", "--doc-length", "8"]) == []
    text = "```bash\n.venv/bin/csbp verify --nproc 4 \\\n  --cp 2   # two rings\n```\n"
    text += "```text\n$ csbp verify --random 8\ncsbp verify --random 8: seeds 0..7\n```\n"
    assert block_commands(text) == [(2, "verify --nproc 4  --cp 2   # two rings"), (6, "verify --random 8")]
    assert words_of("verify --nproc 4  --cp 2   # two rings") == ["verify", "--nproc", "4", "--cp", "2"]


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation but ``-``/``_`` dropped, spaces as ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors_of(path: Path) -> set[str]:
    anchors: set[str] = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip().startswith("```"):
            fenced = not fenced
            continue
        match = re.match(r"^#+\s+(.*)", line)
        if match and not fenced:
            base = anchor = github_anchor(match[1])
            repeat = 0
            while anchor in anchors:  # a repeated heading gets -1, -2, ...
                repeat += 1
                anchor = f"{base}-{repeat}"
            anchors.add(anchor)
    return anchors


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_and_anchor_resolves(path: Path) -> None:
    text = path.read_text(encoding="utf-8")
    problems = []
    for match in re.finditer(r"\]\(([^)\s]+)\)", text):
        target = match[1]
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path.resolve()
        line = text.count("\n", 0, match.start()) + 1
        if not resolved.exists():
            problems.append(f"{line}: {target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors_of(resolved):
            problems.append(f"{line}: {target}: no heading with that anchor")
    assert not problems, "\n".join(problems)


def test_the_anchor_rule_matches_the_readme_links() -> None:
    assert github_anchor("Evaluating a model (`csbp eval`)") == "evaluating-a-model-csbp-eval"
    assert github_anchor("Launch commands: one node, your own `torchrun`, several nodes") == (
        "launch-commands-one-node-your-own-torchrun-several-nodes"
    )
