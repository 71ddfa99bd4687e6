"""Chat templates from strangers cannot ask for unbounded memory or loops (csbp.data.template_sandbox),
and whatever a template's expressions raise is one line. Each payload only just passes a limit,
so that the old, unbounded sandbox rendered it quickly rather than running out of memory."""

from __future__ import annotations

import re
import time

import pytest

from csbp.data import template_sandbox
from csbp.data.chat_template import ChatTemplate
from csbp.data.template_sandbox import MAX_ARGUMENT, MAX_CALLS, MAX_ITERATIONS, MAX_LENGTH, MAX_PRODUCED

OVER = MAX_LENGTH + 1
PAYLOADS = {
    "string repetition": f"{{{{ 'a' * {OVER} }}}}",
    "list repetition": f"{{{{ ([1] * {OVER}) | length }}}}",
    "a huge power": "{{ (7 ** 20000) % 10 }}",
    "integer squaring": "{% set ns = namespace(x=3) %}{% for i in range(16) %}{% set ns.x = ns.x * ns.x %}{% endfor %}x",
    "concatenation doubling": "{% set ns = namespace(s='x') %}{% for i in range(25) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}x",
    "addition doubling": "{% set ns = namespace(s='x') %}{% for i in range(25) %}{% set ns.s = ns.s + ns.s %}{% endfor %}x",
    "a wide filter": f"{{{{ 'x' | center({MAX_ARGUMENT + 1}) }}}}",
    "a wide method": f"{{{{ 'x'.ljust({MAX_ARGUMENT + 1}) }}}}",
    "a growing replace": "{{ ('x' * 5000) | replace('x', 'y' * 5000) }}",
    "a growing join": "{{ ('x' * 5000).join(['a'] * 5000) }}",
    "a repeated format field": "{{ ('{0:99999}' * 200).format('x') }}",
    "a repeated percent field": "{{ ('%99999s' * 200) % (('x',) * 200) }}",
    "nested range loops": (
        f"{{% for i in range({MAX_ITERATIONS // 1000}) %}}{{% for j in range(1001) %}}{{% endfor %}}{{% endfor %}}x"
    ),
    "nested loops over data": (
        f"{{% set s = 'x' * {MAX_ITERATIONS // 1000} %}}{{% for c in s %}}{{% for d in 'y' * 1001 %}}"
        "{% endfor %}{% endfor %}x"
    ),
    "a macro calling itself twice": (
        "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
        f"{{{{ f({MAX_CALLS.bit_length()}) }}}}"
    ),
    "elementwise amplification": (  # each item passes, together they pass MAX_PRODUCED
        f"{{% set big = 'x' * {MAX_LENGTH // 2} %}}"
        f"{{{{ [{', '.join(['big'] * (2 * MAX_PRODUCED // MAX_LENGTH + 1))}] | map('upper') | list | length }}}}"
    ),
    "additions producing too much": (  # each '+' passes; together they pass MAX_PRODUCED (its fast path)
        f"{{% set big = 'x' * {MAX_LENGTH // 2} %}}{{% for i in range({MAX_PRODUCED // MAX_LENGTH + 1}) %}}"
        "{% set t = big + big %}{% endfor %}x"
    ),
    "printing a heavy list": f"{{% set big = 'x' * {MAX_LENGTH // 2} %}}{{{{ [big, big, big] }}}}",
    "a heavy list made a string": f"{{% set big = 'x' * {MAX_LENGTH // 2} %}}{{{{ [big, big, big] | string | length }}}}",
    "a heavy list repeated": f"{{% set big = 'x' * {MAX_LENGTH // 2} %}}{{{{ ([big] * 3) | length }}}}",
    "sizing a long list again and again": (  # each size check walks the list: a loop over it
        f"{{% set l = [1] * {MAX_ITERATIONS // 4} %}}{{% for i in range(5) %}}{{{{ l | string | length }}}}{{% endfor %}}"
    ),
    "too much output": f"{{% for i in range(20) %}}{{{{ 'x' * {MAX_LENGTH // 16} }}}}{{% endfor %}}",
    "a huge JSON indent": "{{ messages | tojson(indent=100000) }}",
    # filters walking their input in Python: 'ab' * 8000000 | sort took 15 s, | urlize 18 s
    "sorting a long string": f"{{{{ ('ab' * {MAX_ITERATIONS // 2 + 1}) | sort | length }}}}",
    "urlizing a long string": f"{{{{ ('a ' * {MAX_ITERATIONS // 2 + 1}) | urlize | length }}}}",
    "the unique characters of a long string": f"{{{{ ('ab' * {MAX_ITERATIONS // 2 + 1}) | unique | list | length }}}}",
}


