"""``prepare_artifact`` and ``open_artifact``: a failed or interrupted prepare leaves nothing, inputs
changed meanwhile and existing outputs are refused, and a damaged or mismatched artifact is detected
(tokenizer fingerprint, out-of-vocabulary ids, model vocab, content fingerprint, special ids). The
supervision, packing and option checks are in ``test_data_prepare.py``, whose helpers and fixtures these use."""

from __future__ import annotations

import json

import pytest

import test_data_prepare as shared
from csbp.data import prepare as prepare_module
from csbp.data.artifact import open_artifact
from csbp.data.packing import PackedSplitWriter
from csbp.data.tokenizer import CsbpTokenizer, train_bpe_tokenizer
from test_data_prepare import TINY_TEXTS, assert_no_leftovers, prepare, write_jsonl

tokenizer_dir, tokenizer = shared.tokenizer_dir, shared.tokenizer  # the module fixtures, shared


def test_failure_mid_prepare_leaves_nothing(tmp_path, tokenizer_dir, monkeypatch) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in TINY_TEXTS])
    out_parent = tmp_path / "out"
    out_parent.mkdir()
    calls = {"n": 0}
    original = PackedSplitWriter.add_document

    def failing_add(self, token_ids, loss_mask):
        calls["n"] += 1
        if calls["n"] == 5:
            raise RuntimeError("disk full")
        original(self, token_ids, loss_mask)

    monkeypatch.setattr(PackedSplitWriter, "add_document", failing_add)
    with pytest.raises(RuntimeError, match="disk full"):
        prepare([path], out_parent / "art", tokenizer_dir, seq_len=8)
    assert_no_leftovers(out_parent, set())
    monkeypatch.undo()

    def failing_manifest(directory, manifest):
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare_module, "write_manifest", failing_manifest)
    with pytest.raises(KeyboardInterrupt):
        prepare([path], out_parent / "art", tokenizer_dir, seq_len=8)
    assert_no_leftovers(out_parent, set())


def test_an_input_changed_while_preparing_is_refused(tmp_path, tokenizer_dir, monkeypatch) -> None:
    # a file still being appended to: the count pass saw fewer documents than the encoding pass
    # wrote, and the artifact was published with a manifest whose counts disagree with its splits
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in TINY_TEXTS])
    original = PackedSplitWriter.add_document

    def appending_add(self, token_ids, loss_mask):
        if self.num_documents == 0 and self.num_tokens == 0:
            with open(path, "a", encoding="utf-8") as handle:
                handle.write(json.dumps({"text": "a late record"}) + "\n")
        original(self, token_ids, loss_mask)

    monkeypatch.setattr(PackedSplitWriter, "add_document", appending_add)
    with pytest.raises(ValueError, match=r"docs\.jsonl changed while csbp data prepare was reading it"):
        prepare([path], tmp_path / "art", tokenizer_dir, seq_len=8)
    assert_no_leftovers(tmp_path, {"docs.jsonl"})


def test_existing_output_needs_overwrite(tmp_path, tokenizer_dir) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": TINY_TEXTS[0]}])
    prepare([path], tmp_path / "art", tokenizer_dir, seq_len=4)
    with pytest.raises(ValueError, match=r"already exists \(fix: choose another --out, or pass --overwrite to replace it\)"):
        prepare([path], tmp_path / "art", tokenizer_dir, seq_len=8)
    art = prepare([path], tmp_path / "art", tokenizer_dir, seq_len=8, overwrite=True)
    assert art.seq_len == 8
    assert_no_leftovers(tmp_path, {"docs.jsonl", "art"})


def test_the_artifact_directory_is_readable_by_others(tmp_path, tokenizer_dir) -> None:
    # it was built in a mkdtemp directory (mode 0700) and renamed as is: no other user (a shared
    # cluster's training account, a container with another uid) could read it
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in TINY_TEXTS])
    art = prepare([path], tmp_path / "art", tokenizer_dir, seq_len=8)
    assert (art.directory.stat().st_mode & 0o777) == 0o755


def test_tokenizer_fingerprint_mismatch(tmp_path, tokenizer_dir, tokenizer) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": "hello world"}])
    prepare([path], tmp_path / "art", tokenizer_dir, seq_len=4)
    other = train_bpe_tokenizer(["something else entirely"] * 5, vocab_size=280)
    with pytest.raises(ValueError) as info:
        open_artifact(tmp_path / "art", tokenizer=other)
    message = str(info.value)
    assert "\n" not in message and other.fingerprint in message and tokenizer.fingerprint in message
    open_artifact(tmp_path / "art", tokenizer=tokenizer)  # the right one passes


class _OutOfVocabTokenizer(CsbpTokenizer):
    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [[1, self.vocab_size] for _ in texts]


