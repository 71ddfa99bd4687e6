"""The JSONL prompt files of ``csbp generate --prompts`` and ``csbp dflash eval --prompts``
(:mod:`csbp.data.prompt_file`): lines end only where a JSONL writer ends them, and a malformed line's
message names the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from csbp.data.prompt_file import read_prompt_lines


def test_unicode_line_separators_inside_a_prompt_stay_in_it(tmp_path: Path) -> None:
    """U+2028, U+2029 and U+0085 are legal unescaped in a JSON string (``ensure_ascii=False`` writes them
    so); ``str.splitlines`` split the line there and refused it as malformed JSON."""
    texts = ["one\u2028two", "three\u2029four\x85five", "plain"]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\r\n".join(json.dumps({"prompt": t}, ensure_ascii=False) for t in texts) + "\n", encoding="utf-8")
    lines = read_prompt_lines(path)
    assert [line.text for line in lines] == texts and [line.number for line in lines] == [1, 2, 3]


def test_a_malformed_line_names_the_file_line_and_fix(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "fine"}\n\n{"prompt": oops}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r'prompts\.jsonl:3: malformed JSON \(.* at column \d+\) \(fix: one \{"prompt"'):
        read_prompt_lines(path)
