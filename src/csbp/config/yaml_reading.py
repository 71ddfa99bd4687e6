"""The YAML dialect of run configs: a safe loader that refuses duplicate keys and alias bombs, and
reads exponent floats the way YAML 1.2 does.

PyYAML implements YAML 1.1, whose floats need a dot and a signed exponent: it reads ``lr: 1e-3``
(and ``1.0e3``) as the *string* ``'1e-3'``. A schema that refuses strings for numbers (never a silent
coercion: a quoted ``lr: "0.001"`` is an error) must then read such plain scalars as floats, as YAML
1.2 and every other YAML library do. Quoted scalars stay strings. Config files and ``--set`` values
are both read here::

    read_yaml_text("optim: {lr: 1e-3}", source="run.yaml")   # {'optim': {'lr': 0.001}}
    parse_yaml_value("3e-4", source="--set optim.lr")         # 0.0003

Two more YAML 1.1 readings that surprise are replaced by YAML 1.2's: only ``true``/``false`` (any
case style) are booleans, so ``yes``, ``no``, ``on`` and ``off`` stay strings (a bool field then
refuses them with one line instead of taking them silently); and an integer with a leading zero is
decimal (``seed: 017`` is 17, not octal 15), with no base-60 integers (``1:30`` stays a string, not
90). ``0x``/``0o``/``0b`` prefixes and ``_`` separators still read as integers.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

MAX_YAML_VALUES = 100_000
"""More values than any run config has by orders of magnitude: anchors and aliases nested to expand
beyond this ("billion laughs") are refused instead of being expanded."""

EXPONENT_FLOAT = re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)[eE][-+]?[0-9]+$")
"""YAML 1.2 floats with an exponent (``1e-3``, ``1.0e3``, ``-2E+4``) that YAML 1.1 reads as strings."""


class ConfigError(ValueError):
    """An invalid config; ``lines`` holds one self-contained line per problem."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = lines
        super().__init__("\n".join(lines))


class ConfigYamlLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping (plain YAML keeps the last
    silently: a second ``train:`` section would drop every field of the first) and reads
    :data:`EXPONENT_FLOAT` scalars as floats."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[object, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            line = key_node.start_mark.line + 1
            if isinstance(key, str) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first on line {seen[key]}; fix: merge the two)",
                    key_node.start_mark,
                )
            if isinstance(key, str):
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


YAML12_BOOL = re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$")
"""YAML 1.2 booleans (YAML 1.1 adds yes/no/on/off/y/n)."""
YAML12_INT = re.compile(r"^[-+]?(?:[0-9][0-9_]*|0x[0-9a-fA-F_]+|0o[0-7_]+|0b[01_]+)$")
"""Integers: decimal (a leading zero too), hexadecimal, octal with ``0o``, binary; no base 60."""


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    """A :data:`YAML12_INT` scalar as an int: decimal unless it has a base prefix."""
    text = str(loader.construct_scalar(node)).replace("_", "")
    sign, digits = (-1, text[1:]) if text[:1] == "-" else (1, text.lstrip("+"))
    return sign * int(digits, 0 if digits[:2].lower() in ("0x", "0o", "0b") else 10)


# add_implicit_resolver copies the resolver table into this class first: SafeLoader is unchanged
ConfigYamlLoader.add_implicit_resolver("tag:yaml.org,2002:float", EXPONENT_FLOAT, list("-+.0123456789"))
ConfigYamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:int")]
    for first, resolvers in ConfigYamlLoader.yaml_implicit_resolvers.items()
}
ConfigYamlLoader.add_implicit_resolver("tag:yaml.org,2002:bool", YAML12_BOOL, list("tTfF"))
ConfigYamlLoader.add_implicit_resolver("tag:yaml.org,2002:int", YAML12_INT, list("-+0123456789"))
ConfigYamlLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)


def read_yaml_file(path: str | Path, *, source: str | None = None) -> Any:
    """The YAML document in ``path`` (:class:`ConfigYamlLoader`, at most :data:`MAX_YAML_VALUES`
    values once aliases are expanded); a :class:`ConfigError` naming ``source`` (default: ``path``)
    otherwise."""
    source = source if source is not None else str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError([f"{source}: not UTF-8 text (fix: save it as UTF-8, or pass the YAML config file)"]) from None
    except OSError as exc:  # permissions: "choose a path you may write" would be the wrong advice for a read
        raise ConfigError(
            [f"{source}: cannot be read: {exc.strerror or exc} (fix: check its permissions, e.g. ls -l {source})"]
        ) from None
    return read_yaml_text(text, source=source)


def read_yaml_text(text: str, *, source: str) -> Any:
    """:func:`read_yaml_file` for YAML held in a string (a run config recorded in a checkpoint)."""
    try:
        data = yaml.load(text, Loader=ConfigYamlLoader)  # a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ConfigError([f"{source}: invalid YAML: {yaml_problem(exc)}"]) from exc
    check_expanded_size(data, source)
    return data


def parse_yaml_value(text: str, *, source: str) -> Any:
    """One ``--set`` value read as YAML (the dialect of config files); ``ConfigError`` naming ``source``."""
    try:
        value = yaml.load(text, Loader=ConfigYamlLoader)  # a SafeLoader subclass
    except yaml.YAMLError as exc:
        problem, _, fix = yaml_problem(exc).partition("; fix: ")  # a duplicate key carries its own fix
        if fix:
            problem, fix = f"{problem})", fix.removesuffix(")")
        raise ConfigError(
            [f"{source}: value {text!r} is not valid YAML: {problem} (fix: {fix or 'quote it'})"]
        ) from exc
    check_expanded_size(value, source)
    return value


def check_expanded_size(data: Any, source: str) -> None:
    """``ConfigError`` when ``data`` holds more than :data:`MAX_YAML_VALUES` values counting each
    alias as often as it is used (a cyclic alias counts forever); stops counting at the limit."""
    count, stack = 0, [data]
    while stack:
        node = stack.pop()
        count += 1
        if count > MAX_YAML_VALUES:
            raise ConfigError(
                [
                    f"{source}: expands to more than {MAX_YAML_VALUES} values through nested YAML anchors/aliases "
                    "(fix: write the values out; a run config has a few hundred)"
                ]
            )
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, (list, tuple)):
            stack.extend(node)


def yaml_problem(exc: yaml.YAMLError) -> str:
    """The line and the problem of a YAML parse error, in a few words."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    return f"line {mark.line + 1}: {problem}" if mark is not None else problem
