"""Tokenizers: trained byte-level BPE, fingerprints, local loading (tokenizers and transformers)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from csbp.data.tokenizer import SpecialTokens, load_tokenizer, special_tokens_from_names, train_bpe_tokenizer

TEXTS = ["hello world, the quick brown fox jumps over the lazy dog", "héllo wörld ✓"] * 10


def test_trained_tokenizer_special_ids_and_round_trip() -> None:
    tok = train_bpe_tokenizer(TEXTS, vocab_size=300)
    assert tok.vocab_size == 300
    assert (tok.eos_id, tok.mask_token_id, tok.pad_id) == (0, 1, 2)
    assert tok.role_ids == {"system": 3, "user": 4, "assistant": 5}
    text = "unseen bytes: ∑ 日本 <|mask|> end"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and ids.count(tok.mask_token_id) == 1
    assert tok.encode_batch([text, "hello"]) == [ids, tok.encode("hello")]
    assert tok.fingerprint == hashlib.sha256(tok.json_bytes).hexdigest()


def test_training_is_deterministic_and_data_dependent() -> None:
    first = train_bpe_tokenizer(TEXTS, vocab_size=290)
    again = train_bpe_tokenizer(TEXTS, vocab_size=290)
    other = train_bpe_tokenizer(TEXTS[::-1] + ["different data"], vocab_size=290)
    assert first.json_bytes == again.json_bytes and first.fingerprint == again.fingerprint
    assert other.fingerprint != first.fingerprint


def test_save_and_load_keep_the_fingerprint(tmp_path: Path) -> None:
    tok = train_bpe_tokenizer(TEXTS, vocab_size=300)
    path = tok.save(tmp_path)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == tok.fingerprint
    for source in (tmp_path, path):
        loaded = load_tokenizer(source)
        assert loaded.fingerprint == tok.fingerprint and loaded.special_ids() == tok.special_ids()
        assert loaded.encode("the lazy fox") == tok.encode("the lazy fox")


def test_vocab_size_too_small() -> None:
    with pytest.raises(ValueError, match="vocab_size is 261; a byte-level BPE needs at least 262"):
        train_bpe_tokenizer(TEXTS, vocab_size=261)
    smallest = train_bpe_tokenizer(TEXTS, vocab_size=262)  # the bound itself: bytes and specials, no merge
    assert smallest.vocab_size == 262 and smallest.decode(smallest.encode(TEXTS[1])) == TEXTS[1]


def _wordlevel_dir(tmp_path: Path, vocab: dict[str, int]) -> Path:
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "tokenizer.json"))
    return tmp_path


def test_special_names_fall_back_to_hf_config(tmp_path: Path) -> None:
    directory = _wordlevel_dir(tmp_path, {"[UNK]": 0, "</s>": 1, "[MASK]": 2, "[PAD]": 3, "word": 4})
    with pytest.raises(ValueError, match="has no eos token '<\\|endoftext\\|>'"):
        load_tokenizer(directory)
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "</s>", "pad_token": {"content": "[PAD]"}, "mask_token": "[MASK]"})
    )
    tok = load_tokenizer(directory)
    assert tok.special_ids() == {"eos": 1, "mask": 2, "pad": 3}
    assert tok.special_names == {"eos": "</s>", "mask": "[MASK]", "pad": "[PAD]"}
    explicit = load_tokenizer(directory, special=SpecialTokens(mask="word"))
    assert explicit.mask_token_id == 4


def test_an_explicit_name_the_tokenizer_lacks_is_refused_not_replaced(tmp_path: Path) -> None:
    """The tokenizer config's names stand in for csbp's default names only: ``csbp data prepare
    --eos-token '<|im_end|>'`` on a tokenizer without it silently took the config's ``eos_token``
    (and ``csbp generate --mask-token X`` its ``mask_token``)."""
    directory = _wordlevel_dir(tmp_path, {"[UNK]": 0, "</s>": 1, "[MASK]": 2, "[PAD]": 3, "word": 4})
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "</s>", "pad_token": "[PAD]", "mask_token": "[MASK]"})
    )
    for field in ("eos", "mask", "pad"):
        with pytest.raises(ValueError, match=rf"has no {field} token '<\|absent\|>' \(fix: .* --{field}-token\)"):
            load_tokenizer(directory, special=SpecialTokens(**{field: "<|absent|>"}))


@pytest.mark.parametrize(
    ("name", "data", "message"),
    [
        ("special_tokens_map.json", b"{bad", "not valid JSON"),  # was json's bare message, no file named
        ("tokenizer_config.json", b"[1]", "expected a JSON object, got list"),  # was an AttributeError traceback
        ("tokenizer_config.json", b"\xff", "not valid JSON"),
    ],
)
def test_a_broken_hf_config_names_its_file(tmp_path: Path, name: str, data: bytes, message: str) -> None:
    directory = _wordlevel_dir(tmp_path, {"[UNK]": 0, "<|endoftext|>": 1, "<|mask|>": 2})
    (directory / name).write_bytes(data)
    with pytest.raises(ValueError, match=rf"{name}: {message}.*\(fix: repair the file\)"):
        load_tokenizer(directory / "tokenizer.json")


def test_a_directory_without_a_tokenizer_is_one_whole_line(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    with pytest.raises(ValueError, match=r"could not load a tokenizer from .*tokenizer\.json\)$") as info:
        load_tokenizer(tmp_path)  # transformers' reason was cut after its first line, "... from one of:"
    assert "\n" not in str(info.value) and not str(info.value).split("(fix:")[0].rstrip().endswith(":")


def test_a_path_that_exists_but_is_no_tokenizer_says_what_it_is(tmp_path: Path) -> None:
    """``--tokenizer /dev/null`` said "does not exist"."""
    import os

    fix = r" \(fix: pass a tokenizer.json file, or a directory holding tokenizer.json\)$"
    with pytest.raises(ValueError, match=r"^tokenizer path /dev/null is a character device, not a tokenizer.json file "
                       r"or a tokenizer directory" + fix):
        load_tokenizer("/dev/null")
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(ValueError, match=r"fifo is a named pipe, not a tokenizer.json file" + ".*" + fix):
        load_tokenizer(tmp_path / "fifo")
    (tmp_path / "dangling").symlink_to(tmp_path / "gone")
    with pytest.raises(ValueError, match=rf"dangling is a symbolic link to {tmp_path / 'gone'}, which does not exist" + fix):
        load_tokenizer(tmp_path / "dangling")
    with pytest.raises(ValueError, match=r"missing does not exist" + fix):
        load_tokenizer(tmp_path / "missing")
    (tmp_path / "to-null").symlink_to("/dev/null")  # a link to something that exists: what it reaches
    with pytest.raises(ValueError, match=r"to-null is a character device, not a tokenizer.json file" + ".*" + fix):
        load_tokenizer(tmp_path / "to-null")


def test_special_tokens_from_names_keeps_the_fields_it_knows() -> None:
    """A manifest's ``special_names`` with a name SpecialTokens has no field for (a later csbp's, or
    an edit) is read for the fields it has, not a TypeError."""
    assert special_tokens_from_names({"eos": "</s>", "bos": "<s>"}) == SpecialTokens(eos="</s>")


def test_a_run_directory_for_a_tokenizer_names_its_model_s(tmp_path: Path) -> None:
    """A directory without tokenizer files got transformers' "Couldn't instantiate the backend tokenizer" reason."""
    (tmp_path / "final").mkdir()
    _wordlevel_dir(tmp_path / "final", {"[UNK]": 0, "<|endoftext|>": 1, "<|mask|>": 2})
    run = tmp_path
    with pytest.raises(ValueError, match=rf"^could not load a tokenizer from {run}: the directory holds no "
                       rf"tokenizer.json, tokenizer_config.json or config.json \(fix: pass its model's, {run / 'final'}\)$"):
        load_tokenizer(run)


def test_missing_mask_token_is_an_error(tmp_path: Path) -> None:
    directory = _wordlevel_dir(tmp_path, {"[UNK]": 0, "<|endoftext|>": 1})
    with pytest.raises(ValueError, match="has no mask token '<\\|mask\\|>'.*--mask-token"):
        load_tokenizer(directory)


def test_transformers_directory_without_tokenizer_json(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    trained = train_bpe_tokenizer(TEXTS, vocab_size=300)
    trained.backend.model.save(str(tmp_path))  # vocab.json + merges.txt, a GPT-2 style directory
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "GPT2Tokenizer",
                "eos_token": "<|endoftext|>",
                "pad_token": "<|pad|>",
                "mask_token": "<|mask|>",
            }
        )
    )
    tok = load_tokenizer(tmp_path)
    assert tok.special_ids() == trained.special_ids()
    assert tok.encode("hello lazy fox") == trained.encode("hello lazy fox")
    assert tok.fingerprint == hashlib.sha256(tok.json_bytes).hexdigest()
    assert load_tokenizer(tmp_path).fingerprint == tok.fingerprint  # reproducible
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(tmp_path / "missing")
