"""``csbp data prepare --workers N``: the same artifact byte for byte, the same error line, nothing
left behind; and chats rendered by a template are tokenized in one batch call per chunk."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import pytest

from csbp.cli.main import build_parser, main
from csbp.data import prepare as prepare_module
from csbp.data.packing import PackedSplitWriter, encode_documents
from csbp.data.prepare import PrepareConfig, prepare_artifact
from csbp.data.sources import Document
from csbp.data.tokenizer import CsbpTokenizer, load_tokenizer, train_bpe_tokenizer

CHATML = (
    "{% for m in messages %}{% if m['content'] == 'BAD' %}{{ raise_exception('no BAD here') }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
)
WORDS = ["the quick brown fox", "jumps over the lazy dog", "hello world, hello tokens", "to be or not to be"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tokenizer")
    train_bpe_tokenizer(WORDS * 10, vocab_size=320).save(directory)
    (directory / "chat_template.jinja").write_text(CHATML, encoding="utf-8")
    return directory


def _inputs(directory: Path, bad_line: int | None = None) -> list[Path]:
    """A chat JSONL (with a template), a text JSONL and a .txt of paragraphs."""
    chats = []
    for i in range(40):
        turns = [{"role": "user", "content": f"{WORDS[i % 4]} {i}"}, {"role": "assistant", "content": WORDS[(i + 1) % 4] * (1 + i % 3)}]
        chats.append({"messages": ([{"role": "system", "content": "be brief"}] if i % 5 == 0 else []) + turns * (1 + i % 2)})
    if bad_line is not None:
        chats[bad_line - 1]["messages"][-1]["content"] = "BAD"
    (directory / "a_chat.jsonl").write_text("".join(json.dumps(c) + "\n" for c in chats), encoding="utf-8")
    texts = [{"text": f"{WORDS[i % 4]} number {i} " * (1 + i % 5)} for i in range(25)]
    (directory / "b_text.jsonl").write_text("".join(json.dumps(t) + "\n" for t in texts), encoding="utf-8")
    (directory / "c_book.txt").write_text("\n\n".join(f"{WORDS[i % 4]} paragraph {i}" for i in range(30)), encoding="utf-8")
    return sorted(directory.iterdir())


def _prepare(inputs: list[Path], out_dir: Path, tokenizer_dir: Path, workers: int) -> None:
    prepare_artifact(PrepareConfig(
        inputs=tuple(inputs), out_dir=out_dir, seq_len=16, tokenizer_path=tokenizer_dir, val_fraction=0.1,
        seed=3, txt_mode="paragraphs", workers=workers,
    ))


def test_two_workers_write_the_same_artifact_byte_for_byte(tmp_path, tokenizer_dir, monkeypatch) -> None:
    data = tmp_path / "data"
    data.mkdir()
    inputs = _inputs(data)
    monkeypatch.setattr(prepare_module, "ENCODE_CHUNK_DOCUMENTS", 7)  # many chunks, several in flight
    _prepare(inputs, tmp_path / "one", tokenizer_dir, workers=1)
    _prepare(inputs, tmp_path / "two", tokenizer_dir, workers=2)
    names = sorted(path.name for path in (tmp_path / "one").iterdir())
    assert names == sorted(path.name for path in (tmp_path / "two").iterdir()) and len(names) == 8
    for name in names:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name
    manifest = json.loads((tmp_path / "one" / "manifest.json").read_text())
    assert manifest["splits"]["val"]["documents"] > 0 and manifest["chat_template"] is not None


@pytest.mark.parametrize("options", [{"chat_documents": "turn"}, {"train_tokenizer": True, "vocab_size": 300}],
                         ids=["turn-documents", "trained-tokenizer"])
def test_two_workers_match_one_with_turn_documents_and_a_trained_tokenizer(
    tmp_path, tokenizer_dir, monkeypatch, options
) -> None:
    """The options that change what the workers get: one document per assistant turn, and a tokenizer
    trained in the main process (pickled to the workers instead of loaded from a directory)."""
    data = tmp_path / "data"
    data.mkdir()
    inputs = _inputs(data)
    monkeypatch.setattr(prepare_module, "ENCODE_CHUNK_DOCUMENTS", 7)
    source = {} if options.get("train_tokenizer") else {"tokenizer_path": tokenizer_dir}
    for workers in (1, 2):
        prepare_artifact(PrepareConfig(
            inputs=tuple(inputs), out_dir=tmp_path / f"w{workers}", seq_len=16, val_fraction=0.1, seed=3,
            txt_mode="paragraphs", workers=workers, **source, **options,
        ))
    names = sorted(path.name for path in (tmp_path / "w1").iterdir())
    assert names == sorted(path.name for path in (tmp_path / "w2").iterdir())
    for name in names:
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes(), name


def test_a_bad_record_in_a_worker_gives_the_same_error_line(tmp_path, tokenizer_dir, monkeypatch) -> None:
    data = tmp_path / "data"
    data.mkdir()
    inputs = _inputs(data, bad_line=33)
    monkeypatch.setattr(prepare_module, "ENCODE_CHUNK_DOCUMENTS", 5)  # the bad record is in a later chunk
    errors = []
    for workers in (1, 2):
        with pytest.raises(ValueError) as info:
            _prepare(inputs, tmp_path / f"art{workers}", tokenizer_dir, workers=workers)
        errors.append(str(info.value))
        assert not (tmp_path / f"art{workers}").exists()
    assert errors[0] == errors[1]
    assert errors[0].startswith(f"{inputs[0]}:33: chat template ") and "no BAD here" in errors[0]
    assert "\n" not in errors[0]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["data"]  # no staging directory left


def test_ctrl_c_ends_the_workers_and_leaves_nothing(tmp_path, tokenizer_dir, monkeypatch) -> None:
    data = tmp_path / "data"
    data.mkdir()
    inputs = _inputs(data)
    monkeypatch.setattr(prepare_module, "ENCODE_CHUNK_DOCUMENTS", 3)  # chunks still in flight when it lands
    add = PackedSplitWriter.add_document
    written = []

    def interrupted_add(self, token_ids, loss_mask):
        written.append(1)
        if len(written) == 10:
            raise KeyboardInterrupt
        add(self, token_ids, loss_mask)

    monkeypatch.setattr(PackedSplitWriter, "add_document", interrupted_add)
    with pytest.raises(KeyboardInterrupt):
        _prepare(inputs, tmp_path / "art", tokenizer_dir, workers=2)
    assert multiprocessing.active_children() == []  # the pool was ended, not left running
    assert sorted(path.name for path in tmp_path.iterdir()) == ["data"]


def test_workers_must_be_at_least_one(tmp_path, tokenizer_dir) -> None:
    parser = build_parser("data")
    words = ["data", "prepare", "x.jsonl", "--out", "a", "--seq-len", "8", "--tokenizer", "t"]
    assert parser.parse_args([*words, "--workers", "3"]).workers == 3 and parser.parse_args(words).workers == 1
    with pytest.raises(ValueError, match=r"^--workers is 0; use 1 or more"):
        PrepareConfig(inputs=(tmp_path,), out_dir=tmp_path / "a", seq_len=8, tokenizer_path=tokenizer_dir, workers=0)


def test_more_workers_than_the_machine_can_run_are_refused(tmp_path, tokenizer_dir, capsys) -> None:
    """--workers between 2^31 and 2^63 reached the pool's queue, a C int: an OverflowError traceback."""
    limit = 8 * (os.cpu_count() or 1)
    words = ["data", "prepare", str(tmp_path), "--out", str(tmp_path / "a"), "--seq-len", "8", "--tokenizer", str(tokenizer_dir)]
    assert main([*words, "--workers", str(2**32)]) == 2
    assert capsys.readouterr().err == (
        f"csbp: error: --workers {2**32}: more than {limit} encoding processes on this machine's {os.cpu_count() or 1} "
        f"CPU cores would only thrash it (fix: --workers {limit} or fewer)\n"
    )
    PrepareConfig(inputs=(tmp_path,), out_dir=tmp_path / "a", seq_len=8, tokenizer_path=tokenizer_dir, workers=limit)


