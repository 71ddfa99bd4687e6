"""Read, override, validate and write run configs.

``load_config("run.yaml", ["optim.lr=3e-4", "topology.cp=2"])`` reads the YAML with a safe loader
(duplicate keys and alias bombs refused, ``1e-3`` read as a float: :mod:`csbp.config.yaml_reading`),
applies ``--set`` overrides (values parsed as YAML scalars of the same dialect: ints, floats, bools,
``null``, flow lists ``[1, 2]``; a flow mapping ``topology={cp: 2, bp: 2}`` is deep-merged into the
section exactly like ``topology.cp=2 topology.bp=2``, keeping its other fields), resolves relative
paths (against the config file's directory for values from the file, against the working directory
for values from ``--set``) and validates the result as a :class:`~csbp.config.schema.RunConfig`,
whose scalar fields take values of their own type only (:mod:`csbp.config.section_base`).

Every problem becomes one line ``<source>: <dotted.field>: <message> (fix: <what to do>)`` in a
:class:`ConfigError`, where ``<source>`` is the config file, or ``--set`` when the offending key
came from an override.
"""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from csbp.atomic import write_text_atomic
from csbp.config.other_files import other_csbp_file
from csbp.config.rules import ConfigRuleError
from csbp.config.schema import RunConfig
from csbp.config.section_base import PATH_FIELD_KEY
from csbp.config.yaml_reading import MAX_YAML_VALUES as MAX_YAML_VALUES
from csbp.config.yaml_reading import ConfigError as ConfigError
from csbp.config.yaml_reading import parse_yaml_value, read_yaml_file
from csbp.config.yaml_reading import read_yaml_text as read_yaml_text

_KEY_PATTERN = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")

Override = tuple[tuple[str, ...], Any]
"""A parsed ``--set`` item: the key path and its YAML-parsed value."""


