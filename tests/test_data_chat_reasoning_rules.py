"""The rules of csbp.data.chat_reasoning one by one, on hand-written inputs (a mutation audit found each
unpinned): which inline reasoning is split out, where a reasoning turn's generation starts, and which
earlier turn a template drops the reasoning of."""

from __future__ import annotations

import pytest

from csbp.data.chat_reasoning import (
    dropped_reasoning,
    generation_end,
    inline_reasoning,
    split_inline_reasoning,
)
from csbp.data.chat_template import ChatTemplate

VERBATIM = ChatTemplate(
    "{% for m in messages %}{% if m['reasoning_content'] %}<think>{{ m['reasoning_content'] }}</think>{% endif %}"
    "{{ m['content'] }}|{% endfor %}",
    "verbatim.jinja",
)
"""Writes the reasoning in a think block and the content as given."""
SPLITTING = ChatTemplate(
    "{% for m in messages %}{% set c = m['content'] %}"
    "{% if '</think>' in c %}<think>{{ c.split('</think>')[0].split('<think>')[-1] }}</think>{{ c.split('</think>')[-1] }}"
    "{% else %}<think>{{ m['reasoning_content'] }}</think>{{ c }}{% endif %}|{% endfor %}",
    "splitting.jinja",
)
"""Splits inline reasoning out of the content itself (the text after the last <think>), ignoring
reasoning_content then."""


@pytest.mark.parametrize(
    ("content", "reasoning"),
    [("<think>R</think>C", "R"), ("x<think>R</think>C", "R"), ("R</think>C", "R"), ("<think>R", ""),
     ("plain", ""), ("a</think>b</think>c", "")],
)
def test_inline_reasoning_is_the_text_before_the_one_end_tag(content: str, reasoning: str) -> None:
    assert inline_reasoning(content) == reasoning


def test_the_content_after_the_end_tag_is_split_out_as_written() -> None:
    """Whitespace after </think> stays in the content when the template writes it so (a stripped
    content rendered another text, and the split was given up)."""
    message = {"role": "assistant", "content": "<think>R</think>\n\nC"}
    text = VERBATIM.render([message])
    assert text == "<think>R</think>\n\nC|"
    assert split_inline_reasoning(VERBATIM, [message], 0, text, "w") == [
        {"role": "assistant", "content": "\n\nC", "reasoning_content": "R"}
    ]


@pytest.mark.parametrize(
    "message",
    [{"role": "assistant", "content": "<think>A</think>B", "reasoning_content": "R"},  # R would be lost
     {"role": "assistant", "content": "<think>a<think>b</think>C"}],  # 'a<think>' would be lost
)
def test_inline_reasoning_is_not_split_beside_reasoning_content_or_a_second_start_tag(message: dict) -> None:
    text = SPLITTING.render([message])
    assert split_inline_reasoning(SPLITTING, [message], 0, text, "w") is None


PROMPTED = ChatTemplate(
    "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }}|{% endfor %}{% if add_generation_prompt %}A>{% endif %}",
    "prompted.jinja",
)
ASK = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "c", "reasoning_content": "r"}]
PROMPT = "user:q|A>"


def test_the_generation_may_start_right_where_the_reasoning_does() -> None:
    """A generation prompt ending where the reasoning starts (one that opens the think block itself)."""
    assert generation_end(PROMPTED, ASK, 1, "user:q|", PROMPT + "r c|", len(PROMPT), "w") == len(PROMPT)


@pytest.mark.parametrize(
    ("rendered", "text", "first"),
    [("xser:q|", PROMPT + "r c|", len(PROMPT)),  # the prompt does not continue the earlier messages
     ("user:q|", "user:q|B>r c|", len(PROMPT)),  # the turn does not begin with the prompt
     ("user:q|", PROMPT + "r c|", len(PROMPT) - 1)],  # the reasoning starts inside the prompt
)
def test_a_turn_that_does_not_continue_its_generation_prompt_is_refused(rendered: str, text: str, first: int) -> None:
    with pytest.raises(ValueError, match=r"^w: chat template prompted\.jinja renders messages\[1\] with its reasoning "
                       r"as text that does not continue its generation prompt"):
        generation_end(PROMPTED, ASK, 1, rendered, text, first, "w")


def test_dropped_reasoning_names_an_earlier_turn_whose_rendered_reasoning_is_gone() -> None:
    field = {"role": "assistant", "content": "c", "reasoning_content": "\nR\n"}
    inline = {"role": "assistant", "content": "<think>S</think>c"}
    user = {"role": "user", "content": "q"}
    assert dropped_reasoning([field, user], 1, "<think>R</think>c", "c") == 0  # stripped as the template writes it
    assert dropped_reasoning([inline, user], 1, "<think>S</think>c", "c") == 0
    assert dropped_reasoning([field, user], 1, "c", "c") is None  # never rendered: not dropped by what follows
    assert dropped_reasoning([field, user], 1, "R", "R") is None  # kept
    assert dropped_reasoning([user, field], 1, "R", "c") is None  # only turns before index count
