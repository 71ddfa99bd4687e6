"""The run config's field reference, generated from the schema: ``csbp config fields`` and docs/config.md.

Every field of ``RunConfig`` (nested sections included: ``model.rope_scaling.*``,
``objective.dflash.*``) with its type (the choices of a ``Literal``), its default (or ``required``)
and the description the schema carries, in the order the schema declares them. Nothing here is
written by hand, so the reference cannot drift from what ``csbp train`` accepts::

    rows = field_rows()                       # [FieldRow("run.name", "str", "required", "..."), ...]
    print(format_text(select(rows, ["attention"])))
"""

from __future__ import annotations

import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from csbp.config.schema import RunConfig


@dataclass(frozen=True)
class FieldRow:
    """One config field: dotted ``name``, ``kind`` (type or choices), ``default`` text, ``description``."""

    name: str
    kind: str
    default: str
    description: str

    @property
    def section(self) -> str:
        return self.name.rsplit(".", 1)[0]


def field_rows(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[FieldRow]:
    """Every leaf field of ``model`` in declaration order, each nested section's fields after its
    parent's own (``model.rope_scaling`` after ``model.dtype``), so every section is one block."""
    rows: list[FieldRow] = []
    nested: list[FieldRow] = []
    for name, info in model.model_fields.items():
        section = _section_model(info.annotation)
        if section is not None:
            nested += field_rows(section, f"{prefix}{name}.")
            continue
        rows.append(FieldRow(f"{prefix}{name}", _kind(info.annotation), _default(info), info.description or ""))
    return rows + nested


def select(rows: Sequence[FieldRow], names: Sequence[str]) -> list[FieldRow]:
    """The rows under any of ``names`` (a section such as ``attention`` or ``objective.dflash``, or a
    field such as ``train.max_steps``); one clear ``ValueError`` for a name that matches nothing."""
    if not names:
        return list(rows)
    picked = []
    for name in names:
        matched = [r for r in rows if r.name == name or r.name.startswith(f"{name}.")]
        if not matched:
            sections = sorted({r.name.split(".")[0] for r in rows}, key=[r.name.split(".")[0] for r in rows].index)
            raise ValueError(f"no config field or section {name!r}; sections: {', '.join(sections)}")
        picked += [r for r in matched if r not in picked]
    return picked


def format_text(rows: Sequence[FieldRow], width: int = 100) -> str:
    """Terminal form: a ``name (type; default)`` line per field, its description indented below."""
    import textwrap

    lines: list[str] = []
    section = None
    for row in rows:
        if row.section != section:
            section = row.section
            lines += ([""] if lines else []) + [f"[{section}]"]
        lines.append(f"{row.name}  ({row.kind}; {row.default})")
        lines += textwrap.wrap(row.description, width=width, initial_indent="    ", subsequent_indent="    ")
    return "\n".join(lines) + "\n"


def format_markdown(rows: Sequence[FieldRow]) -> str:
    """docs/config.md: one table per section."""
    out = [
        "# Run config reference",
        "",
        "Generated from the schema by `csbp config fields --markdown` (a test checks this file is",
        "current). A config is YAML with these sections; unknown keys are errors, `--set a.b=value`",
        "overrides any field, and `csbp config validate FILE --print` shows a config with every default.",
        "Values keep their YAML type: an `int` or `float` field refuses `true` and a quoted `\"32\"`, a",
        "boolean field refuses `1` and `\"yes\"`; `1e-3` and `1.0e-3` are both floats (as in YAML 1.2).",
    ]
    section = None
    for row in rows:
        if row.section != section:
            section = row.section
            out += ["", f"## `{section}`", "", "| field | type | default | what it does |", "|---|---|---|---|"]
        description = row.description.replace("|", "\\|").replace("<", "&lt;")
        out.append(f"| `{row.name.rsplit('.', 1)[1]}` | {_cell(row.kind)} | {_cell(row.default)} | {description} |")
    return "\n".join(out) + "\n"


def _cell(text: str) -> str:
    return f"`{text.replace('|', '/')}`" if text not in ("required", "") else text


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The section model of a field (``Section`` or ``Section | None``), else None."""
    for candidate in typing.get_args(annotation) or (annotation,):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _kind(annotation: Any) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return " | ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        named = [_kind(a) for a in args if a is not type(None)]
        return " | ".join(named) + (" | null" if type(None) in args else "")
    if origin in (list, tuple):
        inner = ", ".join(_kind(a) for a in args if a is not Ellipsis)
        return f"[{inner}{', ...' if origin is list or Ellipsis in args else ''}]"
    return getattr(annotation, "__name__", str(annotation))


def _default(info: Any) -> str:
    if info.is_required():
        return "required"
    extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
    if "default_text" in extra:  # a default a validator fills from other fields
        return str(extra["default_text"])
    value = info.default
    if value is PydanticUndefined and info.default_factory is not None:
        value = info.default_factory()
    return _default_text(value)


def _default_text(value: Any) -> str:
    """A default as YAML would spell it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)
