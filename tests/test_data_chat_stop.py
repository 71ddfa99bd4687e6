"""The stop signal of templated chats: a model fine-tuned on assistant turns must be taught to stop.
A template's own end-of-turn text (``<|im_end|>``) is that signal; a template that writes none after
the assistant's content leaves the EOS appended after the record as the only one, which must then be
supervised (it never was: such a model never learned to stop)."""

from __future__ import annotations

from pathlib import Path

import pytest

from csbp.data.chat_template import ChatTemplate
from csbp.data.packing import encode_documents
from csbp.data.sources import record_to_document
from csbp.data.tokenizer import load_tokenizer
from test_data_chat_template import CHATML, build_tokenizer_dir

PLAIN = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
"""No end-of-turn text: each turn ends in a newline, and the next turn's role name follows."""
EOT_BEFORE_NEXT = "{% for m in messages %}{% if not loop.first %}<|im_end|>{% endif %}{{ m['role'] }}: {{ m['content'] }}{% endfor %}"
"""An end-of-turn written at the start of the next turn: none after the last one."""
USER = {"role": "user", "content": "What is two plus two?"}


def supervised_tail(template_text: str, messages: list[dict[str, str]], tokenizer_dir: Path) -> list[tuple[str, int]]:
    tokenizer = load_tokenizer(tokenizer_dir)
    document = record_to_document({"messages": messages}, "rec:1")
    [(ids, mask)] = encode_documents([document], tokenizer, ChatTemplate(template_text, "t.jinja"))
    return [(tokenizer.decode([token]), int(flag)) for token, flag in zip(ids.tolist(), mask.tolist())][-3:]


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer_dir(tmp_path_factory.mktemp("chatml"), "chatml")


@pytest.mark.parametrize("template", [PLAIN, EOT_BEFORE_NEXT], ids=["newline only", "end-of-turn before the next turn"])
def test_a_template_without_end_of_turn_text_supervises_the_eos(chatml_dir: Path, template: str) -> None:
    tail = supervised_tail(template, [USER, {"role": "assistant", "content": "It is four."}], chatml_dir)
    assert tail[-1] == ("<|endoftext|>", 1)  # was 0: nothing taught the model to stop
    assert tail[-3][1] == 1  # the content is supervised as before
    # an empty assistant turn: the stop is all there is to learn
    assert supervised_tail(template, [USER, {"role": "assistant", "content": ""}], chatml_dir)[-1] == ("<|endoftext|>", 1)


def test_a_template_with_end_of_turn_text_keeps_the_eos_a_plain_separator(chatml_dir: Path) -> None:
    tail = supervised_tail(CHATML, [USER, {"role": "assistant", "content": "It is four."}], chatml_dir)
    assert tail[-2:] == [("\n", 0), ("<|endoftext|>", 0)] and tail[-3] == ("<|im_end|>", 1)


@pytest.mark.parametrize("template", [PLAIN, CHATML], ids=["no end-of-turn", "chatml"])
def test_a_chat_ending_with_a_user_turn_never_supervises_the_eos(chatml_dir: Path, template: str) -> None:
    messages = [USER, {"role": "assistant", "content": "It is four."}, {"role": "user", "content": "Thanks."}]
    assert supervised_tail(template, messages, chatml_dir)[-1] == ("<|endoftext|>", 0)


def test_the_spans_say_whether_the_eos_is_the_stop() -> None:
    chat = [USER, {"role": "assistant", "content": "It is four."}]
    assert ChatTemplate(PLAIN, "t").supervised_spans(chat, "rec:1").eos_is_stop
    assert not ChatTemplate(CHATML, "t").supervised_spans(chat, "rec:1").eos_is_stop
    assert not ChatTemplate(PLAIN, "t").supervised_spans([USER], "rec:1").eos_is_stop
