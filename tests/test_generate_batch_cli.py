"""``csbp generate --batch-size N``: the ``--samples`` drawn N at a time give the completions drawn one at
a time (the tiny float32 export of ``tests/test_generate_cli.py``), and the output says which batch
each came from."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from test_generate_cli import export_tiny_run, parse


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_tiny_run(tmp_path_factory.mktemp("run"))


def draw(checkpoint: Path, tmp_path: Path, batch_size: int, capsys: pytest.CaptureFixture[str]) -> tuple[dict, list[str]]:
    report = tmp_path / f"batch{batch_size}.json"
    argv = ["generate", "--model", str(checkpoint), "--prompt", "the quick", "--device", "cpu", "--block-size", "4"]
    argv += ["--max-new-tokens", "10", "--temperature", "1", "--top-k", "20", "--threshold", "0.3", "--seed", "4"]
    argv += ["--samples", "5", "--batch-size", str(batch_size), "--json", str(report)]
    args = parse(argv)
    assert args.func(args) == 0
    return json.loads(report.read_text()), capsys.readouterr().out.splitlines()


def test_batches_draw_the_completions_of_one_at_a_time(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    alone, alone_lines = draw(checkpoint, tmp_path, 1, capsys)
    batched, lines = draw(checkpoint, tmp_path, 3, capsys)
    fields = ("seed", "completion", "token_ids", "stopped_at", "blocks", "denoising_steps")
    assert [[r[f] for f in fields] for r in batched["samples"]] == [[r[f] for f in fields] for r in alone["samples"]]
    assert len({r["completion"] for r in alone["samples"]}) > 1  # the seeds drew different completions
    assert alone["batch_size"] == 1 and batched["batch_size"] == 3
    assert [r["batch_seeds"] for r in alone["samples"]] == [[4], [5], [6], [7], [8]]
    assert [r["batch_seeds"] for r in batched["samples"]] == [[4, 5, 6]] * 3 + [[7, 8]] * 2
    assert len({r["seconds"] for r in batched["samples"][:3]}) == 1  # the batch's time, shared
    timings = [line for line in lines if line.startswith("[bd3, ")]
    assert [re.search(r"for a batch of (\d)", t).group(1) for t in timings] == ["3"] * 3 + ["2"] * 2  # type: ignore[union-attr]
    assert not any("batch" in line for line in alone_lines)
    assert [line for line in lines if line.startswith("completion")] == [
        line for line in alone_lines if line.startswith("completion")
    ]
    more, _ = draw_more_than_samples(checkpoint, tmp_path, capsys)
    assert more["batch_size"] == 2 and [r["batch_seeds"] for r in more["samples"]] == [[0, 1]] * 2


def draw_more_than_samples(checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[dict, str]:
    """``--batch-size`` is a largest batch: more than ``--samples`` draws them all in one."""
    report = tmp_path / "more.json"
    argv = ["generate", "--model", str(checkpoint), "--prompt", "the", "--device", "cpu", "--block-size", "4"]
    argv += ["--max-new-tokens", "4", "--temperature", "1", "--samples", "2", "--batch-size", "8", "--json", str(report)]
    args = parse(argv)
    assert args.func(args) == 0
    return json.loads(report.read_text()), capsys.readouterr().out


def test_a_batch_size_below_one_is_refused_by_its_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["generate", "--model", "m", "--prompt", "p", "--batch-size", "0"])
    assert "--batch-size" in capsys.readouterr().err
