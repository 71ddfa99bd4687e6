"""A configured data path that is not an artifact: the error names where the relative path was
resolved and the artifact it most likely meant, without ever reading that other artifact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from csbp.cli.main import main
from csbp.config import config_from_dict
from csbp.training.input_hints import missing_artifact_problem
from csbp.training.preflight import check_run
from test_training_run import config_dict, make_artifact


def fake_artifact(directory: Path) -> Path:
    directory.mkdir(parents=True)
    (directory / "manifest.json").write_text("{}", encoding="utf-8")
    return directory


def test_a_recipe_run_from_a_subdirectory_says_where_to_run_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`cd docs && csbp train demo` used to say: prepare data under docs/artifacts."""
    found = fake_artifact(tmp_path / "artifacts" / "demo-4k-64")
    (tmp_path / "docs").mkdir()
    monkeypatch.chdir(tmp_path / "docs")
    assert main(["train", "demo", "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"csbp: error: data.train: {tmp_path / 'docs' / 'artifacts' / 'demo-4k-64'} is not a prepared data "
        f"artifact, but {found} is (a recipe used by name and --set resolve relative paths against the working "
        f"directory, {tmp_path / 'docs'}) (fix: run from {tmp_path}, or pass --set data.train={found})"
    ]
    assert not (tmp_path / "run").exists()
    assert main(["config", "validate", "demo"]) == 0
    out = capsys.readouterr().out
    assert f"(but {found} is an artifact: a recipe used by name resolves relative paths against the working " in out
    assert f"run from {tmp_path}, or pass --set" in out


def test_no_artifact_anywhere_names_the_directory_the_path_was_resolved_against(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    line = missing_artifact_problem(tmp_path / "artifacts" / "x", "data.train")
    assert f"against the working directory, {tmp_path}; a config file against its own directory)" in line
    assert "(fix: prepare it with `csbp data prepare ... --out" in line
    outside = missing_artifact_problem(Path("/nonexistent/artifacts/x"), "data.val")
    assert outside.startswith("data.val: /nonexistent/artifacts/x is not a prepared data artifact (fix:")


def test_a_packaged_recipes_missing_data_gets_the_exact_command_the_makefile_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`csbp train demo` in an empty directory said "prepare it with `csbp data prepare ... --out ...`"; the
    recipe's artifact has one command, which the Makefile runs (the two are checked to agree)."""
    import re
    import shlex

    from csbp.data.corpus import DEMO_ARTIFACTS, demo_prepare_command
    from csbp.recipes import list_recipes, load_run_config

    makefile = (Path(__file__).parents[1] / "Makefile").read_text(encoding="utf-8").replace("\\\n", " ")
    variables = dict(re.findall(r"^(\w+) := (\S+)$", makefile, flags=re.MULTILINE))
    commands = re.findall(r"\$\(CSBP\) data prepare --demo-corpus (.*)", makefile)
    assert len(commands) == len(DEMO_ARTIFACTS), commands
    for line in commands:
        words = [variables.get(w[2:-1], w) if w.startswith("$(") else w for w in shlex.split(line)]
        out = words[words.index("--out") + 1]
        options = [w for i, w in enumerate(words) if w not in ("--out", "--overwrite") and words[i - 1] != "--out"]
        assert " ".join(options) == DEMO_ARTIFACTS[out], out
    monkeypatch.chdir(tmp_path)
    recipe_data = {str(load_run_config(name).data.train) for name in list_recipes()}
    assert {str(tmp_path / key) for key in DEMO_ARTIFACTS} == recipe_data  # every recipe's data is covered
    line = missing_artifact_problem(tmp_path / "artifacts" / "demo-4k-64", "data.train")
    assert f"(fix: prepare it with `{demo_prepare_command('artifacts/demo-4k-64')}`, or run from" in line


def test_the_manifest_file_itself_points_at_its_directory(tmp_path: Path) -> None:
    """It said: run `csbp data prepare ... --out .../manifest.json`."""
    artifact = fake_artifact(tmp_path / "art")
    assert missing_artifact_problem(artifact / "manifest.json", "data.train") == (
        f"data.train: {artifact / 'manifest.json'} is the artifact's manifest file; data.train names the "
        f"artifact directory (fix: set data.train: {artifact})"
    )


def test_a_copied_config_names_the_artifact_under_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    found = fake_artifact(tmp_path / "artifacts" / "x")
    monkeypatch.chdir(tmp_path)
    line = missing_artifact_problem(tmp_path / "configs" / "artifacts" / "x", "data.train")
    assert line.endswith(f"(relative paths in a config file resolve against the file's directory) (fix: set data.train: {found})")


def test_init_from_a_run_directory_or_a_checkpoint_names_the_way_to_its_model(tmp_path: Path) -> None:
    """It said "point it at a local directory with config.json": true, but not which one."""
    artifact = make_artifact(tmp_path / "art")
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "final" / "config.json").write_text("{}", encoding="utf-8")
    step = run / "checkpoints" / "step_0000004"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text("{}", encoding="utf-8")
    data = config_dict(artifact)
    for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
        data["model"].pop(name, None)
    for where, fix in [
        (run, f"(fix: it is a run directory: use its export, {run / 'final'})"),
        (step, f"(fix: it holds training checkpoints: export one first (csbp export {step} --out DIR) and use DIR)"),
    ]:
        data["model"]["init_from"] = str(where)
        with pytest.raises(ValueError) as info:
            check_run(config_from_dict(data), check_device=False)
        assert str(info.value) == f"model.init_from: {where} is not a HF checkpoint directory (no config.json) {fix}"


def test_a_damaged_or_unsupported_init_from_config_names_the_file(tmp_path: Path) -> None:
    """A malformed ``config.json`` said only "Expecting value: line 1 column 20 (char 19)" (invalid UTF-8:
    a codec message), and an unsupported one did not say which checkpoint."""
    artifact = make_artifact(tmp_path / "art")
    init = tmp_path / "init"
    init.mkdir()
    data = config_dict(artifact)
    for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
        data["model"].pop(name, None)
    data["model"]["init_from"] = str(init)
    llama = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
             "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_act": "gelu"}  # fmt: skip
    for content, expected in [
        (b'{"architectures": [', f"{init / 'config.json'}: malformed JSON (Expecting value at line 1) (fix: restore the file)"),
        (b"\xff\xfe", f"{init / 'config.json'}: not UTF-8 text; expected a JSON object (fix: restore the file)"),
        (json.dumps(llama).encode(), f"model.init_from: {init}: config.json hidden_act='gelu' is not supported; csbp implements 'silu'"),
    ]:  # fmt: skip
        (init / "config.json").write_bytes(content)
        with pytest.raises(ValueError) as info:
            check_run(config_from_dict(data), check_device=False)
        assert str(info.value) == expected


