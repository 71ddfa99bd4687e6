"""Packaged recipes: listed, loadable, round-tripping, the demo's layout, copies that resolve their
paths next to themselves, and the suggestion for an unknown name."""

from __future__ import annotations

from pathlib import Path

import pytest

from csbp.config import RunConfig, load_config, write_config
from csbp.recipes import copy_recipe, list_recipes, load_run_config, recipe_path


def test_packaged_recipes_are_listed() -> None:
    assert {"demo", "fast-dllm-v2-demo", "mdlm-demo"} <= set(list_recipes())


@pytest.mark.parametrize("name", list_recipes())
def test_every_packaged_recipe_loads_and_round_trips(name: str, tmp_path: Path) -> None:
    cfg = load_run_config(name)
    assert isinstance(cfg, RunConfig)
    assert cfg.world_size == (2 if name == "demo" else 4), "the demo recipes run on 2 or 4 CPU processes"
    artifact = "demo-4k-64" if name == "demo" else "demo"
    assert cfg.data.train == str(Path.cwd() / "artifacts" / artifact)  # by name: relative to cwd
    reloaded = load_config(write_config(cfg, tmp_path / "run"))
    assert reloaded == cfg


def test_demo_recipe_layout() -> None:
    cfg = load_run_config("demo")
    assert (cfg.objective.name, cfg.objective.block_size, cfg.data.seq_len) == ("bd3", 4, 64)
    assert (cfg.topology.dp, cfg.topology.cp, cfg.topology.bp) == (1, 2, 2)
    assert cfg.topology.to_topology().layout == "csbp"
    assert cfg.model.rope_theta == 1e6 and cfg.model.qk_norm is True  # qwen3 defaults filled in
    assert cfg.objective.loss_weight == "inv_t"


def test_recipe_variants_fill_objective_defaults() -> None:
    fast = load_run_config("fast-dllm-v2-demo")
    assert (fast.objective.name, fast.objective.loss_weight) == ("fast_dllm_v2", "unit")
    mdlm = load_run_config("mdlm-demo")
    assert mdlm.objective.name == "mdlm"
    assert mdlm.objective.block_size == mdlm.data.seq_len  # unset block size means B = L
    assert mdlm.topology.bp == 1


def test_copied_recipe_resolves_paths_next_to_itself(tmp_path: Path) -> None:
    target = copy_recipe("demo", tmp_path)
    assert target == tmp_path / "demo.yaml"
    assert load_config(target).data.train == str(tmp_path / "artifacts" / "demo-4k-64")
    with pytest.raises(ValueError, match="already exists"):
        copy_recipe("demo", tmp_path)
    assert copy_recipe("demo", tmp_path / "sub" / "mine.yaml").name == "mine.yaml"


def test_unknown_recipe_suggests_the_closest_name() -> None:
    with pytest.raises(ValueError, match="did you mean demo"):
        recipe_path("dem")
    with pytest.raises(FileNotFoundError, match="no config file or recipe"):
        load_run_config("no-such-recipe-or-file")
