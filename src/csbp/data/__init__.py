"""Training data: parse sources, tokenize once, pack into memory-mapped artifacts, load batches.

Modules: ``sources`` (JSONL/TXT/Parquet readers), ``tokenizer`` (load or train, fingerprints),
``packing`` + ``prepare`` (``csbp data prepare``), ``artifact`` (on-disk layout, ``open_artifact``),
``loader`` (``PackedLoader``: deterministic, resumable, dp-sharded), ``report`` (inspect/stats
text), ``corpus`` (the Shakespeare demo corpus).
"""

from csbp.data.artifact import Artifact, ArtifactSplit, open_artifact
from csbp.data.corpus import demo_corpus_files
from csbp.data.loader import PackedLoader
from csbp.data.prepare import PrepareConfig, prepare_artifact
from csbp.data.tokenizer import CsbpTokenizer, SpecialTokens, load_tokenizer, train_bpe_tokenizer

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
