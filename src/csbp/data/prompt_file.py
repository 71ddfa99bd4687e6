"""JSONL prompt files: one ``{"prompt": text, ...}`` object per line, as ``csbp generate --prompts`` and
``csbp dflash eval --prompts`` read them.

The file is UTF-8 (a leading byte-order mark is dropped); blank lines are skipped. A file that is not
there or holds no prompt, a line that is not UTF-8, not JSON, or not an object with a string field
``"prompt"`` is refused in one line naming ``FILE:LINE`` and the fix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from csbp.data.json_lines import parse_json_line

LINE_END = re.compile(r"\r\n|\r|\n")
FIX = 'one {"prompt": "..."} object per line'


@dataclass(frozen=True)
class PromptLine:
    """One prompt of the file: its line number, ``FILE:LINE`` and the whole JSON object."""

    number: int
    where: str
    record: dict[str, Any]

    @property
    def text(self) -> str:
        return str(self.record["prompt"])


def read_prompt_lines(path: Path, flag: str = "--prompts") -> list[PromptLine]:
    """Every prompt of the JSONL file ``path`` (module docstring); ``flag`` names the option it came from."""
    if not path.is_file():
        raise ValueError(f"{flag} {path} is not a file (fix: a JSONL file, {FIX})")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:  # the decoder names neither the file nor the line
        line = data[: exc.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text ({exc.reason}) (fix: save the file as UTF-8)") from None
    prompts = []
    # lines end at \n, \r\n or \r only, as a JSONL writer ends them: str.splitlines also splits at U+2028,
    # U+0085 ..., which JSON strings may hold unescaped (json.dumps(ensure_ascii=False) writes them so)
    for number, line in enumerate(LINE_END.split(text), start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        record = parse_json_line(line, where, FIX)
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ValueError(f'{where}: expected an object with a string field "prompt" (fix: {FIX})')
        prompts.append(PromptLine(number, where, record))
    if not prompts:
        raise ValueError(f"{flag} {path} holds no prompts (fix: {FIX})")
    return prompts
