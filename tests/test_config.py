"""Run config: unknown keys, topology and cross-section rules, overrides, paths,
and the one-line error format."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from csbp.config import (
    ConfigError,
    ConfigRuleError,
    RunConfig,
    config_from_dict,
    dump_config,
    load_config,
    write_config,
)
from csbp.recipes import load_run_config, recipe_path


def demo_dict() -> dict[str, Any]:
    """The demo recipe on the cp=2 x bp=4, block-16, 256-token layout and ``artifacts/demo`` data the rule
    tests below are written for (the recipe itself runs cp=2 x bp=2, blocks of 4, 64-token rows on
    ``artifacts/demo-4k-64``)."""
    data = yaml.safe_load(recipe_path("demo").read_text(encoding="utf-8"))
    data["data"]["train"] = "artifacts/demo"
    data["data"]["seq_len"] = 256
    data["topology"]["bp"] = 4
    data["objective"]["block_size"] = 16
    return data


def with_changes(changes: dict[str, Any], base: dict[str, Any] | None = None) -> dict[str, Any]:
    """``base`` (default: the demo recipe) with dotted keys set; a value of ``...`` deletes the key."""
    data = copy.deepcopy(base if base is not None else demo_dict())
    for dotted, value in changes.items():
        *parents, last = dotted.split(".")
        node = data
        for key in parents:
            node = node.setdefault(key, {})
        if value is ...:
            node.pop(last, None)
        else:
            node[last] = value
    return data


def error_lines(data: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        config_from_dict(data, source="config.yaml")
    assert str(info.value) == "\n".join(info.value.lines)
    return info.value.lines


def write_yaml(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- unknown keys and types


def test_unknown_key_is_one_line_with_the_dotted_name_and_a_suggestion() -> None:
    lines = error_lines(with_changes({"model.hiden_size": 64}))
    assert lines == ["config.yaml: model.hiden_size: unknown key (fix: remove it; did you mean hidden_size?)"]


def test_a_key_given_twice_is_refused(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "run.yaml", demo_dict())
    with path.open("a", encoding="utf-8") as handle:
        handle.write("train:\n  max_steps: 5\n")  # a second train: would silently replace the first
    with pytest.raises(ConfigError) as info:
        load_config(path)
    (line,) = info.value.lines
    assert re.fullmatch(r".*run\.yaml: invalid YAML: line \d+: duplicate key 'train' \(first on line \d+; fix: merge the two\)", line)


def test_unknown_section_is_rejected() -> None:
    (line,) = error_lines(with_changes({"trainer.max_steps": 5}))
    assert line.startswith("config.yaml: trainer: unknown key (fix: remove it;")


def test_missing_required_key_names_the_field() -> None:
    (line,) = error_lines(with_changes({"optim.lr": ...}))
    assert line == "config.yaml: optim.lr: required key is missing (fix: add optim.lr: Peak learning rate.)"


def test_wrong_type_and_bad_literal() -> None:
    lines = error_lines(with_changes({"train.max_steps": "many", "model.arch": "gpt2"}))
    assert len(lines) == 2
    assert lines[0] == "config.yaml: model.arch: got 'gpt2' (fix: use 'qwen3', 'llama', 'qwen2' or 'mistral')"
    assert lines[1] == "config.yaml: train.max_steps: expected int, got the string 'many' (fix: set it to int: Optimizer steps)"


def test_every_problem_gets_its_own_line() -> None:
    lines = error_lines(with_changes({"model.foo": 1, "optim.bar": 2, "train.max_steps": 0}))
    assert len(lines) == 3
    assert all(line.startswith("config.yaml: ") and "\n" not in line for line in lines)


# ----------------------------------------------------------------------------- topology


def test_invalid_fused_topology_is_rejected_with_a_clear_line() -> None:
    (line,) = error_lines(with_changes({"topology.cp": 3, "topology.bp": 4}))
    assert line.startswith("config.yaml: topology.bp: cp: 3 with bp: 4 is not a fused CSBP layout")
    assert "multiple of cp" in line and "(fix: accepted layouts:" in line


@pytest.mark.parametrize(
    ("cp", "bp", "replicate", "ok"),
    [
        (1, 1, False, True),  # data
        (4, 1, False, True),  # CP-only
        (1, 4, True, True),  # BP-only with the opt-in
        (1, 4, False, False),  # BP-only without the opt-in
        (2, 4, False, True),  # fused, two rings
        (4, 4, False, True),  # fused, one ring
        (4, 2, False, False),  # bp < cp
        (2, 2, True, False),  # replication outside BP-only
    ],
)
def test_topology_layouts(cp: int, bp: int, replicate: bool, ok: bool) -> None:
    changes = {"topology.cp": cp, "topology.bp": bp, "topology.replicate_clean_prefix": replicate}
    data = with_changes(changes | {"data.seq_len": 512, "objective.block_size": 16})
    if ok:
        assert config_from_dict(data).topology.bp == bp
    else:
        (line,) = error_lines(data)
        assert line.startswith(("config.yaml: topology.bp:", "config.yaml: topology.replicate_clean_prefix:"))
        # YAML words, not the Python Topology's ("set replicate_clean_prefix=True", "Topology(cp=1, bp=4)")
        assert "Topology" not in line and "=True" not in line and "=False" not in line, line
        if replicate != (cp == 1 and bp > 1):
            assert f"set replicate_clean_prefix: {str(not replicate).lower()}" in line, line


def test_streaming_transport_needs_a_ring() -> None:
    (line,) = error_lines(
        with_changes({"topology.cp": 1, "topology.bp": 1, "topology.transport": "streaming"})
    )
    assert line.startswith("config.yaml: topology.transport: streaming needs a CP ring")


# ----------------------------------------------------------------------------- cross-section rules


@pytest.mark.parametrize(
    ("changes", "field", "fragment"),
    [
        ({"data.seq_len": 250}, "data.seq_len", "not a multiple of block_size=16"),
        ({"data.seq_len": 64, "objective.block_size": 32}, "data.seq_len", "fewer than bp=4"),
        ({"data.seq_len": 96}, "data.seq_len", "2*cp*block_size"),
        ({"objective.block_size": 256}, "objective.block_size", "must be below data.seq_len=256"),
        ({"objective.name": "fast_dllm_v2", "objective.block_size": 512}, "objective.block_size", "below"),
        (
            {"objective.name": "mdlm", "objective.block_size": 16, "topology.bp": 1, "topology.cp": 1},
            "objective.block_size",
            "one block per sequence",
        ),
        ({"objective.name": "mdlm", "objective.block_size": ...}, "topology", "mdlm is a single stream"),
        (
            {"objective.name": "mdlm", "objective.block_size": ..., "topology.bp": 1},
            "topology",
            "got cp=2, bp=1",
        ),
        (
            {"objective.name": "ar", "objective.block_size": ..., "objective.loss_weight": ...},
            "topology",
            "ar is a single stream",
        ),
        (
            {"objective.name": "ar", "objective.loss_weight": "unit", "topology.bp": 1, "topology.cp": 1},
            "objective.block_size",
            "ar has no diffusion blocks",
        ),
        (
            {"objective.name": "ar", "objective.block_size": ..., "topology.bp": 1},
            "objective.loss_weight",
            "no noise level",
        ),
        ({"objective.name": "bd3", "objective.block_size": ...}, "objective.block_size", "required for"),
        ({"objective.name": "dflash", "objective.loss_weight": ...}, "objective.dflash", "required when"),
        ({"objective.dflash.target": "t"}, "objective.dflash", "has no effect for objective bd3"),
        ({"objective.t_min": 0.5, "objective.t_max": 0.4}, "objective.t_min", "must be below t_max"),
        ({"model.vocab_size": 100, "objective.mask_token_id": 100}, "objective.mask_token_id", "outside"),
        ({"train.precision": "fp64"}, "train.precision", "does not match model.dtype=float32"),
        ({"model.dtype": "float64"}, "train.precision", "precision=fp32 does not match"),
        ({"train.nproc": 3}, "train.nproc", "does not divide the world size"),
        ({"optim.warmup_steps": 1000}, "optim.warmup_steps", "exceeds train.max_steps"),
        ({"model.num_kv_heads": 3}, "model.num_kv_heads", "not a multiple of num_kv_heads=3"),
        ({"model.head_dim": 31}, "model.head_dim", "is odd"),
        ({"optim.betas": [0.9, 1.0]}, "optim.betas", "must lie in [0, 1)"),
        ({"train.fsdp": True}, "train.fsdp", "which has 1 rank here (topology.dp=1)"),
    ],
)
def test_cross_section_rules(changes: dict[str, Any], field: str, fragment: str) -> None:
    (line,) = error_lines(with_changes(changes))
    assert line.startswith(f"config.yaml: {field}: "), line
    assert fragment in line


def test_mdlm_and_ar_run_data_parallel() -> None:
    mdlm = config_from_dict(
        with_changes({"objective.name": "mdlm", "objective.block_size": ..., "topology.bp": 1, "topology.cp": 1,
                      "topology.dp": 4})
    )
    assert (mdlm.objective.block_size, mdlm.topology.dp) == (256, 4)
    ar = with_changes(
        {"objective.name": "ar", "objective.block_size": ..., "objective.loss_weight": ..., "topology.bp": 1,
         "topology.cp": 1}
    )
    cfg = config_from_dict(ar)
    assert (cfg.objective.block_size, cfg.objective.loss_weight) == (None, "unit")


def dflash_changes() -> dict[str, Any]:
    """Changes turning the demo recipe into a dflash run (a fresh dict each call)."""
    return {
        "objective.name": "dflash",
        "objective.loss_weight": ...,
        "objective.dflash.target": "/models/t",
        "model": {"dtype": "float32"},  # the drafter's shape comes from the target
    }


def test_model_shapes_are_required_unless_init_from() -> None:
    lines = error_lines(with_changes({"model.hidden_size": ..., "model.head_dim": ...}))
    assert lines == [
        "config.yaml: model.hidden_size: required when model.init_from is unset "
        "(fix: set model.hidden_size or model.init_from)",
        "config.yaml: model.head_dim: required when model.init_from is unset "
        "(fix: set model.head_dim or model.init_from)",
    ]
    shapes = ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
    data = with_changes({f"model.{name}": ... for name in shapes} | {"model.init_from": "/ckpt"})
    model = config_from_dict(data).model
    assert model.hidden_size is None and model.rope_theta is None  # read from the checkpoint later


def test_llama_arch_defaults() -> None:
    model = config_from_dict(with_changes({"model.arch": "llama"})).model
    assert (model.rope_theta, model.rms_norm_eps, model.qk_norm, model.tie_embeddings) == (
        5e5,
        1e-5,
        False,
        False,
    )
    explicit = config_from_dict(with_changes({"model.arch": "llama", "model.rope_theta": 1e4})).model
    assert explicit.rope_theta == 1e4


def test_config_is_frozen_and_rule_error_formats() -> None:
    cfg = config_from_dict(demo_dict())
    with pytest.raises(ValueError, match="frozen"):
        cfg.optim.lr = 1.0  # type: ignore[misc]
    err = ConfigRuleError([("a.b", "is wrong", "set it right"), ("", "whole thing", "")])
    assert str(err) == "a.b: is wrong (fix: set it right); whole thing"


# ----------------------------------------------------------------------------- overrides and paths


def test_overrides_use_yaml_scalar_semantics(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "run.yaml", demo_dict())
    cfg = load_config(
        path,
        [
            "optim.lr=3e-4",
            "optim.betas=[0.8, 0.99]",
            "train.fsdp=true",
            "optim.grad_clip=null",
            "topology.dp=2",
            "run.name=override run",
            "objective.t_min=0.01",
        ],
    )
    assert cfg.optim.lr == pytest.approx(3e-4, rel=0, abs=1e-15)
    assert cfg.optim.betas == (0.8, 0.99)
    assert cfg.train.fsdp is True and cfg.optim.grad_clip is None
    assert (cfg.topology.dp, cfg.world_size, cfg.run.name) == (2, 8, "override run")
    assert cfg.objective.t_min == 0.01


def test_nested_override_creates_the_section(tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path / "run.yaml",
        with_changes({"objective.name": "dflash", "objective.loss_weight": ..., "model": {"dtype": "float32"}}),
    )
    cfg = load_config(path, ["objective.dflash.target=targets/qwen", "objective.dflash.max_anchors=64"])
    assert cfg.objective.dflash is not None
    assert cfg.objective.dflash.max_anchors == 64
    assert cfg.objective.dflash.target == str(Path.cwd() / "targets" / "qwen")  # --set paths: cwd


def test_mapping_override_merges_into_the_section_like_dotted_keys(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "run.yaml", demo_dict())  # topology: cp=2, bp=4 among others
    file_cfg = load_config(path)
    merged = load_config(path, ["topology={dp: 2, bp: 4}"])
    dotted = load_config(path, ["topology.dp=2", "topology.bp=4"])
    assert merged.topology == dotted.topology
    assert merged.topology.cp == file_cfg.topology.cp and merged.topology.dp == 2
    assert merged.topology.model_dump(exclude={"dp"}) == file_cfg.topology.model_dump(exclude={"dp"})
    nested = load_config(path, ["optim={lr: 0.001, betas: [0.8, 0.99]}"])
    assert (nested.optim.lr, nested.optim.betas, nested.optim.weight_decay) == (
        0.001, (0.8, 0.99), file_cfg.optim.weight_decay,
    )
    with pytest.raises(ConfigError) as info:  # an error inside the mapping is the override's
        load_config(path, ["optim={lrr: 1}"])
    assert info.value.lines == ["--set: optim.lrr: unknown key (fix: remove it; did you mean lr?)"]
    with pytest.raises(ConfigError, match="not a field name"):
        load_config(path, ["optim={1: 2}"])


def test_override_of_an_unknown_key_is_attributed_to_set(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "run.yaml", demo_dict())  # bp=4
    with pytest.raises(ConfigError) as info:
        load_config(path, ["optim.lrr=1e-3"])
    assert info.value.lines == ["--set: optim.lrr: unknown key (fix: remove it; did you mean lr?)"]
    with pytest.raises(ConfigError) as info:
        load_config(path, ["topology.cp=3"])
    (line,) = info.value.lines
    assert line.startswith(f"{path} with --set topology.cp: topology.bp: cp: 3 with bp: 4 is not a fused")


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("optim.lr", "expected KEY=VALUE"),
        ("=3", "expected KEY=VALUE"),
        ("optim..lr=3", "expected KEY=VALUE"),
        ("optim.lr.value=3", "optim.lr is a value, not a section"),
        ("optim.lr=[1, 2", "is not valid YAML"),
    ],
)
def test_malformed_overrides(tmp_path: Path, override: str, fragment: str) -> None:
    path = write_yaml(tmp_path / "run.yaml", demo_dict())
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[")):
        load_config(path, [override])


def test_relative_paths_resolve_against_the_config_directory(tmp_path: Path, monkeypatch) -> None:
    data = with_changes(
        {"data.val": "../shared/val", "data.tokenizer": "~/tok.json", "run.run_dir": "/abs/run"}
    )
    (tmp_path / "configs").mkdir()
    path = write_yaml(tmp_path / "configs" / "run.yaml", data)
    monkeypatch.chdir(tmp_path)
    cfg = load_config(path, ["model.init_from=ckpt"])
    assert cfg.data.train == str(tmp_path / "configs" / "artifacts" / "demo")
    assert cfg.data.val == str(tmp_path / "shared" / "val")
    assert cfg.data.tokenizer == str(Path("~/tok.json").expanduser())
    assert cfg.run.run_dir == "/abs/run"
    assert cfg.model.init_from == str(tmp_path / "ckpt")  # --set: against the working directory
    assert load_config(path, relative_to=tmp_path / "elsewhere").data.train == str(
        tmp_path / "elsewhere" / "artifacts" / "demo"
    )


def test_file_level_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run:\n  name: [unclosed\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"bad.yaml: invalid YAML: line \d+"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(scalar)
    empty = tmp_path / "empty.yaml"
    empty.write_text("", encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(empty)
    assert info.value.lines == [  # one line, not one "required section is missing" per section
        f"{empty} is empty (fix: write the run config into it, or start from a recipe: "
        f"csbp recipes copy demo {empty} --overwrite)"
    ]
    lines = error_lines({"train": {"max_steps": 1}})  # a missing section names the keys it needs
    assert "config.yaml: run: required section is missing (fix: add the `run:` section with at least name)" in lines
    assert "config.yaml: optim: required section is missing (fix: add the `optim:` section with at least lr)" in lines


def test_dump_config_writes_every_default(tmp_path: Path) -> None:
    cfg = load_run_config("demo")
    text = dump_config(cfg)
    assert text.startswith("# csbp run config")
    dumped = yaml.safe_load(text)
    assert set(dumped) == {"run", "model", "data", "objective", "topology", "attention", "optim", "train"}
    assert dumped["attention"]["backend"] == "auto"
    assert dumped["optim"]["betas"] == [0.9, 0.95]
    assert dumped["train"]["collective_timeout_s"] == 300.0
    assert "betas: [0.9, 0.95]" in text  # short lists stay on one line
    assert load_config(write_config(cfg, tmp_path)) == cfg


def test_short_list_and_non_mapping_section(tmp_path: Path) -> None:
    lines = error_lines(with_changes({"optim.betas": [0.9], "topology": 4}))
    assert lines == [
        "config.yaml: topology: expected a section of `key: value` lines, got 4 (fix: indent its keys under it)",
        "config.yaml: optim.betas: item [1] is missing (fix: set it to [float, float])",
    ]


def test_rule_error_on_a_section_set_from_the_command_line(tmp_path: Path) -> None:
    path = write_yaml(tmp_path / "run.yaml", demo_dict())
    with pytest.raises(ConfigError) as info:
        load_config(path, ["objective.dflash.target=/models/t"])
    assert info.value.lines == [
        "--set: objective.dflash: has no effect for objective bd3 (fix: remove objective.dflash)"
    ]


def test_a_plain_value_error_in_a_rule_still_gives_one_line(monkeypatch) -> None:
    def broken_rule(cfg: RunConfig) -> list:
        raise ValueError("rule crashed on purpose")

    monkeypatch.setattr("csbp.config.schema.cross_section_violations", broken_rule)
    assert error_lines(demo_dict()) == ["config.yaml: rule crashed on purpose"]


def test_attention_backend_is_validated() -> None:
    assert load_run_config("demo").attention.backend == "auto"
    lines = error_lines(with_changes({"attention.backend": "triton"}))
    assert len(lines) == 1 and lines[0].startswith("config.yaml: attention.backend:")


def test_attention_diagonal_is_validated_with_its_backend() -> None:
    assert load_run_config("demo").attention.diagonal == "auto"
    for diagonal, backend in [("sdpa", "tiles"), ("sdpa_fold", "flex"), ("matmul", "auto"), ("flex", "flex"),
                              ("flex", "auto")]:  # flex with auto: flex on CUDA; training on CPU refuses it
        cfg = config_from_dict(with_changes({"attention.diagonal": diagonal, "attention.backend": backend}))
        assert (cfg.attention.diagonal, cfg.attention.backend) == (diagonal, backend)
    lines = error_lines(with_changes({"attention.diagonal": "fast"}))
    assert len(lines) == 1 and lines[0].startswith("config.yaml: attention.diagonal:")
    lines = error_lines(with_changes({"attention.diagonal": "flex", "attention.backend": "tiles"}))
    assert lines == [
        "config.yaml: attention.diagonal: diagonal=flex needs attention.backend flex (or auto on CUDA), got tiles; "
        "use diagonal auto, matmul, sdpa or sdpa_fold with tiles"
    ]
