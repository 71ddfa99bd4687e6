"""A Jinja sandbox with size limits, for chat templates that come from untrusted tokenizer directories.

Jinja's ``ImmutableSandboxedEnvironment`` keeps a template away from Python internals and from
mutating what it is given, but not from asking for unbounded memory or time: ``{{ 'a' * 10**10 }}``,
``{{ 'x' | center(10**10) }}``, ``{{ 10 ** 10**9 }}``, nested ``range(100000)`` loops, or a string
doubled forty times in a ``namespace``. :class:`BoundedSandbox` refuses, with a ``SecurityError``
before the memory is asked for:

* ``*``, ``**``, ``+``, ``%`` and ``~`` whose result would hold more than :data:`MAX_LENGTH`
  characters or items (or an integer of more than :data:`MAX_INT_BITS` bits);
* a call (function, method or filter) given an integer above :data:`MAX_ARGUMENT` (widths, counts,
  indents), and the string methods and filters whose output can outgrow their input (``join``,
  ``replace``, ``format``, ``indent``, ``wordwrap``, ``expandtabs``) when their worst case would pass
  :data:`MAX_LENGTH`;
* more than :data:`MAX_RANGE_ITEMS` ``range`` items in one render (nested loops count in full);
* an output longer than :data:`MAX_LENGTH` characters (:func:`render_bounded`).

``lipsum`` (random text of any length) is not available. What is still possible: loops over the
data itself (nested over a long message's characters), which take time in proportion to the data a
stranger also controls; deep macro recursion ends at Python's recursion limit. Run csbp under OS
limits (``ulimit``, a container) when preparing data with a template nobody has read.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Sized
from contextvars import ContextVar
from typing import Any

import jinja2
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

MAX_LENGTH = 1 << 24
"""Most characters (or list items) one operation may produce, and one render may output."""
MAX_ARGUMENT = 1 << 20
"""Largest integer a call may be given (a width, a count, an indent)."""
MAX_INT_BITS = 1 << 14
"""Largest integer (in bits) ``*`` and ``**`` may produce."""
MAX_RANGE_ITEMS = 1 << 20
"""Most ``range`` items one render may ask for, all loops together."""

_RANGE_LEFT: ContextVar[list[int]] = ContextVar("csbp_template_range_left")
_DIGITS = re.compile(r"\d+")


def _refuse(what: str) -> SecurityError:
    return SecurityError(f"{what} would exceed csbp's template limit of {MAX_LENGTH} characters")


def _size(value: object) -> int:
    return len(value) if isinstance(value, Sized) else 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _format_size(fmt: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """An upper bound on the length of ``fmt`` formatted (``%`` or ``str.format``) with the
    arguments: every field may be as wide as every width written in it, and hold the longest one."""
    runs = _DIGITS.findall(fmt)
    if any(len(run) > 7 for run in runs):
        return MAX_LENGTH + 1
    values = [*args, *kwargs.values()]
    flat = [v for value in values for v in (value if isinstance(value, (tuple, list)) else (value,))]
    longest = max((len(str(value)) for value in flat if isinstance(value, (str, int, float))), default=0)
    longest = max([longest, *(_size(value) * 8 for value in flat if not isinstance(value, str))])
    fields = fmt.count("{") + fmt.count("%")
    return len(fmt) + sum(int(run) for run in runs) + fields * longest


def _growth(name: str, text: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """An upper bound on the output of string operation ``name`` on ``text`` (0: no growth check)."""
    if name == "join" and args and isinstance(args[0], Sized):
        return _size(args[0]) * len(text) + sum(max(_size(item), 8) for item in args[0])  # type: ignore[attr-defined]
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        return len(text) + (text.count(args[0]) if args[0] else len(text) + 1) * len(args[1])
    if name in ("format", "format_map"):
        return _format_size(text, args, kwargs if name == "format" else dict(enumerate(args)))  # type: ignore[arg-type]
    if name == "indent":
        width = args[0] if args else kwargs.get("width", 4)
        return len(text) + (text.count("\n") + 1) * (len(width) if isinstance(width, str) else int(width))
    if name == "wordwrap":
        wrapstring = args[2] if len(args) > 2 else kwargs.get("wrapstring") or "\n"
        return len(text) * (1 + len(str(wrapstring)))
    if name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        return len(text) + text.count("\t") * (size if _is_int(size) else 8)
    return 0


def _check_call(name: str, text: object, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    for value in (*args, *kwargs.values()):
        if _is_int(value) and abs(value) > MAX_ARGUMENT:
            raise SecurityError(f"{name}() was given {value}, above csbp's template limit of {MAX_ARGUMENT}")
    if isinstance(text, str) and _growth(name, text, args, kwargs) > MAX_LENGTH:
        raise _refuse(f"{name}()")


def _bounded_filter(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` (a Jinja filter) with the argument and growth checks of :func:`_check_call`."""
    skip = 1 if getattr(function, "jinja_pass_arg", None) is not None else 0

    @functools.wraps(function)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        value, rest = (args[skip], args[skip + 1 :]) if len(args) > skip else (None, ())
        if name == "join" and value is not None:  # the filter is value|join(separator)
            _check_call(name, rest[0] if rest else kwargs.get("d", ""), (value,), {})
        else:
            _check_call(name, value, rest, kwargs)
        return function(*args, **kwargs)

    return bounded


