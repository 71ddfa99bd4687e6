"""The base of every run-config section: unknown keys, non-finite numbers and coerced scalars
rejected, values frozen; and :func:`path_field`, the marker for fields the loader resolves against
the config file's directory."""

from __future__ import annotations

import math
import types
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from csbp.config.rules import ConfigRuleError

PATH_FIELD_KEY = "csbp_path"
"""``json_schema_extra`` key marking a field whose value is a filesystem path."""

_SCALARS: dict[type, str] = {bool: "true or false", int: "int", float: "float"}
"""The scalar field types whose values must arrive with their own type, and how errors name them."""


def path_field(default: Any = ..., *, description: str) -> Any:
    """A ``Field`` whose value is a filesystem path (resolved against the config file's directory; an
    empty one is refused, not read as that directory)."""
    return Field(default, description=description, min_length=1, json_schema_extra={PATH_FIELD_KEY: True})


class _Section(BaseModel):
    # allow_inf_nan=False: `optim.lr: inf` or `collective_timeout_s: .nan` is an error, not a NaN run.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _refuse_coerced_scalars(cls, value: Any, info: ValidationInfo) -> Any:
        """A bool, int or float field (or list of them) takes a value of its own type: pydantic's lax
        mode would read ``true`` as 1, ``"32"`` as 32 and ``1`` or ``"yes"`` as true, silently. An int
        stays accepted for a float field (and an integral float for an int field: nothing is lost)."""
        name = info.field_name
        field = cls.model_fields.get(name) if name is not None else None
        if field is None:
            return value
        kind = _scalar_kind(field.annotation)
        if kind is not None:
            _check_scalar(value, kind, "", field.description)
            return value
        kind = _item_kind(field.annotation)
        if kind is not None and isinstance(value, (list, tuple)):
            for index, item in enumerate(value):
                _check_scalar(item, kind, f"[{index}]", field.description)
        return value


def _check_scalar(value: Any, kind: type, where: str, description: str | None) -> None:
    """``ConfigRuleError`` (one line: value, its type, the expected type) for a coerced scalar."""
    right_kind = isinstance(value, bool) if kind is bool else not isinstance(value, (bool, str))
    if value is None or right_kind:
        return  # None: the Optional's (or pydantic's own) business; other types: pydantic's errors
    if isinstance(value, bool):
        got = f"the boolean {'true' if value else 'false'}"
    elif isinstance(value, (int, float)):
        got = f"the number {value!r}"
    elif isinstance(value, str):
        got = f"the string {value!r}" if len(value) <= 40 else f"the string {value[:37]!r}..."
    else:
        return  # lists, mappings, ...: pydantic's own error describes them
    expected = _SCALARS[kind]
    if isinstance(value, str) and _parses_as(value, kind):
        fix = f"write {value.strip().lower() if kind is bool else value.strip()} without quotes"
    else:
        fix = f"set it to {expected}" + (f": {description.rstrip('.')}" if description else "")
    at = f" at item {where}" if where else ""
    raise ConfigRuleError([("", f"expected {expected}, got {got}{at}", fix)])


def _parses_as(text: str, kind: type) -> bool:
    """Whether the quoted ``text`` would be a ``kind`` written without its quotes."""
    if kind is bool:
        return text.strip().lower() in ("true", "false")
    try:
        return math.isfinite(kind(text))  # "nan" and "inf" are not YAML numbers either
    except ValueError:
        return False


def _scalar_kind(annotation: Any) -> type | None:
    """``bool``, ``int`` or ``float`` for a field of that type (or ``X | None``), else None."""
    if annotation in _SCALARS:
        return annotation
    if get_origin(annotation) in (Union, types.UnionType):
        kinds = [arg for arg in get_args(annotation) if arg is not type(None)]
        if len(kinds) == 1 and kinds[0] in _SCALARS:
            return kinds[0]
    return None


def _item_kind(annotation: Any) -> type | None:
    """The item type of a ``list[X]`` or ``tuple[X, ...]`` field (or ``... | None``) when ``X`` is
    ``bool``, ``int`` or ``float``, else None."""
    if get_origin(annotation) in (Union, types.UnionType):
        inner = [arg for arg in get_args(annotation) if arg is not type(None)]
        annotation = inner[0] if len(inner) == 1 else None
    if get_origin(annotation) not in (list, tuple):
        return None
    items = {arg for arg in get_args(annotation) if arg is not Ellipsis}
    return next(iter(items)) if len(items) == 1 and next(iter(items)) in _SCALARS else None
