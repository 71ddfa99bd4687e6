"""One line of a JSONL file, parsed or refused in one line naming ``FILE:LINE`` (the data sources of
``csbp data prepare`` and the prompt files of ``csbp generate``/``csbp dflash eval`` read them alike)."""

from __future__ import annotations

import json
from typing import Any


def parse_json_line(line: str, where: str, fix: str | None = None) -> Any:
    """The JSON value of ``line``; ``ValueError`` ``"<where>: malformed JSON (<reason> at column C)"``
    (then ``" (fix: <fix>)"`` where one is given), or for brackets nested thousands deep (which no record
    looks like) ``"<where>: JSON nested too deeply"``."""
    try:
        return json.loads(line)
    except json.JSONDecodeError as exc:
        message = exc.msg.removesuffix(" at")  # json's "Invalid control character at"
        tail = f" (fix: {fix})" if fix else ""
        raise ValueError(f"{where}: malformed JSON ({message} at column {exc.colno}){tail}") from None
    except RecursionError:
        raise ValueError(f"{where}: JSON nested too deeply (fix: one flat object per line)") from None
