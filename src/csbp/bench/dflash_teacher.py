"""``csbp bench dflash --teacher-rows``: the rows of the target's last hidden state each ring member
sends for the KL loss under the context-sharded target pass (``csbp.dflash.teacher_rows``: each
peer gets only the rows its supervised draft rows read), against the all-gather of every shard
that the pass did before, side by side in one run of ``nproc`` processes (one CP ring).

Two layouts per length and anchor count: CP-only (every ring member holds every anchor, so all
read the same rows) and CSBP with ``bp = cp`` (each member holds its own dealt packet). The
exchange runs for real over gloo with a 1-wide hidden state and the bytes are counted by the
``Comm`` layer (``dflash.teacher``), so the rows are exact; multiply by ``H · element_size`` for
a model. Anchors are drawn as training draws them (``uniform``, the same
generator on every rank), over an all-ones loss mask; ``--doc-length`` packs documents.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from csbp.atomic import write_json_atomic
from csbp.attention.documents import packed_doc_ids
from csbp.bench.common import bench_documents, check_zigzag_lengths
from csbp.dflash.anchors import sample_anchors, segment_starts
from csbp.dflash.layouts import DFlashLayout, context_positions
from csbp.dflash.teacher_rows import TEACHER_CATEGORY, exchange_teacher_rows, ring_teacher_needs
from csbp.engine.context import build_parallel_context
from csbp.parallel.launch import run_local
from csbp.topology import Topology

TEACHER_LAYOUTS = ("cp", "csbp")
"""CP-only (one packet of every anchor) and CSBP with ``bp = cp`` (one dealt packet per member)."""


@dataclass(frozen=True)
class TeacherRowsRecord:
    """One layout at one length and anchor count: the busiest ring member's rows sent."""

    seq_len: int
    anchors: int
    layout: str
    exchange_rows: int
    all_gather_rows: int

    @property
    def ratio(self) -> float:
        return self.exchange_rows / self.all_gather_rows


def _doc_ids(seq_len: int, doc_length: int | None, seed: int) -> torch.Tensor:
    documents = bench_documents(seq_len, doc_length, seed)
    return torch.zeros(seq_len, dtype=torch.long) if documents is None else packed_doc_ids(documents)


def _worker(
    rank: int, world: int, seq_len: int, max_anchors: int, block_size: int, doc_length: int | None, seed: int
) -> dict[str, tuple[int, int]]:
    ctx = build_parallel_context(Topology(cp=world))
    ring = ctx.ring_comm()
    assert ring is not None
    loss_mask = torch.ones(seq_len, dtype=torch.bool)
    docs = _doc_ids(seq_len, doc_length, seed)
    anchors = sample_anchors(
        loss_mask, docs, max_anchors=max_anchors, method="uniform", block_size=block_size,
        generator=torch.Generator().manual_seed(seed),
    )
    doc_start = segment_starts(docs)[anchors]
    ids = torch.zeros(seq_len, dtype=torch.long)
    last = torch.zeros(len(context_positions(seq_len, world, ring.rank)), 1, dtype=torch.float32)
    rows: dict[str, tuple[int, int]] = {}
    for name in TEACHER_LAYOUTS:
        owners = world if name == "csbp" else 1
        layout = DFlashLayout(world, ring.rank, owners, ring.rank if owners > 1 else 0, 1.0)
        needs = ring_teacher_needs(
            ids, loss_mask, docs, anchors, doc_start, layout, block_size=block_size, context="strict",
            min_bucket=max(1, min(128, max_anchors // owners)),
        )
        ctx.counter.reset()
        exchange_teacher_rows(last, needs, ring, seq_len=seq_len, cp=world, cp_rank=ring.rank)
        sent = ctx.counter.bytes(TEACHER_CATEGORY) // last.element_size()
        rows[name] = (sent, (world - 1) * last.shape[0])
    return rows


def run_teacher_rows_bench(
    seq_lens: list[int], anchor_counts: list[int], *, nproc: int, block_size: int,
    doc_length: int | None = None, seed: int = 0,
) -> list[TeacherRowsRecord]:
    """Both layouts at every length and anchor count (one launch of ``nproc`` processes each)."""
    if nproc < 2:
        raise ValueError(f"--teacher-rows exchanges over a CP ring: nproc={nproc} must be >= 2")
    check_zigzag_lengths(seq_lens, nproc)
    records = []
    for seq_len in seq_lens:
        for count in anchor_counts:
            ranks = run_local(_worker, nproc, (seq_len, count, block_size, doc_length, seed))
            for name in TEACHER_LAYOUTS:
                records.append(TeacherRowsRecord(
                    seq_len, count, name, max(r[name][0] for r in ranks), max(r[name][1] for r in ranks)
                ))
    return records


def format_teacher_table(records: list[TeacherRowsRecord]) -> str:
    """One line per length, anchor count and layout."""
    lines = [f"{'seq_len':>8} {'anchors':>8} {'layout':>7} {'exchange':>9} {'all_gather':>10} {'ratio':>6}"]
    for r in records:
        lines.append(
            f"{r.seq_len:>8} {r.anchors:>8} {r.layout:>7} {r.exchange_rows:>9} {r.all_gather_rows:>10} {r.ratio:>6.3f}"
        )
    return "\n".join(lines)


def run_teacher_rows_command(args: argparse.Namespace) -> int:
    """``csbp bench dflash --teacher-rows``: print (and with ``--json`` write) the table."""
    records = run_teacher_rows_bench(
        args.seq_lens, args.anchors, nproc=args.nproc, block_size=args.block_size, doc_length=args.doc_length,
    )
    print(
        f"csbp bench dflash --teacher-rows: nproc={args.nproc} (one CP ring) block={args.block_size} "
        f"doc_length={args.doc_length} (rows the busiest ring member sends; x H·element_size for bytes)"
    )
    print(format_teacher_table(records))
    if getattr(args, "json", None):
        write_json_atomic(Path(args.json), [asdict(r) | {"ratio": r.ratio} for r in records])
    return 0
