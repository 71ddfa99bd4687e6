"""``prepare_artifact``: supervision masks, packing, manifest, trained tokenizers, option and
special-token checks; the helpers here are shared with ``test_data_prepare_integrity.py`` (atomicity,
refused outputs and inputs, damaged or mismatched artifacts)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from csbp.data import prepare as prepare_module
from csbp.data.artifact import Artifact, content_fingerprint, open_artifact
from csbp.data.packing import PackedSplitWriter
from csbp.data.prepare import PrepareConfig, prepare_artifact
from csbp.data.tokenizer import CsbpTokenizer, SpecialTokens, load_tokenizer, train_bpe_tokenizer

TINY_TEXTS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello tokens",
    "to be or not to be, that is the question",
] * 10


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tokenizer")
    train_bpe_tokenizer(TINY_TEXTS, vocab_size=300).save(directory)
    return directory


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> CsbpTokenizer:
    return load_tokenizer(tokenizer_dir)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    return path


def prepare(inputs: list[Path], out_dir: Path, tokenizer_dir: Path, *, seq_len: int, **options) -> Artifact:
    config = PrepareConfig(
        inputs=tuple(inputs), out_dir=out_dir, seq_len=seq_len, tokenizer_path=tokenizer_dir, **options
    )
    prepare_artifact(config)
    return open_artifact(out_dir, verify=True)


def assert_no_leftovers(parent: Path, keep: set[str]) -> None:
    assert {p.name for p in parent.iterdir()} == keep


def stream(split) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Flattened (tokens, loss_mask, doc_ids) of a split."""
    return (
        np.asarray(split.tokens).reshape(-1).astype(np.int64),
        np.asarray(split.loss_mask).reshape(-1),
        np.asarray(split.doc_ids).reshape(-1),
    )


def test_chat_supervision_marks_exactly_the_assistant_tokens(tmp_path, tokenizer_dir, tokenizer) -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello world"},
        {"role": "assistant", "content": "the lazy dog"},
        {"role": "user", "content": "to be"},
        {"role": "assistant", "content": "or not"},
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages}])
    art = prepare([path], tmp_path / "art", tokenizer_dir, seq_len=8)
    ids, mask = [], []
    for message in messages:
        content = tokenizer.encode(message["content"])
        ids += [tokenizer.role_ids[message["role"]], *content]
        mask += [0] + [int(message["role"] == "assistant")] * len(content)
    ids, mask = ids + [tokenizer.eos_id], mask + [1]  # the final EOS teaches the model to stop
    tokens, loss_mask, doc_ids = stream(art.split("train"))
    n = len(ids)
    assert tokens[:n].tolist() == ids and loss_mask[:n].tolist() == mask
    assert (tokens[n:] == tokenizer.pad_id).all() and (loss_mask[n:] == 0).all()
    assert (doc_ids[:n] == 0).all() and (doc_ids[n:] == -1).all()


def test_prompt_completion_and_unanswered_chat_supervision(tmp_path, tokenizer_dir, tokenizer) -> None:
    path = write_jsonl(
        tmp_path / "pc.jsonl",
        [
            {"prompt": "to be or", "completion": " not to be"},
            {"messages": [{"role": "user", "content": "hello"}]},
        ],
    )
    art = prepare([path], tmp_path / "art", tokenizer_dir, seq_len=8)
    prompt, completion = tokenizer.encode("to be or"), tokenizer.encode(" not to be")
    user = [tokenizer.role_ids["user"], *tokenizer.encode("hello"), tokenizer.eos_id]
    expected_ids = prompt + completion + [tokenizer.eos_id] + user
    expected_mask = [0] * len(prompt) + [1] * (len(completion) + 1) + [0] * len(user)
    tokens, loss_mask, doc_ids = stream(art.split("train"))
    n = len(expected_ids)
    assert tokens[:n].tolist() == expected_ids and loss_mask[:n].tolist() == expected_mask
    assert doc_ids[:n].tolist() == [0] * (len(prompt) + len(completion) + 1) + [1] * len(user)


