"""Chat-template rules no test pinned (mutation audit of ``csbp.data.chat_template``), against
hand-computed spans and values:

* ``eos_is_stop`` only when *nothing but whitespace* follows the last assistant content, and only
  when the conversation ends with that assistant turn;
* a template that writes an assistant's content twice is refused in one line;
* ``bos_token``/``eos_token``: each from ``tokenizer_config.json``, and only a missing one from
  ``special_tokens_map.json``; a named-template list gives its ``default``; ``auto`` with a
  ``tokenizer.json`` path reads its directory; the manifest records the template's absolute path;
  ``tojson(indent=0)`` is allowed, as in ``json.dumps``; indented block tags render as transformers renders
  them (``lstrip_blocks``).

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_data_chat_template_rules.py -q``
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from csbp.data.chat_template import ChatTemplate, resolve_chat_template

PLAIN = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ end }}\n{% endfor %}"
USER = {"role": "user", "content": "hi"}
ASSISTANT = {"role": "assistant", "content": "hello"}


def template(end: str) -> ChatTemplate:
    return ChatTemplate(PLAIN.replace("{{ end }}", end), "t.jinja")


def test_the_eos_is_the_stop_only_after_whitespace_and_only_at_an_assistant_end() -> None:
    chat = template("").supervised_spans([USER, ASSISTANT], "x:1")
    assert chat.text == "user: hi\nassistant: hello\n" and chat.spans == [(20, 25)] and chat.eos_is_stop
    chat = template(".").supervised_spans([USER, ASSISTANT], "x:1")  # one end-of-turn character: the stop
    assert chat.text[chat.spans[0][0]:chat.spans[0][1]] == "hello." and not chat.eos_is_stop
    chat = template("").supervised_spans([USER, ASSISTANT, USER], "x:1")  # ends with a user turn
    assert chat.spans == [(20, 25)] and not chat.eos_is_stop


def test_content_written_twice_is_refused_in_one_line() -> None:
    twice = ChatTemplate("{% for m in messages %}{{ m['content'] }}|{{ m['content'] }}\n{% endfor %}", "t.jinja")
    with pytest.raises(ValueError, match=r"^x:1: chat template t\.jinja does not render messages\[1\]\.content "
                                         r"exactly once as given"):  # fmt: skip
        twice.supervised_spans([USER, ASSISTANT], "x:1")


def test_bos_and_eos_come_from_the_config_and_only_missing_ones_from_the_map(tmp_path: Path) -> None:
    (tmp_path / "chat_template.jinja").write_text("{{ bos_token }}|{{ eos_token }}", encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<B>", "eos_token": {"content": "</s>"}}))
    found = resolve_chat_template("auto", tmp_path / "tokenizer.json")  # a tokenizer.json path: its directory
    assert found is not None and (found.bos_token, found.eos_token) == ("<s>", "</s>")
    assert found.source == str(tmp_path / "chat_template.jinja")


def test_a_named_template_list_gives_its_default(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "PLAIN"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named}))
    found = resolve_chat_template("auto", tmp_path)
    assert found is not None and found.text == "PLAIN"


def test_the_manifest_records_an_absolute_template_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    entry = ChatTemplate("x", "templates/chat.jinja").manifest_entry()
    assert entry["source"] == str(tmp_path / "templates" / "chat.jinja")


def test_tojson_takes_indent_zero() -> None:
    rendered = ChatTemplate("{{ messages[0] | tojson(indent=0) }}", "t.jinja").render([USER])
    assert rendered == json.dumps(USER, indent=0)


def test_indented_block_tags_render_as_transformers_renders_them() -> None:
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models

    text = ("{% for m in messages %}\n    {% if m['role'] == 'user' %}\n  U: {{ m['content'] }}\n    {% else %}\n"
            "  A: {{ m['content'] }}\n    {% endif %}\n{% endfor %}")  # fmt: skip
    backend = Tokenizer(models.WordLevel({"a": 0}, unk_token="a"))
    reference = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=text)
    expected = reference.apply_chat_template([USER, ASSISTANT], tokenize=False)
    assert ChatTemplate(text, "t.jinja").render([USER, ASSISTANT]) == expected == "  U: hi\n  A: hello\n"
