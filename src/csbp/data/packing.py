"""Tokenize parsed documents and pack them into fixed-length rows on disk.

``encode_documents`` turns ``Document`` objects into ``(token_ids, loss_mask)`` pairs: text
segments are tokenized (in one batch call), chat role markers become their special id, and EOS is
appended (supervised iff ``Document.eos_supervised``). With a ``ChatTemplate``, chat documents are
instead rendered by the template and tokenized whole; a token is supervised iff its character
offsets overlap an assistant span (``ChatTemplate.supervised_spans``; an assistant's ``reasoning_content``
is passed to the template, and refused without one: ``reasoning_refusal``), and the EOS separator
appended after them is unsupervised (the template's own end-of-turn tokens carry the stop signal),
unless the chat ends with an assistant turn that the template closes with no end-of-turn text: then
that EOS is the only stop signal, and supervised. ``turn_documents`` makes one document of each
assistant turn of a chat (``--chat-documents turn``). ``PackedSplitWriter`` streams those pairs
into the flat ``.bin`` files of one split (layout in ``artifact.py``): greedy concatenation, the
document ordinal as doc id, and the final partial row padded with ``pad_id`` (mask 0, doc id -1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import chain
from pathlib import Path

import numpy as np

from csbp.data.artifact import ARRAY_DTYPES, array_file_name
from csbp.data.chat_template import ChatTemplate, SupervisedChat
from csbp.data.sources import Document
from csbp.data.tokenizer import CsbpTokenizer
from csbp.wording import counted


def role_marker_message(tokenizer: CsbpTokenizer, role: str) -> str:
    """Why a chat cannot be written with ``tokenizer``'s role markers, and the fixes."""
    return (
        f"chat data needs the role marker {tokenizer.role_marker_name(role)!r}, which tokenizer "
        f"{tokenizer.source} lacks (fix: --chat-template PATH naming the model's chat template, or "
        "--train-tokenizer)"
    )


def reasoning_refusal(doc: Document) -> str:
    """Why a chat with a ``reasoning_content`` cannot be written with csbp's role markers, and the fixes."""
    return (
        f"{doc.where}: messages[{doc.first_reasoning()}].reasoning_content is set, but without a chat template "
        "the chat is written with csbp's role markers, which have no place for reasoning, so it would be dropped "
        "(fix: --chat-template PATH naming a template that renders reasoning_content, such as Qwen3's; or write "
        "the reasoning into the content)"
    )


def turn_documents(doc: Document) -> list[Document]:
    """One document per assistant turn of a chat record (``--chat-documents turn``): its messages up to
    and including that turn, only that turn supervised, each keeping the record's ``where``. A record
    without an assistant turn stays one document with nothing supervised; messages after the last
    assistant turn, never supervised, are dropped. Other documents are returned as they are."""
    if doc.messages is None:
        return [doc]
    turns = [index for index, (role, _) in enumerate(doc.messages) if role == "assistant"]
    if not turns:
        return [replace(doc, last_turn_only=True, eos_supervised=False)]
    assert len(doc.segments) == 2 * len(doc.messages)  # _chat_document's: a role marker, then the content
    return [
        replace(doc, messages=doc.messages[: i + 1], segments=doc.segments[: 2 * (i + 1)], eos_supervised=True,
                last_turn_only=True, reasoning=doc.reasoning[: i + 1])
        for i in turns
    ]