def test_packing_reproduces_the_token_stream(tmp_path, tokenizer_dir, tokenizer) -> None:
    texts = [f"{TINY_TEXTS[i % 3]} number {i}" for i in range(9)]
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in texts])
    art = prepare([path], tmp_path / "art", tokenizer_dir, seq_len=7)
    expected, expected_docs = [], []
    for ordinal, text in enumerate(texts):
        ids = tokenizer.encode(text) + [tokenizer.eos_id]
        expected += ids
        expected_docs += [ordinal] * len(ids)
    train = art.split("train")
    assert train.num_rows == -(-len(expected) // 7) and train.tokens.shape == (train.num_rows, 7)
    tokens, loss_mask, doc_ids = stream(train)
    n, padding = len(expected), train.num_rows * 7 - len(expected)
    assert tokens[:n].tolist() == expected and doc_ids[:n].tolist() == expected_docs
    assert loss_mask[:n].all() and not loss_mask[n:].any()
    assert tokens[n:].tolist() == [tokenizer.pad_id] * padding and (doc_ids[n:] == -1).all()
    assert art.split("val").num_rows == 0 and art.split("val").tokens.shape == (0, 7)


def test_long_documents_are_encoded_in_batches_of_bounded_characters(tmp_path, tokenizer_dir, monkeypatch) -> None:
    # 256 documents went to the tokenizer at once whatever their length: 256 books, tens of GB
    texts = [f"{TINY_TEXTS[i % 3]} number {i} " * (1 + i % 4) for i in range(12)]
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in texts])
    whole = prepare([path], tmp_path / "whole", tokenizer_dir, seq_len=7, val_fraction=0.25)
    batches: list[list[int]] = []
    encode = prepare_module.encode_documents

    def spy(documents, *args):
        batches.append([len(doc.texts()[0]) for doc in documents])
        return encode(documents, *args)

    limit = 2 * len(texts[0]) + 5
    monkeypatch.setattr(prepare_module, "ENCODE_CHUNK_CHARACTERS", limit, raising=False)
    monkeypatch.setattr(prepare_module, "encode_documents", spy)
    chunked = prepare([path], tmp_path / "chunked", tokenizer_dir, seq_len=7, val_fraction=0.25)
    assert sum(len(batch) for batch in batches) == len(texts) and len(batches) > 3
    assert all(sum(batch) <= limit or len(batch) == 1 for batch in batches)
    assert max(len(t) for t in texts) > limit  # one document alone may pass the limit
    assert chunked.fingerprint == whole.fingerprint  # the batches do not change a byte


def test_manifest_contents(tmp_path, tokenizer_dir, tokenizer) -> None:
    path = write_jsonl(
        tmp_path / "docs.jsonl", [{"text": t} for t in TINY_TEXTS[:8]] + [{"text": ""}, {"text": " "}]
    )
    notes = tmp_path / "notes.txt"
    notes.write_text("hello world\n", encoding="utf-8")
    art = prepare([path, notes], tmp_path / "art", tokenizer_dir, seq_len=16, val_fraction=0.25, seed=3)
    m = art.manifest
    doc_tokens = [len(tokenizer.encode(t)) + 1 for t in TINY_TEXTS[:8] + ["hello world\n"]]
    assert m["format"] == "csbp-packed-tokens" and m["format_version"] == 1 and m["seq_len"] == 16
    assert m["counts"] == {"documents": 9, "skipped_empty": 2, "tokens": sum(doc_tokens)}
    assert m["splits"]["val"]["documents"] == 2 and m["splits"]["train"]["documents"] == 7  # round(0.25*9)
    for split in ("train", "val"):
        s = m["splits"][split]
        assert s["rows"] * 16 == s["tokens"] + s["padding_tokens"] and 0 <= s["padding_tokens"] < 16
        assert s["supervised_tokens"] == s["tokens"]  # plain text: everything, EOS included
        assert s["files"]["tokens"] == f"{split}.tokens.bin"
    assert m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"] == sum(doc_tokens)
    tokenizer_bytes = (tokenizer_dir / "tokenizer.json").read_bytes()
    assert (
        m["tokenizer"]["fingerprint"] == hashlib.sha256(tokenizer_bytes).hexdigest() == tokenizer.fingerprint
    )
    assert (tmp_path / "art" / "tokenizer.json").read_bytes() == tokenizer_bytes
    assert m["tokenizer"]["vocab_size"] == 300 == art.vocab_size
    assert m["special_ids"] == {"eos": 0, "mask": 1, "pad": 2, "system": 3, "user": 4, "assistant": 5}
    assert art.mask_token_id == 1
    assert m["content_fingerprint"] == content_fingerprint(tmp_path / "art")
    assert [s["name"] for s in m["sources"]] == ["docs.jsonl", "notes.txt"]
    assert m["options"] == {"seed": 3, "txt_mode": "file", "val_fraction": 0.25, "chat_documents": "record"}