@pytest.mark.parametrize("payload", PAYLOADS.values(), ids=PAYLOADS.keys())
def test_resource_bombs_are_refused_in_one_line(payload: str) -> None:
    template = ChatTemplate(payload, "evil/tokenizer_config.json")
    started = time.process_time()  # CPU time: a loaded machine (CI next to other jobs) must not fail it
    with pytest.raises(
        ValueError, match=r"^rec 3: chat template evil/tokenizer_config.json (was refused|failed|would render more)"
    ) as info:
        template.render([{"role": "user", "content": "hi"}], where="rec 3")
    assert "\n" not in str(info.value)
    assert time.process_time() - started < 10.0  # the slowest, 2**20 macro calls, takes ~3 s of CPU here


SLOW = {  # each step is quick and within every count; together they ran for minutes
    "a method call in a loop": "{% set s = 'a' * 4000000 %}{% for i in range(20000) %}{{ s.count('b') }}{% endfor %}x",
    "a filter on a long string in a loop": (  # 0.2 s a step: the clock must be read at once
        "{% set s = 'a ' * 2000000 %}{% for i in range(150) %}{{ s | wordcount }}{% endfor %}x"
    ),
    "a containment test in a loop": (
        "{% set s = 'a' * 4000000 %}{% for i in range(200000) %}{% if 'b' in s %}{% endif %}{% endfor %}x"
    ),
}


