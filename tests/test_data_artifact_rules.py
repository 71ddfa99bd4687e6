"""Rules of csbp.data.artifact no other test pinned (a mutation audit found each): the content
fingerprint's formula, the chunked count of supervised tokens, empty splits, the manifest's records
and what ``open_artifact`` refuses. Arrays here are written by hand; values are counted by hand."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from csbp.data import artifact as artifact_module
from csbp.data.artifact import (
    ARRAY_DTYPES,
    SPLITS,
    Artifact,
    array_file_name,
    content_fingerprint,
    count_supervised,
    max_token_id,
    open_artifact,
)


def test_the_content_fingerprint_is_the_documented_formula(tmp_path: Path) -> None:
    """sha256 of 'name:sha256(file)' lines joined by newlines: the value computed with coreutils'
    sha256sum for these six files (a changed formula fails every artifact already prepared)."""
    for split in SPLITS:
        for field in ARRAY_DTYPES:
            (tmp_path / array_file_name(split, field)).write_bytes(f"{split}-{field}".encode())
    assert content_fingerprint(tmp_path) == "1888f8a6128f315f4e16bf11319e1f033a6961f64c20ba0e9a24ed1c3cf31997"


def write_split(directory: Path, split: str, tokens: list[list[int]], loss_mask: list[list[int]]) -> None:
    for field, values in (("tokens", tokens), ("loss_mask", loss_mask), ("doc_ids", [[0] * len(r) for r in tokens])):
        np.asarray(values, dtype=ARRAY_DTYPES[field]).tofile(directory / array_file_name(split, field))


@pytest.mark.parametrize("chunk", [1 << 24, 1, 2, 3, 4, 5])
def test_supervised_tokens_are_counted_in_any_chunking(tmp_path: Path, chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(artifact_module, "_SCAN_CHUNK", chunk)
    write_split(tmp_path, "train", [[7, 5, 7], [7, 7, 2]], [[1, 1, 0], [1, 0, 1]])  # 7 supervised at (0,0), (1,0)
    assert count_supervised(tmp_path, "train", 7) == 2
    assert count_supervised(tmp_path, "train", 2) == 1
    assert count_supervised(tmp_path, "train", 9) == 0
    assert max_token_id(tmp_path, "train") == 7


def test_an_empty_split_has_no_largest_id_and_nothing_supervised(tmp_path: Path) -> None:
    write_split(tmp_path, "val", [], [])
    assert max_token_id(tmp_path, "val") == -1
    assert count_supervised(tmp_path, "val", 0) == 0
    write_split(tmp_path, "train", [[3, 4]], [[1, 1]])
    artifact = Artifact(tmp_path, {"splits": {"train": {}, "val": {}}, "seq_len": 2})
    assert artifact.count_supervised(4) == 1  # an empty split adds nothing (not -1)
    assert artifact.max_token_id() == 4


@pytest.mark.parametrize(
    ("train", "val", "expected"),
    [(0, 0, 0), (2, 3, 5), (2, None, None), (None, 3, None), (True, 0, None), (1.0, 0, None)],
)
def test_recorded_supervised_mask_tokens_need_an_integer_record_for_both_splits(train: object, val: object,
                                                                                expected: int | None) -> None:
    splits = {name: ({} if value is None else {"supervised_mask_tokens": value}) for name, value in
              (("train", train), ("val", val))}
    assert Artifact(Path("."), {"splits": splits}).recorded_supervised_mask_tokens() == expected


def test_a_split_other_than_train_or_val_is_refused() -> None:
    with pytest.raises(ValueError, match=r"^split is 'test'; use one of \('train', 'val'\)$"):
        Artifact(Path("."), {"seq_len": 2, "splits": {"test": {"rows": 0}}}).split("test")


def test_the_chat_template_entry_is_read_from_the_manifest() -> None:
    entry = {"source": "/t/chat_template.jinja", "sha256": "ab"}
    assert Artifact(Path("."), {"chat_template": entry}).chat_template == entry
    assert Artifact(Path("."), {"chat_template": None}).chat_template is None
    assert Artifact(Path("."), {}).chat_template is None


def test_a_manifest_record_of_the_largest_id_is_used_without_reading_the_files(tmp_path: Path) -> None:
    """check_run on every rank reads only the record (csbp train's verify_data reads the files)."""
    write_split(tmp_path, "train", [[3, 9]], [[1, 1]])
    write_split(tmp_path, "val", [], [])
    splits = {"train": {"max_token_id": 9}, "val": {"max_token_id": -1}}
    assert Artifact(tmp_path, {"splits": splits}).max_token_id() == 9
    (tmp_path / array_file_name("train", "tokens")).unlink()  # the record suffices
    assert Artifact(tmp_path, {"splits": splits}).max_token_id() == 9


def _hand_artifact(directory: Path, **changes: object) -> Path:
    """A valid artifact of one train row [5, 6] (seq_len 2) and no val rows; ``changes`` replace
    top-level manifest fields. Its tokenizer.json is a placeholder: only its presence is checked."""
    manifest = {
        "format": artifact_module.FORMAT_NAME, "format_version": artifact_module.FORMAT_VERSION, "seq_len": 2,
        "special_ids": {"eos": 0, "mask": 1, "pad": 0}, "content_fingerprint": "0" * 64,
        "tokenizer": {"fingerprint": "0" * 64, "vocab_size": 8, "special_names": {}},
        "splits": {"train": {"rows": 1}, "val": {"rows": 0}},
    }
    manifest.update(changes)
    write_split(directory, "train", [[5, 6]], [[1, 1]])
    write_split(directory, "val", [], [])
    (directory / artifact_module.TOKENIZER_FILE).write_text("{}")
    (directory / artifact_module.MANIFEST_NAME).write_text(json.dumps(manifest))
    return directory


def test_open_artifact_refuses_another_format_version_seq_len_1_and_no_tokenizer_file(tmp_path: Path) -> None:
    """Each refused by its own check: a format version this reader does not know (its layout may
    differ), seq_len 1 (csbp data prepare refuses it: no token of a row has a next one) and a missing
    tokenizer.json (found when the artifact is opened, not when training first decodes)."""
    open_artifact(_hand_artifact(tmp_path))  # the base is valid
    for version in (2, None, "1"):
        with pytest.raises(ValueError, match=rf"manifest.json: format 'csbp-packed-tokens' version {version!r} is not "
                           r"'csbp-packed-tokens' version 1; re-run csbp data prepare$"):
            open_artifact(_hand_artifact(tmp_path, format_version=version))
    with pytest.raises(ValueError, match=r"manifest.json: seq_len is 1, not an integer in \[2, 2147483647\]"):
        open_artifact(_hand_artifact(tmp_path, seq_len=1))
    _hand_artifact(tmp_path)
    (tmp_path / artifact_module.TOKENIZER_FILE).unlink()
    with pytest.raises(ValueError, match=rf"^artifact {tmp_path} is missing tokenizer.json; re-run csbp data prepare$"):
        open_artifact(tmp_path)


def test_an_array_file_longer_than_the_manifest_says_is_refused(tmp_path: Path) -> None:
    """Not only a truncated file: bytes past the manifest's rows are no row the memmap shows, so the
    file is not what was prepared."""
    _hand_artifact(tmp_path)
    path = tmp_path / array_file_name("train", "tokens")
    path.write_bytes(path.read_bytes() + bytes(4))
    with pytest.raises(ValueError, match=r"train.tokens.bin: 12 bytes, manifest implies 8; the artifact is longer than "
                       r"its manifest says \(appended to, or another artifact's\), re-run csbp data prepare$"):
        open_artifact(tmp_path)  # it said 'truncated or corrupt' for a longer file too
    path.write_bytes(path.read_bytes()[:4])
    with pytest.raises(ValueError, match=r"train.tokens.bin: 4 bytes, manifest implies 8; the artifact is truncated, re-run"):
        open_artifact(tmp_path)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"tokenizer": {"fingerprint": "0", "vocab_size": 2**32 + 1, "special_names": {}}},
         r"tokenizer.vocab_size is 4294967297, not an integer in \[1, 4294967296\]"),  # ids are uint32
        ({"tokenizer": {"fingerprint": "0", "vocab_size": True, "special_names": {}}},
         r"tokenizer.vocab_size is True, not an integer"),  # JSON true is no count
        ({"tokenizer": {"fingerprint": "0", "vocab_size": 8}}, r"missing field tokenizer.special_names"),
        ({"special_ids": {"eos": 0, "mask": -1, "pad": 0}}, r"special_ids must map names to token ids"),
        ({"special_ids": [0, 1, 0]}, r"special_ids must map names to token ids"),
    ],
)
def test_open_artifact_refuses_a_manifest_field_out_of_its_range(tmp_path: Path, change: dict[str, object],
                                                                  message: str) -> None:
    """Each in one line when the artifact is opened (a bool, a list or a missing field used to reach
    the code reading it: a size of 2**32 + 1 ids, a mask id -1, a KeyError/AttributeError traceback)."""
    with pytest.raises(ValueError, match=rf"manifest.json: {message}.*re-run csbp data prepare$"):
        open_artifact(_hand_artifact(tmp_path, **change))
    changed = next(iter(change))
    if changed == "tokenizer":  # the largest size is accepted
        open_artifact(_hand_artifact(tmp_path, tokenizer={"fingerprint": "0", "vocab_size": 2**32, "special_names": {}}))