def test_trained_tokenizer_is_deterministic(tmp_path) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in TINY_TEXTS])
    manifests = []
    for name in ("one", "two"):
        config = PrepareConfig(
            inputs=(path,),
            out_dir=tmp_path / name,
            seq_len=8,
            train_tokenizer=True,
            vocab_size=290,
            val_fraction=0.1,
            seed=1,
        )
        manifests.append(prepare_artifact(config))
    assert manifests[0]["tokenizer"]["fingerprint"] == manifests[1]["tokenizer"]["fingerprint"]
    assert manifests[0]["content_fingerprint"] == manifests[1]["content_fingerprint"]
    assert manifests[0]["tokenizer"]["vocab_size"] == 290
    tokenizer = open_artifact(tmp_path / "one").load_tokenizer()
    assert tokenizer.fingerprint == manifests[0]["tokenizer"]["fingerprint"]
    assert tokenizer.decode(tokenizer.encode("hello <|mask|> world")) == "hello <|mask|> world"


def test_chat_needs_role_markers_in_the_tokenizer(tmp_path, monkeypatch) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(
        models.WordLevel({"hi": 0, "<|endoftext|>": 1, "<|mask|>": 2, "[UNK]": 3}, unk_token="[UNK]")
    )
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok_dir = tmp_path / "wordlevel"
    tok_dir.mkdir()
    backend.save(str(tok_dir / "tokenizer.json"))
    plain = write_jsonl(tmp_path / "plain.jsonl", [{"text": "hi hi"}])
    art = prepare([plain], tmp_path / "plain_art", tok_dir, seq_len=2)
    assert art.special_ids == {"eos": 1, "mask": 2, "pad": 1}  # pad falls back to EOS
    assert stream(art.split("train"))[0].tolist() == [0, 0, 1, 1]
    chat = write_jsonl(
        tmp_path / "chat.jsonl", [{"text": "hi"}, {"messages": [{"role": "user", "content": "hi"}]}]
    )
    with pytest.raises(ValueError, match=r"chat\.jsonl:2: chat data needs the role marker '<\|user\|>'"):
        prepare([chat], tmp_path / "chat_art", tok_dir, seq_len=4)
    assert not (tmp_path / "chat_art").exists()
    # refused while counting, before anything is encoded, naming the fix for a model's tokenizer
    monkeypatch.setattr(prepare_module, "encode_documents", lambda *a, **k: pytest.fail("encoded"))
    with pytest.raises(ValueError, match=r"chat\.jsonl:2: .* lacks \(fix: --chat-template PATH .*, or --train-tokenizer\)$"):
        prepare([chat], tmp_path / "chat_art", tok_dir, seq_len=4)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"seq_len": 1}, r"--seq-len 1: a row needs at least 2 tokens \(fix: --seq-len 2 or more\)"),
        ({"val_fraction": 1.0}, "val_fraction is 1.0"),
        ({"seed": -1}, "--seed is -1; use 0 or more"),
        # was "the mask token '' occurs in the text" (every text holds ''), after reading the inputs
        ({"special": SpecialTokens(mask="")}, r"--mask-token is ''; name a token \(default <\|mask\|>\)"),
        ({"special": SpecialTokens(eos=" ")}, "--eos-token is ' '; name a token"),  # was numpy's "expected non-negative integer", after reading the inputs
        ({"train_tokenizer": True}, r"\(fix: pass exactly one of --tokenizer DIR or --train-tokenizer"),
        ({"tokenizer_path": None, "train_tokenizer": True}, r"size is not given \(fix: add --vocab-size N"),
        ({"vocab_size": 400}, "--vocab-size only applies with --train-tokenizer"),
        ({"tokenizer_path": None, "train_tokenizer": True, "vocab_size": 10}, "--vocab-size 10 is too small"),
    ],
)
def test_invalid_config(tmp_path, tokenizer_dir, options, message) -> None:
    base = {"inputs": (tmp_path,), "out_dir": tmp_path / "art", "seq_len": 4, "tokenizer_path": tokenizer_dir}
    with pytest.raises(ValueError, match=message):
        PrepareConfig(**{**base, **options})


