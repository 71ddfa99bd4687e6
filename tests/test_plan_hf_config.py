"""``csbp plan --model config.json``: a Hugging Face config the planner cannot read as a decoder fails
in one line naming the file, the field and the fix.

The planner's reader (torch-free, so not csbp's HF importer) took ``int()`` of every size: 0 heads
crashed with a ZeroDivisionError traceback, ``"abc"`` failed without naming the file or field, -3
layers or a vocabulary of 1.5 planned a model of negative or truncated size, 12 query heads over 5
K/V heads (no whole groups) were planned although csbp refuses that model, and ``"false"`` tied the
embeddings.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from csbp.cli.main import USER_ERROR_EXIT_CODE, main

CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 1536,
    "intermediate_size": 4096,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 3,
    "head_dim": 128,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
}


def plan(capsys: pytest.CaptureFixture[str], path: Path) -> tuple[int, str, str]:
    code = main(["plan", "--model", str(path), "--seq-len", "64K", "--gpus", "8", "--gpu", "h100"])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_attention_heads": 0, "head_dim": None}, "num_attention_heads must be a positive integer, got 0"),
        ({"hidden_size": "abc"}, "hidden_size must be a positive integer, got 'abc' (fix: the model's hidden_size)"),
        ({"num_hidden_layers": -3}, "num_hidden_layers must be a positive integer, got -3"),
        ({"vocab_size": 1.5}, "vocab_size must be a positive integer, got 1.5"),
        ({"num_key_value_heads": True}, "num_key_value_heads must be a positive integer, got True"),
        (
            {"num_key_value_heads": 5},
            "num_attention_heads=12 is not a multiple of num_key_value_heads=5 (fix: a num_key_value_heads that divides",
        ),
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, got 'false'"),
        ({"use_sliding_window": True, "max_window_layers": 0, "sliding_window": 0},
         "sliding_window must be a positive integer, got 0"),
        ({"use_sliding_window": True, "max_window_layers": -1}, "max_window_layers must be an integer >= 0, got -1"),
        ({"layer_types": ["full_attention"]}, "layer_types must list num_hidden_layers="),
        ({"intermediate_size": None}, "missing field 'intermediate_size'"),
    ],
)
def test_a_bad_field_is_one_line_naming_the_file(tmp_path: Path, capsys, change, message) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CONFIG, **change}))
    code, out, err = plan(capsys, path)
    assert code == USER_ERROR_EXIT_CODE and out == ""
    assert f"{path}: {message}" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize(("text", "message"), [("not json", "not valid JSON"), ("[1, 2]", "a Hugging Face config.json is a JSON object, got list")])
def test_a_file_that_is_no_json_object_is_one_line(tmp_path: Path, capsys, text, message) -> None:
    path = tmp_path / "config.json"
    path.write_text(text)
    code, out, err = plan(capsys, path)
    assert code == USER_ERROR_EXIT_CODE and f"{path}: {message}" in err and len(err.strip().splitlines()) == 1


def test_a_valid_config_plans_its_shape(tmp_path: Path, capsys) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CONFIG, "num_key_value_heads": None}))  # absent K/V heads: one per query head
    code, out, _ = plan(capsys, path)
    # 12 layers x (q, k, v, o at 12 heads x 128 + SwiGLU 3 x 1536 x 4096 + 2 norms) + 2 x 32000 x 1536 embeddings
    layer = 1536 * 36 * 128 + 12 * 128 * 1536 + 3 * 1536 * 4096 + 2 * 1536
    assert code == 0 and f"({(12 * layer + 2 * 32000 * 1536) / 1e6:.2f}M params" in out


def test_a_csbp_export_is_planned_with_the_objective_block_and_window_it_trained_with(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``csbp plan --model RUN/final`` printed "bd3, block 32" for a model its config.json records as trained
    with blocks of 4 (``csbp_training``)."""
    record = {"objective": {"name": "fast_dllm_v2", "block_size": 16}, "topology": {"window": 512}}
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CONFIG, "csbp_training": record}), encoding="utf-8")
    code, out, err = plan(capsys, path)
    assert (code, err) == (0, "") and "fast_dllm_v2, block 16)" in out.splitlines()[0], out
    from csbp.plan.workload import hf_workload

    workload = hf_workload(path)
    assert workload.model.groups[0].window == 512
    assert hf_workload(path, objective="bd3").objective.block == 32  # another objective: not its block size
    path.write_text(json.dumps(CONFIG), encoding="utf-8")
    assert "bd3, block 32)" in plan(capsys, path)[1].splitlines()[0]  # no record: the defaults