def _bounded_range(*args: int) -> range:
    items = range(*args)
    left = _RANGE_LEFT.get(None)
    if len(items) > MAX_RANGE_ITEMS or (left is not None and left[0] < len(items)):
        raise SecurityError(f"the template's range() loops would exceed csbp's limit of {MAX_RANGE_ITEMS} items")
    if left is not None:
        left[0] -= len(items)
    return items


_bounded_range.__name__ = "range"  # as templates and refusals name it


class _BoundedCodeGenerator(CodeGenerator):
    """Compiles ``a ~ b`` to :meth:`BoundedSandbox.bounded_concat` instead of a plain join."""

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: Any) -> None:
        self.write("environment.bounded_concat((")
        for argument in node.nodes:
            self.visit(argument, frame)
            self.write(", ")
        self.write("))")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """``ImmutableSandboxedEnvironment`` with the size limits of this module."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _BoundedCodeGenerator

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.globals.pop("lipsum", None)
        self.globals["range"] = _bounded_range

    def bound_filters(self) -> None:
        """Wrap every filter registered so far with the checks of :func:`_check_call`."""
        self.filters = {name: _bounded_filter(name, function) for name, function in self.filters.items()}

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if _is_int(left) and _is_int(right):
            bits = max(left.bit_length(), 1)
            if (operator == "**" and right > 0 and bits * right > MAX_INT_BITS) or (
                operator == "*" and bits + right.bit_length() > MAX_INT_BITS
            ):
                raise SecurityError(f"{operator} would make an integer above {MAX_INT_BITS} bits")
        elif operator == "*" and (_is_int(left) or _is_int(right)):
            count, sized = (left, right) if _is_int(left) else (right, left)
            if count * _size(sized) > MAX_LENGTH:
                raise _refuse("*")
        elif operator == "+" and _size(left) + _size(right) > MAX_LENGTH:
            raise _refuse("+")
        elif operator == "%" and isinstance(left, str):
            arguments = right if isinstance(right, tuple) else (right,)
            if _format_size(left, arguments, right if isinstance(right, dict) else {}) > MAX_LENGTH:
                raise _refuse("%")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        bound = getattr(__obj, "__self__", None)  # sandboxed str.format is a wrapper of the method
        bound = getattr(getattr(__obj, "__wrapped__", None), "__self__", bound)
        _check_call(getattr(__obj, "__name__", "call"), bound, args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def bounded_concat(self, values: tuple[Any, ...]) -> str:
        pieces = [str(value) for value in values]
        if sum(len(piece) for piece in pieces) > MAX_LENGTH:
            raise _refuse("~")
        return "".join(pieces)


def render_bounded(template: jinja2.Template, **variables: Any) -> str:
    """``template.render(**variables)`` with this render's ``range`` budget, its output capped at
    :data:`MAX_LENGTH` characters (a ``SecurityError`` beyond)."""
    token = _RANGE_LEFT.set([MAX_RANGE_ITEMS])
    try:
        pieces: list[str] = []
        length = 0
        for piece in template.generate(**variables):
            length += len(piece)
            if length > MAX_LENGTH:
                raise _refuse("the rendered text")
            pieces.append(piece)
        return "".join(pieces)
    finally:
        _RANGE_LEFT.reset(token)
