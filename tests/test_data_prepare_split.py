"""``csbp data prepare`` rules no test pinned (mutation audit of ``csbp.data.prepare``), each against
hand-computed values:

* the val split is ``round(val_fraction * N)`` documents (not truncated), at least one when the
  fraction is positive and ``N >= 2``, and never every document;
* a trained tokenizer learns from the train documents only (merging the val documents' text leaked
  them into the vocabulary);
* the mask token's text in an assistant's ``reasoning_content`` is refused like anywhere else;
* an input rewritten to the same size during prepare is caught by its modification time;
* documents are encoded in batches of at most ``ENCODE_CHUNK_DOCUMENTS``;
* a trained tokenizer that reached ``--vocab-size`` prints no "fewer ids" note;
* the errors name the first chat record, ``--workers`` above the limit is refused, a chat holding only
  reasoning is no empty document, and whitespace-only lines separate ``.txt`` paragraphs, and a directory's files are read sorted.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_data_prepare_split.py -q``
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from csbp.data import prepare as prepare_module
from csbp.data.artifact import open_artifact
from csbp.data.packing import PackedSplitWriter
from csbp.data.prepare import ENCODE_CHUNK_DOCUMENTS, PrepareConfig, prepare_artifact
from csbp.data.sources import Document, Segment, expand_inputs, iter_documents, record_to_document
from csbp.data.tokenizer import load_tokenizer
from test_data_prepare import TINY_TEXTS, prepare, tokenizer_dir, write_jsonl  # noqa: F401


@pytest.mark.parametrize(
    ("documents", "fraction", "val"),
    [
        (9, 0.3, 3),  # round(2.7) = 3, not int(2.7) = 2
        (5, 0.01, 1),  # round(0.05) = 0: at least one
        (3, 0.9, 2),  # round(2.7) = 3 of 3: one stays in train
    ],
)
def test_the_val_split_size(tmp_path: Path, tokenizer_dir: Path, documents: int, fraction: float, val: int) -> None:  # noqa: F811
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in TINY_TEXTS[:documents]])
    splits = prepare([path], tmp_path / "art", tokenizer_dir, seq_len=4, val_fraction=fraction).manifest["splits"]
    assert (splits["train"]["documents"], splits["val"]["documents"]) == (documents - val, val)


def test_a_trained_tokenizer_never_sees_the_val_documents(tmp_path: Path) -> None:
    # every document repeats its own made-up word, which BPE merges into one token when it trains on it
    words = [f"q{chr(97 + i)}z{chr(97 + i)}v" for i in range(12)]
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": " ".join([word] * 40)} for word in words])
    prepare_artifact(PrepareConfig(inputs=(path,), out_dir=tmp_path / "art", seq_len=8, train_tokenizer=True,
                                   vocab_size=400, val_fraction=0.25))  # fmt: skip
    art = open_artifact(tmp_path / "art")
    tokenizer = load_tokenizer(tmp_path / "art")
    val_text = tokenizer.decode([int(t) for t in art.split("val").tokens.reshape(-1) if int(t) > 5])
    in_val = [word for word in words if word in val_text]
    assert len(in_val) == 3  # round(0.25 * 12)
    vocabulary = {token.replace("Ġ", "") for token in tokenizer.backend.get_vocab()}
    assert all(word in vocabulary for word in words if word not in in_val)  # train words merged whole
    assert not any(word in vocabulary for word in in_val)


def test_the_mask_text_in_reasoning_is_refused(tmp_path: Path) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "ok", "reasoning_content": "think <|mask|> twice"}]}  # fmt: skip
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in TINY_TEXTS] + [chat])
    with pytest.raises(ValueError, match=r"docs\.jsonl:31: .*the mask token '<\|mask\|>'"):
        prepare_artifact(PrepareConfig(inputs=(path,), out_dir=tmp_path / "art", seq_len=8, train_tokenizer=True,
                                       vocab_size=300))  # fmt: skip


def test_an_input_rewritten_to_the_same_size_is_refused(
    tmp_path: Path, tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in TINY_TEXTS])
    original = PackedSplitWriter.add_document

    def rewriting_add(self: PackedSplitWriter, token_ids: object, loss_mask: object) -> None:
        if self.num_documents == 0 and self.num_tokens == 0:
            text = path.read_text(encoding="utf-8")
            path.write_text(text.replace("fox", "cat"), encoding="utf-8")  # the same number of bytes
            stat = path.stat()
            os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a clock step coarse filesystems show
        original(self, token_ids, loss_mask)  # type: ignore[arg-type]

    monkeypatch.setattr(PackedSplitWriter, "add_document", rewriting_add)
    with pytest.raises(ValueError, match=r"docs\.jsonl changed while csbp data prepare was reading it"):
        prepare([path], tmp_path / "art", tokenizer_dir, seq_len=8)
    assert not (tmp_path / "art").exists()


def test_documents_are_encoded_in_batches_of_bounded_count() -> None:
    documents = (Document((Segment("w", supervised=True),), True, f"d{i}") for i in range(2 * ENCODE_CHUNK_DOCUMENTS + 5))
    sizes = [len(chunk) for chunk in prepare_module._chunks(documents, frozenset(), False)]
    assert sizes == [ENCODE_CHUNK_DOCUMENTS, ENCODE_CHUNK_DOCUMENTS, 5]


def test_a_tokenizer_that_reached_its_vocab_size_has_no_note(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in TINY_TEXTS])
    said: list[str] = []
    prepare_artifact(PrepareConfig(inputs=(path,), out_dir=tmp_path / "art", seq_len=8, train_tokenizer=True,
                                   vocab_size=300), log=said.append)  # fmt: skip
    assert open_artifact(tmp_path / "art").vocab_size == 300
    assert not any("not --vocab-size" in line for line in said), said
    prepare_artifact(PrepareConfig(inputs=(path,), out_dir=tmp_path / "big", seq_len=8, train_tokenizer=True,
                                   vocab_size=5000), log=said.append)  # fmt: skip
    assert any("not --vocab-size 5000" in line for line in said), said


def test_turn_documents_without_a_template_name_the_first_chat(tmp_path: Path, tokenizer_dir: Path) -> None:  # noqa: F811
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": TINY_TEXTS[0]}, chat, chat])
    with pytest.raises(ValueError, match=r"docs\.jsonl:2: --chat-documents turn renders"):
        prepare([path], tmp_path / "art", tokenizer_dir, seq_len=4, chat_documents="turn")  # no template there


def test_workers_beyond_the_machines_limit_are_refused(tmp_path: Path) -> None:
    limit = prepare_module.max_workers()
    with pytest.raises(ValueError, match=rf"--workers {limit + 1}: more than {limit} encoding processes"):
        PrepareConfig(inputs=(tmp_path,), out_dir=tmp_path / "a", seq_len=8, train_tokenizer=True, vocab_size=300,
                      workers=limit + 1)  # fmt: skip


def test_a_chat_holding_only_reasoning_is_not_empty_and_paragraphs_split_on_blank_lines(tmp_path: Path) -> None:
    only_reasoning = {"messages": [{"role": "user", "content": ""},
                                   {"role": "assistant", "content": "", "reasoning_content": "thinking"}]}  # fmt: skip
    assert not record_to_document(only_reasoning, "x:1").is_empty
    text = tmp_path / "book.txt"
    text.write_text("one\n  \ntwo\n\t\nthree\n\nfour", encoding="utf-8")  # whitespace-only lines are blank
    paragraphs = [doc.segments[0].text for doc in iter_documents([text], txt_mode="paragraphs")]
    assert paragraphs == ["one", "two", "three", "four"]


def test_a_directory_expands_to_its_files_sorted(tmp_path: Path) -> None:
    names = ["e.jsonl", "b.txt", "d.jsonl", "a.jsonl", "c.txt"]
    for name in names:  # created out of order
        (tmp_path / name).write_text('{"text": "x"}\n', encoding="utf-8")
    assert [path.name for path in expand_inputs([tmp_path])] == sorted(names)