def test_a_fast_dllm_v2_release_is_planned_as_fast_dllm_v2_at_its_bd_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Fast-dLLM v2 release (``csbp.models.hf_release``) records no ``csbp_training``; its ``bd_size`` is
    the block size it trained with, and it was planned as bd3 with blocks of 32 whatever that was."""
    path = tmp_path / "config.json"
    release = {"model_type": "Fast_dLLM_Qwen", "architectures": ["Fast_dLLM_QwenForCausalLM"], "bd_size": 16}
    path.write_text(json.dumps({**CONFIG, **release}), encoding="utf-8")
    code, out, err = plan(capsys, path)
    assert (code, err) == (0, "") and "fast_dllm_v2, block 16)" in out.splitlines()[0], out


@pytest.mark.parametrize("topology", [[512], "window: 512", 3])
def test_a_record_whose_topology_is_no_mapping_plans_without_a_window(tmp_path: Path, capsys, topology) -> None:
    """``(trained.get("topology") or {}).get("window")`` raised AttributeError (a traceback) on such a record."""
    path = tmp_path / "config.json"
    record = {"objective": {"name": "bd3", "block_size": 16}, "topology": topology}
    path.write_text(json.dumps({**CONFIG, "csbp_training": record}), encoding="utf-8")
    code, out, err = plan(capsys, path)
    assert (code, err) == (0, "") and "bd3, block 16)" in out.splitlines()[0], err


@pytest.mark.parametrize(
    ("record", "config", "planned"),
    [
        ({"objective": {"name": "mdlm", "block_size": None}}, {}, ("mdlm", 32, 0)),  # was planned as bd3
        ({"objective": {"name": "bd3", "block_size": True}}, {}, ("bd3", 32, 0)),  # true is no block size (not 1)
        (  # the config's own sliding window is the model's; the trained window only fills in a full-attention one
            {"objective": {"name": "bd3", "block_size": 8}, "topology": {"window": 512}},
            {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0},
            ("bd3", 8, 64),
        ),
    ],
)
def test_a_csbp_export_record_is_read_as_the_run_wrote_it(tmp_path: Path, record, config, planned) -> None:
    """``csbp_training`` as ``csbp.generation.run_settings.training_record_of`` writes it."""
    from csbp.plan.workload import hf_workload

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**CONFIG, **config, "csbp_training": record}), encoding="utf-8")
    workload = hf_workload(path)
    assert (workload.objective.name, workload.objective.block, workload.model.groups[0].window) == planned


@pytest.mark.parametrize(
    ("config", "groups"),
    [
        ({}, [(4, 0)]),
        ({"use_sliding_window": True, "sliding_window": 64}, [(4, 0)]),  # max_window_layers 28 >= 4 layers
        ({"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1}, [(1, 0), (3, 64)]),
        ({"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0}, [(4, 64)]),
        ({"use_sliding_window": True, "max_window_layers": 2}, [(2, 0), (2, 4096)]),  # transformers' default size
        ({"sliding_window": 64, "layer_types": ["full_attention", "sliding_attention"] * 2}, [(2, 0), (2, 64)]),
    ],
)
def test_only_the_layers_transformers_slides_are_planned_with_a_window(tmp_path: Path, config, groups) -> None:
    """It windowed every layer under use_sliding_window; transformers (and csbp's importer) slide only
    layers i >= max_window_layers, or those layer_types names: a Qwen config was under-priced."""
    from transformers import Qwen2Config

    from csbp.models.hf_families import QWEN_DEFAULT_MAX_WINDOW_LAYERS
    from csbp.plan.workload import QWEN_DEFAULT_MAX_WINDOW_LAYERS as PLANNED_DEFAULT
    from csbp.plan.workload import hf_workload

    assert PLANNED_DEFAULT == QWEN_DEFAULT_MAX_WINDOW_LAYERS
    base = {**CONFIG, "num_hidden_layers": 4}
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**base, **config}), encoding="utf-8")
    planned = hf_workload(path).model.groups
    assert [(g.count, g.window) for g in planned] == groups
    reference = Qwen2Config(**{k: v for k, v in {**base, **config}.items() if not k.startswith("_")})
    sliding = sum(kind == "sliding_attention" for kind in reference.layer_types)
    assert sum(g.count for g in planned if g.window) == sliding  # what transformers builds


@pytest.mark.parametrize(
    ("fields", "kv_heads", "window"),
    [
        ({}, 8, 4096),  # MistralConfig: 8 K/V heads and a 4096-token window on every layer when absent
        ({"sliding_window": None, "num_key_value_heads": 4}, 4, 0),  # null: every layer attends fully
        ({"sliding_window": 32768}, 8, 32768),
    ],
)
def test_a_mistral_config_is_planned_as_transformers_reads_it(tmp_path: Path, fields: dict, kv_heads: int, window: int) -> None:
    """Read as a Qwen config, an absent window meant full attention and absent K/V heads the query heads."""
    from csbp.plan.workload import hf_workload

    config = {key: value for key, value in CONFIG.items() if key not in ("num_key_value_heads", "head_dim")}
    path = tmp_path / "config.json"
    mistral = {**config, "num_attention_heads": 16, "model_type": "mistral", "architectures": ["MistralForCausalLM"]}
    # without model_type the importer knows the family by its architectures alone: so does the planner
    unnamed = {key: value for key, value in mistral.items() if key != "model_type"}
    for read in (mistral, unnamed):
        path.write_text(json.dumps({**read, **fields}))
        (group,) = hf_workload(path).model.groups
        assert (group.count, group.n_kv_heads, group.window, group.head_dim) == (12, kv_heads, window, 96)


def test_a_release_with_a_bad_bd_size_is_refused_as_generate_refuses_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``bd_size: "16"`` was planned as block 32 without a word, while generate and eval refuse it."""
    path = tmp_path / "config.json"
    release = {"model_type": "Fast_dLLM_Qwen", "architectures": ["Fast_dLLM_QwenForCausalLM"], "bd_size": "16"}
    path.write_text(json.dumps({**CONFIG, **release}), encoding="utf-8")
    code, out, err = plan(capsys, path)
    assert code == 2 and f"{path} bd_size is '16'" in err, (code, out, err)
