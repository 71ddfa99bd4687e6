"""``csbp bench dflash --target-pass``: the online DFlash target pass per rank, replicated (the full
sequence on every rank, ``capture_target_features``) vs context-sharded (each CP ring member runs
its zigzag rows and all-gathers K/V per layer, ``csbp.dflash.target_shard``), side by side in one
run of ``nproc`` processes (one CP ring of ``nproc``), the two passes alternating step by step
(``pass_order``) on the same tokens.

Per pass: the time of each timed step is its slowest rank's (every rank starts the pass after a
barrier, so the step ends when the slowest one does; ``times_s``, in run order) and ``time_s`` is the
median of those step times, as in ``csbp bench attention|train|dflash``; the table's ``±`` is their
spread and ``~`` marks a ``time_x`` (sharded ``time_s`` / replicated ``time_s``, both so defined)
within it, ``csbp.bench.spread``. Per rank, and reported for the largest rank: causal attention
pairs (query, key) summed over the target layers (and the attention FLOPs, forward only), peak
memory growth of the pass (``PeakMemory``: CUDA allocator peak or the process's RSS high-water mark
on the CPU), and bytes received over the ring (``dflash.target``: the per-layer K/V all-gathers; 0
for the replicated pass). The KL teacher rows the step then exchanges (``dflash.teacher``,
``csbp.dflash.teacher_rows``) depend on the anchors and are not part of this pass.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from csbp.atomic import write_json_atomic
from csbp.bench.common import BENCH_DTYPES, check_zigzag_lengths
from csbp.bench.measure import PeakMemory, attention_flops
from csbp.bench.spread import NOISE_MARK, NOISE_NOTE, format_spread, within_noise
from csbp.devices import backend_device
from csbp.dflash.features import capture_target_features
from csbp.dflash.layouts import context_positions
from csbp.dflash.target_shard import TARGET_CATEGORY, capture_sharded_target_features
from csbp.engine.context import ParallelContext, build_parallel_context
from csbp.models.config import DecoderConfig
from csbp.models.decoder import Decoder
from csbp.parallel.comm import Comm
from csbp.parallel.launch import run_local
from csbp.topology import Topology
from csbp.wording import counted

PASSES = ("replicated", "sharded")


@dataclass(frozen=True)
class TargetPassRecord:
    """One pass at one length: its step time (median over the steps of the slowest rank's time) and the
    largest per-rank counts."""

    seq_len: int
    capture: str
    time_s: float  # the median of ``times_s``
    attention_pairs: int
    attention_gflops: float
    peak_mib: float
    bytes_moved: int
    times_s: tuple[float, ...] = ()  # every timed step: the slowest rank's time, in run order


RankPass = tuple[int, int, int, list[float]]
"""One rank's results of one pass: ``(attention pairs, peak memory bytes, bytes received, step times)``."""


def causal_pairs(positions: torch.Tensor) -> int:
    """(query, key) pairs of causal attention for queries at ``positions`` over the whole row."""
    return int((positions.long() + 1).sum())


def _worker(
    rank: int, world: int, config: DecoderConfig, seq_len: int, dtype: torch.dtype, warmup: int, repeats: int
) -> dict[str, RankPass]:
    ctx = build_parallel_context(Topology(cp=world))
    ring = ctx.ring_comm()
    assert ring is not None
    target = Decoder(config, dtype=dtype, seed=1, device=backend_device())
    layer_ids = (0, config.num_layers - 1)
    generator = torch.Generator().manual_seed(2)
    times: dict[str, list[float]] = {capture: [] for capture in PASSES}
    peak, moved = dict.fromkeys(PASSES, 0), dict.fromkeys(PASSES, 0)
    for index in range(warmup + repeats):
        ids = torch.randint(0, config.vocab_size, (1, seq_len), generator=generator)  # the same for both passes
        for capture in pass_order(index):
            elapsed, memory_bytes = _timed_pass(ctx, ring, target, ids, layer_ids, capture)
            if index >= warmup:
                times[capture].append(elapsed)
                peak[capture] = max(peak[capture], memory_bytes)
                moved[capture] = ctx.counter.bytes(TARGET_CATEGORY)
    results = {}
    for capture in PASSES:
        rows = context_positions(seq_len, world, ring.rank) if capture == "sharded" else torch.arange(seq_len)
        pairs = causal_pairs(rows) * config.num_layers
        results[capture] = (pairs, peak[capture], moved[capture], times[capture])
    return results


def pass_record(seq_len: int, capture: str, per_rank: list[RankPass], config: DecoderConfig) -> TargetPassRecord:
    """The record of one pass from every rank's results: per step the slowest rank's time, the median of
    those (not the slowest rank's median: a rank slow in one step and another slow in the next make
    every step slow, which the ranks' medians both miss), and the largest per-rank counts."""
    steps = tuple(max(step) for step in zip(*(rank[3] for rank in per_rank), strict=True))
    pairs = max(rank[0] for rank in per_rank)
    return TargetPassRecord(
        seq_len, capture, statistics.median(steps), pairs,
        attention_flops(pairs, num_heads=config.num_heads, head_dim=config.head_dim, backward=False) / 1e9,
        max(rank[1] for rank in per_rank) / 2**20, max(rank[2] for rank in per_rank), steps,
    )


def _timed_pass(
    ctx: ParallelContext, ring: Comm, target: Decoder, ids: torch.Tensor, layer_ids: tuple[int, ...], capture: str
) -> tuple[float, int]:
    """One pass: its wall seconds (device synchronised) and peak memory growth on this rank."""
    ctx.counter.reset()
    dist.barrier()
    with PeakMemory(ctx.device) as memory:
        start = time.perf_counter()
        if capture == "sharded":
            capture_sharded_target_features(
                target, ids, layer_ids, comm=ring, cp=ring.size, cp_rank=ring.rank, with_last_hidden=True
            )
        else:
            capture_target_features(target, ids, layer_ids, with_last_hidden=True)
        if ctx.device.type == "cuda":
            torch.cuda.synchronize(ctx.device)
        elapsed = time.perf_counter() - start
    return elapsed, memory.bytes


def pass_order(index: int) -> tuple[str, ...]:
    """The passes of step ``index`` in run order: both every step, the first alternating, so a drift of
    the machine's load (or a cache warmed by the other pass) favours neither."""
    return PASSES if index % 2 == 0 else PASSES[::-1]


def run_target_pass_bench(
    seq_lens: list[int], *, nproc: int, config: DecoderConfig, dtype: torch.dtype = torch.float32,
    warmup: int = 1, repeats: int = 3, device: str = "cpu",
) -> list[TargetPassRecord]:
    """Both passes at every length (one launch of ``nproc`` processes per length)."""
    if nproc < 2:
        raise ValueError(f"--target-pass compares the sharded pass over a CP ring: nproc={nproc} must be >= 2")
    check_zigzag_lengths(seq_lens, nproc)
    records = []
    for seq_len in seq_lens:
        ranks = run_local(_worker, nproc, (config, seq_len, dtype, warmup, repeats), device=device)
        records += [pass_record(seq_len, capture, [r[capture] for r in ranks], config) for capture in PASSES]
    return records


def format_target_table(records: list[TargetPassRecord]) -> str:
    """One line per length and pass, with the sharded/replicated ratio of each column."""
    lines = [
        f"{'seq_len':>8} {'capture':>10} {'time_s':>9} {'±':>4} {'pairs':>12} {'attn_GF':>9} {'peak_MiB':>9} "
        f"{'bytes':>11} {'time_x':>7} {'pairs_x':>7} {'peak_x':>7}"
    ]
    base = {r.seq_len: r for r in records if r.capture == "replicated"}
    marked = False
    for r in records:
        b = base[r.seq_len]
        noisy = b is not r and within_noise(r.times_s, b.times_s)
        marked |= noisy
        lines.append(
            f"{r.seq_len:>8} {r.capture:>10} {r.time_s:>9.4f} {format_spread(r.times_s)} {r.attention_pairs:>12} "
            f"{r.attention_gflops:>9.3f} {r.peak_mib:>9.1f} {r.bytes_moved:>11} "
            f"{r.time_s / b.time_s:>6.3f}{NOISE_MARK if noisy else ' '} "
            f"{r.attention_pairs / b.attention_pairs:>7.3f} {r.peak_mib / max(b.peak_mib, 1e-9):>7.3f}"
        )
    return "\n".join(lines + ([NOISE_NOTE] if marked else []))


def run_target_pass_command(args: argparse.Namespace) -> int:
    """``csbp bench dflash --target-pass``: print (and with ``--json`` write) the side-by-side table."""
    config = DecoderConfig(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, intermediate_size=args.intermediate_size,
        num_layers=args.num_target_layers, num_heads=args.num_heads, num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
    )
    records = run_target_pass_bench(
        args.seq_lens, nproc=args.nproc, config=config, dtype=BENCH_DTYPES[args.dtype], warmup=args.warmup,
        repeats=args.repeats, device=args.device,
    )
    print(
        f"csbp bench dflash --target-pass: nproc={args.nproc} (one CP ring) target={args.num_target_layers}x"
        f"{args.hidden_size} heads={args.num_heads}/{args.num_kv_heads}x{args.head_dim} {args.dtype} "
        f"(per step the slowest rank's time, median of {counted(args.repeats, 'step')}, ± half their range; "
        "x = sharded / replicated)"
    )
    print(format_target_table(records))
    if getattr(args, "json", None):
        write_json_atomic(Path(args.json), [asdict(r) for r in records])
    return 0
