"""Real document layouts for the planner: ``csbp plan --data ARTIFACT``, and a run config with
``data.document_mask`` (``topology: auto``, ``csbp plan --model run.yaml``: its ``data.train``).

An artifact (``csbp data prepare``, ``csbp.data.artifact``) is one token stream cut into rows of
its ``seq_len``; ``{split}.doc_ids.bin`` gives every token's document ordinal (-1 = pad), so a
document boundary is exactly where the id changes (``Documents.from_doc_ids``, what the run's
document mask uses). A planning row of ``L`` tokens is ``L`` consecutive tokens of that stream
starting at a row start: ``L`` = the artifact's ``seq_len`` is one artifact row as training sees it,
a longer ``L`` concatenates the following rows in order (a document cut by a row boundary is
whole again), a shorter one keeps a row's first ``L`` tokens.

The planner costs ``rows`` such windows, spread evenly over the split (first and last included,
deterministic), and averages their predictions (``model.predict``). By default ``SAMPLE_ROWS``, but
no more than ``SAMPLE_TOKENS`` tokens in all (at least one row): counting a 1M-token row takes
seconds per layout family, so 1M plans 4 rows. The trailing pad of the split's last row is avoided
whenever enough tokens precede it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from csbp.plan.documents import RowDocuments

if TYPE_CHECKING:
    from csbp.config.schema import RunConfig

SAMPLE_ROWS = 16
SAMPLE_TOKENS = 1 << 22


def default_rows(seq_len: int) -> int:
    """Rows planned without ``--data-rows``: ``SAMPLE_ROWS`` within ``SAMPLE_TOKENS`` (at least one)."""
    return max(1, min(SAMPLE_ROWS, SAMPLE_TOKENS // seq_len))


@dataclass(frozen=True)
class DocumentSample:
    """The real rows a plan is costed on, and where they came from."""

    source: str
    seq_len: int
    rows: tuple[RowDocuments, ...]
    windows: int  # planning windows the split holds (the sample is drawn from these)

    def lengths(self) -> np.ndarray:
        """Tokens of every document piece in the sampled rows (a piece cut by the row's end counts
        as the row's mask sees it)."""
        return np.concatenate(
            [np.diff(np.append(np.asarray(r.starts, dtype=np.int64), r.seq_len)) for r in self.rows]
        )

    def summary(self) -> dict[str, object]:
        """``count, mean, p50, p90, max`` of the document lengths, with the sample's size."""
        lengths = self.lengths()
        return {
            "source": self.source,
            "rows": len(self.rows),
            "windows": self.windows,
            "count": int(lengths.size),
            "mean": float(lengths.mean()),
            "p50": float(np.percentile(lengths, 50)),
            "p90": float(np.percentile(lengths, 90)),
            "max": int(lengths.max()),
        }

    def describe(self) -> str:
        """``artifacts/x train: 16 of 120 windows, 310 documents, length mean 211 p50 95 p90 512 max 4,096``."""
        s = self.summary()
        return (
            f"{s['source']}: {s['rows']} of {s['windows']:,} windows, {s['count']:,} documents, length "
            f"mean {s['mean']:,.0f} p50 {s['p50']:,.0f} p90 {s['p90']:,.0f} max {s['max']:,}"
        )


def row_documents(doc_ids: np.ndarray) -> RowDocuments:
    """The documents of one row of document ids: a new document wherever the id changes."""
    ids = np.asarray(doc_ids)
    starts = np.flatnonzero(np.concatenate(([True], ids[1:] != ids[:-1])))
    return RowDocuments(int(ids.size), tuple(int(s) for s in starts))


def artifact_documents(
    directory: str | Path, seq_len: int, *, split: str = "train", rows: int | None = None
) -> DocumentSample:
    """``rows`` planning rows of ``seq_len`` tokens from ``split`` of the artifact at ``directory``
    (see the module docstring); ``ValueError`` in one line when the artifact cannot supply them."""
    from csbp.data.artifact import open_artifact

    rows = default_rows(seq_len) if rows is None else rows
    if rows < 1:
        raise ValueError(f"--data-rows must be >= 1, got {rows}")
    artifact = open_artifact(directory)
    data = artifact.split(split)
    if data.num_rows == 0:
        raise ValueError(f"artifact {directory} split {split} has no rows; prepare it with more data")
    stream = data.doc_ids.reshape(-1)
    total = int(stream.size)
    last = np.asarray(data.doc_ids[-1])
    filled = int(np.flatnonzero(last != -1)[-1]) + 1 if (last != -1).any() else 0
    valid = total - artifact.seq_len + filled  # tokens before the last row's trailing pad
    if seq_len > total:
        raise ValueError(
            f"artifact {directory} split {split} holds {total:,} tokens, fewer than the planned "
            f"L={seq_len:,}: plan a shorter --seq-len or prepare more data"
        )
    end = valid if seq_len <= valid else total
    offsets = np.arange(0, end - seq_len + 1, artifact.seq_len)
    picked = np.unique(np.linspace(0, offsets.size - 1, min(rows, offsets.size)).round().astype(np.int64))
    sample = tuple(row_documents(stream[offsets[i] : offsets[i] + seq_len]) for i in picked)
    return DocumentSample(f"{directory} {split}", seq_len, sample, int(offsets.size))


def run_config_documents(cfg: RunConfig, seq_len: int | None = None) -> DocumentSample | None:
    """The rows a run config trains on when it masks documents: ``data.train``'s documents at
    ``seq_len`` (default ``data.seq_len``); None without ``data.document_mask`` (one document a
    row is then exact). ``ValueError`` in one line when the artifact cannot supply them."""
    if not cfg.document_mask:
        return None
    return artifact_documents(cfg.data.train, seq_len or cfg.data.seq_len)
