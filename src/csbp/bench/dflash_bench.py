"""``csbp bench dflash``: DFlash drafter training steps under CP-only, BP-only and CSBP side by side
(csbp.md §14-§15).

For every (anchor count, context length) cell each layout runs complete drafter training steps on
``nproc`` gloo processes of one thread: the drafter forward over the rank's anchor blocks and
context shard (``DFlashStep``), the chunked LM-head loss, backward and gradient averaging over all
ranks. The frozen target is tiny and random; its features are captured before the timer (as an
offline feature store would provide them), the data is random tokens, fully supervised, one
document per row. Anchors are drawn per sample from a generator seeded by (seed, step, sample), so
every layout trains on identical blocks and the step-0 loss must agree across layouts.

Per layout it records the median step time over ``repeats`` steps after ``warmup`` (the slowest
rank), the attention bytes a rank sends per step (context K/V over the CP ring), the peak memory
growth per rank and ``drafter_flops_per_rank``, counted from the rank's actual packet:

* per block row of the packet (dead padding rows included, they are computed) and draft layer:
  q/k/v/o projections and the SwiGLU MLP; per scored row (slots ``1 … B−1`` of live anchors inside
  the sequence) the LM head; per context row the rank holds: the fusion ``fc`` and each layer's
  context k/v projections. Forward ``2·m·n`` per matrix; backward doubles trainable matmuls whose
  input needs a gradient (×3 in all), weight-gradient only for ``fc`` (×2), input-gradient only
  for the frozen head (×2);
* attention: ``B·(B + a − doc_start)`` allowed pairs per live anchor ``a`` per layer
  (``csbp.bench.measure.attention_flops``, forward and backward).

CP-only ranks process *all* anchors of a sample (only context is sharded), so their block-path
FLOPs are ``cp`` times those of a CSBP rank: that replication is what CSBP removes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from csbp.bench.measure import PeakMemory, attention_flops, fixed_mmap_threshold
from csbp.dflash.config import DFlashConfig, DFlashObjectiveConfig, default_target_layer_ids
from csbp.dflash.drafter import DFlashDrafter
from csbp.dflash.features import TargetFeatures, capture_target_features
from csbp.dflash.layouts import AnchorPacket, context_positions, owned_packet
from csbp.dflash.step import DFlashBatch, DFlashStep, build_dflash_rank_plan, sample_batch_anchors
from csbp.engine.context import build_parallel_context
from csbp.engine.grads import average_gradients
from csbp.models.config import DecoderConfig
from csbp.models.decoder import Decoder
from csbp.parallel.launch import run_local
from csbp.topology import Topology

LAYOUTS: tuple[str, ...] = ("cp", "bp", "csbp")
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class DFlashBenchConfig:
    """Models and problem shared by every layout of one (anchors, context length) cell."""

    seq_len: int
    anchors: int
    samples: int = 1
    block_size: int = 16
    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 384
    num_target_layers: int = 2
    num_draft_layers: int = 1
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    dtype: str = "float32"
    warmup: int = 1
    repeats: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {tuple(_DTYPES)}")
        for name in ("samples", "repeats", "anchors", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.anchors > self.seq_len - 1:
            raise ValueError(
                f"anchors={self.anchors} exceeds the {self.seq_len - 1} valid anchors of "
                f"seq_len {self.seq_len}; lower --anchors"
            )

    def target_config(self) -> DecoderConfig:
        return DecoderConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=self.num_target_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
        )

    def drafter_config(self) -> DFlashConfig:
        return DFlashConfig.from_target(
            self.target_config(),
            num_layers=self.num_draft_layers,
            block_size=self.block_size,
            mask_token_id=self.vocab_size - 1,
            target_layer_ids=default_target_layer_ids(self.num_target_layers, self.num_draft_layers),
        )

    def objective(self) -> DFlashObjectiveConfig:
        return DFlashObjectiveConfig(max_anchors=self.anchors)


@dataclass(frozen=True)
class DFlashRecord:
    """One row of the benchmark table (and of the ``--json`` output)."""

    layout: str
    cp: int
    bp: int
    dp: int
    seq_len: int
    anchors: int
    block_size: int
    nproc: int
    samples: int
    step_time_s: float
    drafter_flops_per_rank: int
    attention_bytes_per_rank: int
    peak_mem_bytes: int
    loss_step0: float


def drafter_step_flops(
    config: DFlashConfig, packet: AnchorPacket, num_context_rows: int, seq_len: int
) -> int:
    """Drafter matmul and attention FLOPs of one training step over ``packet`` (module docstring)."""
    hidden, block = config.hidden_size, config.block_size
    q_width, kv_width = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    block_row = 2 * hidden * (2 * q_width + 2 * kv_width) + 6 * hidden * config.intermediate_size
    context_row = 2 * hidden * 2 * kv_width
    live = packet.anchors[packet.keep]
    scored = int((seq_len - 1 - live).clamp(min=0, max=block - 1).sum())
    matmul = 3 * config.num_layers * (len(packet) * block * block_row + num_context_rows * context_row)
    matmul += (
        2 * num_context_rows * 2 * config.feature_width * hidden + 2 * scored * 2 * hidden * config.vocab_size
    )
    pairs = int((block * (block + live - packet.doc_start[packet.keep])).sum()) * config.num_layers
    return matmul + attention_flops(pairs, num_heads=config.num_heads, head_dim=config.head_dim)


def anchor_generator(seed: int, step: int, sample: int) -> torch.Generator:
    """The anchors of global sample ``sample`` at ``step``: the same in every layout."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + sample)