def test_tokenizer_is_checked_before_the_inputs_are_read(tmp_path) -> None:
    broken = tmp_path / "broken.jsonl"
    broken.write_text("not json\n")  # reading the inputs would fail on line 1
    with pytest.raises(ValueError, match="tokenizer path .*missing does not exist"):
        prepare([broken], tmp_path / "art", tmp_path / "missing", seq_len=4)
    assert not (tmp_path / "art").exists()


def test_more_documents_than_int32_ids_are_refused_before_encoding(tmp_path, tokenizer_dir, monkeypatch) -> None:
    monkeypatch.setattr(prepare_module, "MAX_DOCUMENTS_PER_SPLIT", 2)
    monkeypatch.setattr(prepare_module, "encode_documents", lambda *a, **k: pytest.fail("encoded"))
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in TINY_TEXTS[:4]])
    with pytest.raises(ValueError, match="the train split would hold 3 documents, more than the 2 int32"):
        prepare([path], tmp_path / "art", tokenizer_dir, seq_len=4, val_fraction=0.25)
    assert not (tmp_path / "art").exists()


def test_all_empty_inputs_are_an_error(tmp_path, tokenizer_dir) -> None:
    path = write_jsonl(tmp_path / "empty.jsonl", [{"text": ""}, {"text": "\n"}])
    with pytest.raises(ValueError, match=r"no non-empty documents \(2 empty ones skipped\)"):
        prepare([path], tmp_path / "art", tokenizer_dir, seq_len=4)


# ----------------------------------------------------------------------------- mask token, rows


