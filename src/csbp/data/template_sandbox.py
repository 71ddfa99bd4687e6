"""A Jinja sandbox with size and work limits, for chat templates from untrusted tokenizer directories.

Jinja's ``ImmutableSandboxedEnvironment`` keeps a template away from Python internals and from
mutating what it is given, but not from asking for unbounded memory or time: ``{{ 'a' * 10**10 }}``,
``{{ 'x' | center(10**10) }}``, ``{{ 10 ** 10**9 }}``, nested loops, a string doubled forty times in
a ``namespace``, a macro calling itself twice per call. :class:`BoundedSandbox` refuses, with a
``SecurityError``, before the memory is asked for where the size can be known in advance:

* ``*``, ``**``, ``+``, ``%`` and ``~`` whose result would exceed :data:`MAX_LENGTH` characters or
  items, counting what the items hold (or an integer of more than :data:`MAX_INT_BITS` bits);
* a call (function, method, macro or filter) given an integer above :data:`MAX_ARGUMENT` (widths,
  counts, indents), and the string methods and filters whose output can outgrow their input
  (``join``, ``replace``, ``format``, ``indent``, ``wordwrap``, ``expandtabs``, ``string``,
  ``tojson``) when their worst case would pass :data:`MAX_LENGTH`;
* and, per render (:func:`render_bounded`): more than :data:`MAX_ITERATIONS` loop iterations (every
  ``for`` loop, nested ones counted in full, ``range`` items, and the items of the lists these
  checks walk to size them), more than :data:`MAX_CALLS`
  calls, more than :data:`MAX_PRODUCED` characters produced by calls, filters and operators
  altogether (``[s] * 1000 | map('upper') | list``), an output longer than :data:`MAX_LENGTH`,
  or more than :data:`MAX_SECONDS` of CPU time. The filters that walk their input item by item
  in Python (``unique``, ``sort``, ``map``, ``urlize``, ``title`` ...: :data:`WALKING_FILTERS`)
  charge that input's length to the iterations first, so no single step runs for long (``'ab' *
  8000000 | sort`` took 15 s, ``| urlize`` 18 s); the clock bounds what the counts cannot, such
  as a loop calling ``s.count('x')`` on a 16 Mi character string a million times (an hour).

``lipsum`` (random text of any length) is not available. Python's recursion limit ends deep macro
recursion. These bound what a template can ask for; for a template nobody has read, an OS limit
(``ulimit -v``, a container) remains the belt to these braces.
"""

from __future__ import annotations

import functools
import math
import re
import time
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

MAX_LENGTH = 1 << 24
"""Most characters (or items) one operation may produce, and one render may output."""
MAX_ARGUMENT = 1 << 20
"""Largest integer a call may be given (a width, a count, an indent)."""
MAX_INT_BITS = 1 << 14
"""Largest integer (in bits) ``*`` and ``**`` may produce."""
MAX_ITERATIONS = 1 << 22
"""Most loop iterations (and ``range`` items) one render may run, all loops together."""
MAX_CALLS = 1 << 20
"""Most calls (functions, methods, macros) one render may make."""
MAX_PRODUCED = 1 << 27
"""Most characters (or items) one render's calls, filters and operators may produce altogether."""
MAX_SECONDS = 10.0
"""Most CPU seconds (of the rendering thread) one render may take; a chat template takes milliseconds."""
WALKING_FILTERS = frozenset({
    "unique", "sort", "dictsort", "groupby", "map", "select", "reject", "selectattr", "rejectattr",
    "min", "max", "sum", "batch", "slice", "title", "urlize", "wordwrap", "pprint",
})
"""Filters whose Python code walks their input item by item (or word by word): its length is charged
to :data:`MAX_ITERATIONS` before they run."""

_DIGITS = re.compile(r"\d+")
_REPR_FACTOR = 10
"""Most characters ``repr`` writes for one character of a string (``'\\U000e0000'``): what a string
inside a printed list, or formatted with ``!r``/``%r``, may grow by."""
_REPR_CONVERSION = re.compile(r"![ra]|%(\([^)]*\))?[-#0 +*.\d]*[ra]")
_NESTED_FIELD = re.compile(r"\{[^{}]*\{")
"""A replacement field whose spec holds another (``'{0:{w}}'``): its width comes from an argument."""
_TOO_DEEP = 32
"""Containers nested deeper than this are taken as too large (no chat template nests so)."""
_CLOCK_EVERY = 64
"""Steps (loop items, calls, filters, operators) between two reads of the clock (each
read costs ~0.2 us). A call, filter or operator on a value of ``n`` characters or items counts as
``1 + n // 2**16`` steps: on a 16 Mi character string (``s | wordcount`` takes 0.7 s) the clock is
read at once."""
_STEP_SIZE = 1 << 16


