"""The ``csbp`` root command: exit codes, one-line user errors, config/recipes/doctor subcommands."""

from __future__ import annotations

import argparse
import importlib
import platform
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from csbp import __version__
from csbp.cli.doctor_cmd import collect_environment
from csbp.cli.main import SUBCOMMAND_MODULES, USER_ERROR_EXIT_CODE, build_parser, main, with_suggestion
from csbp.config import ConfigError, load_config
from csbp.recipes import list_recipes, recipe_path


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--version")
    assert (code, out.strip()) == (0, f"csbp {__version__}")


def test_no_command_prints_help_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys)
    assert code == USER_ERROR_EXIT_CODE and "usage: csbp" in err


def test_every_registered_module_exposes_register() -> None:
    for name in SUBCOMMAND_MODULES:
        assert callable(importlib.import_module(name).register), name


def test_ctrl_c_while_the_command_starts_is_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Building the parser imports torch (seconds on a loaded machine): Ctrl-C there printed a
    traceback of the import machinery."""

    def interrupted(command: str | None = None) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(importlib.import_module("csbp.cli.main"), "build_parser", interrupted)
    assert main(["recipes", "list"]) == 130
    assert capsys.readouterr().err == "csbp: interrupted\n"


def test_argparse_usage_errors_return_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "recipes", "frobnicate")
    assert code == 2 and "invalid choice" in err


# ----------------------------------------------------------------------------- config validate


def test_config_validate_recipe_prints_a_summary(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "config", "validate", "demo", "--set", "train.max_steps=70")
    assert (code, err) == (0, "")
    assert out.startswith("config ok: demo\n")
    assert "csbp layout: dp=1 cp=2 bp=2, world size 2" in out
    assert "70 steps, 32 sequences per step" in out
    assert "block_size 4 (16 blocks per sequence)" in out
    # mdlm's one block is the sequence (it said "(1 blocks per sequence)")
    code, out, err = run(capsys, "config", "validate", "mdlm-demo")
    assert code == 0 and "objective  mdlm, block_size 256 (the whole sequence)\n" in out, out
    code, out, err = run(capsys, "config", "validate", "demo", "--set", "objective.resample=true",
                         "--set", "optim.ema_decay=0.999", "--set", "train.eval_every=10",
                         "--set", "objective.clip_search_widths=[0.5, 0.6]")
    assert code == 0 and ("t in [0.3, 0.8], masked fractions resampled into it, searched over 2 widths at "
                          "validation\n") in out, out
    assert "20 warm-up steps), weight average 0.999 for validation and export\n" in out, out


def test_config_validate_notes_missing_inputs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(recipe_path("demo").read_text(encoding="utf-8"), encoding="utf-8")
    code, out, _ = run(capsys, "config", "validate", str(config))
    assert code == 0
    assert f"note: data.train does not exist yet: {tmp_path / 'artifacts' / 'demo-4k-64'}" in out
    (tmp_path / "artifacts" / "demo-4k-64").mkdir(parents=True)  # exists, so it is checked like `csbp train` does
    code, out, err = run(capsys, "config", "validate", str(config))
    assert code == 2 and "note:" not in out and "demo-4k-64 is not a prepared data artifact" in err
    # a tokenizer directory is not made by `csbp data prepare`: its note told users to prepare it with that
    (tmp_path / "artifacts" / "demo-4k-64").rmdir()
    code, out, _ = run(capsys, "config", "validate", str(config), "--set", f"data.tokenizer={tmp_path / 'tok'}")
    assert code == 0 and f"note: data.tokenizer does not exist: {tmp_path / 'tok'}\n" in out, out
    # an input checkpoint is not to come: "does not exist yet" fits the data csbp data prepare may still make
    code, out, _ = run(capsys, "config", "validate", str(config), "--set", f"model.init_from={tmp_path / 'hf'}")
    assert code == 0 and f"note: model.init_from does not exist: {tmp_path / 'hf'}\n" in out, out


def test_config_validate_print_round_trips(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "config", "validate", "mdlm-demo", "--set", "optim.lr=1e-3", "--print")
    assert code == 0
    dumped = tmp_path / "dumped.yaml"
    dumped.write_text(out, encoding="utf-8")
    cfg = load_config(dumped)
    assert cfg.optim.lr == 1e-3 and cfg.objective.block_size == 256
    assert yaml.safe_load(out)["objective"]["name"] == "mdlm"


def test_invalid_config_exits_2_with_one_stderr_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = run(capsys, "config", "validate", "demo", "--set", "topology.cp=3")
    assert (code, out) == (USER_ERROR_EXIT_CODE, "")
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(
        "csbp: error: recipe demo with --set topology.cp: topology.bp: cp: 3 with bp: 2 is not a fused CSBP layout"
    )
    assert "Traceback" not in err


def test_several_problems_give_one_line_each(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(
        capsys, "config", "validate", "demo", "--set", "optim.lrr=1", "--set", "model.arch=gpt"
    )
    assert code == USER_ERROR_EXIT_CODE
    assert err.splitlines() == [
        "csbp: error: --set: model.arch: got 'gpt' (fix: use 'qwen3', 'llama', 'qwen2' or 'mistral')",
        "csbp: error: --set: optim.lrr: unknown key (fix: remove it; did you mean lr?)",
    ]


def test_missing_config_file(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "config", "validate", "nowhere.yaml")
    assert code == USER_ERROR_EXIT_CODE
    assert (
        err.startswith("csbp: error: no config file or recipe named 'nowhere.yaml'") and err.count("\n") == 1
    )


def test_debug_flag_reraises(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError):
        main(["--debug", "config", "validate", "demo", "--set", "topology.cp=3"])
    with pytest.raises(ConfigError):  # after the command too, where users type it (it was "unrecognized")
        main(["config", "validate", "demo", "--set", "topology.cp=3", "--debug"])
    assert main(["config", "validate", "demo", "--set", "topology.cp=3"]) == USER_ERROR_EXIT_CODE


# ----------------------------------------------------------------------------- recipes


def test_recipes_list(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "recipes", "list")
    assert code == 0
    lines = out.splitlines()
    assert [line.split()[0] for line in lines] == list_recipes()
    summary_columns = {len(line) - len(line[len(line.split()[0]) :].lstrip()) for line in lines}
    assert len(summary_columns) == 1, "summaries must start in one aligned column"
    assert any("BD3-LM" in line for line in lines)


def test_recipes_without_an_action_lists_them(capsys: pytest.CaptureFixture[str]) -> None:
    """It was an argparse error ("the following arguments are required: ACTION")."""
    code, out, err = run(capsys, "recipes")
    assert (code, err) == (0, "")
    assert out == run(capsys, "recipes", "list")[1]
    code, out, _ = run(capsys, "recipes", "--help")
    assert code == 0 and out.startswith("usage: csbp recipes [-h] [ACTION ...]\n")
    assert "no ACTION: list" in " ".join(out.split())
    code, _, err = run(capsys, "recipes", "show")  # an action's errors still name it alone
    assert code == 2 and err.startswith("csbp recipes show: error: the following arguments are required: NAME")


def test_recipes_show(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "recipes", "show", "demo")
    assert code == 0 and out == recipe_path("demo").read_text(encoding="utf-8")
    code, _, err = run(capsys, "recipes", "show", "dmo")
    assert code == USER_ERROR_EXIT_CODE
    assert err == "csbp: error: unknown recipe 'dmo' (fix: did you mean demo?)\n"


def test_recipes_copy(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "recipes", "copy", "fast-dllm-v2-demo", str(tmp_path))
    target = tmp_path / "fast-dllm-v2-demo.yaml"
    assert (code, out) == (0, f"wrote {target}\n")
    assert target.read_text(encoding="utf-8") == recipe_path("fast-dllm-v2-demo").read_text(encoding="utf-8")
    code, _, err = run(capsys, "recipes", "copy", "fast-dllm-v2-demo", str(tmp_path))
    assert code == USER_ERROR_EXIT_CODE and "already exists (fix: pass --overwrite" in err
    target.write_text("edited\n", encoding="utf-8")
    code, _, _ = run(capsys, "recipes", "copy", "fast-dllm-v2-demo", str(tmp_path), "--overwrite")
    assert code == 0 and target.read_text(encoding="utf-8").startswith("# Fast-dLLM v2")
    code, _, _ = run(capsys, "recipes", "copy", "fast-dllm-v2-demo", str(tmp_path), "--force")  # the old name
    assert code == 0


@pytest.mark.parametrize("dest", ["x.txt", "notes.txt", "Makefile"])
def test_recipes_copy_refuses_a_destination_that_is_no_yaml_file_nor_a_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], dest: str
) -> None:
    """``recipes copy demo DIR/x.txt`` created a directory x.txt/ holding demo.yaml."""
    (tmp_path / "notes.txt").write_text("mine\n", encoding="utf-8")
    (tmp_path / "Makefile").write_text("all:\n", encoding="utf-8")
    code, out, err = run(capsys, "recipes", "copy", "demo", str(tmp_path / dest))
    (line,) = err.splitlines()
    assert (code, out) == (USER_ERROR_EXIT_CODE, "")
    assert line.startswith(f"csbp: error: DEST {tmp_path / dest}: ") and f"(fix: DEST {tmp_path / Path(dest).stem}.yaml, or" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["Makefile", "notes.txt"]  # nothing created


@pytest.mark.parametrize(
    "argv",
    [
        ["train", "demo", "--run-dir", ""],
        ["train", "demo", "--run-dir", " "],
        ["eval", "--model", "", "--data", "art"],
        ["eval", "--model", "m", "--data", ""],
        ["eval", "--model", "m", "--data", "art", "--json", ""],
        ["generate", "--model", "", "--prompt", "a"],
        ["generate", "--model", "m", "--prompt", "a", "--tokenizer", ""],
        ["plan", "--model", "", "--gpus", "8", "--seq-len", "4096"],
        *(["plan", "--model", "nemotron-8b", "--gpus", "8", "--seq-len", "4096", flag, ""]
          for flag in ("--data", "--target-config", "--calibration")),
        ["plan", "calibrate", "", "--out", "cal.json"],
        ["export", "", "--out", "out"],
        ["export", "run", "--out", ""],
        ["data", "prepare", "--demo-corpus", "--seq-len", "64", "--out", ""],
        ["data", "prepare", "--demo-corpus", "--seq-len", "64", "--out", "art", "--tokenizer", ""],
        ["recipes", "copy", "demo", ""],
        ["dflash", "eval", "--target", "t", "--drafter", "d", "--prompts", "p.jsonl", "--tokenizer", ""],
        ["dflash", "export", "--run-dir", "", "--out", "o"],
        ["dflash", "prepare-features", "--target", "t", "--data", "art", "--out", ""],
    ],
)
def test_an_empty_path_is_refused_not_read_as_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    """``csbp train demo --run-dir ''`` (an unset shell variable) trained into the working directory."""
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, *argv)
    (line,) = err.splitlines()
    assert code == USER_ERROR_EXIT_CODE and "is an empty path (fix: name a path, or . for the working directory)" in line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["train", "config validate"])
def test_an_empty_config_name_is_refused(capsys: pytest.CaptureFixture[str], command: str) -> None:
    """It read "csbp: error:  is a directory, not a config file": the working directory."""
    code, _, err = run(capsys, *command.split(), "")
    assert code == USER_ERROR_EXIT_CODE and err.startswith("csbp: error: CONFIG '' is empty (fix: pass a YAML file")


# ----------------------------------------------------------------------------- doctor


def test_doctor_prints_an_aligned_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "doctor")
    assert (code, err) == (0, "")
    rows = collect_environment()
    lines = out.splitlines()
    assert len(lines) == len(rows)
    value_column = max(len(r[0]) for r in rows) + 2 + max(len(r[1]) for r in rows) + 2
    for line, (_, item, value) in zip(lines, rows):
        assert line[value_column:] == value, "values must start in one aligned column"
        assert line[:value_column].split()[-1] == item
    items = {item: value for _, item, value in rows}
    assert items["gloo"] == "yes"  # CPU multi-process runs need it
    assert {"nccl", "mpi", "threads", "count", "runtime"} <= set(items)
    for package in ("transformers", "tokenizers", "safetensors", "tensorboard"):
        try:
            want = metadata.version(package)
        except metadata.PackageNotFoundError:  # e.g. transformers (a dev extra) on a device image
            want = "not"  # doctor says "not installed (<what it is for>)"
        assert items[package].split()[0] == want
    assert rows[0] == ("python", "version", f"{platform.python_version()} ({sys.executable})")


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "attention", "--json", "{file}/x.json"],
        ["bench", "train", "--png", "{file}/x.png"],
        ["bench", "kernels", "--json", "{dir}"],
        ["plan", "--model", "nemotron-3b", "--gpus", "8", "--json", "{file}/sub/plan.json"],
        ["plan", "calibrate", "--published", "--out", "{dir}"],
    ],
)
def test_unwritable_output_files_fail_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    (tmp_path / "f.txt").write_text("in the way")
    args = [arg.format(file=tmp_path / "f.txt", dir=tmp_path) for arg in argv]
    assert main(args) == USER_ERROR_EXIT_CODE
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "(fix: " in err, err


def _all_parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                yield from _all_parsers(child)


def test_every_help_renders_and_shows_defaults() -> None:
    helps = {parser.prog: parser.format_help() for parser in _all_parsers(build_parser())}
    assert len(helps) > 20
    for prog, text in helps.items():
        assert "(default: None)" not in text and "(default: False)" not in text, prog
        assert "(default: )" not in text, prog  # --set's empty list printed an empty default
    generate = " ".join(helps["csbp generate"].split())
    assert "--max-new-tokens MAX_NEW_TOKENS (default: 128)" in generate
    assert "0 = greedy (default: 0.0)" in generate
    assert "(default: B)" not in generate and "(default: (default" not in generate


@pytest.mark.parametrize(
    "argv",
    [["config", "fields"], ["plan", "--model", "nemotron-3b", "--seq-len", "4096", "--gpus", "8"]],
    ids=["config-fields", "plan"],
)
def test_a_reader_that_stops_reading_ends_the_command_quietly(argv: list[str]) -> None:
    """``csbp plan ... | head -3``: the reader closes its end early (here: before csbp writes at all,
    so the test does not race the pipe's buffer). csbp stops with 141 (128 + SIGPIPE) and nothing on
    stderr; it said "csbp: error: Broken pipe (BrokenPipeError) (fix: check the path)" and exited 2."""
    import os
    import subprocess

    read_end, write_end = os.pipe()
    os.close(read_end)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    try:
        done = subprocess.run([sys.executable, "-m", "csbp", *argv], stdout=write_end, stderr=subprocess.PIPE,
                              env=env, text=True, timeout=120)
    finally:
        os.close(write_end)
    assert (done.returncode, done.stderr) == (141, "")


def test_a_broken_pipe_that_is_not_stdout_is_still_reported(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``BrokenPipeError`` from elsewhere (a socket between training processes) is an error to show."""
    import csbp.cli.recipes_cmd as recipes_cmd

    def broken(args: argparse.Namespace) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(recipes_cmd, "run_list", broken)
    code, _, err = run(capsys, "recipes", "list")
    assert code == USER_ERROR_EXIT_CODE and err == "csbp: error: Broken pipe (BrokenPipeError) (fix: check the path)\n"


def test_an_unknown_flag_points_at_the_subcommand_s_help(capsys: pytest.CaptureFixture[str]) -> None:
    """It said "(see csbp --help)", whose page does not list csbp train's flags."""
    code, _, err = run(capsys, "train", "--config", "run.yaml")
    assert (code, err) == (2, "csbp train: error: unrecognized arguments: --config (see csbp train --help)\n")
    code, _, err = run(capsys, "data", "prepare", "x.txt", "--out", "o", "--seq-len", "8", "--train-tokenizer", "--bogus")
    assert (code, err) == (2, "csbp data prepare: error: unrecognized arguments: --bogus (see csbp data prepare --help)\n")


def test_a_mistyped_command_or_choice_gets_the_nearest_one(capsys: pytest.CaptureFixture[str]) -> None:
    """`csbp trian demo` listed the thirteen commands and left the reader to spot the typo."""
    code, _, err = run(capsys, "trian", "demo")
    assert code == 2 and err.startswith("csbp: error: argument COMMAND: invalid choice: 'trian' (choose from ")
    assert err.endswith("'plan'); did you mean train? (see csbp --help)\n")
    code, _, err = run(capsys, "verify", "--transport", "strieming")
    assert code == 2 and err.endswith("; did you mean streaming? (see csbp verify --help)\n")
    code, _, err = run(capsys, "verify", "--dtype", "bf16")  # nothing near: no guess
    assert code == 2 and err.endswith("(choose from 'float64', 'float32') (see csbp verify --help)\n")
    # newer Pythons print the choices unquoted
    assert with_suggestion("argument COMMAND: invalid choice: 'trian' (choose from config, train, plan)").endswith(
        "(choose from config, train, plan); did you mean train?"
    )


def test_an_override_without_its_set_flag_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    """`--set a=1 b=2` lost the second override to "unrecognized arguments" with no word on why."""
    code, _, err = run(capsys, "config", "validate", "demo", "--set", "optim.lr=1e-3", "optim.warmup_steps=1")
    assert code == 2 and err.startswith(
        "csbp config validate: error: unrecognized arguments: optim.warmup_steps=1; each KEY=VALUE needs its own "
        "--set: --set optim.warmup_steps=1 (see"
    )


def test_a_negative_size_reaches_the_flags_own_check(capsys: pytest.CaptureFixture[str]) -> None:
    """`--seq-len -256K` was "expected one argument": argparse read the value as a flag."""
    code, _, err = run(capsys, "plan", "--model", "nemotron-8b", "--gpus", "8", "--gpu", "h200", "--seq-len", "-256K")
    assert code == 2 and err.startswith("csbp plan: error: argument --seq-len: '-256K' is not a length")
    code, _, err = run(capsys, "bench", "kernels", "--seq-lens", "-512")
    assert code == 2 and "argument --seq-lens: -512 must be >= 1" in err
    code, _, err = run(capsys, "verify", "--seq-len", "-1e-3")
    assert code == 2 and "argument --seq-len:" in err and "expected one argument" not in err


def test_a_huge_integer_or_minus_inf_is_refused_by_its_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """A fuzz of every flag found 10**30 reaching torch or numpy (OverflowError tracebacks, rc 1) through
    `type=int` flags and int options alike, and `-inf` read as a flag ("expected one argument")."""
    huge = str(10**30)
    for argv, flag in ((["verify", "--nproc", "2", "--seed", huge], "--seed"), (["verify", "--nproc", huge], "--nproc"),
                       (["eval", "--model", "m", "--data", "d", "--samples", huge], "--samples"),
                       (["plan", "--model", "nemotron-8b", "--gpus", "8", "--seq-len", "4096", "--block-size", huge],
                        "--block-size")):  # --gpus stops lower, at 2^31 - 1 (test_plan_cli.py)
        code, _, err = run(capsys, *argv)
        assert code == 2 and f"argument {flag}: {huge} is too large (at most 2^63 - 1)" in err, argv
    code, _, err = run(capsys, "generate", "--model", "m", "--prompt", "a", "--temperature", "-inf")
    assert code == 2 and "argument --temperature: -inf must be a finite number" in err


def test_run_local_refuses_more_cpu_processes_than_the_machine_can_run() -> None:
    """`csbp eval --nproc 10**30` built that many Process objects and exhausted the machine's memory."""
    import os

    from csbp.parallel.launch import MIN_PROCESS_LIMIT, PROCESSES_PER_CORE, run_local

    limit = max(MIN_PROCESS_LIMIT, PROCESSES_PER_CORE * (os.cpu_count() or 1))
    with pytest.raises(ValueError, match=rf"^--nproc {limit + 1}: more than {limit} processes .* \(fix: --nproc {limit} or fewer\)$"):
        run_local(print, limit + 1)