class _OneBatchBackend:
    """A ``tokenizers.Tokenizer`` that refuses one-at-a-time ``encode``."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.batches: list[int] = []

    def __getattr__(self, name: str):
        return getattr(self.backend, name)

    def encode(self, *args, **kwargs):
        raise AssertionError("a rendered chat was tokenized alone")

    def encode_batch(self, texts, **kwargs):
        self.batches.append(len(texts))
        return self.backend.encode_batch(texts, **kwargs)


def test_rendered_chats_are_tokenized_in_one_batch_call(tokenizer_dir) -> None:
    loaded = load_tokenizer(tokenizer_dir)
    proxy = _OneBatchBackend(loaded.backend)
    tokenizer = CsbpTokenizer(proxy, loaded.json_bytes, special=loaded.special, source="proxy")  # type: ignore[arg-type]
    from csbp.data.chat_template import resolve_chat_template
    from csbp.data.sources import record_to_document

    template = resolve_chat_template("auto", tokenizer_dir)
    records = [{"messages": [{"role": "user", "content": w}, {"role": "assistant", "content": w}]} for w in WORDS]
    documents: list[Document] = [record_to_document(r, f"r:{i}") for i, r in enumerate(records)]
    encoded = encode_documents(documents, tokenizer, template)
    assert len(encoded) == 4 and proxy.batches.count(4) == 1
    assert all(int(mask.sum()) > 0 for _, mask in encoded)


def test_a_worker_that_died_ends_the_call_with_one_line() -> None:
    """``multiprocessing.Pool`` waited forever for a dead worker's chunk; the executor reports it, and
    prepare turns that into one line naming the likely cause."""
    from concurrent.futures import Future
    from concurrent.futures.process import BrokenProcessPool

    from csbp.data.encode_pool import _result

    future: Future = Future()
    future.set_exception(BrokenProcessPool("A process in the process pool was terminated abruptly"))
    with pytest.raises(ChildProcessError) as info:
        _result(future)
    from csbp.cli.main import describe_os_error

    assert describe_os_error(info.value) == (
        "an encoding worker of csbp data prepare --workers died (ChildProcessError) (fix: a worker process was "
        "killed, often for memory: run again, with fewer workers if memory is short)"
    )
