"""Text reports behind ``csbp data inspect`` and ``csbp data stats``.

``inspect`` decodes rows with supervised spans wrapped in ``[[ ... ]]`` and padding collapsed to
``<|pad|>xN``; ``stats`` summarises token counts, the supervised fraction, documents per row and a
power-of-two histogram of document lengths (in tokens, EOS included, pieces of a document split
across rows counted together).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from csbp.data.artifact import MANIFEST_NAME, SPLITS, Artifact, ArtifactSplit
from csbp.data.packing import unsupervised_rows_note
from csbp.data.tokenizer import CsbpTokenizer
from csbp.wording import counted

SUPERVISED_OPEN, SUPERVISED_CLOSE = "[[", "]]"
_SPLIT_COUNTS = ("rows", "documents", "tokens", "supervised_tokens", "padding_tokens")
_ROWS_PER_CHUNK = 4096


def _recorded(artifact: Artifact, *keys: str) -> Any:
    """The manifest's value at ``keys``; ``ValueError`` naming the field when it is missing."""
    node: Any = artifact.manifest
    for key in keys:
        if not isinstance(node, dict) or key not in node:
            raise ValueError(
                f"{artifact.directory / MANIFEST_NAME}: missing field {'.'.join(keys)}; re-run csbp data prepare"
            )
        node = node[key]
    return node


def format_manifest_summary(artifact: Artifact) -> str:
    """A few lines: where, tokenizer, special ids, counts, fingerprints, sources."""
    m = artifact.manifest
    counts = {key: _recorded(artifact, "counts", key) for key in ("documents", "skipped_empty", "tokens")}
    options = m.get("options")
    per = options.get("chat_documents", "record") if isinstance(options, dict) else "record"
    # --chat-documents turn: counts.documents is the records read; the splits count what was packed
    packed = "" if per != "turn" or artifact.chat_template is None else (
        f"; {sum(int(_recorded(artifact, 'splits', split, 'documents')) for split in SPLITS)} documents packed"
    )
    lines = [
        f"artifact      {artifact.directory}",
        f"format        {m['format']} v{m['format_version']} ({m.get('created_by', '?')})",
        f"seq_len       {artifact.seq_len}",
        f"tokenizer     vocab {artifact.vocab_size}, source {m['tokenizer'].get('source', '?')}",
        f"  fingerprint {artifact.tokenizer_fingerprint}",
        "special ids   " + ", ".join(f"{name}={value}" for name, value in artifact.special_ids.items()),
        f"documents     {counts['documents']}{' records' if packed else ''} ({counts['skipped_empty']} empty "
        f"skipped), {counts['tokens']} tokens{packed}",
    ]
    template = artifact.chat_template
    if template is not None:
        lines.append(f"chat template {template.get('source', '?')} (sha256 {template.get('sha256', '?')})")
        shown_per = {"record": "one per chat record", "turn": "one per assistant turn, only it supervised"}
        lines.append(f"chat docs     {shown_per.get(per, repr(per))} (--chat-documents {per})")
    for split in SPLITS:
        s = {key: _recorded(artifact, "splits", split, key) for key in _SPLIT_COUNTS}
        lines.append(
            f"  {split:<5}       {counted(s['rows'], 'row')}, {counted(s['documents'], 'document')}, "
            f"{s['tokens']} tokens, {s['supervised_tokens']} supervised, {s['padding_tokens']} padding"
        )
    # recorded since csbp wrote it (an older manifest lacks it: nothing said)
    recorded = {split: m["splits"][split].get("unsupervised_rows") for split in SPLITS}
    if all(isinstance(count, int) for count in recorded.values()):
        rows = {split: int(_recorded(artifact, "splits", split, "rows")) for split in SPLITS}
        if note := unsupervised_rows_note(recorded, rows):
            lines.append(note)
    lines.append(f"content       {artifact.fingerprint}")
    sources = m.get("sources")
    names = [str(s.get("name", "?")) if isinstance(s, dict) else "?" for s in sources or ()] if isinstance(sources, list) else []
    shown = ", ".join(names[:5]) + (f", ... ({len(names)} files)" if len(names) > 5 else "")
    lines.append(f"sources       {shown}")
    return "\n".join(lines)