def load_config(
    path: str | Path,
    overrides: Sequence[str] = (),
    *,
    relative_to: str | Path | None = None,
    source: str | None = None,
) -> RunConfig:
    """Load and validate the YAML config at ``path`` with ``--set`` style ``overrides``.

    ``relative_to`` is the directory relative paths in the file are resolved against (default: the
    file's own directory); ``source`` names the file in error lines (default: ``path``). Raises
    ``FileNotFoundError`` for a missing file and :class:`ConfigError` for anything invalid.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    source = source if source is not None else str(path)
    data = read_yaml_file(path, source=source)
    empty = data is None or data == {}
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            [
                f"{source}: the top level must be a mapping of sections (run:, model:, ...), got "
                f"{'a list' if isinstance(data, list) else _short_repr(data)} (fix: write each section as `name:` at "
                "the start of a line with its keys indented under it, as in `csbp recipes copy demo .`)"
            ]
        )
    other = other_csbp_file(data, path)
    if other is not None:  # one line, not one per section it lacks and per key it has
        raise ConfigError([f"{source} is {other}"])
    base_dir = Path(relative_to) if relative_to is not None else path.parent
    data = _resolve_paths(data, RunConfig, base_dir.absolute())
    parsed = parse_overrides(overrides)
    resolved = [(keys, _resolve_override_path(keys, value)) for keys, value in parsed]
    data = apply_overrides(data, resolved)
    try:
        return config_from_dict(data, source=source, override_keys=[keys for keys, _ in parsed])
    except ConfigError:
        if not empty:
            raise
        # one line instead of one "required section is missing" per section
        raise ConfigError(
            [f"{source} is empty (fix: write the run config into it, or start from a recipe: "
             f"csbp recipes copy demo {path} --overwrite)"]
        ) from None


def parse_overrides(overrides: Sequence[str]) -> list[Override]:
    """Parse ``["a.b=1", "c.d=[1, 2]"]`` into key paths and YAML-scalar values."""
    parsed: list[Override] = []
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not _KEY_PATTERN.match(key):
            raise ConfigError(
                [f"--set {item!r}: expected KEY=VALUE with a dotted key (fix: e.g. --set optim.lr=3e-4)"]
            )
        value = parse_yaml_value(text, source=f"--set {key}")
        parsed.extend(_leaf_overrides(tuple(key.split(".")), value))
    return parsed


def _leaf_overrides(keys: tuple[str, ...], value: Any) -> list[Override]:
    """A mapping value as one override per leaf (``a={b: 1}`` is ``a.b=1``): merged into the section
    like dotted keys, not replacing it (plain YAML would silently drop the section's other fields)."""
    if not isinstance(value, dict) or not value:
        return [(keys, value)]
    leaves: list[Override] = []
    for key, item in value.items():
        if not isinstance(key, str) or not _KEY_PATTERN.match(key) or "." in key:
            name, colon, rest = str(key).partition(":")  # YAML reads {cp:2} as the key 'cp:2'
            fix = f"a space after each colon: {{{name}: {rest}}}" if colon and rest else "e.g. --set optim.lr=3e-4"
            raise ConfigError(
                [f"--set {'.'.join(keys)}: key {key!r} of the mapping is not a field name (fix: {fix})"]
            )
        leaves.extend(_leaf_overrides((*keys, key), item))
    return leaves


def apply_overrides(data: dict[str, Any], overrides: Sequence[Override]) -> dict[str, Any]:
    """A copy of ``data`` with each ``(keys, value)`` set; missing or null sections are created and a
    mapping value is deep-merged into an existing section (as :func:`parse_overrides` flattens it)."""
    result = _deep_copy_mappings(data)
    for keys, value in overrides:
        node = result
        for depth, key in enumerate(keys[:-1]):
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            if not isinstance(child, dict):
                dotted = ".".join(keys[: depth + 1])
                raise ConfigError(
                    [f"--set {'.'.join(keys)}: {dotted} is a value, not a section (fix: set {dotted}=...)"]
                )
            node = child
        if isinstance(value, dict) and isinstance(node.get(keys[-1]), dict):
            node[keys[-1]] = apply_overrides(node[keys[-1]], [((key,), item) for key, item in value.items()])
        else:
            node[keys[-1]] = value
    return result


def config_from_dict(
    data: dict[str, Any], *, source: str = "config", override_keys: Sequence[tuple[str, ...]] = ()
) -> RunConfig:
    """Validate an already-loaded mapping; errors become a :class:`ConfigError` naming ``source``."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as exc:
        lines: list[str] = []
        errors = exc.errors(include_url=False)
        misspelled = _misspelled_keys(errors)
        for error in errors:
            loc = tuple(error["loc"])
            if error["type"] == "missing" and loc in misspelled.values():
                continue  # said by the line of the misspelled key
            described = [_misspelling(loc, misspelled[loc])] if loc in misspelled else _describe_error(error)
            for field, message, fix in described:
                origin = _error_origin(field, tuple(error["loc"]), error["type"], source, override_keys, message)
                line = f"{origin}: {field}: {message}" if field else f"{origin}: {message}"
                line += f" (fix: {fix})" if fix else ""
                if line not in lines:
                    lines.append(line)
        raise ConfigError(lines) from exc


def dump_config(cfg: RunConfig) -> str:
    """The config as YAML text (every field explicit) that :func:`load_config` reads back equal."""
    sections = [
        yaml.dump({name: values}, Dumper=_FlowListDumper, sort_keys=False, default_flow_style=False)
        for name, values in cfg.model_dump(mode="json").items()
    ]
    return "# csbp run config (validated; every default written out)\n" + "\n".join(sections)


def write_config(cfg: RunConfig, run_dir: str | Path) -> Path:
    """Write ``<run_dir>/config.yaml`` and return its path."""
    path = Path(run_dir) / "config.yaml"
    write_text_atomic(path, dump_config(cfg))  # a crash never leaves half a config for --resume
    return path


class _FlowListDumper(yaml.SafeDumper):
    """Block-style sections with lists written inline (``betas: [0.9, 0.95]``)."""


_FlowListDumper.add_representer(
    list, lambda dumper, data: dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True)
)


def _describe_error(error: dict[str, Any]) -> list[tuple[str, str, str]]:
    """``(dotted field, message, fix)`` for one pydantic error (several for a rule error)."""
    loc = tuple(error["loc"])
    dotted = _dotted(loc)
    kind, value = error["type"], error.get("input")
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, ConfigRuleError):
        prefix = ".".join(str(part) for part in loc)
        return [
            (".".join(p for p in (prefix, field) if p), message, fix)
            for field, message, fix in cause.violations
        ]
    if kind == "value_error":
        return [(dotted, str(cause) if cause is not None else error["msg"], "")]
    info = _field_info(loc)
    if kind == "extra_forbidden":
        return [(dotted, "unknown key", _unknown_key_fix(loc))]
    if kind == "missing" and loc and isinstance(loc[-1], int):
        expected = _type_text(info.annotation) if info is not None else "more items"
        return [(_dotted(loc[:-1]), f"item [{loc[-1]}] is missing", f"set it to {expected}")]
    if kind == "missing":
        section = _nested_model(info.annotation) if info is not None else None
        if section is not None:  # a whole section: say which of its keys it needs
            needed = [name for name, field in section.model_fields.items() if field.is_required()]
            keys = f" with at least {', '.join(needed)}" if needed else ""
            return [(dotted, "required section is missing", f"add the `{dotted}:` section{keys}")]
        what = f": {info.description}" if info is not None and info.description else ""
        return [(dotted, "required key is missing", f"add {dotted}{what}")]
    if kind == "literal_error":
        expected = error.get("ctx", {}).get("expected", "")
        return [(dotted, f"got {_short_repr(value)}", f"use {expected}")]
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return [
            (
                dotted,
                f"expected a section of `key: value` lines, got {_short_repr(value)}",
                "indent its keys under it",
            )
        ]
    bound = _BOUNDS.get(kind)
    if bound is not None:  # a value out of range: the fix states the range, not just the type
        limit = error.get("ctx", {}).get(bound[1])
        fix = f"set it to a value {bound[0]} {limit}" + (f" ({info.description.rstrip('.')})" if info and info.description else "")
        return [(dotted, f"must be {bound[0]} {limit}, got {_short_repr(value)}", fix)]
    fix = f"set it to {_type_text(info.annotation)}" if info is not None else ""
    if info is not None and info.description:
        fix += f": {info.description.rstrip('.')}"
    # not "a valid tuple"; pydantic's own ", got a number with a fractional part" would precede ours
    message = "expected a list" if kind in ("tuple_type", "list_type") else error["msg"].split(", got ")[0]
    if info is not None and message.startswith("Input should be a valid "):  # as the csbp checks say it
        message = f"expected {_type_text(info.annotation)}"
    return [(dotted, f"{message}, got {_short_repr(value)}", fix)]


_BOUNDS = {
    "greater_than": (">", "gt"), "greater_than_equal": (">=", "ge"),
    "less_than": ("<", "lt"), "less_than_equal": ("<=", "le"),
}
"""pydantic's range errors: the comparison and its ``ctx`` key."""


def _misspelled_keys(errors: Sequence[Any]) -> dict[tuple[Any, ...], tuple[Any, ...]]:
    """Unknown keys that look like a required key missing beside them (``Model:`` for ``model:``),
    each mapped to that key's location: one problem, said in one line instead of two."""
    missing = [
        tuple(e["loc"]) for e in errors if e["type"] == "missing" and e["loc"] and isinstance(e["loc"][-1], str)
    ]
    pairs: dict[tuple[Any, ...], tuple[Any, ...]] = {}
    for error in errors:
        loc = tuple(error["loc"])
        if error["type"] != "extra_forbidden" or not loc:
            continue
        beside = [m for m in missing if m[:-1] == loc[:-1] and m not in pairs.values()]
        names = [str(m[-1]).lower() for m in beside]
        close = difflib.get_close_matches(str(loc[-1]).lower(), names, n=1)
        if close:
            pairs[loc] = beside[names.index(close[0])]
    return pairs


def _misspelling(unknown: tuple[Any, ...], missing: tuple[Any, ...]) -> tuple[str, str, str]:
    """``(dotted field, message, fix)`` of an unknown key standing for the missing ``missing``."""
    info = _field_info(missing)
    what = "section" if info is not None and _nested_model(info.annotation) is not None else "key"
    return (
        _dotted(unknown),
        f"unknown {what}; did you mean {missing[-1]}?",
        f"rename {unknown[-1]} to {missing[-1]}",
    )


def _short_repr(value: Any, limit: int = 60) -> str:
    """``value`` as a YAML user wrote it (``null``, ``true``, ``[1, 2]``; strings quoted), shortened."""
    text = _yaml_text(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _yaml_text(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml_text(item) for item in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{key}: {_yaml_text(item)}" for key, item in value.items()) + "}"
    return repr(value)


def _dotted(loc: tuple[Any, ...]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _error_origin(
    field: str, loc: tuple[Any, ...], kind: str, source: str, override_keys: Sequence[tuple[str, ...]],
    message: str = "",
) -> str:
    """Where an error comes from: ``--set`` for an overridden field; for a key missing from a section
    ``--set`` wrote into, the file with those overrides; for a rule spanning several
    fields, the file plus the overrides inside the section that raised it which the message names (all
    of them when it names none); else the file."""
    overridden = [".".join(keys) for keys in override_keys]
    for dotted in overridden:
        if (
            field == dotted
            or field.startswith((dotted + ".", dotted + "["))
            or dotted.startswith(field + ".")
        ):
            return "--set"
    if kind == "missing":  # a section --set filled in part (it may have created it) lacks a required key
        parent = field.rpartition(".")[0]
        siblings = [dotted for dotted in overridden if parent and dotted.rpartition(".")[0] == parent]
        if siblings:
            return f"{source} with --set {', '.join(siblings)}"
    if kind == "value_error":
        prefix = ".".join(str(part) for part in loc)
        inside = [dotted for dotted in overridden if not prefix or dotted.startswith(prefix + ".")]
        named = [dotted for dotted in inside if dotted in message or f"{dotted.rsplit('.', 1)[-1]}=" in message]
        inside = named or inside
        if inside:
            return f"{source} with --set {', '.join(inside)}"
    return source


def _unknown_key_fix(loc: tuple[Any, ...]) -> str:
    parent = _section_model_at(loc[:-1])
    if parent is None:
        return "remove it"
    # a field of another section (`train.warmup_steps` for optim.warmup_steps) before a look-alike here
    elsewhere = [name for name in _field_names(RunConfig) if name.split(".")[-1] == loc[-1]]
    valid = list(parent.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), valid, n=1)
    if elsewhere:
        hint = f"did you mean {' or '.join(elsewhere)}?"
    else:
        hint = f"did you mean {close[0]}?" if close else f"valid keys: {', '.join(valid)}"
    return f"remove it; {hint}"


def _field_names(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every field's dotted name under ``model`` (sections themselves included)."""
    names: list[str] = []
    for name, info in model.model_fields.items():
        names.append(prefix + name)
        nested = _nested_model(info.annotation)
        if nested is not None:
            names += _field_names(nested, f"{prefix}{name}.")
    return names


def _section_model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The section model at ``loc`` (``()`` is :class:`RunConfig`)."""
    model: type[BaseModel] | None = RunConfig
    for part in loc:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return None
        model = _nested_model(model.model_fields[part].annotation)
    return model


def _field_info(loc: tuple[Any, ...]) -> FieldInfo | None:
    """The field a pydantic error location points to (list indices stop at their list field)."""
    model: type[BaseModel] | None = RunConfig
    info: FieldInfo | None = None
    for part in loc:
        if isinstance(part, int):
            break
        if model is None or part not in model.model_fields:
            return None
        info = model.model_fields[part]
        model = _nested_model(info.annotation)
    return info


def _nested_model(annotation: Any) -> type[BaseModel] | None:
    """The section model inside ``Section`` or ``Section | None``, else ``None``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation) if get_origin(annotation) is not None else ():
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _type_text(annotation: Any) -> str:
    if isinstance(annotation, type):
        return annotation.__name__
    origin = get_origin(annotation)
    args = get_args(annotation)
    if origin is Union or type(annotation).__name__ == "UnionType":
        return " or ".join("null" if arg is type(None) else _type_text(arg) for arg in args)
    if str(origin).endswith("Literal"):
        return "one of " + ", ".join(repr(arg) for arg in args)
    if origin in (tuple, list):  # a YAML flow list: [float, float], [int, ...]
        if origin is tuple and Ellipsis not in args:
            return "[" + ", ".join(_type_text(arg) for arg in args) + "]"
        return f"[{_type_text(args[0])}, ...]" if args else "a list"
    return str(annotation).replace("typing.", "")


def _is_path_field(info: FieldInfo) -> bool:
    extra = info.json_schema_extra
    return isinstance(extra, dict) and bool(extra.get(PATH_FIELD_KEY))


def _resolve(value: str, base_dir: Path) -> str:
    if not value:
        return value  # refused by validation: "" would otherwise name base_dir itself
    path = Path(value).expanduser()
    return os.path.normpath(path if path.is_absolute() else base_dir / path)


def _resolve_paths(data: dict[str, Any], model: type[BaseModel], base_dir: Path) -> dict[str, Any]:
    """A copy of ``data`` with relative values of path fields made absolute against ``base_dir``."""
    result = dict(data)
    for key, value in data.items():
        info = model.model_fields.get(key) if isinstance(key, str) else None
        if info is None:
            continue  # unknown keys are reported by validation
        nested = _nested_model(info.annotation)
        if _is_path_field(info) and isinstance(value, str):
            result[key] = _resolve(value, base_dir)
        elif nested is not None and isinstance(value, dict):
            result[key] = _resolve_paths(value, nested, base_dir)
    return result


def _resolve_override_path(keys: tuple[str, ...], value: Any) -> Any:
    """Relative ``--set`` values of path fields are resolved against the working directory."""
    info = _field_info(keys)
    if info is not None and _is_path_field(info) and isinstance(value, str):
        return _resolve(value, Path.cwd())
    return value


def _deep_copy_mappings(data: dict[str, Any]) -> dict[str, Any]:
    return {
        key: _deep_copy_mappings(value) if isinstance(value, dict) else value for key, value in data.items()
    }