class TurnTally:
    """What ``--chat-documents turn`` made of the chat records: documents, their tokens, and the
    tokens of each record's longest document (the whole conversation up to its last assistant turn),
    to report the cost, which grows with the square of a record's assistant turns."""

    def __init__(self) -> None:
        self.documents = self.tokens = self._longest = self._current = 0
        self._where: str | None = None

    def add(self, doc: Document, num_tokens: int) -> None:
        """Count one encoded document of a chat record (a record's documents come in order, each
        longer than the one before)."""
        if doc.where != self._where:
            self._longest += self._current
            self._where = doc.where
        self._current = num_tokens
        self.documents += 1
        self.tokens += num_tokens

    def summary(self, records: int) -> str:
        whole = self._longest + self._current
        return (
            f"{counted(records, 'chat record')} became {counted(self.documents, 'document')} of {self.tokens} tokens, "
            f"{self.tokens / max(whole, 1):.2f}x the {whole} of each record's conversation rendered once (one "
            "document per assistant turn: the tokens grow with the square of a record's turns)"
        )


def _render_chat(
    messages: Sequence[tuple[str, str]],
    template: ChatTemplate,
    where: str,
    last_turn_only: bool,
    reasoning: Sequence[str] = (),
) -> SupervisedChat:
    spans_of = template.last_turn_spans if last_turn_only else template.supervised_spans
    dicts: list[dict[str, str]] = [{"role": r, "content": c} for r, c in messages]
    for message, thought in zip(dicts, reasoning):
        if thought:
            message["reasoning_content"] = thought
    return spans_of(dicts, where)