def format_row(
    tokens: np.ndarray, loss_mask: np.ndarray, doc_ids: np.ndarray, tokenizer: CsbpTokenizer
) -> str:
    """Decode one row; supervised runs in ``[[ ]]``, padding (doc id -1) collapsed to ``<pad>xN``."""
    tokens = np.asarray(tokens, dtype=np.int64)
    kind = (np.asarray(loss_mask) != 0).astype(np.int8) + 2 * (
        np.asarray(doc_ids) < 0
    )  # 0 text, 1 sup, 2 pad
    cuts = np.flatnonzero(np.diff(kind)) + 1
    pieces: list[str] = []
    for start, stop in zip(np.concatenate([[0], cuts]), np.concatenate([cuts, [tokens.shape[0]]])):
        run_kind = int(kind[start])
        if run_kind >= 2:
            pieces.append(f"{tokenizer.decode([tokenizer.pad_id])}x{stop - start}")
            continue
        text = tokenizer.decode(tokens[start:stop].tolist())
        pieces.append(f"{SUPERVISED_OPEN}{text}{SUPERVISED_CLOSE}" if run_kind == 1 else text)
    return "".join(pieces)


def format_inspect(artifact: Artifact, *, split: str, num_rows: int) -> str:
    """Manifest summary followed by the first ``num_rows`` decoded rows of ``split``."""
    tokenizer = artifact.load_tokenizer()
    rows = artifact.split(split)
    shown = min(num_rows, rows.num_rows)
    if shown == 0:  # --rows 0, or an empty split (the summary counts its rows): no heading over nothing
        return format_manifest_summary(artifact)
    lines = [
        format_manifest_summary(artifact),
        "",
        f"first {shown} of {rows.num_rows} {split} rows "
        f"(supervised spans in {SUPERVISED_OPEN} {SUPERVISED_CLOSE}):",
    ]
    for index in range(shown):
        doc_ids = sorted({int(d) for d in np.unique(rows.doc_ids[index]) if d >= 0})
        lines.append(f"--- row {index} (documents {doc_ids}) ---")
        lines.append(format_row(rows.tokens[index], rows.loss_mask[index], rows.doc_ids[index], tokenizer))
    return "\n".join(lines)


@dataclass(frozen=True)
class SplitStats:
    """Measured statistics of one split."""

    rows: int
    tokens: int
    supervised_tokens: int
    padding_tokens: int
    documents_per_row: tuple[float, int, int]  # mean, min, max
    document_lengths: np.ndarray  # int64 [documents]
    piece_lengths: np.ndarray  # int64 [pieces]: documents as cut into rows (what a document mask sees)

    @property
    def supervised_fraction(self) -> float:
        return self.supervised_tokens / self.tokens if self.tokens else 0.0