class OutputTooLong(SecurityError):
    """The rendered text would pass :data:`MAX_LENGTH` characters: a record this long, more often
    than a hostile template."""


@dataclass
class _Budget:
    iterations: int = MAX_ITERATIONS
    calls: int = MAX_CALLS
    produced: int = MAX_PRODUCED
    deadline: float = math.inf
    """``time.thread_time()`` past which the render is refused (inf outside :func:`render_bounded`)."""
    until_clock: int = _CLOCK_EVERY


_BUDGET: ContextVar[_Budget] = ContextVar("csbp_template_budget")


def _budget() -> _Budget:
    budget = _BUDGET.get(None)
    return budget if budget is not None else _Budget()  # outside render_bounded: per-call limits only


def _step(budget: _Budget, *operands: object) -> None:
    """Count one step of ``budget``'s render on ``operands`` (see :data:`_CLOCK_EVERY`); every
    :data:`_CLOCK_EVERY` steps, check its CPU time."""
    steps = 1
    for value in operands:
        if isinstance(value, (str, list, tuple, dict)):
            steps += len(value) // _STEP_SIZE
    budget.until_clock -= steps
    if budget.until_clock <= 0:
        budget.until_clock = _CLOCK_EVERY
        if time.thread_time() > budget.deadline:
            raise SecurityError(f"the render would take more than csbp's template limit of {MAX_SECONDS:g} s of CPU time")


def _charge_iterations(count: int) -> None:
    budget = _budget()
    _step(budget)
    budget.iterations -= count
    if budget.iterations < 0:
        raise SecurityError(
            f"the template's loops (and the lists it walks) would exceed csbp's limit of {MAX_ITERATIONS} items"
        )


def _refuse(what: str, limit: int = MAX_LENGTH) -> SecurityError:
    return SecurityError(f"{what} would exceed csbp's template limit of {limit} characters")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _weight(value: object, depth: int = 0, quoted: int = 1) -> int:
    """The size of ``value`` (past :data:`MAX_LENGTH`: that + 1): its characters, counting each string
    inside a container ``quoted`` times (:func:`_printed`: an upper bound on ``str(value)``)."""
    if isinstance(value, str):
        return len(value) * (quoted if depth else 1)
    if _is_int(value):
        return value.bit_length() // 3 + 2  # type: ignore[union-attr]
    if value is None or isinstance(value, (bool, float, jinja2.Undefined)):
        return 24
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        if depth > _TOO_DEEP or len(value) > MAX_LENGTH:
            return MAX_LENGTH + 1
        _charge_iterations(len(value))  # walking a container is work, as a loop over it is
        total = 2
        items = value.items() if isinstance(value, dict) else ((item, None) for item in value)
        for key, item in items:
            total += 4 + _weight(key, depth + 1, quoted) + (0 if item is None else _weight(item, depth + 1, quoted))
            if total > MAX_LENGTH:
                return MAX_LENGTH + 1
        return total
    return min(len(str(value)), MAX_LENGTH + 1)  # a namespace, a cycler: their str is their size


def _printed(value: object) -> int:
    """An upper bound on the characters ``str(value)`` takes: a string inside a container is written
    as its ``repr`` (:data:`_REPR_FACTOR`)."""
    return _weight(value, quoted=_REPR_FACTOR)


def _digit_widths(text: str) -> int:
    """The widths written in ``text`` together (past :data:`MAX_LENGTH` when one has over 7 digits)."""
    runs = _DIGITS.findall(text)
    if any(len(run) > 7 for run in runs):
        return MAX_LENGTH + 1
    return sum(int(run) for run in runs)


def _format_size(fmt: str, values: Iterable[Any]) -> int:
    """An upper bound on the length of ``fmt`` formatted (``%`` or ``str.format``) with ``values``:
    every field may be as wide as all widths written in it together, plus (``%*s``, ``'{0:{w}}'``)
    the widest an argument can make it, and hold the heaviest value (as its ``repr`` under ``!r``)."""
    values = list(values)
    widths = _digit_widths(fmt)
    nested = _NESTED_FIELD.search(fmt) is not None  # '{0:{w}}': an int's or a string's digits are a width
    if nested or "*" in fmt:  # '%*s': an int is
        widths += max((abs(v) if _is_int(v) else _digit_widths(v) for v in values
                       if _is_int(v) or (nested and isinstance(v, str))), default=0)
    weigh = (lambda value: _printed([value])) if _REPR_CONVERSION.search(fmt) else _printed
    heaviest = max((weigh(value) for value in values), default=0)
    return len(fmt) + (fmt.count("{") + fmt.count("%")) * (widths + heaviest)


