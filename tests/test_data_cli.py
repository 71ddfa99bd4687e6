"""``csbp data prepare/inspect/stats`` through ``register`` on a fresh argparse parser."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from csbp.cli.data_cmd import register
from csbp.data.artifact import open_artifact
from csbp.data.report import format_row


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="csbp")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return int(args.func(args))


@pytest.fixture
def artifact_dir(tmp_path: Path) -> Path:
    data = tmp_path / "chat.jsonl"
    records = [
        {"messages": [{"role": "user", "content": "say hello"}, {"role": "assistant", "content": "hello"}]},
        {"text": "a plain document about the quick brown fox"},
        {"text": ""},
        {"prompt": "2+2=", "completion": "4"},
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    out = tmp_path / "art"
    code = run(
        [
            "data",
            "prepare",
            str(data),
            "--out",
            str(out),
            "--seq-len",
            "16",
            "--train-tokenizer",
            "--vocab-size",
            "300",
            "--seed",
            "2",
        ]
    )
    assert code == 0
    return out


def test_prepare_writes_a_valid_artifact(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "notes.txt"
    data.write_text("first paragraph\n\nsecond paragraph\n\n\n", encoding="utf-8")
    assert (
        run(
            [
                "data",
                "prepare",
                str(data),
                "--out",
                str(tmp_path / "art"),
                "--seq-len",
                "2",  # the train paragraph is 3 tokens: fills a row
                "--train-tokenizer",
                "--vocab-size",
                "280",
                "--txt-mode",
                "paragraphs",
                "--val-fraction",
                "0.5",
            ]
        )
        == 0
    )
    assert "2 documents (1 val), 1 empty skipped" in capsys.readouterr().out
    artifact = open_artifact(tmp_path / "art", verify=True)
    assert artifact.manifest["counts"] == {
        "documents": 2,
        "skipped_empty": 1,
        "tokens": artifact.manifest["counts"]["tokens"],
    }
    assert artifact.split("train").num_rows >= 1 and artifact.split("val").num_rows >= 1


def test_inspect_marks_supervised_spans(artifact_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert run(["data", "inspect", str(artifact_dir), "--rows", "1", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "seq_len       16" in out and "3 (1 empty skipped)" in out
    assert "--- row 0 (documents [0, 1])" in out
    assert "<|user|>say hello<|assistant|>[[hello<|endoftext|>a plain document" in out
    assert out.startswith("verified: content fingerprint ")  # it printed nothing, as if the check were skipped
    assert run(["data", "stats", str(artifact_dir), "--verify"]) == 0
    assert capsys.readouterr().out.startswith("verified: content fingerprint ")
    assert run(["data", "inspect", str(artifact_dir), "--rows", "0"]) == 0
    out = capsys.readouterr().out  # it printed a heading "first 0 of 1 train rows (...):" over nothing
    assert "supervised spans" not in out and out.startswith("artifact ") and out.split("\n")[-2].startswith("sources ")


def test_inspect_refuses_a_replaced_tokenizer_without_verify(artifact_dir: Path) -> None:
    # inspect decoded every row with whatever tokenizer.json held: garbage, and no word of it
    from csbp.data.tokenizer import train_bpe_tokenizer

    train_bpe_tokenizer(["other text entirely, other merges"] * 5, vocab_size=300).save(artifact_dir)
    with pytest.raises(ValueError, match=r"tokenizer\.json: fingerprint .* is not the manifest's tokenizer\.fingerprint"):
        run(["data", "inspect", str(artifact_dir), "--rows", "1"])


def test_format_row_collapses_padding(artifact_dir: Path) -> None:
    artifact = open_artifact(artifact_dir)
    train = artifact.split("train")
    last = train.num_rows - 1
    text = format_row(
        train.tokens[last], train.loss_mask[last], train.doc_ids[last], artifact.load_tokenizer()
    )
    padding = artifact.manifest["splits"]["train"]["padding_tokens"]
    assert padding > 0 and text.endswith(f"<|pad|>x{padding}")


def test_stats_report(artifact_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    artifact = open_artifact(artifact_dir)
    split = artifact.manifest["splits"]["train"]
    capsys.readouterr()
    assert run(["data", "stats", str(artifact_dir)]) == 0
    out = capsys.readouterr().out
    fraction = 100 * split["supervised_tokens"] / split["tokens"]
    assert f"supervised          {split['supervised_tokens']} ({fraction:.2f}% of tokens)" in out
    assert f"tokens              {split['tokens']} (+{split['padding_tokens']} padding)" in out
    assert "documents           3" in out and "document length histogram" in out
    assert "[val]" in out and "(no documents)" in out


@pytest.mark.parametrize("path", [("counts",), ("splits", "val", "documents"), ("splits", "train", "padding_tokens")])
def test_inspect_names_a_missing_manifest_count(artifact_dir: Path, path: tuple[str, ...]) -> None:
    manifest_path = artifact_dir / "manifest.json"
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    node = manifest
    for key in path[:-1]:
        node = node[key]
    del node[path[-1]]
    manifest["sources"] = ["not an object"]
    manifest_path.write_text(json.dumps(manifest), encoding="utf-8")
    with pytest.raises(ValueError, match=rf"manifest.json: missing field {'.'.join(path)}"):
        run(["data", "inspect", str(artifact_dir), "--rows", "0"])


def test_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["data"]) == 2  # no subcommand: help on stderr
    assert "prepare" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a tokenizer source is required
        run(["data", "prepare", "x.jsonl", "--out", str(tmp_path / "o"), "--seq-len", "8"])
    with pytest.raises(ValueError, match="no inputs"):
        run(
            [
                "data",
                "prepare",
                "--out",
                str(tmp_path / "o"),
                "--seq-len",
                "8",
                "--train-tokenizer",
                "--vocab-size",
                "300",
            ]
        )
    with pytest.raises(ValueError, match="is not a csbp data artifact"):
        run(["data", "stats", str(tmp_path)])


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [("--seq-len", "1", "1 must be >= 2"), ("--val-fraction", "1", "1 must lie in [0, 1)"), ("--vocab-size", "0", "0 must be >= 1"),
     ("--seed", "-1", "-1 must be >= 0")],
)
def test_prepare_flags_are_refused_by_their_flag_name(
    tmp_path: Path, flag: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """They were refused by PrepareConfig's field names ("val_fraction is 1.0; use a value in [0, 1)")."""
    argv = ["data", "prepare", "x.txt", "--out", str(tmp_path / "o"), "--train-tokenizer", "--vocab-size", "300"]
    argv += ["--seq-len", "8", flag, value]
    with pytest.raises(SystemExit):
        run(argv)
    assert f"argument {flag}: {message}" in capsys.readouterr().err


def test_a_tokenizer_smaller_than_asked_is_noted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--vocab-size 512 on a small corpus gave 345 ids with no word of it."""
    data = tmp_path / "small.txt"
    data.write_text("a tiny corpus with few pairs to merge\n", encoding="utf-8")
    argv = ["data", "prepare", str(data), "--out", str(tmp_path / "art"), "--seq-len", "4", "--train-tokenizer",
            "--vocab-size", "2000", "--val-fraction", "0"]
    assert run(argv) == 0
    captured = capsys.readouterr()
    real = json.loads((tmp_path / "art" / "manifest.json").read_text())["tokenizer"]["vocab_size"]
    assert real < 2000 and f"note: the tokenizer has {real} ids, not --vocab-size 2000" in captured.out + captured.err
