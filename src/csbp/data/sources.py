"""Readers that turn raw training files into ``Document`` objects for ``csbp data prepare``.

Supported inputs (chosen by file suffix; a directory expands to its supported files, sorted):

* ``.jsonl`` and ``.parquet`` records, in this order of precedence when several apply:
  ``messages`` (a chat: list of ``{"role": system|user|assistant, "content": str}``; only
  assistant content is supervised; an assistant message may carry its reasoning as a string
  ``reasoning_content``, which only a chat template can render (``Document.reasoning``; with csbp's
  role markers ``prepare`` refuses it); any other message field, such as ``tool_calls``, reasoning on
  another role, and a record's ``tools``/``documents`` are refused unless null or empty, as they
  would be dropped), ``prompt`` + ``completion`` (only the completion is supervised), ``text``
  (everything is supervised);
* ``.txt`` files: one document per file, or (``txt_mode="paragraphs"``) one document per
  blank-line-separated paragraph. Project Gutenberg header/footer boilerplate is removed when
  its markers are present.

Text files are read as UTF-8 (a leading byte-order mark, as some Windows editors write, is
dropped) with universal newlines: ``\r\n`` line ends of ``.txt`` files become ``\n``; strings
inside JSONL and Parquet records are kept exactly as given.

A ``Document`` is a list of segments: plain text to tokenize, or a chat role marker that the
tokenizer maps to one special token id (``<|user|>`` ...); chat documents also keep their
messages, which ``--chat-template`` renders with the model's own template instead. Tokenization happens later, in
``prepare.py``; this module only parses and validates. Problems in the data raise ``ValueError``
naming the file and the 1-based line (JSONL) or row (Parquet).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from csbp.data.corpus import strip_gutenberg_boilerplate
from csbp.data.json_lines import parse_json_line

TxtMode = Literal["file", "paragraphs"]
ChatDocuments = Literal["record", "turn"]
"""``--chat-documents``: one document per chat record, or one per assistant turn (``packing.turn_documents``)."""

SUPPORTED_SUFFIXES = (".jsonl", ".txt", ".parquet")
CHAT_ROLES = ("system", "user", "assistant")
ACCEPTED_FIELDS = "'messages' (list of {role, content}), 'prompt' + 'completion', or 'text' (all strings)"


@dataclass(frozen=True)
class Segment:
    """One piece of a document: ``text`` to tokenize, or (when ``role`` is set) the single special
    token marking the start of a chat message of that role (``text`` is then empty).

    ``supervised`` says whether the tokens of this piece carry loss (loss mask 1).
    """

    text: str
    supervised: bool
    role: str | None = None


@dataclass(frozen=True)
class Document:
    """A parsed document. The EOS token appended after it is supervised iff ``eos_supervised``
    (plain text, completions and chats ending with an assistant turn teach the model to stop).
    ``where`` is ``file:line`` / ``file:row`` / ``file`` for error messages."""

    segments: tuple[Segment, ...]
    eos_supervised: bool
    where: str
    messages: tuple[tuple[str, str], ...] | None = None
    """For chat records: ``(role, content)`` per message, for rendering with a chat template."""
    reasoning: tuple[str, ...] = ()
    """For chat records with reasoning: each message's ``reasoning_content`` ("" where it has none;
    only assistant messages have one), else empty. Only a chat template renders it."""
    last_turn_only: bool = False
    """A chat rendered with a template supervises its last message alone (``--chat-documents turn``)."""

    @property
    def is_empty(self) -> bool:
        """True when no text segment has non-whitespace content (such documents are skipped)."""
        return not any(s.text.strip() for s in self.segments) and not any(r.strip() for r in self.reasoning)

    def texts(self) -> list[str]:
        """The plain-text pieces (what a tokenizer is trained on), reasoning included."""
        return [s.text for s in self.segments if s.role is None] + [r for r in self.reasoning if r]

    def first_reasoning(self) -> int | None:
        """The index of the first message with a ``reasoning_content``, None when there is none."""
        return next((index for index, text in enumerate(self.reasoning) if text), None)


def expand_inputs(inputs: Sequence[str | Path]) -> list[Path]:
    """Resolve files and directories into the ordered list of input files."""
    files: list[Path] = []
    for item in inputs:
        path = Path(item)
        if path.is_dir():
            odd_case = sorted(p.name for p in path.iterdir()
                              if p.suffix not in SUPPORTED_SUFFIXES and p.suffix.lower() in SUPPORTED_SUFFIXES)
            if odd_case:  # skipped like a README they would be lost without a word
                raise ValueError(f"input directory {path} holds {odd_case[0]}, whose suffix is not lower case: it "
                                 f"would be skipped (fix: rename it to {Path(odd_case[0]).stem}"
                                 f"{Path(odd_case[0]).suffix.lower()})")
            found = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in SUPPORTED_SUFFIXES)
            if not found:
                raise ValueError(
                    f"input directory {path} holds no {'/'.join(SUPPORTED_SUFFIXES)} files (fix: pass the directory "
                    f"or files holding the data, each a {'/'.join(SUPPORTED_SUFFIXES)} file; other files are skipped)"
                )
            files.extend(found)
        elif path.is_file():
            if path.suffix not in SUPPORTED_SUFFIXES:
                raise ValueError(unsupported_suffix(path))
            files.append(path)
        elif path.exists():  # a pipe (``<(zcat data.jsonl.gz)``), a device
            raise ValueError(
                f"input {path} is neither a regular file nor a directory: csbp data prepare reads its inputs "
                "more than once (fix: write it to a .jsonl/.txt/.parquet file first)"
            )
        elif path.is_symlink():
            raise ValueError(
                f"input {path} is a symbolic link to {os.readlink(path)}, which does not exist (fix: pass the file "
                "itself, or point the link at it)"
            )
        else:
            raise ValueError(
                f"input {path} does not exist (fix: check the path; a relative one is read from the working "
                f"directory, {Path.cwd()})"
            )
    if not files:
        raise ValueError(
            f"no input files given (fix: name one or more {'/'.join(SUPPORTED_SUFFIXES)} files or directories)"
        )
    first_named: dict[Path, Path] = {}
    for path in files:
        earlier = first_named.setdefault(path.resolve(), path)
        if earlier is not path:
            raise ValueError(
                f"input {path} is given twice (also as {earlier}): its documents would be packed twice, "
                "possibly into both train and val (fix: name each file once)"
            )
    return files


_RECORD_FIX = "(fix: repair or drop the record)"


def unsupported_suffix(path: Path) -> str:
    """The refusal of an input file ``path`` whose suffix csbp data prepare does not read."""
    return (
        f"input {path}: unsupported suffix {path.suffix!r}; use one of {SUPPORTED_SUFFIXES} (fix: rename a "
        "plain-text file to .txt, or convert the data to .jsonl, one {\"text\": ...} object a line)"
    )


def iter_documents(files: Sequence[Path], *, txt_mode: TxtMode = "file") -> Iterator[Document]:
    """Yield every document of ``files`` in order, empty ones included (check ``is_empty``)."""
    for path in files:
        try:
            yield from _read_file(path, txt_mode)
        except UnicodeDecodeError as exc:
            where, reason = _undecodable_line(path) or (str(path), exc.reason)
            raise ValueError(f"{where}: not UTF-8 text ({reason}) (fix: re-encode the file as UTF-8)") from None


def _undecodable_line(path: Path) -> tuple[str, str] | None:
    """``(file:line, what is wrong)`` of the first line of ``path`` that is not UTF-8 (line ends
    counted as universal newlines do: ``\\r\\n``, ``\\r`` or ``\\n``), None when every line decodes."""
    line_number = 0
    with open(path, "rb") as handle:
        for raw in handle:
            body = raw[:-1] if raw.endswith(b"\n") else raw
            body = body[:-1] if body.endswith(b"\r") else body
            for line in body.split(b"\r"):  # a lone \r ends a line too (a UTF-8 byte 0x0d is only that)
                line_number += 1
                try:
                    line.decode("utf-8")
                except UnicodeDecodeError as exc:
                    bad = line[exc.start : exc.start + 1].hex()
                    return f"{path}:{line_number}", f"{exc.reason}: byte 0x{bad} at byte {exc.start + 1} of the line"
    return None


def _read_file(path: Path, txt_mode: TxtMode) -> Iterator[Document]:
    if path.suffix == ".jsonl":
        yield from _read_jsonl(path)
    elif path.suffix == ".parquet":
        yield from _read_parquet(path)
    elif path.suffix == ".txt":
        yield from _read_txt(path, txt_mode)
    else:
        raise ValueError(unsupported_suffix(path))


def record_to_document(record: Any, where: str) -> Document:
    """Parse one JSONL/Parquet record (see the module docstring for the accepted fields)."""
    document = _record_to_document(record, where)
    for text in [segment.text for segment in document.segments] + list(document.reasoning):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"{where}: text holds {exc.object[exc.start:exc.end]!r}, which is not valid Unicode (a lone "
                "surrogate escape?) (fix: repair or drop the record)"
            ) from None
    return document


def _record_to_document(record: Any, where: str) -> Document:
    if not isinstance(record, dict):
        raise ValueError(
            f"{where}: expected a JSON object with {ACCEPTED_FIELDS}, got {type(record).__name__} {_RECORD_FIX}"
        )
    if record.get("messages") is not None:
        for key in UNRENDERED_RECORD_FIELDS:
            if _is_set(record.get(key)):
                raise ValueError(
                    f"{where}: {key!r} is set, but csbp renders chats from their messages alone, so it would be "
                    "dropped (fix: remove it, or write its content into the system message)"
                )
        return _chat_document(record["messages"], where)
    if record.get("prompt") is not None or record.get("completion") is not None:
        prompt, completion = record.get("prompt"), record.get("completion")
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise ValueError(
                f"{where}: 'prompt' and 'completion' must both be strings; accepted: {ACCEPTED_FIELDS} {_RECORD_FIX}"
            )
        segments = (Segment(prompt, supervised=False), Segment(completion, supervised=True))
        return Document(segments, eos_supervised=True, where=where)
    if record.get("text") is not None:
        text = record["text"]
        if not isinstance(text, str):
            raise ValueError(f"{where}: 'text' must be a string, got {type(text).__name__} {_RECORD_FIX}")
        return Document((Segment(text, supervised=True),), eos_supervised=True, where=where)
    present = sorted(key for key, value in record.items() if value is not None)
    raise ValueError(
        f"{where}: no usable field among the non-null fields {present}; accepted: {ACCEPTED_FIELDS} {_RECORD_FIX}"
    )


def _chat_document(messages: Any, where: str) -> Document:
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects {_RECORD_FIX}")
    segments: list[Segment] = []
    reasoning: list[str] = []
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise ValueError(f"{where}: messages[{index}] must be an object with 'role' and 'content' {_RECORD_FIX}")
        role, content = message["role"], message["content"]
        dropped = next((key for key, value in message.items() if key not in MESSAGE_FIELDS and _is_set(value)), None)
        if dropped is not None:  # tool_calls, a per-turn training weight: never silently lost
            raise ValueError(
                f"{where}: messages[{index}].{dropped} is set, but csbp trains on each message's role and content "
                "(and an assistant's reasoning_content) alone, so it would be dropped (fix: remove the field, or "
                "write it into the content)"
            )
        if role not in CHAT_ROLES:
            raise ValueError(f"{where}: messages[{index}].role is {role!r}; use one of {CHAT_ROLES} {_RECORD_FIX}")
        if not isinstance(content, str):
            raise ValueError(f"{where}: messages[{index}].content must be a string {_RECORD_FIX}")
        thought = message.get("reasoning_content")
        if _is_set(thought) and role != "assistant":
            raise ValueError(
                f"{where}: messages[{index}].reasoning_content is set on a {role} message; only an assistant turn "
                "carries reasoning (fix: remove the field, or write it into the content)"
            )
        if _is_set(thought) and not isinstance(thought, str):
            raise ValueError(f"{where}: messages[{index}].reasoning_content must be a string, got {type(thought).__name__} {_RECORD_FIX}")
        reasoning.append(thought if _is_set(thought) else "")
        segments.append(Segment("", supervised=False, role=role))
        segments.append(Segment(content, supervised=role == "assistant"))
    ends_with_assistant = messages[-1]["role"] == "assistant"
    pairs = tuple((str(m["role"]), str(m["content"])) for m in messages)
    return Document(tuple(segments), eos_supervised=ends_with_assistant, where=where, messages=pairs,
                    reasoning=tuple(reasoning) if any(reasoning) else ())


MESSAGE_FIELDS = ("role", "content", "reasoning_content")
"""The fields of a chat message csbp reads (``reasoning_content``: assistant turns, with a chat template)."""


UNRENDERED_RECORD_FIELDS = ("tools", "documents")
"""Fields of a chat record that transformers' ``apply_chat_template`` would render and csbp does not."""