def _format_values(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    if name == "format_map":
        return list(args[0].values()) if args and isinstance(args[0], dict) else list(args)
    return [*args, *kwargs.values()]


def _growth(name: str, text: object, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int:
    """An upper bound on the output of string operation ``name`` on ``text`` (0: no check needed)."""
    if name == "string":  # str() of a container: its strings as their repr
        return _printed(text)
    if name in ("tojson", "pprint"):  # escapes, and per item: indent x depth and the separators
        return _weight(text) * _json_growth(name, (*args, *kwargs.values())) + 2  # a string's quotes
    if not isinstance(text, str):
        return 0
    if name == "join" and args:
        items = args[0]
        if isinstance(items, (list, tuple, set, frozenset, dict)):
            return len(items) * len(text) + _weight(items)
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        return len(text) + (text.count(args[0]) if args[0] else len(text) + 1) * len(args[1])
    if name in ("format", "format_map"):
        return _format_size(text, _format_values(name, args, kwargs))
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


def _json_growth(name: str, options: tuple[Any, ...]) -> int:
    """An upper bound on the characters ``tojson``/``pprint`` writes per unit of :func:`_weight`, given
    its arguments (whatever their position): 12 for a character under a truthy ``ensure_ascii``
    (``\\ud83d\\ude00``; csbp's tojson escapes only when asked), a ``repr``'s for ``pprint``, 6
    (``\\u0000``) else; and per item (weight >= 4, depth <= 32) 8 x the indent, and both separators."""
    indents = [len(v) if isinstance(v, str) else v for v in options if _is_int(v) or isinstance(v, str)]
    indent = max([abs(v) for v in indents], default=0 if name == "tojson" else 1)
    separators = sum(len(s) for v in options if isinstance(v, (tuple, list)) for s in v if isinstance(s, str))
    # ensure_ascii escapes for any truthy value: an int or a string counts as an indent (>= 14 already)
    escaped = any(v is True or (v and not isinstance(v, (int, str, tuple, list))) for v in options)
    escape = 12 if escaped else _REPR_FACTOR if name == "pprint" else 6
    return escape + 8 * indent + separators


def _check_call(name: str, text: object, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    for value in (*args, *kwargs.values()):
        if _is_int(value) and abs(value) > MAX_ARGUMENT:
            raise SecurityError(f"{name}() was given {value}, above csbp's template limit of {MAX_ARGUMENT}")
    if _growth(name, text, args, kwargs) > MAX_LENGTH:
        raise _refuse(f"{name}()")


def _produced(result: Any) -> Any:
    """Charge ``result``'s size to this render's :data:`MAX_PRODUCED` budget; return it."""
    if isinstance(result, (str, list, tuple, dict)):
        budget = _budget()
        budget.produced -= len(result)
        if budget.produced < 0:
            raise _refuse("the strings and lists this render produced, altogether,", MAX_PRODUCED)
    return result


def _bounded_filter(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` (a Jinja filter) with the checks of :func:`_check_call`, its result charged."""
    skip = 1 if getattr(function, "jinja_pass_arg", None) is not None else 0

    @functools.wraps(function)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        value, rest = (args[skip], args[skip + 1 :]) if len(args) > skip else (None, ())
        if name == "join":  # value|join(separator): the separator is the text repeated
            _check_call(name, rest[0] if rest else kwargs.get("d", ""), (value,), {})
        else:
            _check_call(name, value, rest, kwargs)
        _step(_budget(), value)
        if name in WALKING_FILTERS and isinstance(value, (str, list, tuple, dict, set, frozenset)):
            _charge_iterations(len(value))
        return _produced(function(*args, **kwargs))

    return bounded


def _iterate(items: Iterable[Any]) -> Iterator[Any]:
    """``items``, each item charged to this render's :data:`MAX_ITERATIONS` budget."""
    for item in items:
        _charge_iterations(1)
        yield item


def _bounded_range(*args: int) -> range:
    items = range(*args)
    if len(items) > MAX_ARGUMENT:
        raise SecurityError(f"range() of {len(items)} items is above csbp's template limit of {MAX_ARGUMENT}")
    _charge_iterations(len(items))
    return items


_bounded_range.__name__ = "range"  # as templates and refusals name it


class _BoundedCodeGenerator(CodeGenerator):
    """Compiles ``a ~ b`` to :meth:`BoundedSandbox.bounded_concat` and every ``for`` loop's iterable
    through :meth:`BoundedSandbox.bounded_loop`."""

    def visit_Concat(self, node: nodes.Concat, frame: Any) -> None:
        self.write("environment.bounded_concat((")
        for argument in node.nodes:
            self.visit(argument, frame)
            self.write(", ")
        self.write("))")

    def visit_For(self, node: nodes.For, frame: Any) -> None:
        if not getattr(node, "csbp_bounded", False):
            node.iter = nodes.Call(nodes.EnvironmentAttribute("bounded_loop"), [node.iter], [], None, None)
            node.csbp_bounded = True  # type: ignore[attr-defined]  # a node may be compiled twice
        super().visit_For(node, frame)


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """``ImmutableSandboxedEnvironment`` with the limits of this module."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _BoundedCodeGenerator

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, finalize=self._finalize, **kwargs)
        self.globals.pop("lipsum", None)
        self.globals["range"] = _bounded_range

    def bound_filters(self) -> None:
        """Wrap every filter registered so far with the checks of :func:`_check_call`."""
        self.filters = {name: _bounded_filter(name, function) for name, function in self.filters.items()}

    @staticmethod
    def _finalize(value: Any) -> Any:
        if not isinstance(value, str) and _printed(value) > MAX_LENGTH:  # {{ [s, s, s, ...] }}
            raise _refuse("printing a value")
        return value

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "+" and type(left) is str and type(right) is str:  # a chat template's usual step
            return self._join_two(left, right)  # the checks below, for this case alone
        _step(_budget(), left, right)
        if _is_int(left) and _is_int(right):
            bits = max(left.bit_length(), 1)
            if (operator == "**" and right > 0 and bits * right > MAX_INT_BITS) or (
                operator == "*" and bits + right.bit_length() > MAX_INT_BITS
            ):
                raise SecurityError(f"{operator} would make an integer above {MAX_INT_BITS} bits")
        elif operator == "*" and (_is_int(left) or _is_int(right)):
            count, repeated = (left, right) if _is_int(left) else (right, left)
            if count > 0 and count * _weight(repeated) > MAX_LENGTH:
                raise _refuse("*")
        elif operator == "+" and not isinstance(left, (int, float)) and _weight(left) + _weight(right) > MAX_LENGTH:
            raise _refuse("+")
        elif operator == "%" and isinstance(left, str):
            values = right.values() if isinstance(right, dict) else right if isinstance(right, tuple) else (right,)
            if _format_size(left, values) > MAX_LENGTH:
                raise _refuse("%")
        return _produced(super().call_binop(context, operator, left, right))

    @staticmethod
    def _join_two(left: str, right: str) -> str:
        """``left + right`` charged and checked as :meth:`call_binop` does (a step, the length, the
        budget of produced text), without its type dispatch: a third of a chat render's time."""
        budget = _budget()
        _step(budget, left, right)
        if len(left) + len(right) > MAX_LENGTH:
            raise _refuse("+")
        result = left + right
        budget.produced -= len(result)
        if budget.produced < 0:
            raise _refuse("the strings and lists this render produced, altogether,", MAX_PRODUCED)
        return result

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = _budget()
        budget.calls -= 1
        if budget.calls < 0:
            raise SecurityError(f"the template would make more than csbp's limit of {MAX_CALLS} calls")
        bound = getattr(__obj, "__self__", None)  # sandboxed str.format is a wrapper of the method
        bound = getattr(getattr(__obj, "__wrapped__", None), "__self__", bound)
        _step(budget, bound, *args)
        _check_call(getattr(__obj, "__name__", "call"), bound, args, kwargs)
        return _produced(super().call(__context, __obj, *args, **kwargs))

    def bounded_loop(self, items: Any) -> Any:
        """A ``for`` loop's iterable, each item charged to the render's iteration budget."""
        return _iterate(items) if not isinstance(items, jinja2.Undefined) else items

    def bounded_concat(self, values: tuple[Any, ...]) -> str:
        _step(_budget(), *values)
        if sum(_printed(value) for value in values) > MAX_LENGTH:
            raise _refuse("~")
        return _produced("".join(str(value) for value in values))


def render_bounded(template: jinja2.Template, **variables: Any) -> str:
    """``template.render(**variables)`` under a fresh per-render budget (:data:`MAX_SECONDS` of CPU
    time among it), its output capped at :data:`MAX_LENGTH` characters (a ``SecurityError`` beyond)."""
    budget = _Budget(deadline=time.thread_time() + MAX_SECONDS)
    token = _BUDGET.set(budget)
    try:
        pieces: list[str] = []
        length = 0
        for piece in template.generate(**variables):  # each piece comes of a step counted already, or
            length += len(piece)  # of the template's own text
            if length > MAX_LENGTH:
                raise OutputTooLong(str(_refuse("the rendered text")))
            pieces.append(piece)
        return "".join(pieces)
    finally:
        _BUDGET.reset(token)
