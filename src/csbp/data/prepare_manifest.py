"""The ``manifest.json`` that ``csbp data prepare`` writes into an artifact: format and version, the
tokenizer (fingerprint, source, special names and ids), array dtypes, document and token counts, per
split its counts, files and largest token id, the content fingerprint, the input files and the
options that shaped the artifact. ``csbp.data.artifact`` reads it back.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import csbp
from csbp.data.artifact import (
    ARRAY_DTYPES,
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    SPLITS,
    TOKENIZER_FILE,
    array_file_name,
    content_fingerprint,
    max_token_id,
)
from csbp.data.packing import SplitCounts
from csbp.data.tokenizer import CsbpTokenizer

if TYPE_CHECKING:
    from csbp.data.prepare import PrepareConfig


def build_manifest(
    config: PrepareConfig,
    files: list[Path],
    tokenizer: CsbpTokenizer,
    counts: dict[str, SplitCounts],
    num_documents: int,
    num_empty: int,
    build_dir: Path,
) -> dict[str, Any]:
    """The manifest of the artifact built in ``build_dir`` (``prepare_artifact`` adds its
    ``chat_template`` entry)."""
    return {
        "format": FORMAT_NAME,
        "format_version": FORMAT_VERSION,
        "created_by": f"csbp {csbp.__version__}",
        "seq_len": config.seq_len,
        "tokenizer": {
            "fingerprint": tokenizer.fingerprint,
            "source": "trained"
            if config.train_tokenizer
            else str(Path(config.tokenizer_path or "").resolve()),
            "file": TOKENIZER_FILE,
            "vocab_size": tokenizer.vocab_size,
            "special_names": tokenizer.special_names,
        },
        "special_ids": tokenizer.special_ids(),
        "dtypes": {name: dtype.str for name, dtype in ARRAY_DTYPES.items()},
        "counts": {
            "documents": num_documents,
            "skipped_empty": num_empty,
            "tokens": sum(c.tokens for c in counts.values()),
        },
        "splits": {
            split: {
                **asdict(counts[split]),
                "files": {name: array_file_name(split, name) for name in ARRAY_DTYPES},
                "max_token_id": max_token_id(build_dir, split),
            }
            for split in SPLITS
        },
        "content_fingerprint": content_fingerprint(build_dir),
        "sources": [
            {"name": path.name, "path": str(path.resolve()), "bytes": path.stat().st_size} for path in files
        ],
        "options": {
            "val_fraction": config.val_fraction,
            "seed": config.seed,
            "txt_mode": config.txt_mode,
            "chat_documents": config.chat_documents,
        },
    }


def write_manifest(directory: Path, manifest: dict[str, Any]) -> None:
    """Write ``manifest.json`` (sorted keys, trailing newline)."""
    text = json.dumps(manifest, indent=2, sort_keys=True) + "\n"
    (Path(directory) / MANIFEST_NAME).write_text(text, encoding="utf-8")