def supervised_tokens(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[int]:
    """1 for each token whose characters ``[start, end)`` (an empty one: ``[start, start + 1)``)
    overlap one of ``spans`` (sorted, disjoint), else 0 (as a list; see ``_supervised_mask``)."""
    return _supervised_mask(offsets, spans).astype(np.int64).tolist()


def _supervised_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """``supervised_tokens`` as a ``uint8`` array: one binary search per token (testing every span for
    every token took 13 s for a chat of 1600 turns); the offsets are read with ``np.fromiter``, as
    ``np.asarray`` of a list of tuples cost as much as the search."""
    dtype = ARRAY_DTYPES["loss_mask"]
    if not len(offsets) or not spans:
        return np.zeros(len(offsets), dtype=dtype)
    bounds = np.fromiter(chain.from_iterable(offsets), dtype=np.int64, count=2 * len(offsets)).reshape(-1, 2)
    starts, ends = bounds[:, 0], np.maximum(bounds[:, 1], bounds[:, 0] + 1)
    span_starts, span_ends = (np.asarray(side, dtype=np.int64) for side in zip(*spans))
    first = np.searchsorted(span_ends, starts, side="right")  # the first span ending after the token starts
    overlaps = (first < len(span_ends)) & (span_starts[np.minimum(first, len(span_ends) - 1)] < ends)
    return overlaps.astype(dtype)


def _render_chats(
    documents: Sequence[Document], template: ChatTemplate
) -> tuple[list[SupervisedChat], ValueError | None]:
    """The chats of ``documents`` rendered in order, up to the first that fails, and its error
    (raised by ``encode_documents`` when it reaches that document, so errors come in document order)."""
    chats: list[SupervisedChat] = []
    for doc in documents:
        assert doc.messages is not None
        try:
            chats.append(_render_chat(doc.messages, template, doc.where, doc.last_turn_only, doc.reasoning))
        except ValueError as exc:
            return chats, exc
    return chats, None


def encode_documents(
    documents: Sequence[Document], tokenizer: CsbpTokenizer, chat_template: ChatTemplate | None = None
) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(token_ids uint32 [n], loss_mask uint8 [n])`` per document, EOS included.

    Plain text is tokenized in one batch call, and so are the chats the template renders.
    Raises ``ValueError`` (naming the document) for an id outside ``[0, tokenizer.vocab_size)``.
    """
    def templated(doc: Document) -> bool:
        return chat_template is not None and doc.messages is not None

    texts = [
        segment.text
        for doc in documents
        if not templated(doc)
        for segment in doc.segments
        if segment.role is None
    ]
    encoded_texts = iter(tokenizer.encode_batch(texts))
    chats: list[SupervisedChat] = []
    failure: ValueError | None = None
    if chat_template is not None:
        chats, failure = _render_chats([doc for doc in documents if templated(doc)], chat_template)
    chat_encodings = tokenizer.backend.encode_batch([chat.text for chat in chats], add_special_tokens=False)
    rendered = iter(zip(chats, chat_encodings))
    encoded: list[tuple[np.ndarray, np.ndarray]] = []
    for doc in documents:
        if templated(doc):
            chat, encoding = next(rendered, (None, None))
            if chat is None:  # its render failed: the documents before it were checked first
                assert failure is not None
                raise failure
            token_ids, loss_mask = _with_eos(
                np.asarray(encoding.ids, dtype=np.int64), _supervised_mask(encoding.offsets, chat.spans),
                tokenizer.eos_id, doc.eos_supervised and chat.eos_is_stop,
            )
        else:
            if doc.first_reasoning() is not None:
                raise ValueError(reasoning_refusal(doc))
            ids: list[int] = []
            mask: list[int] = []
            for segment in doc.segments:
                if segment.role is not None and segment.role not in tokenizer.role_ids:
                    raise ValueError(f"{doc.where}: {role_marker_message(tokenizer, segment.role)}")
                piece = [tokenizer.role_ids[segment.role]] if segment.role is not None else next(encoded_texts)
                ids.extend(piece)
                mask.extend([int(segment.supervised)] * len(piece))
            ids.append(tokenizer.eos_id)
            mask.append(int(doc.eos_supervised))
            token_ids = np.asarray(ids, dtype=np.int64)
            loss_mask = np.asarray(mask, dtype=ARRAY_DTYPES["loss_mask"])
        bad = (token_ids < 0) | (token_ids >= tokenizer.vocab_size)
        if bad.any():
            raise ValueError(
                f"{doc.where}: token id {int(token_ids[bad][0])} is outside the tokenizer vocabulary "
                f"[0, {tokenizer.vocab_size}); the tokenizer {tokenizer.source} is inconsistent"
            )
        encoded.append((token_ids.astype(ARRAY_DTYPES["tokens"]), loss_mask))
    return encoded


def _with_eos(ids: np.ndarray, mask: np.ndarray, eos_id: int, eos_supervised: bool) -> tuple[np.ndarray, np.ndarray]:
    return np.append(ids, eos_id), np.append(mask, np.uint8(eos_supervised)).astype(ARRAY_DTYPES["loss_mask"])


@dataclass(frozen=True)
class SplitCounts:
    """What one split holds (``tokens`` counts document tokens incl. EOS, not padding;
    ``supervised_mask_tokens`` the supervised positions holding the mask token, which ``csbp train``
    refuses: ``csbp data prepare`` writes 0; ``unsupervised_rows`` the rows without a supervised token,
    which add nothing to the loss and which a DFlash run refuses)."""

    rows: int
    documents: int
    tokens: int
    supervised_tokens: int
    padding_tokens: int
    supervised_mask_tokens: int
    unsupervised_rows: int


def unsupervised_rows_note(unsupervised: dict[str, int], rows: dict[str, int]) -> str | None:
    """One line on the rows of each split without a supervised token (``csbp data prepare`` and
    ``csbp data inspect``), or ``None`` when every row supervises one."""
    if not any(unsupervised.values()):
        return None
    per_split = ", ".join(f"{split} {unsupervised[split]} of {rows[split]}" for split in unsupervised)
    return (
        f"rows that supervise no token: {per_split}; they add nothing to the loss and a DFlash run refuses "
        "them (fix: a longer --seq-len, so that no row lies wholly inside a prompt or chat history, or drop "
        "records whose unsupervised part is longer than a row or that have no assistant turn)"
    )


class PackedSplitWriter:
    """Appends documents of one split to its three array files; ``finish`` pads the last row."""

    _FLUSH_TOKENS = 1 << 20

    def __init__(self, directory: Path, split: str, *, seq_len: int, pad_id: int, mask_token_id: int) -> None:
        self.seq_len = seq_len
        self.pad_id = pad_id
        self.mask_token_id = mask_token_id
        self._handles = {
            field: open(Path(directory) / array_file_name(split, field), "wb") for field in ARRAY_DTYPES
        }
        self._pending: dict[str, list[np.ndarray]] = {field: [] for field in ARRAY_DTYPES}
        self._pending_tokens = 0
        self.num_documents = 0
        self.num_tokens = 0
        self.num_supervised = 0
        self.num_supervised_mask = 0
        self.num_unsupervised_rows = 0  # rows completed so far without a supervised token
        self._open_row_supervised = False  # whether the row being filled holds one

    def add_document(self, token_ids: np.ndarray, loss_mask: np.ndarray) -> None:
        """Append one encoded document (EOS already included); its doc id is its ordinal."""
        doc_ids = np.full(token_ids.shape[0], self.num_documents, dtype=ARRAY_DTYPES["doc_ids"])
        self._append(token_ids, loss_mask, doc_ids)
        self._count_unsupervised_rows(loss_mask)
        self.num_documents += 1
        self.num_tokens += int(token_ids.shape[0])
        self.num_supervised += int(loss_mask.sum())
        self.num_supervised_mask += int(np.count_nonzero((token_ids == self.mask_token_id) & (loss_mask != 0)))

    def _count_unsupervised_rows(self, loss_mask: np.ndarray) -> None:
        """Count the rows this document completes without a supervised token (before ``num_tokens``
        grows); rows are numbered from the open one (0), which the document continues."""
        offset = self.num_tokens % self.seq_len
        rows = np.unique((np.flatnonzero(loss_mask) + offset) // self.seq_len)
        if self._open_row_supervised:
            rows = np.union1d(rows, [0])
        completed = (offset + int(loss_mask.shape[0])) // self.seq_len
        self.num_unsupervised_rows += completed - int(np.count_nonzero(rows < completed))
        self._open_row_supervised = bool(rows.size) and int(rows[-1]) == completed

    def _append(self, token_ids: np.ndarray, loss_mask: np.ndarray, doc_ids: np.ndarray) -> None:
        for field, values in (("tokens", token_ids), ("loss_mask", loss_mask), ("doc_ids", doc_ids)):
            self._pending[field].append(values.astype(ARRAY_DTYPES[field], copy=False))
        self._pending_tokens += int(token_ids.shape[0])
        if self._pending_tokens >= self._FLUSH_TOKENS:
            self._flush()

    def _flush(self) -> None:
        for field, parts in self._pending.items():
            if parts:
                np.concatenate(parts).tofile(self._handles[field])
            parts.clear()
        self._pending_tokens = 0

    def finish(self) -> SplitCounts:
        """Pad the stream to whole rows, flush, close; return the split's counts."""
        padding = -self.num_tokens % self.seq_len
        if padding and not self._open_row_supervised:  # the last row, padded below
            self.num_unsupervised_rows += 1
        self._append(
            np.full(padding, self.pad_id, dtype=ARRAY_DTYPES["tokens"]),
            np.zeros(padding, dtype=ARRAY_DTYPES["loss_mask"]),
            np.full(padding, -1, dtype=ARRAY_DTYPES["doc_ids"]),
        )
        self.close()
        return SplitCounts(
            rows=(self.num_tokens + padding) // self.seq_len,
            documents=self.num_documents,
            tokens=self.num_tokens,
            supervised_tokens=self.num_supervised,
            padding_tokens=padding,
            supervised_mask_tokens=self.num_supervised_mask,
            unsupervised_rows=self.num_unsupervised_rows,
        )

    def close(self) -> None:
        """Flush what is pending and close the files (idempotent)."""
        if all(handle.closed for handle in self._handles.values()):
            return
        self._flush()
        for handle in self._handles.values():
            handle.close()
