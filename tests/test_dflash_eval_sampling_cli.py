"""``csbp dflash eval --temperature/--top-k/--top-p/--seed/--json`` on the workspace of
``test_dflash_cli`` (a tiny target, an untrained drafter, an artifact): ``--temperature 0`` is the
greedy evaluation unchanged, a positive temperature is reproducible by its seed and recorded in
``--json``, and contradicting flags are refused in one line before any weights load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from test_dflash_cli import _eval_argv, build_workspace, run_cli


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_workspace(tmp_path_factory.mktemp("dflash_eval_sampling_cli"))


def _argv(workspace: dict[str, Path], *extra: str) -> list[str]:
    data = ["--data", str(workspace["artifact"]), "--num-prompts", "2", "--prompt-len", "8"]
    return _eval_argv(workspace, *data, "--max-new-tokens", "12", "--ignore-eos", *extra)


def _report(out: str) -> list[str]:
    return [line for line in out.splitlines() if not line.startswith("wall time")]  # timings vary


def test_temperature_zero_is_the_greedy_evaluation_unchanged(
    workspace: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_cli(_argv(workspace)) == 0
    default = _report(capsys.readouterr().out)
    assert run_cli(_argv(workspace, "--temperature", "0", "--json", str(tmp_path / "t0.json"))) == 0
    assert _report(capsys.readouterr().out) == default
    assert "lossless check on" in default[0] and "sampling" not in default[0]
    record = json.loads((tmp_path / "t0.json").read_text())
    assert (record["temperature"], record["top_k"], record["top_p"], record["seed"]) == (0.0, None, 1.0, 0)
    assert record["lossless"] is True and f"acceptance_length: {record['acceptance_length']:.3f}" == default[-1]
    inputs = record["inputs"]  # what chose the prompts, so the record says how to run it again
    assert inputs["data"] == str(workspace["artifact"]) and inputs["prompts"] is None and inputs["ignore_eos"]
    assert (inputs["num_prompts"], inputs["prompt_len"], inputs["max_new_tokens"]) == (2, 8, 12)


def test_a_positive_temperature_samples_reproducibly_and_records_its_settings(
    workspace: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    records = []
    for name in ("a", "b"):
        argv = _argv(workspace, "--temperature", "1", "--top-k", "8", "--seed", "3", "--json", str(tmp_path / name))
        assert run_cli(argv) == 0
        out = _report(capsys.readouterr().out)
        assert "lossless check off, speculative sampling at temperature 1, top_k 8, seed 3" in out[0]
        assert out[-2].startswith("speculative sampling at temperature 1, top_k 8, seed 3: lossless in distribution")
        records.append(json.loads((tmp_path / name).read_text()))
    assert records[0] == records[1]
    record = records[0]
    assert (record["temperature"], record["top_k"], record["top_p"], record["seed"]) == (1.0, 8, 1.0, 3)
    assert record["lossless"] is None and all(p["lossless"] is None for p in record["prompts"])
    assert sum(record["histogram"]) == sum(len(p["acceptance_lengths"]) for p in record["prompts"])


def test_contradicting_sampling_flags_are_refused_before_loading(
    workspace: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import csbp.models.hf_io as hf_io

    def no_loading(*args: object, **kwargs: object) -> None:
        raise AssertionError("the target's weights were loaded")

    monkeypatch.setattr(hf_io, "load_hf_checkpoint", no_loading)
    dflash2 = tmp_path / "dflash2"
    shutil.copytree(workspace["drafter"], dflash2)
    config = json.loads((dflash2 / "config.json").read_text())
    config["dflash_config"]["selector_rank"] = 4
    (dflash2 / "config.json").write_text(json.dumps(config))
    cases = [
        (["--temperature", "-1"], "argument --temperature: -1 must be a finite number >= 0"),
        (["--top-p", "0.9"], "--top-p 0.9 only shapes sampled tokens, but --temperature 0 is greedy (fix: --temperature"),
        (["--top-k", "5"], "--top-k 5 only shapes sampled tokens"),
        (["--top-k", "5", "--top-p", "0.5"], "--top-k 5 and --top-p 0.5 only shape sampled tokens"),
        (["--temperature", "1", "--check-lossless"], "--check-lossless compares with plain greedy decoding"),
    ]
    for extra, message in cases:
        assert run_cli(_argv(workspace, *extra)) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, err
    argv = _argv(workspace, "--temperature", "1")
    argv[argv.index("--drafter") + 1] = str(dflash2)
    assert run_cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "candidate selector" in err and "(fix: --temperature 0)" in err and len(err.splitlines()) == 1, err
    # --temperature 1 --no-check-lossless is what the default already does: accepted (loading is the next step)
    with pytest.raises(AssertionError, match="weights were loaded"):
        run_cli(_argv(workspace, "--temperature", "1", "--no-check-lossless"))
