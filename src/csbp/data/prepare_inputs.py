"""What ``csbp data prepare`` learns from its inputs before it encodes them, and the check that they
did not change meanwhile.

Counting reads every input once (``sources.py`` parses): the non-empty documents, the empty ones
skipped, the chat records and the first record using each chat role (so that a role marker a given
tokenizer lacks is refused before any encoding), the documents ``--chat-documents turn`` would make,
the first record with a ``reasoning_content``, and, for a tokenizer still to be trained, the first
document whose text holds the mask token. The inputs are read again to train the tokenizer and to
encode; their ``(size, mtime)`` taken at the start must still hold at the end (``check_unchanged``).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from csbp.data.mask_checks import mask_fix, mask_in_text_message
from csbp.data.packing import role_marker_message
from csbp.data.sources import Document, TxtMode, iter_documents
from csbp.data.tokenizer import CsbpTokenizer


def file_states(files: list[Path]) -> list[tuple[int, int]]:
    """``(size, mtime_ns)`` of each input file."""
    return [(stat.st_size, stat.st_mtime_ns) for stat in (path.stat() for path in files)]


def check_unchanged(files: list[Path], before: list[tuple[int, int]]) -> None:
    """``ValueError`` naming the first input whose size or modification time is not what it was when
    prepare began: its passes (count, train a tokenizer, encode) may have read different documents."""
    for path, earlier, now in zip(files, before, file_states(files)):
        if now != earlier:
            raise ValueError(
                f"input {path} changed while csbp data prepare was reading it (size {earlier[0]} -> {now[0]} bytes): "
                "its document count, split and tokenizer may disagree (fix: prepare from files nobody is writing)"
            )


def non_empty_documents(files: list[Path], txt_mode: TxtMode) -> Iterator[Document]:
    return (doc for doc in iter_documents(files, txt_mode=txt_mode) if not doc.is_empty)


@dataclass
class _Found:
    """What counting the inputs found: non-empty documents, empty ones skipped, non-empty chat
    records (the first at ``first_chat``), the first record (``file:line``) using each chat role, and
    the documents ``--chat-documents turn`` would make (one per assistant turn, at least one a record),
    and the first chat record with a ``reasoning_content`` (refused when no chat template renders it)."""

    documents: int = 0
    empty: int = 0
    chats: int = 0
    first_chat: str = ""
    first_use_of_role: dict[str, str] = field(default_factory=dict)
    turn_documents: int = 0
    first_reasoning: Document | None = None


def count_documents(files: list[Path], txt_mode: TxtMode, literal_mask: str | None = None) -> _Found:
    """Count the documents (see ``_Found``); ``ValueError`` on the first document whose text holds
    ``literal_mask`` (the mask token's text, when it is a special token of the tokenizer to be
    trained)."""
    found = _Found()
    for doc in iter_documents(files, txt_mode=txt_mode):
        if doc.is_empty:
            found.empty += 1
            continue
        found.documents += 1
        found.turn_documents += 1
        if doc.messages is not None:
            found.chats += 1
            found.first_chat = found.first_chat or doc.where
            for role, _ in doc.messages:
                found.first_use_of_role.setdefault(role, doc.where)
            found.turn_documents += max(sum(role == "assistant" for role, _ in doc.messages), 1) - 1
            if found.first_reasoning is None and doc.first_reasoning() is not None:
                found.first_reasoning = doc
        if literal_mask is not None and any(literal_mask in text for text in doc.texts()):
            which, fix = f"the mask token {literal_mask!r}", mask_fix(literal_mask, default_available=True)
            raise ValueError(f"{doc.where}: {mask_in_text_message(which, fix)}")
    return found


def check_role_markers(tokenizer: CsbpTokenizer, first_use: dict[str, str]) -> None:
    """``ValueError`` naming the first record of a chat role whose marker ``tokenizer`` lacks (chats
    formatted with csbp's role markers; ``first_use``: role -> ``file:line``), before any encoding."""
    for role, where in first_use.items():
        if role not in tokenizer.role_ids:
            raise ValueError(f"{where}: {role_marker_message(tokenizer, role)}")
