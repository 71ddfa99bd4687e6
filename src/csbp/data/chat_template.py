"""Chat records formatted with the model's own Jinja chat template (``--chat-template``).

A chat model only ever sees its own format at inference, so training data for it must be rendered
with the template in its tokenizer directory (``tokenizer_config.json`` ``chat_template``, or a
``chat_template.jinja`` file) rather than csbp's ``<|user|>`` role markers.

Templates from a downloaded model are untrusted input: they are rendered in Jinja2's
``ImmutableSandboxedEnvironment`` (attribute access to internals such as ``__class__`` and
mutation of passed-in objects are refused), with the size and work limits of
:mod:`csbp.data.template_sandbox` (no ``'a' * 10**10``, nested ``range(100000)`` loops or output
past 16 Mi characters, no render past 10 s of CPU time), and with the globals templates commonly use:
``raise_exception``, ``strftime_now``, ``bos_token``, ``eos_token`` and ``add_generation_prompt``,
and a ``tojson`` filter taking the ``json.dumps`` options transformers' takes (``ensure_ascii``,
``indent``, ``separators``, ``sort_keys``). An error a template raises while rendering is one
``ValueError`` line naming the record. ``strftime_now`` reads the clock, as in transformers: a
template that writes today's date (Llama 3.1's system header) makes the artifact depend on the day.
``{% generation %}`` blocks are accepted and render their body unchanged; supervision never
depends on them.

Supervision (``ChatTemplate.supervised_spans``): the conversation's prefixes ``messages[:i+1]``
are rendered; each render must start with the previous one (the template is *prefix-stable*),
so the text added by message ``i`` is the difference. For an assistant message the same turn is
also rendered with a sentinel as content, which splits the difference into the scaffolding before
the content, the content, and the end-of-turn text after it. The content and the end-of-turn text
(trailing whitespace excluded) are supervised; system/user turns and scaffolding are not. A template
that writes no end-of-turn text after the last assistant turn (``{{ role }}: {{ content }}\n``)
leaves nothing in the text that teaches the model to stop: ``SupervisedChat.eos_is_stop`` then says
the EOS appended after the record must be supervised instead (as TRL's SFT appends a supervised EOS);
an earlier assistant turn of such a template has no stop target (the next turn's text is not
supervised, so it teaches nothing wrong either).

An assistant turn with reasoning (``reasoning_content``, passed to the template; or inline
``<think>R</think>C`` content that the template itself splits) is also rendered with a second
sentinel in place of the reasoning, which must appear exactly once as given. Such a turn is
supervised from the end of its generation prompt (``messages[:i]`` rendered with
``add_generation_prompt``) through its end-of-turn: the model writes the think scaffolding, the
reasoning and the answer after that prompt. A turn without reasoning keeps the rule above (content
and end-of-turn). Rules and refusals: :mod:`csbp.data.chat_reasoning`.

Templates that rewrite earlier turns once a later one follows (Qwen3's drops the ``<think>`` block
of an assistant turn once a user turn follows it) are not prefix-stable, and their records are
refused. ``--chat-documents turn`` (``ChatTemplate.last_turn_spans``) makes one document of each
assistant turn ``i`` instead: ``messages[:i+1]`` rendered, only that last turn supervised, which is
the text the model sees when it writes turn ``i`` at inference. It only needs ``messages[:i]`` to
render as a prefix of ``messages[:i+1]``. A record whose earlier turn loses its reasoning that way
is refused naming that turn: a record-long document would train it without the reasoning it was
written with, while at inference the model writes every turn after thinking.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple

import jinja2
import jinja2.ext
import jinja2.nodes

from csbp.data.chat_reasoning import (
    REASONING,
    THINK_END,
    as_given,
    dropped_reasoning,
    generation_end,
    refusal,
    split_inline_reasoning,
)
from csbp.data.template_sandbox import MAX_LENGTH, BoundedSandbox, OutputTooLong, render_bounded

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_JSON_FILE = "chat_template.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
Message = dict[str, str]


class _GenerationBlock(jinja2.ext.Extension):
    """Accepts ``{% generation %}...{% endgeneration %}`` and renders the body as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return list(parser.parse_statements(("name:endgeneration",), drop_needle=True))


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format_string: str) -> str:
    return datetime.now().strftime(format_string)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain JSON and may pass
    # these json.dumps options (as transformers' apply_chat_template accepts them)
    if indent is not None and not 0 <= indent <= _MAX_JSON_INDENT:
        raise jinja2.exceptions.TemplateError(f"tojson(indent={indent}): csbp allows 0 to {_MAX_JSON_INDENT}")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