def _batch(ids_GL: torch.Tensor, sample: int) -> DFlashBatch:
    """Sample ``sample`` as a one-row batch: fully supervised, one document."""
    ids = ids_GL[sample : sample + 1]
    return DFlashBatch(ids, torch.ones_like(ids, dtype=torch.bool), torch.zeros_like(ids))


class _LayoutRunner:
    """One layout's drafter, step and process groups on this rank."""

    def __init__(self, topology: Topology, cfg: DFlashBenchConfig, target: Decoder) -> None:
        self.cfg = cfg
        self.ctx = build_parallel_context(topology)
        self.objective = cfg.objective()
        self.plan = build_dflash_rank_plan(self.ctx, self.objective)
        self.drafter = DFlashDrafter(
            cfg.drafter_config(), target=target, dtype=_DTYPES[cfg.dtype], seed=cfg.seed
        )
        self.step_fn = DFlashStep(self.drafter, self.objective, self.plan)
        per_replica = cfg.samples // topology.dp
        first = self.ctx.coords.dp_rank * per_replica
        self.samples = range(first, first + per_replica)
        layout = self.plan.layout
        self.context_rows = int(context_positions(cfg.seq_len, layout.cp, layout.cp_rank).numel())
        self.times: list[float] = []
        self.flops: list[int] = []
        self.peak = self.attention_bytes = 0
        self.loss_step0 = float("nan")

    def _flops(self, batch: DFlashBatch, generator: torch.Generator) -> int:
        cfg, layout = self.cfg, self.plan.layout
        anchors = sample_batch_anchors(batch, self.objective, cfg.block_size, generator)[0]
        minimum = self.objective.anchor_bucket_minimum(layout.num_owners)
        packet = owned_packet(
            anchors, torch.zeros_like(anchors), layout, context="strict", min_bucket=minimum
        )
        return drafter_step_flops(self.drafter.config, packet, self.context_rows, cfg.seq_len)

    def step(self, ids_GL: torch.Tensor, features_GLF: torch.Tensor, index: int, *, measured: bool) -> None:
        """One timed step over this replica's samples; the slowest rank's time is the step time."""
        layer_ids = tuple(self.drafter.config.target_layer_ids or ())
        self.ctx.counter.reset()
        dist.barrier()
        with PeakMemory() as memory:
            start = time.perf_counter()
            self.drafter.zero_grad(set_to_none=True)
            total, values = torch.zeros(()), []
            for sample in self.samples:
                features = TargetFeatures(features_GLF[sample : sample + 1], None, layer_ids)
                out = self.step_fn(
                    _batch(ids_GL, sample), anchor_generator(self.cfg.seed, index, sample), features=features
                )
                total = total + out.loss / len(self.samples)
                values.append(out.loss_value)
            total.backward()
            average_gradients(self.drafter.parameters(), self.ctx.world_comm("gradients"))
            elapsed = time.perf_counter() - start
        slowest = torch.tensor([elapsed], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        if index == 0:  # every rank of a replica holds its replica's loss; average over replicas
            loss = torch.tensor([sum(values) / len(values)], dtype=torch.float64)
            dist.all_reduce(loss)
            self.loss_step0 = float(loss[0]) / dist.get_world_size()
        if measured:
            self.times.append(float(slowest[0]))
            self.flops.append(
                sum(
                    self._flops(_batch(ids_GL, g), anchor_generator(self.cfg.seed, index, g))
                    for g in self.samples
                )
            )
            self.peak = max(self.peak, memory.bytes)
            self.attention_bytes = self.ctx.counter.bytes("attention")

    def summary(self) -> dict[str, float]:
        return {
            "step_time_s": statistics.median(self.times),
            "flops": float(statistics.mean(self.flops)),
            "peak": float(self.peak),
            "attention_bytes": float(self.attention_bytes),
            "loss_step0": self.loss_step0,
        }


def _worker(
    rank: int, world: int, topologies: list[Topology], cfg: DFlashBenchConfig
) -> list[dict[str, float]]:
    """All layouts of one cell in the same processes, steps interleaved round-robin on the same batch."""
    target = Decoder(cfg.target_config(), dtype=_DTYPES[cfg.dtype], seed=cfg.seed + 1)
    runners = [_LayoutRunner(topology, cfg, target) for topology in topologies]
    layer_ids = cfg.drafter_config().target_layer_ids or ()
    data_generator = torch.Generator().manual_seed(cfg.seed + 2)
    for index in range(cfg.warmup + cfg.repeats):
        ids_GL = torch.randint(0, cfg.vocab_size - 1, (cfg.samples, cfg.seq_len), generator=data_generator)
        features_GLF = capture_target_features(target, ids_GL, layer_ids).features
        for runner in runners:
            runner.step(ids_GL, features_GLF, index, measured=index >= cfg.warmup)
    return [runner.summary() for runner in runners]


def dflash_topologies(
    nproc: int, csbp_cp: int | None = None, csbp_bp: int | None = None
) -> dict[str, Topology]:
    """CP-only (cp = nproc), BP-only (bp = nproc) and CSBP (cp x bp, default nproc x nproc; the
    remaining factor of ``nproc`` becomes data parallelism, e.g. cp = bp = 2 on 4 ranks is dp = 2)."""
    cp, bp = csbp_cp or nproc, csbp_bp or nproc
    local = max(cp, bp)
    if nproc % local != 0:
        raise ValueError(
            f"CSBP cp={cp}, bp={bp} uses {local} ranks per sample, which does not divide nproc={nproc}"
        )
    return {
        "cp": Topology(cp=nproc),
        "bp": Topology(bp=nproc, replicate_clean_prefix=True),
        "csbp": Topology(dp=nproc // local, cp=cp, bp=bp),
    }


def run_dflash_bench(
    seq_lens: list[int],
    anchor_counts: list[int],
    *,
    layouts: list[str],
    nproc: int,
    csbp_cp: int | None = None,
    csbp_bp: int | None = None,
    samples: int | None = None,
    timeout_s: float = 1800.0,
    progress: bool = False,
    **cfg_kwargs: object,
) -> list[DFlashRecord]:
    """Run every (anchors, seq_len) cell, all ``layouts`` side by side in one launch per cell."""
    if nproc < 2:
        raise ValueError(f"nproc must be >= 2 to compare parallel layouts, got {nproc}")
    topologies = dflash_topologies(nproc, csbp_cp, csbp_bp)
    unknown = [name for name in layouts if name not in topologies]
    if unknown or not layouts:
        raise ValueError(f"unknown or no layout(s) {unknown}: choose from {sorted(topologies)}")
    cell = [topologies[name] for name in layouts]
    samples = samples or max(t.dp for t in cell)
    if any(samples % t.dp for t in cell):
        raise ValueError(f"samples={samples} must be a multiple of every layout's dp {[t.dp for t in cell]}")
    configs = [
        DFlashBenchConfig(seq_len=n, anchors=a, samples=samples, **cfg_kwargs)  # type: ignore[arg-type]
        for a in anchor_counts
        for n in seq_lens
    ]
    for cfg in configs:  # fail closed before any process starts
        for name, topology in zip(layouts, cell):
            if cfg.seq_len % (2 * topology.cp) != 0:
                raise ValueError(
                    f"seq_len={cfg.seq_len} must be a multiple of 2*cp={2 * topology.cp} ({name})"
                )
            if cfg.anchors < topology.bp:
                raise ValueError(
                    f"anchors={cfg.anchors} must be >= bp={topology.bp} ({name}): every BP rank needs one"
                )
    records: list[DFlashRecord] = []
    for cfg in configs:
        with fixed_mmap_threshold():
            per_rank = run_local(_worker, nproc, (cell, cfg), timeout_s=timeout_s)
        for index, (name, topology) in enumerate(zip(layouts, cell, strict=True)):
            results = [rank_results[index] for rank_results in per_rank]
            step = results[0]["step_time_s"]
            records.append(
                DFlashRecord(
                    layout=name,
                    cp=topology.cp,
                    bp=topology.bp,
                    dp=topology.dp,
                    seq_len=cfg.seq_len,
                    anchors=cfg.anchors,
                    block_size=cfg.block_size,
                    nproc=nproc,
                    samples=cfg.samples,
                    step_time_s=step,
                    drafter_flops_per_rank=int(max(r["flops"] for r in results)),
                    attention_bytes_per_rank=int(max(r["attention_bytes"] for r in results)),
                    peak_mem_bytes=int(max(r["peak"] for r in results)),
                    loss_step0=results[0]["loss_step0"],
                )
            )
            if progress:
                print(f"  anchors={cfg.anchors} L={cfg.seq_len} {name}: {step:.3f} s/step", flush=True)
    return records


def format_table(records: list[DFlashRecord]) -> str:
    """A text table with each metric and its ratio to CP-only at the same anchors and length."""
    base = {(r.anchors, r.seq_len): r for r in records if r.layout == "cp"}
    header = (
        f"{'anchors':>7} {'seq_len':>7} {'layout':<6} {'cp':>3} {'bp':>3} {'dp':>3} {'step s':>8} "
        f"{'x cp':>6} {'GFLOP/rank':>10} {'x cp':>6} {'attn MiB/rank':>13} {'x cp':>6} {'peak MiB':>9} "
        f"{'x cp':>6} {'loss0':>8}"
    )
    lines = [header, "-" * len(header)]

    def ratio(value: float, ref: float | None) -> str:
        return f"{value / ref:6.2f}" if ref else "     -"

    for r in records:
        b = base.get((r.anchors, r.seq_len))
        lines.append(
            f"{r.anchors:>7} {r.seq_len:>7} {r.layout:<6} {r.cp:>3} {r.bp:>3} {r.dp:>3} "
            f"{r.step_time_s:>8.3f} "
            f"{ratio(r.step_time_s, b and b.step_time_s)} {r.drafter_flops_per_rank / 1e9:>10.3f} "
            f"{ratio(r.drafter_flops_per_rank, b and b.drafter_flops_per_rank)} "
            f"{r.attention_bytes_per_rank / 2**20:>13.2f} "
            f"{ratio(r.attention_bytes_per_rank, b and b.attention_bytes_per_rank)} "
            f"{r.peak_mem_bytes / 2**20:>9.1f} {ratio(r.peak_mem_bytes, b and b.peak_mem_bytes)} "
            f"{r.loss_step0:>8.4f}"
        )
    return "\n".join(lines)


def records_as_dicts(records: list[DFlashRecord]) -> list[dict[str, object]]:
    return [asdict(r) for r in records]


# ----------------------------------------------------------------------------- CLI


def register_dflash_bench(kinds: argparse._SubParsersAction) -> None:
    """Add ``csbp bench dflash`` to the ``csbp bench`` sub-subcommands."""
    bench = kinds.add_parser("dflash", help="CP-only vs BP-only vs CSBP DFlash drafter training steps")
    bench.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    bench.add_argument("--anchors", type=int, nargs="+", default=[16, 64], help="anchor blocks per sample")
    bench.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    bench.add_argument("--nproc", type=int, default=4)
    bench.add_argument("--csbp-cp", type=int, default=None, help="CP degree of CSBP (default nproc)")
    bench.add_argument("--csbp-bp", type=int, default=None, help="BP degree of CSBP (default nproc)")
    bench.add_argument("--samples", type=int, default=None, help="samples per step (default: the largest dp)")
    bench.add_argument("--block-size", type=int, default=16)
    bench.add_argument("--vocab-size", type=int, default=1024)
    bench.add_argument("--hidden-size", type=int, default=128)
    bench.add_argument("--intermediate-size", type=int, default=384)
    bench.add_argument("--num-target-layers", type=int, default=2)
    bench.add_argument("--num-draft-layers", type=int, default=1)
    bench.add_argument("--num-heads", type=int, default=4)
    bench.add_argument("--num-kv-heads", type=int, default=2)
    bench.add_argument("--head-dim", type=int, default=32)
    bench.add_argument("--dtype", choices=tuple(_DTYPES), default="float32")
    bench.add_argument("--repeats", type=int, default=3)
    bench.add_argument("--warmup", type=int, default=1)
    bench.add_argument("--json", type=Path, default=None, help="write the records to this JSON file")
    bench.add_argument(
        "--png", type=Path, default=None, help="speedup plot (default: --json with suffix .png)"
    )
    bench.set_defaults(func=run_dflash_bench_command)


def run_dflash_bench_command(args: argparse.Namespace) -> int:
    from csbp.bench.plot import plot_speedups
    from csbp.cli.bench_cmd import write_json_atomic

    print(
        f"csbp bench dflash: nproc={args.nproc} block={args.block_size} drafter={args.num_draft_layers}x"
        f"{args.hidden_size} heads={args.num_heads}/{args.num_kv_heads}x{args.head_dim} "
        f"vocab={args.vocab_size} {args.dtype} (random tokens, 1 thread per process, "
        f"median of {args.repeats})",
        flush=True,
    )
    records = run_dflash_bench(
        args.seq_lens,
        args.anchors,
        layouts=args.layouts,
        nproc=args.nproc,
        csbp_cp=args.csbp_cp,
        csbp_bp=args.csbp_bp,
        samples=args.samples,
        progress=True,
        block_size=args.block_size,
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_target_layers=args.num_target_layers,
        num_draft_layers=args.num_draft_layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        dtype=args.dtype,
        warmup=args.warmup,
        repeats=args.repeats,
    )
    print(format_table(records))
    if args.json is not None:
        write_json_atomic(args.json, records_as_dicts(records))
        print(f"wrote {args.json}")
    png = (
        args.png
        if args.png is not None
        else (args.json.with_suffix(".png") if args.json is not None else None)
    )
    if png is not None:
        if "cp" in args.layouts:
            plot_speedups(records_as_dicts(records), png, group_by="anchors", title="csbp bench dflash")
            print(f"wrote {png}")
        else:
            print("no plot: speedups are relative to CP-only, add 'cp' to --layouts")
    return 0
