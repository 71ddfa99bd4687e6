"""``csbp config fields`` and docs/config.md: the field reference generated from the schema."""

from __future__ import annotations

from pathlib import Path

import pytest

from csbp.cli.main import main
from csbp.config.reference import field_rows, format_markdown, select
from csbp.recipes import load_run_config

ROOT = Path(__file__).resolve().parents[1]


def test_every_field_is_listed_with_a_description_and_a_real_default() -> None:
    rows = field_rows()
    names = [r.name for r in rows]
    assert len(names) == len(set(names)) > 100
    assert {"run.name", "attention.flex_backward", "model.rope_scaling.factor", "objective.dflash.max_anchors",
            "topology.cp", "train.max_steps"} <= set(names)
    assert all(r.description for r in rows), [r.name for r in rows if not r.description]
    flex = next(r for r in rows if r.name == "attention.flex_backward")
    assert (flex.kind, flex.default) == ("auto | direct | recompute", "auto")
    # the listed default is what a config that leaves the field out gets (the demo recipe, validated)
    import yaml

    from csbp.config.reference import _default_text
    from csbp.recipes import recipe_path

    checked = set()
    for recipe in ("demo", "fast-dllm-v2-demo", "mdlm-demo", "dflash-demo"):
        raw = yaml.safe_load(recipe_path(recipe).read_text(encoding="utf-8"))
        cfg = load_run_config(recipe)
        for row in rows:
            *sections, field = row.name.split(".")
            owner, given = cfg, raw
            for part in sections:
                owner, given = getattr(owner, part), (given or {}).get(part)
            if owner is None or row.default in ("required", "null", "by objective") or field in (given or {}):
                continue
            assert _default_text(getattr(owner, field)) == row.default, f"{recipe}: {row.name}"
            checked.add(row.name)
    assert len(checked) > 30


def test_docs_config_md_is_current() -> None:
    """Regenerate with: .venv/bin/csbp config fields --markdown > docs/config.md"""
    assert (ROOT / "docs" / "config.md").read_text(encoding="utf-8") == format_markdown(field_rows())


def test_fields_command_selects_sections_and_fields(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "fields", "attention", "train.max_steps"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("[attention]\nattention.backend  (auto | tiles | flex; auto)\n")
    assert "train.max_steps  (int; required)\n    Optimizer steps.\n" in out and "optim.lr" not in out
    assert main(["config", "fields", "atention"]) == 2
    err = capsys.readouterr().err
    assert "no config field or section 'atention'; sections: run, model, data, objective, topology" in err
    assert [r.name for r in select(field_rows(), ["model.rope_scaling"])][0] == "model.rope_scaling.type"


def test_every_section_is_one_block() -> None:
    """A nested section (model.rope_scaling) declared between its parent's fields used to split the
    parent in two: docs/config.md had two `## model` tables and `csbp config fields` two [model] blocks."""
    rows = field_rows()
    sections = [r.section for r in rows]
    blocks = [s for i, s in enumerate(sections) if i == 0 or sections[i - 1] != s]
    assert len(blocks) == len(set(blocks)), blocks
    headings = [line for line in format_markdown(rows).splitlines() if line.startswith("## ")]
    assert len(headings) == len(set(headings)) and "## `model.rope_scaling`" in headings
    names = [r.name for r in rows]
    assert names.index("model.dtype") < names.index("model.rope_scaling.type")