_MAX_JSON_INDENT = 16


def _environment() -> BoundedSandbox:
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.bound_filters()
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class SupervisedChat(NamedTuple):
    """A chat rendered by its template, with what to supervise.

    Attributes:
        text: the rendered conversation.
        spans: ``(start, end)`` character spans of ``text`` to supervise.
        eos_is_stop: the conversation ends with an assistant turn after whose content the template
            writes no end-of-turn text (whitespace at most): the EOS appended after ``text`` is the
            only stop signal, and must be supervised.
    """

    text: str
    spans: list[tuple[int, int]]
    eos_is_stop: bool


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template with the token strings it refers to.

    Attributes:
        text: the Jinja source.
        source: where it came from (a file path, or ``DIR/tokenizer_config.json``).
        sha256: hex digest of ``text`` (recorded in the artifact manifest).
        bos_token, eos_token: values of the ``bos_token``/``eos_token`` template globals.
    """

    text: str
    source: str
    bos_token: str = ""
    eos_token: str = ""

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()

    def manifest_entry(self) -> dict[str, str]:
        """What the artifact manifest records about the template: its file as an absolute path (an
        export run from another directory reads it there) and its sha256."""
        return {"source": str(Path(self.source).resolve()), "sha256": self.sha256}

    def render(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool = False,
        where: str = "",
        without: str = "pass --chat-template none",
    ) -> str:
        """The template's text for ``messages``; any template error raises one ``ValueError`` line, whose
        fix names ``without``: how the command goes on without the template."""
        try:
            compiled = _compile(self.text)
            return render_bounded(
                compiled,
                messages=[dict(message) for message in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except OutputTooLong:
            raise ValueError(
                f"{where or self.source}: chat template {self.source} would render more than csbp's limit of "
                f"{MAX_LENGTH} characters for this record (fix: split the record into shorter chats, or {without})"
            ) from None
        except jinja2.exceptions.SecurityError as exc:
            raise ValueError(
                f"{where or self.source}: chat template {self.source} was refused by the sandbox ({exc}) "
                f"(fix: use a trusted template, or {without})"
            ) from None
        except Exception as exc:  # a template is code: whatever it raises (TypeError ...) is one line
            first_line = str(exc).splitlines()[0] if str(exc) else ""
            if not isinstance(exc, jinja2.exceptions.TemplateError):
                first_line = f"{type(exc).__name__}: {first_line}"
            raise ValueError(
                f"{where or self.source}: chat template {self.source} failed: {first_line or type(exc).__name__} "
                f"(fix: repair the record, or {without}, or use another template)"
            ) from None

    def supervised_spans(self, messages: Sequence[Message], where: str) -> SupervisedChat:
        """The rendered text, its spans to supervise and whether the EOS after it is the stop
        (see the module docstring)."""
        rendered = ""
        spans: list[tuple[int, int]] = []
        eos_is_stop = False
        for index, message in enumerate(messages):
            text = self.render(messages[: index + 1], where=where)
            dropped = dropped_reasoning(messages, index, rendered, text) if not text.startswith(rendered) else None
            if dropped is not None:
                raise ValueError(
                    f"{where}: chat template {self.source} drops the reasoning of messages[{dropped}] once "
                    f"messages[{index}] follows (the turn becomes history without it), so one document per record "
                    "would train that turn without the reasoning it was written with (fix: --chat-documents turn, "
                    "one document per assistant turn, rendered as the model sees it when writing that turn)"
                )
            if not text.startswith(rendered):
                raise ValueError(
                    f"{where}: chat template {self.source} is not prefix-stable for this record: rendering "
                    f"messages[:{index + 1}] changes the text of the earlier messages (fix: --chat-documents turn, "
                    "one document per assistant turn with the turns before it as the template renders them; or "
                    "--chat-template none)"
                )
            eos_is_stop = False
            if message["role"] == "assistant":
                start, end, content_end = self._assistant_span(messages, index, rendered, text, where)
                if end > start:
                    spans.append((start, end))
                eos_is_stop = end == content_end  # no end-of-turn text after the content
            rendered = text
        return SupervisedChat(rendered, spans, eos_is_stop)

    def last_turn_spans(self, messages: Sequence[Message], where: str) -> SupervisedChat:
        """``messages`` rendered with only its last message supervised, when that is an assistant
        turn (``--chat-documents turn``; nothing is supervised otherwise). Only the text of
        ``messages[:-1]`` must be a prefix of the whole render: what the template does to earlier
        turns once later ones follow does not matter."""
        text = self.render(messages, where=where)
        index = len(messages) - 1
        if index < 0 or messages[index]["role"] != "assistant":
            return SupervisedChat(text, [], False)
        rendered = self.render(messages[:index], where=where) if index else ""
        if not text.startswith(rendered):
            raise ValueError(
                f"{where}: chat template {self.source} renders messages[:{index}] differently once "
                f"messages[{index}] (an assistant turn) follows, so even --chat-documents turn cannot find its "
                "span (fix: --chat-template none, or a template that renders the turns before one unchanged)"
            )
        start, end, content_end = self._assistant_span(messages, index, rendered, text, where)
        return SupervisedChat(text, [(start, end)] if end > start else [], end == content_end)

    def _assistant_span(
        self, messages: Sequence[Message], index: int, rendered: str, text: str, where: str
    ) -> tuple[int, int, int]:
        """Where message ``index``'s supervised text lies in ``text`` (``rendered`` is the text of the
        messages before it): ``(start, end, where the content ends)``. The scaffolding around the content
        (and the reasoning) is found by rendering the same turn with a sentinel in its place: the real
        turn must be that scaffolding around some content, else the template is content-dependent and
        the record is refused. A turn with reasoning is supervised from the end of its generation prompt
        (see the module docstring)."""
        split = split_inline_reasoning(self, messages, index, text, where)
        messages = split or messages
        message = messages[index]
        # inline: the reasoning came as <think>...</think> in the content (split, or kept there as given)
        inline = split is not None or (REASONING not in message and THINK_END in message["content"])
        added = text[len(rendered):]
        before, after = self._around(messages, index, "content", rendered, added, where, inline)
        start = len(rendered) + len(before)
        content_end = len(rendered) + len(added) - len(after)
        if (inline or REASONING in message) and not as_given(text[start:content_end], message["content"]):
            raise ValueError(refusal(self, where, index, "content", inline))
        if message.get(REASONING):
            r_before, r_after = self._around(messages, index, REASONING, rendered, added, where, inline)
            r_start, r_end = len(rendered) + len(r_before), len(rendered) + len(added) - len(r_after)
            if not as_given(text[r_start:r_end], message[REASONING]):
                raise ValueError(refusal(self, where, index, REASONING, inline))
            start = generation_end(self, messages, index, rendered, text, min(start, r_start), where)
        return start, content_end + len(after.rstrip()), content_end

    def _around(
        self, messages: Sequence[Message], index: int, field: str, rendered: str, added: str, where: str, inline: bool
    ) -> tuple[str, str]:
        """The template text of message ``index`` before and after its ``field`` (``added`` is the
        turn's text), found with a sentinel in place of the field."""
        sentinel = _SENTINELS[field]
        probe = [*messages[:index], {**messages[index], field: sentinel}]
        probe_text = self.render(probe, where=where)
        probe_added = probe_text[len(rendered):]
        if not probe_text.startswith(rendered) or probe_added.count(sentinel) != 1:
            if inline or REASONING in messages[index]:  # the fix is about the reasoning, not --chat-template none
                raise ValueError(refusal(self, where, index, field, inline))
            raise ValueError(
                f"{where}: chat template {self.source} does not render messages[{index}].content exactly once "
                "as given, so its supervised span cannot be found (fix: --chat-template none)"
            )
        before, after = probe_added.split(sentinel)
        if not (added.startswith(before) and added.endswith(after) and len(added) >= len(before) + len(after)):
            if inline or REASONING in messages[index]:
                raise ValueError(refusal(self, where, index, field, inline))
            raise ValueError(
                f"{where}: chat template {self.source} renders the scaffolding of messages[{index}] differently "
                "depending on its content, so its supervised span cannot be found (fix: --chat-template none)"
            )
        return before, after


_SENTINEL = "csbpAssistantContentSentinel"
"""Stands in for an assistant message's content to locate the template text around it."""
_SENTINELS = {"content": _SENTINEL, REASONING: "csbpAssistantReasoningSentinel"}
"""The stand-in for each field of an assistant message whose place in the turn is located."""
_COMPILED: dict[str, jinja2.Template] = {}


def _compile(text: str) -> jinja2.Template:
    compiled = _COMPILED.get(text)
    if compiled is None:
        compiled = _environment().from_string(text)
        _COMPILED[text] = compiled
    return compiled


def _token_string(value: Any) -> str:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _config(directory: Path) -> dict[str, Any]:
    path = directory / CONFIG_FILE
    return _read_json(path) if path.is_file() else {}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc}) (fix: repair the file)".splitlines()[0]) from None
    if not isinstance(config, dict):  # a config must be an object: never read as "no template here"
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(config), "a number")
        raise ValueError(f"{path}: holds {kind}, not a JSON object (fix: repair the file)")
    return config