def split_stats(rows: ArtifactSplit) -> SplitStats:
    """Scan a split in chunks of rows (bounded memory) and measure it."""
    lengths = np.zeros(0, dtype=np.int64)
    per_row: list[np.ndarray] = []
    pieces: list[np.ndarray] = []
    supervised = padding = 0
    for first in range(0, rows.num_rows, _ROWS_PER_CHUNK):
        doc_ids = np.asarray(rows.doc_ids[first : first + _ROWS_PER_CHUNK], dtype=np.int64)  # [R, L]
        valid = doc_ids >= 0
        padding += int((~valid).sum())
        supervised += int(np.count_nonzero(rows.loss_mask[first : first + _ROWS_PER_CHUNK]))
        boundaries = (doc_ids[:, 1:] != doc_ids[:, :-1]) & valid[:, 1:]  # a new document starts
        per_row.append(valid[:, 0].astype(np.int64) + boundaries.sum(axis=1))
        pieces.append(_piece_lengths(doc_ids))
        counts = np.bincount(doc_ids[valid], minlength=lengths.shape[0])
        counts[: lengths.shape[0]] += lengths
        lengths = counts
    docs_per_row = np.concatenate(per_row) if per_row else np.zeros(0, dtype=np.int64)
    summary = (
        (float(docs_per_row.mean()), int(docs_per_row.min()), int(docs_per_row.max()))
        if docs_per_row.size
        else (0.0, 0, 0)
    )
    total = rows.num_rows * rows.seq_len - padding
    piece_lengths = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    return SplitStats(rows.num_rows, total, supervised, padding, summary, lengths, piece_lengths)


def _piece_lengths(doc_ids: np.ndarray) -> np.ndarray:
    """Lengths of the maximal runs of one non-padding id in each row of ``doc_ids [R, L]``."""
    if doc_ids.size == 0:
        return np.zeros(0, dtype=np.int64)
    starts = np.ones(doc_ids.shape, dtype=bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    run = np.cumsum(starts.ravel()) - 1
    lengths = np.bincount(run)
    return lengths[doc_ids.ravel()[starts.ravel()] >= 0]


def format_length_summary(lengths: np.ndarray, *, seq_len: int, num_rows: int) -> list[str]:
    """Mean and quantiles of document lengths, and the share of a row's ``L^2`` (query, key) pairs a
    document mask keeps (``sum len^2 / (rows L^2)`` over the in-row pieces)."""
    if lengths.size == 0:
        return []
    q50, q90 = np.percentile(lengths, [50, 90])
    kept = float((lengths.astype(np.float64) ** 2).sum()) / max(num_rows * seq_len**2, 1)
    return [
        f"  in-row doc length   mean {lengths.mean():.1f}, median {q50:.0f}, p90 {q90:.0f}, max {lengths.max()}",
        f"  document mask keeps {100 * kept:.2f}% of each row's attention pairs (data.document_mask)",
    ]


def format_length_histogram(lengths: np.ndarray, *, width: int = 40) -> list[str]:
    """Power-of-two buckets ``[2^k, 2^(k+1))`` with counts and a bar."""
    if lengths.size == 0:
        return ["  (no documents)"]
    buckets = np.floor(np.log2(np.maximum(lengths, 1))).astype(np.int64)
    counts = np.bincount(buckets)
    peak = int(counts.max())
    lines = []
    for k, count in enumerate(counts):
        if count:
            bar = "#" * max(1, round(width * int(count) / peak))
            lines.append(f"  [{2**k:>8}, {2 ** (k + 1):>8})  {int(count):>8}  {bar}")
    return lines


def format_stats(artifact: Artifact) -> str:
    """The ``csbp data stats`` report for both splits."""
    lines = [f"artifact {artifact.directory} (seq_len {artifact.seq_len}, vocab {artifact.vocab_size})"]
    for split in SPLITS:
        stats = split_stats(artifact.split(split))
        mean, low, high = stats.documents_per_row
        lines += [
            "",
            f"[{split}]",
            f"  rows                {stats.rows}",
            f"  tokens              {stats.tokens} (+{stats.padding_tokens} padding)",
            f"  supervised          {stats.supervised_tokens} "
            f"({100 * stats.supervised_fraction:.2f}% of tokens)",
            f"  documents           {stats.document_lengths.shape[0]}",
            f"  documents per row   mean {mean:.2f}, min {low}, max {high}",
            *format_length_summary(stats.piece_lengths, seq_len=artifact.seq_len, num_rows=stats.rows),
            "  document length histogram (tokens incl. EOS):",
            *format_length_histogram(stats.document_lengths),
        ]
    return "\n".join(lines)