def test_a_mask_token_shared_with_another_special_token_is_refused(tmp_path, tokenizer_dir) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in TINY_TEXTS])
    trained = {"inputs": (path,), "out_dir": tmp_path / "art", "seq_len": 8, "train_tokenizer": True, "vocab_size": 300}
    for name, field in (("<|endoftext|>", "eos"), ("<|pad|>", "pad"), ("<|user|>", "user")):
        with pytest.raises(ValueError) as info:  # by name, before any tokenizer is trained
            PrepareConfig(**trained, special=SpecialTokens(mask=name))
        assert str(info.value).startswith(f"--mask-token {name!r} is also the {field} token {name!r}")
        assert "(fix: pass --mask-token naming a token the data never holds, such as the default <|mask|>)" in str(
            info.value
        )
    broken = tmp_path / "broken.jsonl"
    broken.write_text("not json\n")  # reading the inputs would fail on line 1
    with pytest.raises(ValueError, match=r"^the mask token '<\|endoftext\|>' \(id 0\) is also the eos token"):
        prepare([broken], tmp_path / "art", tokenizer_dir, seq_len=8, special=SpecialTokens(mask="<|endoftext|>"))
    # a tokenizer directory whose special_tokens_map.json names EOS as its mask token (no <|mask|>)
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({"hi": 0, "<|endoftext|>": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok_dir = tmp_path / "wordlevel"
    tok_dir.mkdir()
    backend.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "special_tokens_map.json").write_text(json.dumps({"mask_token": "<|endoftext|>"}))
    with pytest.raises(ValueError) as info:
        prepare([path], tmp_path / "art", tok_dir, seq_len=2)
    assert str(info.value) == (
        "the mask token '<|endoftext|>' (id 1) is also the eos token '<|endoftext|>' (--eos-token): training "
        "would take every eos token for a masked position (fix: pass --mask-token naming a token of the "
        "tokenizer that the data never holds)"
    )
    assert not (tmp_path / "art").exists()


def test_a_mask_token_in_the_text_is_refused(tmp_path, tokenizer_dir, tokenizer, monkeypatch) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in TINY_TEXTS])

    def no_training(*args, **kwargs):
        raise AssertionError("the tokenizer was trained before the mask token was checked")

    monkeypatch.setattr(prepare_module, "train_bpe_tokenizer", no_training)
    config = PrepareConfig(
        inputs=(path,), out_dir=tmp_path / "art", seq_len=8, train_tokenizer=True, vocab_size=300,
        special=SpecialTokens(mask="fox"),
    )
    with pytest.raises(ValueError) as info:  # a trained tokenizer would make "fox" the special [M]
        prepare_artifact(config)
    assert str(info.value) == (
        f"{path}:1: the mask token 'fox' occurs in the text: training would take it for a masked position "
        "(fix: pass --mask-token naming a token the data never holds, such as the default <|mask|>)"
    )
    monkeypatch.undo()
    # a given tokenizer: an ordinary token the text encodes to
    word = tokenizer.backend.id_to_token(tokenizer.encode(" quick")[0])
    with pytest.raises(ValueError, match=rf"docs\.jsonl:1: the mask token '{word}' \(id \d+\) occurs in the text"):
        prepare([path], tmp_path / "art", tokenizer_dir, seq_len=8, special=SpecialTokens(mask=word))
    # the default mask token written in a document
    marked = write_jsonl(tmp_path / "marked.jsonl", [{"text": TINY_TEXTS[0]}, {"text": "fill <|mask|> in"}])
    with pytest.raises(ValueError) as info:
        prepare([marked], tmp_path / "art", tokenizer_dir, seq_len=8)
    assert str(info.value).startswith(f"{marked}:2: the mask token '<|mask|>' (id 1) occurs in the text")
    assert str(info.value).endswith(
        "(fix: remove <|mask|> from the data, or pass --mask-token naming another token the data never holds)"
    )
    assert not (tmp_path / "art").exists()
    manifest = prepare([path], tmp_path / "art", tokenizer_dir, seq_len=8).manifest
    assert [manifest["splits"][s]["supervised_mask_tokens"] for s in ("train", "val")] == [0, 0]


def test_a_train_split_shorter_than_one_row_is_refused(tmp_path, tokenizer_dir, tokenizer, monkeypatch) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in TINY_TEXTS[:3]])
    num_tokens = sum(len(tokenizer.encode(t)) + 1 for t in TINY_TEXTS[:3])
    padded: list[int] = []
    original_finish = PackedSplitWriter.finish

    def recording_finish(self):
        padded.append(self.seq_len)
        return original_finish(self)

    monkeypatch.setattr(PackedSplitWriter, "finish", recording_finish)
    with pytest.raises(ValueError) as info:
        prepare([path], tmp_path / "art", tokenizer_dir, seq_len=100_000)
    assert str(info.value) == (
        f"--seq-len 100000 is longer than the {num_tokens} tokens of the train split: its one row would be "
        f"{100 * (1 - num_tokens / 1e5):.2f}% padding (fix: --seq-len {num_tokens} or less, or add data)"
    )
    assert padded == [] and not (tmp_path / "art").exists()  # refused before any padding was written
    assert_no_leftovers(tmp_path, {"docs.jsonl"})
    art = prepare([path], tmp_path / "art", tokenizer_dir, seq_len=num_tokens)  # exactly one full row
    assert art.split("train").num_rows == 1 and art.manifest["splits"]["train"]["padding_tokens"] == 0