def _template_in_config(config: dict[str, Any], path: Path) -> str | None:
    value = config.get("chat_template")
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):  # named templates: [{"name": "default", "template": ...}, ...]
        for entry in value:
            if isinstance(entry, dict) and entry.get("name") == "default" and isinstance(entry.get("template"), str):
                return str(entry["template"])
    raise ValueError(f"{path}: 'chat_template' is neither a string nor a list holding a 'default' template")


def template_in_file(name: str, data: bytes) -> str | None:
    """The chat template a file of name ``name`` holding ``data`` carries: a ``.json`` file's
    ``chat_template`` (``tokenizer_config.json``, ``chat_template.json``; None when it has none),
    else the whole text (a ``.jinja`` file). ``ValueError`` naming the file when it is malformed."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{name}: not UTF-8 text (fix: restore the file)") from None
    if not name.endswith(".json"):
        return text
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{name}: not valid JSON ({exc}) (fix: repair the file)".splitlines()[0]) from None
    return _template_in_config(config, Path(name)) if isinstance(config, dict) else None


def read_template_file(path: Path) -> str | None:
    """:func:`template_in_file` of the file at ``path``; None when there is none."""
    return template_in_file(str(path), path.read_bytes()) if path.is_file() else None


def resolve_chat_template(
    spec: str, tokenizer_path: Path | None, *, without: str = "pass --chat-template none"
) -> ChatTemplate | None:
    """The template ``--chat-template SPEC`` selects: ``none`` -> None; ``auto`` -> the tokenizer
    directory's ``chat_template.jinja``, ``chat_template.json`` or ``tokenizer_config.json``
    template (first found), else None; anything
    else is the path of a ``.jinja`` file. ``bos_token``/``eos_token`` come from the tokenizer
    directory's ``tokenizer_config.json``, and where it names none, from its
    ``special_tokens_map.json`` (as transformers reads them). A syntax error's fix names ``without``:
    how the command goes on without the template."""
    directory = None
    if tokenizer_path is not None:
        tokenizer_path = Path(tokenizer_path)
        directory = tokenizer_path if tokenizer_path.is_dir() else tokenizer_path.parent
    config = _config(directory) if directory is not None else {}
    tokens = {name: _token_string(config.get(name)) for name in ("bos_token", "eos_token")}
    if directory is not None and not all(tokens.values()) and (directory / SPECIAL_TOKENS_MAP_FILE).is_file():
        special_map = _read_json(directory / SPECIAL_TOKENS_MAP_FILE)  # a template's {{ bos_token }} was ""
        tokens = {name: value or _token_string(special_map.get(name)) for name, value in tokens.items()}
    if spec == "none":
        return None
    if spec == "auto":
        if directory is None:
            return None
        jinja_file, json_file = directory / TEMPLATE_FILE, directory / TEMPLATE_JSON_FILE
        if jinja_file.is_file():
            return _checked(ChatTemplate(_read_text(jinja_file), str(jinja_file), **tokens), without)
        if json_file.is_file():
            text = _template_in_config(_read_json(json_file), json_file)
            if text is not None:
                return _checked(ChatTemplate(text, str(json_file), **tokens), without)
        text = _template_in_config(config, directory / CONFIG_FILE)
        if text is None:
            return None
        return _checked(ChatTemplate(text, str(directory / CONFIG_FILE), **tokens), without)
    path = Path(spec)
    if path.is_dir():
        raise ValueError(
            f"--chat-template {spec} is a directory; give the path of a .jinja file, or auto to use the "
            "template of the --tokenizer directory"
        )
    if not path.is_file():
        raise ValueError(f"--chat-template {spec}: no such file; use auto, none or the path of a .jinja file")
    return _checked(ChatTemplate(_read_text(path), str(path), **tokens), without)


def _read_text(path: Path) -> str:
    """A ``.jinja`` template file's text; ``ValueError`` naming it when it is not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start + 1}) (fix: re-encode it as UTF-8)") from None


def _checked(template: ChatTemplate, without: str) -> ChatTemplate:
    """Compile once up front, so a syntax error is reported before any data is read."""
    try:
        _compile(template.text)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ValueError(
            f"{template.source}: chat template line {exc.lineno}: {exc.message} (fix: repair the template, "
            f"or {without})"
        ) from None
    return template
