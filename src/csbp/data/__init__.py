"""Training data: parse sources, tokenize once, pack into memory-mapped artifacts, load batches.

Modules: ``sources`` (JSONL/TXT/Parquet readers), ``tokenizer`` (load or train, fingerprints),
``packing`` + ``prepare`` + ``prepare_inputs`` + ``prepare_manifest`` + ``mask_checks`` (``csbp data
prepare``), ``artifact`` (on-disk layout, ``open_artifact``), ``loader`` (``PackedLoader``:
deterministic, resumable, dp-sharded), ``report`` (inspect/stats text), ``corpus`` (the Shakespeare
demo corpus).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from csbp.data.artifact import Artifact, ArtifactSplit, open_artifact
    from csbp.data.corpus import demo_corpus_files
    from csbp.data.loader import PackedLoader
    from csbp.data.prepare import PrepareConfig, prepare_artifact
    from csbp.data.tokenizer import CsbpTokenizer, SpecialTokens, load_tokenizer, train_bpe_tokenizer

_HOMES = {
    "Artifact": "artifact",
    "ArtifactSplit": "artifact",
    "open_artifact": "artifact",
    "demo_corpus_files": "corpus",
    "PackedLoader": "loader",
    "PrepareConfig": "prepare",
    "prepare_artifact": "prepare",
    "CsbpTokenizer": "tokenizer",
    "SpecialTokens": "tokenizer",
    "load_tokenizer": "tokenizer",
    "train_bpe_tokenizer": "tokenizer",
}


def __getattr__(name: str) -> Any:
    """The exports, imported on first use (PEP 562): reading an artifact (``csbp plan --data``)
    does not import the loader and torch."""
    if name not in _HOMES:
        raise AttributeError(f"module 'csbp.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"csbp.data.{_HOMES[name]}"), name)


__all__ = [
    "Artifact",
    "ArtifactSplit",
    "CsbpTokenizer",
    "PackedLoader",
    "PrepareConfig",
    "SpecialTokens",
    "demo_corpus_files",
    "load_tokenizer",
    "open_artifact",
    "prepare_artifact",
    "train_bpe_tokenizer",
]
