"""Rules of csbp.data.template_sandbox no other test pinned (a mutation audit found each): every
payload here is refused by the one check it names, and rendered by the sandbox with that check gone
(so a test that only asked "was it refused?" would not notice the check missing)."""

from __future__ import annotations

import re

import pytest

from csbp.data.chat_template import ChatTemplate
from csbp.data.template_sandbox import MAX_ARGUMENT, MAX_INT_BITS, MAX_ITERATIONS, MAX_LENGTH

HALF = MAX_LENGTH // 2 + 1
REFUSED = {
    # range(-2**20, 2**20): each argument within MAX_ARGUMENT, 2**21 items, within MAX_ITERATIONS
    "a range of more items than a call may ask for": (
        f"{{{{ range(-{MAX_ARGUMENT}, {MAX_ARGUMENT}) | length }}}}",
        f"range() of {2 * MAX_ARGUMENT} items is above csbp's template limit of {MAX_ARGUMENT}",
    ),
    "range items charged as loop iterations": (  # never looped over: made into lists
        f"{{% for i in range(5) %}}{{{{ range({MAX_ARGUMENT}) | list | length }}}}{{% endfor %}}",
        f"the template's loops (and the lists it walks) would exceed csbp's limit of {MAX_ITERATIONS} items",
    ),
    "a power of a wide base": (  # 101 bits ** 200: 20200 bits (a sum of the two is 301)
        "{{ ((2 ** 100) ** 200) % 10 }}", f"** would make an integer above {MAX_INT_BITS} bits",
    ),
    "a product of two wide integers": (  # 16002 bits * 8001 bits (the wider of the two is within)
        "{% set x = 2 ** 8000 %}{{ (x * x * x) % 10 }}", f"* would make an integer above {MAX_INT_BITS} bits",
    ),
    "one range item past the iteration budget": (  # the four ranges are the whole budget: accepted below
        f"{{{{ range({MAX_ARGUMENT}) | length }}}}" * (MAX_ITERATIONS // MAX_ARGUMENT) + "{{ range(1) | length }}",
        f"the template's loops (and the lists it walks) would exceed csbp's limit of {MAX_ITERATIONS} items",
    ),
    "a namespace holding half the limit, twice": (  # its size is its str(), as printed inside the list
        f"{{% set ns = namespace(s='x' * {HALF}) %}}{{{{ [ns, ns] | string | length }}}}",
        f"string() would exceed csbp's template limit of {MAX_LENGTH} characters",
    ),
    "a list nested past the depth a chat template takes": (
        "{% set ns = namespace(l=[]) %}{% for i in range(33) %}{% set ns.l = [ns.l] %}{% endfor %}{{ ns.l | string | length }}",
        f"string() would exceed csbp's template limit of {MAX_LENGTH} characters",
    ),
    "two lists of half the limit added": (  # each within MAX_LENGTH, the sum past it (strings: checked apart)
        f"{{% set big = ['x' * {HALF}] %}}{{{{ (big + big) | length }}}}",
        f"+ would exceed csbp's template limit of {MAX_LENGTH} characters",
    ),
}


@pytest.mark.parametrize(("payload", "reason"), REFUSED.values(), ids=REFUSED.keys())
def test_each_bound_refuses_by_its_own_check(payload: str, reason: str) -> None:
    template = ChatTemplate(payload, "evil/chat_template.jinja")
    with pytest.raises(ValueError, match=rf"^rec 3: chat template evil/chat_template.jinja was refused by the sandbox "
                       rf"\({re.escape(reason)}\)"):
        template.render([{"role": "user", "content": "hi"}], where="rec 3")


def test_lipsum_is_not_available() -> None:
    """jinja2's ``lipsum(n)`` writes random text of any length (module docstring)."""
    rendered = ChatTemplate("{{ lipsum is defined }}|{{ range is defined }}", "t").render(
        [{"role": "user", "content": "hi"}], where="rec 0"
    )
    assert rendered == "False|True"


def test_the_edges_of_the_iteration_budget_and_the_depth_bound_render() -> None:
    """What the refusals above add one to: the whole iteration budget, and a list 32 deep."""
    messages = [{"role": "user", "content": "hi"}]
    whole = f"{{{{ range({MAX_ARGUMENT}) | length }}}}" * (MAX_ITERATIONS // MAX_ARGUMENT)
    assert ChatTemplate(whole, "t").render(messages, where="rec 0") == str(MAX_ARGUMENT) * (MAX_ITERATIONS // MAX_ARGUMENT)
    deep = "{% set ns = namespace(l=[]) %}{% for i in range(32) %}{% set ns.l = [ns.l] %}{% endfor %}{{ ns.l | string }}"
    assert ChatTemplate(deep, "t").render(messages, where="rec 0") == "[" * 33 + "]" * 33
