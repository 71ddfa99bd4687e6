"""Rows that supervise no token (a prompt or chat history longer than a row, records without an
assistant turn): the packer counts them as it writes, ``csbp data prepare`` and ``csbp data inspect``
say how many each split holds, and an artifact written before the count still inspects."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from csbp.data.artifact import MANIFEST_NAME, open_artifact
from csbp.data.packing import PackedSplitWriter
from csbp.data.report import format_manifest_summary
from test_data_chat_template import CHAT, build_tokenizer_dir
from test_data_chat_turns import run_cli

NOTE = "rows that supervise no token: "


@pytest.mark.parametrize("seq_len", [1, 3, 7, 16])
def test_the_packer_counts_the_rows_without_a_supervised_token(tmp_path: Path, seq_len: int) -> None:
    rng = np.random.default_rng(seq_len)
    writer = PackedSplitWriter(tmp_path, "train", seq_len=seq_len, pad_id=0, mask_token_id=1)
    masks = []
    for _ in range(60):  # documents of 1..20 tokens, many wholly unsupervised, some supervised in spots
        length = int(rng.integers(1, 21))
        mask = (rng.random(length) < rng.choice([0.0, 0.05, 0.5])).astype(np.uint8)
        writer.add_document(np.full(length, 2, dtype=np.int64), mask)
        masks.append(mask)
    counts = writer.finish()
    stream = np.concatenate(masks)
    stream = np.append(stream, np.zeros(-stream.shape[0] % seq_len, dtype=np.uint8)).reshape(-1, seq_len)
    expected = int((stream.sum(axis=1) == 0).sum())
    assert 0 < expected < counts.rows  # both kinds of row occur
    assert counts.unsupervised_rows == expected


def test_a_supervised_token_in_the_padded_last_row_counts_it_supervised(tmp_path: Path) -> None:
    writer = PackedSplitWriter(tmp_path, "val", seq_len=4, pad_id=0, mask_token_id=1)
    writer.add_document(np.full(5, 2, dtype=np.int64), np.array([0, 0, 0, 0, 1], dtype=np.uint8))
    writer.add_document(np.full(1, 2, dtype=np.int64), np.array([0], dtype=np.uint8))
    assert writer.finish().unsupervised_rows == 1  # row 0; row 1 holds the fifth token


def test_the_packer_counts_only_supervised_mask_tokens(tmp_path: Path) -> None:
    """``supervised_mask_tokens`` (which ``csbp train`` refuses) counts the mask token only where the
    loss mask supervises it: a mask token in a prompt is harmless."""
    writer = PackedSplitWriter(tmp_path, "train", seq_len=4, pad_id=0, mask_token_id=1)
    writer.add_document(np.array([1, 2, 1, 1, 3], dtype=np.int64), np.array([0, 0, 1, 0, 1], dtype=np.uint8))
    counts = writer.finish()
    assert counts.supervised_mask_tokens == 1 and counts.supervised_tokens == 2


def test_prepare_and_inspect_say_how_many_rows_supervise_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = build_tokenizer_dir(tmp_path / "tok", "chatml")
    data = tmp_path / "chat.jsonl"
    # a long user turn: with --seq-len 8 whole rows of the conversation before each answer
    long = [{"role": "user", "content": "Tell me, " * 12 + "what is two plus two?"}, CHAT[2]]
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in (long, CHAT)), encoding="utf-8")
    out = tmp_path / "a"
    argv = ["data", "prepare", str(data), "--tokenizer", str(directory), "--seq-len", "8", "--out", str(out),
            "--chat-documents", "turn", "--val-fraction", "0"]
    assert run_cli(argv) == 0
    said = capsys.readouterr().out
    manifest = json.loads((out / MANIFEST_NAME).read_text(encoding="utf-8"))
    train = manifest["splits"]["train"]
    assert 0 < train["unsupervised_rows"] < train["rows"] and manifest["splits"]["val"]["unsupervised_rows"] == 0
    line = (
        f"{NOTE}train {train['unsupervised_rows']} of {train['rows']}, val 0 of {manifest['splits']['val']['rows']}; "
        "they add nothing to the loss and a DFlash run refuses them (fix: a longer --seq-len, so that no row "
        "lies wholly inside a prompt or chat history, or drop records whose unsupervised part is longer than "
        "a row or that have no assistant turn)\n"
    )
    assert line in said
    assert run_cli(["data", "inspect", str(out), "--rows", "0"]) == 0
    assert line in capsys.readouterr().out

    # an artifact from a csbp without the count still opens and inspects, saying nothing of it
    for split in manifest["splits"].values():
        del split["unsupervised_rows"]
    (out / MANIFEST_NAME).write_text(json.dumps(manifest), encoding="utf-8")
    assert NOTE not in format_manifest_summary(open_artifact(out, verify=True))


def test_prepare_says_nothing_when_every_row_supervises(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "t.jsonl"
    data.write_text("".join(json.dumps({"text": f"line {i} of text"}) + "\n" for i in range(20)), encoding="utf-8")
    out = tmp_path / "a"
    directory = build_tokenizer_dir(tmp_path / "tok", "chatml")
    assert run_cli(["data", "prepare", str(data), "--tokenizer", str(directory), "--seq-len", "8", "--out", str(out)]) == 0
    assert NOTE not in capsys.readouterr().out
    assert [s["unsupervised_rows"] for s in open_artifact(out).manifest["splits"].values()] == [0, 0]