def test_a_directory_of_artifacts_names_them(tmp_path: Path) -> None:
    """`data.train: artifacts` said to prepare data into artifacts/ itself."""
    first = fake_artifact(tmp_path / "artifacts" / "demo")
    fake_artifact(tmp_path / "artifacts" / "demo-4k-64")
    assert missing_artifact_problem(tmp_path / "artifacts", "data.train") == (
        f"data.train: {tmp_path / 'artifacts'} is a directory of artifacts, not one (demo, demo-4k-64) "
        f"(fix: set data.train: {first}, or the one you mean)"
    )


def test_a_config_in_a_subdirectory_names_the_init_from_checkpoint_under_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``model.init_from: hf-base`` in ``configs/run.yaml`` run from the directory holding ``hf-base``
    said "point it at a local directory with config.json"; ``data.train`` already named the path
    under the working directory."""
    import yaml

    from csbp.config import load_config

    artifact = make_artifact(tmp_path / "art")
    found = tmp_path / "hf-base"
    found.mkdir()
    (found / "config.json").write_text("{}", encoding="utf-8")
    data = config_dict(artifact)
    for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
        data["model"].pop(name, None)
    data["model"]["init_from"] = "hf-base"
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "run.yaml").write_text(yaml.safe_dump(data), encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    assert main(["config", "validate", str(tmp_path / "configs" / "run.yaml")]) == 0
    assert (f"note: model.init_from does not exist: {tmp_path / 'configs' / 'hf-base'} (but {found} is a HF "
            "checkpoint directory: relative paths resolve against the config file's directory)\n") in capsys.readouterr().out
    with pytest.raises(ValueError) as info:
        check_run(load_config(tmp_path / "configs" / "run.yaml"), check_device=False)
    assert str(info.value) == (
        f"model.init_from: {tmp_path / 'configs' / 'hf-base'} is not a HF checkpoint directory (no config.json) "
        f"(fix: {found} is a HF checkpoint directory (relative paths in a config file resolve against the file's "
        "directory): set model.init_from: " + str(found) + ")"
    )
