"""Odd values of single config fields (found by driving every field through `csbp config validate`
and `csbp train`): each is one `csbp: error: <field>: ... (fix: ...)` line, exit 2, no traceback."""

from __future__ import annotations

from pathlib import Path

import pytest

from test_config_errors import error_lines, tiny


@pytest.mark.parametrize("value", ["[]", "[qwen3]", "{}"])
def test_a_list_or_mapping_for_model_arch_is_one_error_line(tmp_path: Path, value: str) -> None:
    # it used to raise TypeError (unhashable type) from the arch-defaults lookup: a traceback
    lines = error_lines(tiny(tmp_path), f"model.arch={value}")
    assert len(lines) == 1
    assert lines[0].startswith("--set: model.arch: got ")
    assert lines[0].endswith("(fix: use 'qwen3', 'llama' or 'qwen2')")