@pytest.mark.parametrize("payload", SLOW.values(), ids=SLOW.keys())
def test_a_render_past_the_cpu_time_limit_is_refused_in_one_line(payload: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each payload ran for over 20 s of CPU (a million steps of the first: over an hour)."""
    monkeypatch.setattr(template_sandbox, "MAX_SECONDS", 0.5)
    template = ChatTemplate(payload, "evil/chat_template.jinja")
    started = time.thread_time()
    with pytest.raises(ValueError, match=r"^rec 3: chat template evil/chat_template.jinja was refused by the sandbox "
                       r"\(the render would take more than csbp's template limit of 0.5 s of CPU time\)") as info:
        template.render([{"role": "user", "content": "hi"}], where="rec 3")
    assert "\n" not in str(info.value)
    assert time.thread_time() - started < 3.0


def test_a_record_longer_than_the_output_limit_says_to_split_it() -> None:
    """A plain template and a record of 17 M characters: the refusal named the template as the fault
    ("use a trusted template")."""
    template = ChatTemplate("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}", "tok/chat_template.jinja")
    with pytest.raises(ValueError, match=rf"^data.jsonl:5: chat template tok/chat_template.jinja would render more than "
                       rf"csbp's limit of {MAX_LENGTH} characters for this record \(fix: split the record into shorter chats"):
        template.render([{"role": "user", "content": "x" * (MAX_LENGTH + 1)}], where="data.jsonl:5")


@pytest.mark.parametrize(
    ("payload", "error"),
    [("{{ 1 / 0 }}", "ZeroDivisionError"), ("{{ messages[0]['content'] + 1 }}", "TypeError"),
     ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError")],
)
def test_python_errors_of_template_expressions_are_one_line(payload: str, error: str) -> None:
    """These used to escape as a traceback (not a jinja2 TemplateError)."""
    with pytest.raises(ValueError, match=f"chat template t failed: {error}"):
        ChatTemplate(payload, "t").render([{"role": "user", "content": "hi"}], where="rec 0")


LEGIT = (
    "{% set ns = namespace(last=-1) %}"
    "{% for m in messages %}{{ '%-9s|' % m['role'] }}{{ '{}:{}'.format(loop.index, m['content']) }}"
    "{{ [m['content']] | join(', ') }}{{ (m['content'] ~ '.') * 2 }}{% if loop.last %}[{{ loop.length }}]{% endif %}"
    "{% set ns.last = loop.index0 %}{% else %}none{% endfor %}{{ ns.last }}"
    "{% for k, v in {'a': 1, 'b': [1, 2]}.items() if v %}{{ k }}={{ v | tojson(indent=2) }};{% endfor %}"
    "{% for i in range(messages | length - 1, -1, -1) %}{{ messages[i]['role'][0] }}{% endfor %}"
    "{% for item in [[1, [2]], [3]] recursive %}{{ item if item is number else loop(item) }}{% endfor %}"
    "{% macro shout(t) %}{{ t | upper }}{% endmacro %}{{ shout('ok') }}{{ messages | tojson | length > 0 }}"
    "{{ 2 ** 64 }}{{ ('x' * 5) | center(9) }}{{ 'a-b' | replace('-', '+') }}{{ '\t' | indent(2) }}"
    "{% for i in range(1000) %}{% endfor %}{{ messages[0]['content'].split('h') | string }}"
)


def test_templates_within_the_limits_render_as_jinja_renders_them() -> None:
    """Loops (else, filters, recursion, loop.last/length), macros, formatting and joins inside the
    limits render exactly as in Jinja's own sandbox."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    reference = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(LEGIT)
    assert ChatTemplate(LEGIT, "t").render(messages) == reference.render(messages=messages)
    assert ChatTemplate("{% for m in [] %}x{% else %}empty{% endfor %}", "t").render(messages) == "empty"


ASTRAL = "\\U000e0000"  # repr writes it in 10 characters, json.dumps(ensure_ascii=True) in 12
PAST_THE_BOUND = {  # each rendered, writing more than MAX_LENGTH characters in one step (unbounded: MemoryError)
    "JSON item separators": ("tojson()", f"{{{{ ([1] * 1000) | tojson(separators=('x' * {OVER // 1000 + 1}, ':')) | length }}}}"),
    "JSON key separators": ("tojson()", f"{{{{ {{'a': 1, 'b': 2}} | tojson(separators=(',', 'y' * {OVER // 2 + 1})) | length }}}}"),
    "a JSON indent given by position": ("tojson()", (
        "{% set ns = namespace(x=[1] * 40000) %}{% for i in range(29) %}{% set ns.x = [ns.x] %}{% endfor %}"
        "{{ ns.x | tojson(False, 16) | length }}")),
    "ASCII JSON of astral characters": ("tojson()", f"{{{{ ('\\U0001F600' * {OVER // 12 + 1}) | tojson(ensure_ascii=True) | length }}}}"),
    "a list of astral characters made a string": ("string()", f"{{{{ ['{ASTRAL}' * {OVER // 10 + 1}] | string | length }}}}"),
    "a list of astral characters printed": ("printing a value", f"{{{{ ['{ASTRAL}' * {OVER // 10 + 1}] }}}}"),
    "a list of astral characters concatenated": ("~", f"{{{{ ('' ~ ['{ASTRAL}' * {OVER // 10 + 1}]) | length }}}}"),
    "astral characters formatted with !r": ("format()", f"{{{{ '{{!r}}'.format('{ASTRAL}' * {OVER // 10 + 1}) | length }}}}"),
    "astral characters formatted with %r": ("%", f"{{{{ ('%r' % ('{ASTRAL}' * {OVER // 10 + 1})) | length }}}}"),
    "a percent width given by argument": ("%", f"{{{{ ('%*s' % ({OVER}, 'x')) | length }}}}"),
    "a percent precision given by argument": ("%", f"{{{{ ('%.*f' % ({OVER}, 1.0)) | length }}}}"),
    "a format width given by argument": ("format()", f"{{{{ ('{{0:{{w}}}}' * 17).format('x', w={MAX_ARGUMENT - 1}) | length }}}}"),
    "a format_map width given by argument": (
        "format_map()", f"{{{{ ('{{a:{{w}}}}' * 17).format_map({{'a': 'x', 'w': {MAX_ARGUMENT - 1}}}) | length }}}}"),
    "a growing join": ("join()", "{{ ('x' * 5000).join(['a'] * 5000) | length }}"),
    "a growing join filter": ("join()", "{{ (['a'] * 5000) | join('x' * 5000) | length }}"),
    "an indent of the first line": ("indent()", f"{{{{ ('x' * {MAX_LENGTH - 10}) | indent(100, true) | length }}}}"),
    "expanded tabs": ("expandtabs()", f"{{{{ ('\\t' * 17).expandtabs({MAX_ARGUMENT - 1}) | length }}}}"),
    "a format width given as a string": ("format()", f"{{{{ '{{0:{{1}}}}'.format('x', '{OVER}') | length }}}}"),
}


@pytest.mark.parametrize(("operation", "payload"), PAST_THE_BOUND.values(), ids=PAST_THE_BOUND.keys())
def test_operations_past_their_size_bound_are_refused_before_they_run(operation: str, payload: str) -> None:
    """Each payload rendered: the step's size bound missed separators, an indent given by position,
    repr and ensure_ascii escapes (10 and 12 characters for one) or widths taken from the arguments,
    and only the budget of everything produced (8 x as much) stood behind it (a separator of 16 K
    characters between 100 K items asked for 1.6 G characters)."""
    template = ChatTemplate(payload, "evil/chat_template.jinja")
    with pytest.raises(ValueError, match=rf"^rec 3: chat template evil/chat_template.jinja was refused by the sandbox "
                       rf"\({re.escape(operation)} would exceed csbp's template limit of {MAX_LENGTH} characters\)"):
        template.render([{"role": "user", "content": "hi"}], where="rec 3")


HOSTILE = ["", "\U000e0000\x00'\"\\\n\U0001F600é<", ["\U000e0000" * 7, {"\x00\U0001F600": [None, 1.5e-300, -10**30]}],
           {"k": [[["\U000e0000"]]], "\n": True}, [[], {}, [[[[]]]]], ("a", "\U000e0000" * 3), -10**30,
           -1.2345678901234567e-308, None, "\U0001F600" * 10, [[[[[[[[[[[[]]]]]]]]]]]]]  # indents grow with depth


@pytest.mark.parametrize("value", HOSTILE, ids=range(len(HOSTILE)))
def test_the_size_bounds_hold_against_what_python_writes(value: object) -> None:
    """The sandbox's bounds, checked against str(), json.dumps (csbp's tojson) and pprint themselves."""
    import json
    import pprint

    assert len(str(value)) <= template_sandbox._printed(value)
    assert len(pprint.pformat(value)) <= template_sandbox._growth("pprint", value, (), {})
    assert len(repr(value)) <= template_sandbox._format_size("{!r}", [value])
    # ensure_ascii is any truthy value (1.0 escapes as True does), and an int before the indent is not it
    options = [(False, None, None), (True, None, None), (True, 16, (",,,", "::::")), (1.0, None, None), (1, 16, None)]
    for ascii_only, indent, separators in options:
        written = json.dumps(value, ensure_ascii=ascii_only, indent=indent, separators=separators)
        bound = template_sandbox._growth("tojson", value, (ascii_only, indent, separators), {})
        assert len(written) <= bound, (ascii_only, indent, separators)