def test_out_of_vocab_ids_are_rejected(tmp_path, tokenizer_dir, tokenizer, monkeypatch) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": "hello"}, {"text": "world"}])
    broken = _OutOfVocabTokenizer(
        tokenizer.backend, tokenizer.json_bytes, special=tokenizer.special, source="broken"
    )
    monkeypatch.setattr(prepare_module, "load_tokenizer", lambda *args, **kwargs: broken)
    with pytest.raises(
        ValueError, match=r"docs\.jsonl:1: token id 300 is outside the tokenizer vocabulary \[0, 300\)"
    ):
        prepare([path], tmp_path / "art", tokenizer_dir, seq_len=4)
    assert not (tmp_path / "art").exists()


def test_model_vocab_check(tmp_path, tokenizer_dir) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": "hello world"}])
    art = prepare([path], tmp_path / "art", tokenizer_dir, seq_len=4)
    art.require_vocab_size(300)
    with pytest.raises(ValueError, match="vocab_size 300 but the model embeds only 299 ids"):
        art.require_vocab_size(299)


def test_open_artifact_detects_damage(tmp_path, tokenizer_dir) -> None:
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in TINY_TEXTS[:4]])
    art_dir = tmp_path / "art"
    prepare([path], art_dir, tokenizer_dir, seq_len=4)
    tokens_file = art_dir / "train.tokens.bin"
    data = bytearray(tokens_file.read_bytes())
    data[0] ^= 1
    tokens_file.write_bytes(bytes(data))
    open_artifact(art_dir)  # sizes still match: only verify notices
    with pytest.raises(ValueError, match="content_fingerprint .* does not match the files"):
        open_artifact(art_dir, verify=True)
    tokens_file.write_bytes(bytes(data[:-4]))
    with pytest.raises(ValueError, match="train.tokens.bin: .* bytes, manifest implies"):
        open_artifact(art_dir)
    with pytest.raises(ValueError, match="is not a csbp data artifact"):
        open_artifact(tmp_path)


def test_verify_refuses_special_ids_the_tokenizer_does_not_give(tmp_path, tokenizer_dir, tokenizer) -> None:
    # the mask id is read from the manifest, which the content fingerprint does not cover
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in TINY_TEXTS[:4]])
    art_dir = tmp_path / "art"
    prepare([path], art_dir, tokenizer_dir, seq_len=4)
    manifest_path = art_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    manifest["special_ids"]["mask"] = tokenizer.encode("the")[0]
    manifest_path.write_text(json.dumps(manifest), encoding="utf-8")
    with pytest.raises(ValueError, match=r"special_ids.mask is \d+, but its tokenizer.json gives '<\|mask\|>' the id 1 "):
        open_artifact(art_dir, verify=True)
    del manifest["special_ids"]["mask"]
    manifest_path.write_text(json.dumps(manifest), encoding="utf-8")
    with pytest.raises(ValueError, match="special_ids.mask is None"):
        open_artifact(art_dir, verify=True)


def test_verify_refuses_a_special_id_the_tokenizer_has_no_token_for(tmp_path, tokenizer_dir) -> None:
    """A manifest ``special_ids`` entry beyond the tokenizer's own is refused too (training's mask
    check reads every entry: an added one equal to the mask id would refuse a sound run)."""
    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in TINY_TEXTS[:4]])
    art_dir = tmp_path / "art"
    prepare([path], art_dir, tokenizer_dir, seq_len=4)
    manifest_path = art_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    manifest["special_ids"]["bos"] = 7
    manifest_path.write_text(json.dumps(manifest), encoding="utf-8")
    with pytest.raises(ValueError, match=r"special_ids.bos is 7, but its tokenizer.json gives 'bos' the id None "):
        open_artifact(art_dir, verify=True)


def test_verify_refuses_a_token_id_equal_to_the_vocabulary_size(tmp_path, tokenizer_dir) -> None:
    """The first id past the vocabulary, in files whose content fingerprint was recomputed to match."""
    import numpy as np

    from csbp.data.artifact import content_fingerprint

    path = write_jsonl(tmp_path / "docs.jsonl", [{"text": t} for t in TINY_TEXTS[:4]])
    art_dir = tmp_path / "art"
    prepare([path], art_dir, tokenizer_dir, seq_len=4)
    tokens = np.memmap(art_dir / "train.tokens.bin", dtype="<u4", mode="r+")
    tokens[2] = 299  # the largest id: accepted
    tokens.flush()
    manifest_path = art_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    manifest["content_fingerprint"] = content_fingerprint(art_dir)
    manifest_path.write_text(json.dumps(manifest), encoding="utf-8")
    open_artifact(art_dir, verify=True)
    tokens[2] = 300
    tokens.flush()
    del tokens
    manifest["content_fingerprint"] = content_fingerprint(art_dir)
    manifest_path.write_text(json.dumps(manifest), encoding="utf-8")
    with pytest.raises(ValueError, match=r"split train: token id 300 is outside the vocabulary \[0, 300\)"):
        open_artifact(art_dir, verify=True)