def _is_set(value: Any) -> bool:
    """A field's value other than null or an empty string, list or object (as exports write absent ones)."""
    return value is not None and not (isinstance(value, (str, list, dict)) and not value)


def _read_jsonl(path: Path) -> Iterator[Document]:
    with open(path, encoding="utf-8-sig") as handle:  # -sig: a leading byte-order mark is dropped
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_number}"
            yield record_to_document(parse_json_line(line, where), where)


def _read_parquet(path: Path) -> Iterator[Document]:
    import pyarrow as pa
    import pyarrow.parquet as pq  # heavy import, only when Parquet input is used

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise ValueError(f"input {path}: not a readable Parquet file ({exc}) (fix: check the file)") from None
    row_number = 0
    batches = parquet.iter_batches(batch_size=1024)
    while True:
        try:  # a damaged page is found only when its batch is read
            batch = next(batches, None)
            records = batch.to_pylist() if batch is not None else []
        except (pa.ArrowException, OSError) as exc:
            raise ValueError(
                f"input {path}: rows after {row_number} cannot be read ({exc}) (fix: check the file)"
            ) from None
        if batch is None:
            return
        for record in records:
            row_number += 1
            yield record_to_document(record, f"{path}:row {row_number}")


_BLANK_LINES = re.compile(r"\n[ \t\r\f\v]*\n")


def _read_txt(path: Path, txt_mode: TxtMode) -> Iterator[Document]:
    text = strip_gutenberg_boilerplate(path.read_text(encoding="utf-8-sig"))
    if txt_mode == "file":
        yield Document((Segment(text, supervised=True),), eos_supervised=True, where=str(path))
    elif txt_mode == "paragraphs":
        for index, paragraph in enumerate(_BLANK_LINES.split(text.replace("\r\n", "\n")), start=1):
            segment = Segment(paragraph.strip(), supervised=True)
            yield Document((segment,), eos_supervised=True, where=f"{path}:paragraph {index}")
    else:
        raise ValueError(f"txt_mode is {txt_mode!r}; use 'file' or 'paragraphs'")
