"""Config values keep their YAML type (no bool or quoted string read as a number, ``1e-3`` read as a
float), and each mistake is one error line: a misspelled section, an empty file, a directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from csbp.cli.main import main
from csbp.config import ConfigError, config_from_dict, load_config
from csbp.config.loading import read_yaml_text
from csbp.recipes import list_recipes, load_run_config

TINY = """\
run: {name: tiny, seed: 0}
model: {arch: qwen3, hidden_size: 32, intermediate_size: 64, num_layers: 2, num_heads: 2, num_kv_heads: 1, head_dim: 16}
data: {train: art, seq_len: 32}
objective: {name: bd3, block_size: 4}
topology: {dp: 1, cp: 1, bp: 1}
optim: {lr: 1.0e-3, warmup_steps: 2}
train: {max_steps: 6, micro_batch_size: 2}
"""


def tiny(tmp_path: Path, old: str = "", new: str = "") -> Path:
    """The tiny config file, with ``old`` replaced by ``new``."""
    assert old in TINY
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY.replace(old, new, 1), encoding="utf-8")
    return path


def error_lines(path: Path, *overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return info.value.lines


# ----------------------------------------------------------------------------- no silent coercion


@pytest.mark.parametrize(
    ("old", "new", "overrides", "line"),
    [
        ("", "", ["model.hidden_size=true"],
         "--set: model.hidden_size: expected int, got the boolean true (fix: set it to int: Residual stream width)"),
        # the bool used to become max_steps=1, and the error then blamed optim.warmup_steps
        ("", "", ["train.max_steps=true"],
         "--set: train.max_steps: expected int, got the boolean true (fix: set it to int: Optimizer steps)"),
        ("num_layers: 2", "num_layers: true", [],
         "{path}: model.num_layers: expected int, got the boolean true (fix: set it to int: Number of decoder layers)"),
        ("hidden_size: 32", 'hidden_size: "32"', [],
         "{path}: model.hidden_size: expected int, got the string '32' (fix: write 32 without quotes)"),
        ("lr: 1.0e-3", 'lr: "0.001"', [],
         "{path}: optim.lr: expected float, got the string '0.001' (fix: write 0.001 without quotes)"),
        ("lr: 1.0e-3", "lr: '1e-3'", [],  # quoted, it stays a string: only a plain 1e-3 is a float
         "{path}: optim.lr: expected float, got the string '1e-3' (fix: write 1e-3 without quotes)"),
        ("lr: 1.0e-3", "lr: false", [],
         "{path}: optim.lr: expected float, got the boolean false (fix: set it to float: Peak learning rate)"),
        ("", "", ["train.fsdp=1"],  # a bool field takes true or false only
         "--set: train.fsdp: expected true or false, got the number 1 "
         "(fix: set it to true or false: Shard parameters and optimizer state (FSDP2))"),
        ("", "", ['train.fsdp="true"'],
         "--set: train.fsdp: expected true or false, got the string 'true' (fix: write true without quotes)"),
        ("", "", ["optim.betas=[true, 0.9]"],
         "--set: optim.betas: expected float, got the boolean true at item [0] "
         "(fix: set it to float: AdamW (beta1, beta2))"),
        ("lr: 1.0e-3", "lr: 'nan'", [],  # a quoted nan is not offered as a number
         "{path}: optim.lr: expected float, got the string 'nan' (fix: set it to float: Peak learning rate)"),
    ],
    ids=["set-bool-int", "set-bool-max-steps", "yaml-bool-int", "quoted-int", "quoted-float", "quoted-exponent",
         "bool-float", "number-bool", "quoted-bool", "bool-list-item", "quoted-nan"],
)
def test_a_bool_or_string_for_a_number_is_one_error_line(
    tmp_path: Path, old: str, new: str, overrides: list[str], line: str
) -> None:
    path = tiny(tmp_path, old, new)
    assert error_lines(path, *overrides) == [line.format(path=path)]


@pytest.mark.parametrize(
    ("old", "new", "overrides", "lr"),
    [
        ("", "", [], 1e-3),
        ("lr: 1.0e-3", "lr: 1e-3", [], 1e-3),  # YAML 1.1 (PyYAML) reads 1e-3 as a string
        ("lr: 1.0e-3", "lr: 2E-4", [], 2e-4),
        ("lr: 1.0e-3", "lr: 1", [], 1.0),  # an int for a float field stays accepted
        ("", "", ["optim.lr=3e-4"], 3e-4),
        ("", "", ["optim.lr=1.0e-3"], 1e-3),
        ("", "", ["optim={lr: 5e-4}"], 5e-4),
    ],
    ids=["dotted", "exponent", "capital-exponent", "int", "set-exponent", "set-dotted", "set-mapping"],
)
def test_numbers_in_either_float_spelling_are_read_as_numbers(
    tmp_path: Path, old: str, new: str, overrides: list[str], lr: float
) -> None:
    cfg = load_config(tiny(tmp_path, old, new), overrides)
    assert type(cfg.optim.lr) is float and cfg.optim.lr == pytest.approx(lr, rel=1e-12)


def test_the_config_yaml_reads_exponent_floats_as_yaml_1_2_does() -> None:
    text = "a: 1e-3\nb: '1e-3'\nc: 1.0e3\nd: -2E+4\ne: .5e1\nf: 1_000\ng: 1e\nh: e3\ni: 12\n"
    assert read_yaml_text(text, source="t.yaml") == {
        "a": 1e-3, "b": "1e-3", "c": 1000.0, "d": -2e4, "e": 5.0, "f": 1000, "g": "1e", "h": "e3", "i": 12,
    }
    assert read_yaml_text("rope_theta: 1e6", source="t.yaml") == {"rope_theta": 1e6}
    assert type(read_yaml_text("x: 1e6", source="t.yaml")["x"]) is float


def test_the_config_yaml_reads_booleans_and_integers_as_yaml_1_2_does(capsys: pytest.CaptureFixture[str]) -> None:
    """YAML 1.1's yes/no/on/off booleans, leading-zero octal and base-60 integers are not taken."""
    text = ("a: yes\nb: off\nc: true\nd: FALSE\ne: 017\nf: 1:30\ng: 0x1F\nh: 0o17\ni: 0b101\nj: -1_000\n"
            "k: +5\nl: '017'\nm: 0\n")
    assert read_yaml_text(text, source="t.yaml") == {
        "a": "yes", "b": "off", "c": True, "d": False, "e": 17, "f": "1:30", "g": 31, "h": 15, "i": 5, "j": -1000,
        "k": 5, "l": "017", "m": 0,
    }
    assert main(["config", "validate", "demo", "--set", "train.fsdp=on"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("csbp: error: --set: train.fsdp: expected true or false, got the string 'on'")
    assert len(err.splitlines()) == 1
    assert main(["config", "validate", "demo", "--set", "run.seed=017", "--print"]) == 0
    assert "seed: 17" in capsys.readouterr().out


def test_a_mapping_from_plain_yaml_keeps_its_strings_refused() -> None:
    """``config_from_dict`` takes already-parsed data: a string there is a string, whoever parsed it."""
    data = load_run_config("demo").model_dump(mode="json")
    data["optim"]["lr"] = "1e-3"
    with pytest.raises(ConfigError) as info:
        config_from_dict(data, source="config.yaml")
    assert info.value.lines == [
        "config.yaml: optim.lr: expected float, got the string '1e-3' (fix: write 1e-3 without quotes)"
    ]


@pytest.mark.parametrize("name", list_recipes())
def test_every_recipe_validates_with_its_value_types(name: str) -> None:
    cfg = load_run_config(name)
    assert isinstance(cfg.optim.lr, float) and type(cfg.train.max_steps) is int


# ----------------------------------------------------------------------------- one line per mistake


def test_a_misspelled_section_is_one_line(tmp_path: Path) -> None:
    path = tiny(tmp_path, "model:", "Model:")
    assert error_lines(path) == [f"{path}: Model: unknown section; did you mean model? (fix: rename Model to model)"]


def test_a_misspelled_required_key_is_one_line(tmp_path: Path) -> None:
    path = tiny(tmp_path, "seq_len: 32", "seqlen: 32")
    assert error_lines(path) == [
        f"{path}: data.seqlen: unknown key; did you mean seq_len? (fix: rename seqlen to seq_len)"
    ]


def test_an_unknown_key_with_nothing_missing_keeps_its_own_line(tmp_path: Path) -> None:
    path = tiny(tmp_path, "train: {max_steps", "trainer: {}\ntrain: {max_steps")
    (line,) = error_lines(path)
    assert line.startswith(f"{path}: trainer: unknown key (fix: remove it; did you mean train?")


@pytest.mark.parametrize(
    ("override", "hint"),
    [
        ("train.warmup_steps=5", "did you mean optim.warmup_steps?"),  # it used to say max_steps
        ("train.lr=1e-3", "did you mean optim.lr?"),
        ("train.eps=1e-8", "did you mean objective.eps or optim.eps?"),
        ("model.dflash={}", "did you mean objective.dflash?"),
        ("optim.lrr=1e-3", "did you mean lr?"),  # a look-alike in its own section, as before
    ],
)
def test_a_key_put_in_the_wrong_section_names_the_section_that_has_it(
    tmp_path: Path, override: str, hint: str
) -> None:
    key = override.split("=")[0]
    assert error_lines(tiny(tmp_path), override) == [f"--set: {key}: unknown key (fix: remove it; {hint})"]
    section, field = key.split(".")
    path = tiny(tmp_path, f"{section}: {{", f"{section}: {{{field}: 1, ")  # the same in the file
    assert error_lines(path) == [f"{path}: {key}: unknown key (fix: remove it; {hint})"]


def test_a_flow_mapping_without_spaces_after_its_colons_says_so(tmp_path: Path) -> None:
    """YAML reads `--set topology={cp:1,bp:2}` as the keys 'cp:1' and 'bp:2'; the fix used to be a
    generic `e.g. --set optim.lr=3e-4`."""
    assert error_lines(tiny(tmp_path), "topology={cp:1,bp:2}") == [
        "--set topology: key 'cp:1' of the mapping is not a field name (fix: a space after each colon: {cp: 1})"
    ]
    assert error_lines(tiny(tmp_path), "topology={1: 2}") == [
        "--set topology: key 1 of the mapping is not a field name (fix: e.g. --set optim.lr=3e-4)"
    ]


@pytest.mark.parametrize("text", ["", "# only a comment\n", "{}\n"])
def test_an_empty_file_is_one_line(tmp_path: Path, text: str) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text(text, encoding="utf-8")
    assert error_lines(path) == [
        f"{path} is empty (fix: write the run config into it, or start from a recipe: "
        f"csbp recipes copy demo {path} --overwrite)"
    ]


# ----------------------------------------------------------------------------- a directory for a config


def test_a_directory_names_the_config_file_inside(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert main(["config", "validate", str(run_dir)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"csbp: error: {run_dir} is a directory, not a config file (fix: pass a YAML file")
    tiny(run_dir).rename(run_dir / "config.yaml")
    assert main(["config", "validate", str(run_dir)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        f"csbp: error: {run_dir} is a directory, not a config file (fix: pass the config inside it: "
        f"{run_dir / 'config.yaml'})"
    )


@pytest.mark.parametrize(
    ("where", "content", "said"),
    [
        ("art/manifest.json", {"format": "csbp-packed-tokens", "format_version": 1, "seq_len": 64, "tokenizer": {}},
         "a data artifact's manifest, not a run config (fix: name its directory in a run config, data.train: {dir}:"),
        ("feats/manifest.json", {"format": "csbp-dflash-features", "rows": 3},
         "a DFlash feature store's manifest, not a run config (fix: name its directory in a drafter's run config, "
         "objective.dflash.features: {dir}:"),
        ("run/final/config.json", {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 9},
         "a model's HF config.json, not a run config (fix: pass a run config"),
        ("run/checkpoints/step_0000002/trainer_state.json", {"format_version": 1, "step": 2, "config_yaml": "run: {}"},
         "a training checkpoint's state, not a run config (fix: continue its run: csbp train {run}/config.yaml "
         "--run-dir {run} --resume)"),
    ],
)
def test_a_json_file_csbp_wrote_is_named_for_what_it_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str, content: dict[str, object], said: str
) -> None:
    """``csbp train ART/manifest.json`` printed 18 lines: 5 missing sections and 13 unknown keys."""
    path = tmp_path / where
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(content), encoding="utf-8")
    assert main(["train", str(path)]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    expected = said.format(dir=path.parent, run=tmp_path / "run")
    assert line.startswith(f"csbp: error: {path} is {expected}"), line


def test_the_formats_it_recognises_are_those_csbp_writes() -> None:
    from csbp.config.other_files import DATA_MANIFEST_FORMAT, FEATURES_MANIFEST_FORMAT
    from csbp.data.artifact import FORMAT_NAME
    from csbp.dflash.features import FEATURES_FORMAT

    assert (DATA_MANIFEST_FORMAT, FEATURES_MANIFEST_FORMAT) == (FORMAT_NAME, FEATURES_FORMAT)


def test_a_recipe_name_wins_over_a_directory_of_that_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo").mkdir()
    assert load_run_config("demo").run.name == "demo"


def test_values_and_types_are_named_in_yaml_words(tmp_path: Path) -> None:
    """They read "got None", "got True", "Input should be a valid tuple" and "tuple[float, float]"."""
    path = tiny(tmp_path)
    assert error_lines(path, "objective.noise=", "optim.betas=null", "optim.lr=1e-3", "model.rope_scaling=true") == [
        "--set: model.rope_scaling: expected a section of `key: value` lines, got true (fix: indent its keys under it)",
        "--set: objective.noise: got null (fix: use 'rotated' or 'stratified')",
        "--set: optim.betas: expected a list, got null (fix: set it to [float, float]: AdamW (beta1, beta2))",
    ]


def test_an_unreadable_config_file_says_it_cannot_be_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A permission error fell through to the generic OS-error line, whose fix was about writing."""
    path = tiny(tmp_path)
    real_read_text = Path.read_text

    def denied(self: Path, *args: object, **kwargs: object) -> str:
        if self == path:
            raise PermissionError(13, "Permission denied", str(self))
        return real_read_text(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "read_text", denied)
    assert main(["config", "validate", str(path)]) == 2
    assert capsys.readouterr().err == (
        f"csbp: error: {path}: cannot be read: Permission denied (fix: check its permissions, e.g. ls -l {path})\n"
    )


@pytest.mark.parametrize(
    ("text", "got"), [("- run\n- model\n", "a list"), ("just words\n", "'just words'")], ids=["list", "scalar"]
)
def test_a_config_that_is_not_a_mapping_says_what_it_is_and_the_fix(tmp_path: Path, text: str, got: str) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(text, encoding="utf-8")
    (line,) = error_lines(path)
    assert line.startswith(f"{path}: the top level must be a mapping of sections (run:, model:, ...), got {got} (fix: ")


def test_a_utf16_config_is_told_to_be_saved_as_utf8(tmp_path: Path) -> None:
    """The fix said "pass a YAML file" to a YAML file saved as UTF-16."""
    path = tmp_path / "run.yaml"
    path.write_bytes(TINY.encode("utf-16"))
    assert error_lines(path) == [f"{path}: not UTF-8 text (fix: save it as UTF-8, or pass the YAML config file)"]


def test_a_fractional_int_says_got_once(tmp_path: Path) -> None:
    """It read "..., got a number with a fractional part, got 10.5"."""
    assert error_lines(tiny(tmp_path), "train.max_steps=10.5") == [
        "--set: train.max_steps: expected int, got 10.5 (fix: set it to int: Optimizer steps)"
    ]


def test_a_value_out_of_range_gets_a_fix_that_states_the_range(tmp_path: Path) -> None:
    """It said "(fix: set it to int: Optimizer steps)" to a -5, as if the type were wrong."""
    assert error_lines(tiny(tmp_path), "train.max_steps=-5") == [
        "--set: train.max_steps: must be > 0, got -5 (fix: set it to a value > 0 (Optimizer steps))"
    ]
    # a seed past 2^64 validated, then failed in torch.manual_seed after the launch ("Overflow when unpacking")
    (line,) = error_lines(tiny(tmp_path), "run.seed=99999999999999999999")
    assert line.startswith("--set: run.seed: must be <= 9223372036854775807, got 99999999999999999999 (fix: ")
    assert load_config(tiny(tmp_path), [f"run.seed={2**63 - 1}"]).run.seed == 2**63 - 1


def test_a_rule_error_names_only_the_overrides_it_is_about(tmp_path: Path) -> None:
    """A rule across fields listed every --set key of the command line in its prefix ("with --set data.seq_len,
    optim.lr, train.max_steps, ..."): now only those the message names."""
    path = tiny(tmp_path)
    assert error_lines(path, "data.seq_len=64", "optim.lr=2e-3", "train.max_steps=1") == [
        f"{path} with --set train.max_steps: optim.warmup_steps: warmup_steps=2 exceeds train.max_steps=1 "
        "(fix: lower warmup_steps)"
    ]


def test_a_field_to_drop_can_be_dropped_from_the_command_line(tmp_path: Path) -> None:
    """``--set objective='{name: ar}'`` on a bd3 config said "remove objective.block_size", which --set cannot."""
    (line,) = error_lines(tiny(tmp_path), "objective.name=ar")
    assert "ar has no diffusion blocks" in line and "--set objective.block_size=null" in line, line


def test_a_key_missing_from_a_section_set_made_names_the_set(tmp_path: Path) -> None:
    """``--set model.rope_scaling.factor=2`` creates the section without its required ``type``: the line
    blamed the config file alone, which has no rope_scaling at all."""
    path = tiny(tmp_path)
    (line,) = error_lines(path, "model.rope_scaling.factor=2")
    assert line.startswith(f"{path} with --set model.rope_scaling.factor: model.rope_scaling.type: required key"), line
