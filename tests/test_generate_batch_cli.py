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
    assert [r["batch"] for r in alone["samples"]] == [0, 1, 2, 3, 4]
    assert [r["batch"] for r in batched["samples"]] == [0, 0, 0, 1, 1]
    assert len({r["seconds"] for r in batched["samples"][:3]}) == 1  # the batch's time, shared
    timings = [line for line in lines if line.startswith("[bd3, ")]
    assert [re.search(r"for a batch of (\d)", t).group(1) for t in timings] == ["3"] * 3 + ["2"] * 2  # type: ignore[union-attr]
    assert not any("batch" in line for line in alone_lines)
    assert [line for line in lines if line.startswith("completion")] == [
        line for line in alone_lines if line.startswith("completion")
    ]
    more, _ = draw_more_than_samples(checkpoint, tmp_path, capsys)
    assert more["batch_size"] == 2 and [r["batch"] for r in more["samples"]] == [0, 0]


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


def test_a_prompts_file_gives_each_prompt_s_completions_as_alone(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Samples of different prompts share batches; each is the completion that prompt and seed give alone."""
    texts = ["the quick", "block", "the lazy dog jumps over"]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": t}) for t in texts[:2]) + "\n\n" + json.dumps({"prompt": texts[2]}))
    common = ["--device", "cpu", "--block-size", "4", "--max-new-tokens", "9", "--temperature", "1", "--top-k", "20"]
    report = tmp_path / "many.json"
    args = parse(["generate", "--model", str(checkpoint), "--prompts", str(prompts), *common, "--seed", "2",
                  "--samples", "2", "--batch-size", "4", "--json", str(report)])  # fmt: skip
    assert args.func(args) == 0
    out = capsys.readouterr().out.splitlines()
    many = json.loads(report.read_text())
    assert [p["prompt"] for p in many["prompts"]] == texts
    assert [p["where"] for p in many["prompts"]] == [f"{prompts}:1", f"{prompts}:2", f"{prompts}:4"]
    assert [(r["prompt_index"], r["seed"], r["batch"]) for r in many["samples"]] == [
        (0, 2, 0), (0, 3, 0), (1, 2, 0), (1, 3, 0), (2, 2, 1), (2, 3, 1)
    ]
    assert [line for line in out if line.startswith("prompt: ")] == [f"prompt: {t}" for t in texts]
    for record in many["samples"]:
        alone_report = tmp_path / "alone.json"
        args = parse(["generate", "--model", str(checkpoint), "--prompt", texts[record["prompt_index"]], *common,
                      "--seed", str(record["seed"]), "--json", str(alone_report)])  # fmt: skip
        assert args.func(args) == 0
        (alone,) = json.loads(alone_report.read_text())["samples"]
        assert (alone["token_ids"], alone["stopped_at"]) == (record["token_ids"], record["stopped_at"])
    capsys.readouterr()


def test_bad_prompts_files_are_refused_naming_the_line_before_loading(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def no_loading(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("csbp.models.hf_io.load_hf_checkpoint", no_loading)
    prompts = tmp_path / "prompts.jsonl"
    base = ["generate", "--model", str(checkpoint), "--prompts", str(prompts), "--device", "cpu", "--block-size", "4"]
    cases = [
        ('{"prompt": "the"}\n{"prompt": "a"\n', [], f"{prompts}:2: malformed JSON"),
        ('{"prompt": "the"}\n["the"]\n', [], f'{prompts}:2: expected an object with a string field "prompt"'),
        ("\n\n", [], f"--prompts {prompts} holds no prompts"),
        ('{"prompt": "the"}\n{"prompt": "x <|mask|> y"}\n', [], f"{prompts}:2: holds the mask token <|mask|>"),
        ('{"prompt": "the"}\n{"prompt": ""}\n', ["--objective", "fast_dllm_v2"], f"{prompts}:2: empty, but fast_dllm_v2"),
        ('{"prompt": "a"}\n{"prompt": "' + "the quick brown fox " * 40 + '"}\n', ["--max-new-tokens", "32760"],
         f"the prompt of {prompts}:2:"),
    ]  # fmt: skip
    for text, extra, message in cases:
        prompts.write_text(text, encoding="utf-8")
        args = parse([*base, *extra])
        with pytest.raises(ValueError, match=re.escape(message)):
            args.func(args)
    prompts.write_bytes(b'{"prompt": "the"}\n{"prompt": "caf\xe9"}\n')  # Latin-1, not UTF-8
    args = parse(base)
    with pytest.raises(ValueError, match=re.escape(f"{prompts}:2: not UTF-8 text")):  # it named no file
        args.func(args)
    missing = parse([*base[:3], "--prompts", str(tmp_path / "none.jsonl"), *base[5:]])
    with pytest.raises(ValueError, match="is not a file"):
        missing.func(missing)
    with pytest.raises(SystemExit):
        parse([*base, "--prompt", "the"])
    assert "not allowed with argument" in capsys.readouterr().err
