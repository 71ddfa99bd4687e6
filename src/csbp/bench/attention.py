"""``csbp bench attention``: CP-only (generic and mask-aware), BP-only and CSBP attention side by
side on the same inputs, optionally over packed documents (``--doc-length N``). On request
(``--layouts ... bp-balanced csbp-balanced``) also BP-only and CSBP with the ``balanced`` block
schedule (blocks dealt by their cost under the document mask and the window, ``counts.rank_schedule``).

For every sequence length, each layout runs a stack of attention layers (RMSNorm, q/k/v
projection, the layout's attention transport over the ``[x_t ; x_0]`` rows the rank holds,
output projection, residual) forward and backward on ``nproc`` gloo processes of one thread.
Per layout it records the median step time (the slowest rank; every repeat in ``step_times_s``, its
spread in the table's ``±`` column, and a ``~`` on a ratio within it), the attention K/V bytes each rank
sends per step (from the counted collectives layer), the peak memory growth per rank, the
attention FLOPs per rank counted on allowed (unmasked) pairs only, and time per useful FLOP.

All layouts of one sequence length run in the same ``nproc`` processes, their steps interleaved
round-robin (layout A step i, layout B step i, ...) as in ``csbp bench train|dflash``, so a slow
drift of the machine's load hits every layout alike instead of biasing the layouts that run last.
``--ablate-overlap`` also times each layout with its collectives serialized
(``csbp.parallel.comm.serialized_collectives``), alternating step by step with the overlapped steps.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

import torch
from torch import nn

from csbp.attention.backends import check_backend_trains_on
from csbp.attention.diagonal import check_diagonal_backend
from csbp.attention.transports.window import WindowAttention
from csbp.bench.common import (
    BALANCED_LAYOUTS,
    OVERLAP_COLUMNS,
    Column,
    StepMeasurement,
    StepSeries,
    add_head_options,
    add_layout_options,
    add_output_options,
    add_overlap_ablation_option,
    add_transport_option,
    bench_documents,
    check_cell_sequence,
    check_device_option,
    check_head_options,
    format_ratio_table,
    launch_cell,
    layout_schedule,
    layout_transport,
    max_over_ranks,
    measured_step,
    overlap_modes,
    overlap_ratio,
    print_header,
    repeats_of,
    require_parallel,
    select_topologies,
    serialized_if,
    write_outputs,
)
from csbp.bench.measure import allowed_pairs, attention_flops
from csbp.cli.options import add_clean_option, add_diagonal_option, positive_int
from csbp.engine.block_diffusion import build_rank_plan
from csbp.engine.context import build_parallel_context
from csbp.models.decoder import AttentionFn, RMSNorm
from csbp.topology import Topology
from csbp.wording import counted


@dataclass(frozen=True)
class AttentionBenchConfig:
    """Problem size shared by every layout of one benchmark run."""

    seq_len: int
    block_size: int = 16
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    num_layers: int = 1
    window: int | None = None
    transport: str = "collective"
    backend: str = "tiles"
    diagonal: str = "auto"  # kernel of the noisy block diagonal (csbp.attention.diagonal)
    clean: str = "generic"  # kernel of the clean-context partials (csbp.attention.backends.CLEAN_KERNELS)
    doc_length: int | None = None
    schedule: str = "dual_end"  # block schedule of the BP/CSBP layout (``*-balanced``: "balanced")
    warmup: int = 1
    repeats: int = 3
    seed: int = 0
    ablate_overlap: bool = False  # also time serialized collectives (``--ablate-overlap``)


@dataclass(frozen=True)
class AttentionRecord:
    """One row of the benchmark table (and of the ``--json`` output)."""

    layout: str
    cp: int
    bp: int
    seq_len: int
    block_size: int
    nproc: int
    window: int | None
    transport: str
    step_time_s: float
    kv_bytes_per_rank: int
    attn_flops_per_rank: int
    peak_mem_bytes: int
    time_per_gflop_s: float
    # the stack's shape, so `csbp plan calibrate` can fit its cost model to these records
    bench: str = "attention"
    hidden_size: int = 0
    num_layers: int = 0
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    doc_length: int | None = None  # mean packed-document length (None: one document per sample)
    serialized_step_time_s: float | None = None  # ``--ablate-overlap``: collectives waited for at issue
    overlap_ratio: float | None = None  # step_time_s / serialized_step_time_s
    step_times_s: tuple[float, ...] = ()  # every timed repeat (the slowest rank's), in run order
    serialized_step_times_s: tuple[float, ...] = ()  # ``--ablate-overlap``: every serialized repeat


class AttentionStack(nn.Module):
    """``num_layers`` pre-norm attention blocks; the attention itself comes from outside."""

    def __init__(self, cfg: AttentionBenchConfig, width: int) -> None:
        super().__init__()
        self.cfg = cfg
        q_out = cfg.num_heads * cfg.head_dim
        kv_out = cfg.num_kv_heads * cfg.head_dim
        self.norms = nn.ModuleList(RMSNorm(width, 1e-6) for _ in range(cfg.num_layers))
        self.qkv = nn.ModuleList(nn.Linear(width, q_out + 2 * kv_out, bias=False) for _ in range(cfg.num_layers))
        self.out = nn.ModuleList(nn.Linear(q_out, width, bias=False) for _ in range(cfg.num_layers))

    def forward(self, x_SND: torch.Tensor, attention: AttentionFn) -> torch.Tensor:
        cfg = self.cfg
        s, n, _ = x_SND.shape
        h, hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        for i in range(cfg.num_layers):
            qkv = self.qkv[i](self.norms[i](x_SND))
            q, k, v = qkv.split([h * d, hk * d, hk * d], dim=-1)
            q = q.view(s, n, h, d).transpose(1, 2)
            k = k.view(s, n, hk, d).transpose(1, 2)
            v = v.view(s, n, hk, d).transpose(1, 2)
            o = attention(q, k, v, i).transpose(1, 2).reshape(s, n, h * d)
            x_SND = x_SND + self.out[i](o)
        return x_SND


class _LayoutRun:
    """One layout's plan, stack and inputs on this rank, and its measured steps."""

    def __init__(self, topology: Topology, cfg: AttentionBenchConfig) -> None:
        self.cfg = cfg
        self.ctx = build_parallel_context(topology)
        self.plan = build_rank_plan(
            self.ctx, cfg.seq_len, cfg.block_size, transport=cfg.transport, window=cfg.window,  # type: ignore[arg-type]
            schedule=cfg.schedule,  # type: ignore[arg-type]
            backend=cfg.backend, diagonal=cfg.diagonal, clean=cfg.clean,
            documents=bench_documents(cfg.seq_len, cfg.doc_length, cfg.seed),
        )
        width = cfg.num_heads * cfg.head_dim
        torch.manual_seed(cfg.seed)
        self.stack = AttentionStack(cfg, width).to(self.ctx.device)
        # Every rank draws the full 2L inputs with the same seed and keeps its own rows.
        full = torch.randn(2 * cfg.seq_len, width, generator=torch.Generator().manual_seed(cfg.seed + 1))
        logical = self.plan.rows.pos + self.plan.rows.clean.long() * cfg.seq_len
        self.x = full[logical].unsqueeze(0).to(self.ctx.device)
        self.series, self.serial = StepSeries(), StepSeries()
        self.bytes_per_step = 0

    def step(self, it: int) -> None:
        """Step ``it`` (a warm-up step while ``it < warmup``), twice with ``--ablate-overlap``."""
        for serialized in overlap_modes(it, self.cfg.ablate_overlap):
            step = self._measured(serialized)
            if it >= self.cfg.warmup:
                (self.serial if serialized else self.series).add(step)
                self.bytes_per_step = self.ctx.counter.bytes("attention") + self.ctx.counter.bytes("attention_recompute")

    def _measured(self, serialized: bool) -> StepMeasurement:
        """One forward + backward, timed. Its input, output and graph die on return, so the next step's
        peak memory is read from a base that holds nothing of this one."""
        xi = self.x.clone().requires_grad_(True)
        with measured_step(self.ctx.counter) as step, serialized_if(serialized):
            self.stack(xi, self.plan.attention).sum().backward()
        return step

    def summary(self) -> dict[str, float]:
        cfg = self.cfg
        pairs = allowed_pairs(self.plan.rows, block_size=cfg.block_size)
        flops = attention_flops(pairs, num_heads=cfg.num_heads, head_dim=cfg.head_dim) * cfg.num_layers
        return {
            "step_time_s": self.series.median_s(),
            "kv_bytes": float(self.bytes_per_step),
            "flops": float(flops),
            "peak": float(self.series.peak_bytes),
            "serial_step_time_s": self.serial.median_s() if self.serial.times_s else float("nan"),
            "halo": float(isinstance(self.plan.attention, WindowAttention)),  # else the ring's all-gather/ring
            **self.series.repeats_s(),
            **{f"serial_{key}": value for key, value in self.serial.repeats_s().items()},
        }


def _worker(
    rank: int, world: int, topologies: list[Topology], cfgs: tuple[AttentionBenchConfig, ...]
) -> list[dict[str, float]]:
    """All layouts of one length in the same processes (``cfgs[i]`` is layout ``i``'s config: its
    transport and schedule), steps interleaved round-robin so slow drifts hit every layout alike."""
    runs = [_LayoutRun(topology, cfg) for topology, cfg in zip(topologies, cfgs, strict=True)]
    for it in range(cfgs[0].warmup + cfgs[0].repeats):
        for run in runs:
            run.step(it)
    return [run.summary() for run in runs]


def run_attention_bench(
    seq_lens: list[int],
    *,
    nproc: int,
    layouts: list[str],
    csbp_cp: int | None = None,
    timeout_s: float = 1800.0,
    device: str = "cpu",
    header: str | None = None,
    **cfg_kwargs: object,
) -> list[AttentionRecord]:
    """Run every sequence length, all ``layouts`` side by side in one launch of ``nproc`` processes
    (steps interleaved), and return the records in run order.
    ``header`` is printed once every input is checked, before anything runs (a bad input prints
    nothing but its error line)."""
    require_parallel(nproc)  # was: a Topology error about replicate_clean_prefix for --nproc 1
    bases, schedules = zip(*(layout_schedule(name) for name in layouts), strict=True) if layouts else ((), ())
    cell = select_topologies(list(bases), nproc, csbp_cp)
    configs = [AttentionBenchConfig(seq_len=n, **cfg_kwargs) for n in seq_lens]  # type: ignore[arg-type]
    for cfg in configs:  # fail closed before any process starts
        if cfg.warmup < 0 or cfg.repeats < 1:
            raise ValueError(f"warmup must be >= 0 and repeats >= 1, got {cfg.warmup} and {cfg.repeats}")
        check_cell_sequence(cell, cfg.seq_len, cfg.block_size)
    print_header(header)
    records: list[AttentionRecord] = []
    for cfg in configs:
        layout_cfgs = tuple(
            replace(cfg, transport=layout_transport(name, cfg.transport), schedule=schedule)
            for name, schedule in zip(layouts, schedules, strict=True)
        )
        per_layout = launch_cell(_worker, nproc, cell, layout_cfgs, timeout_s=timeout_s, device=device)
        for name, topology, layout_cfg, results in zip(layouts, cell, layout_cfgs, per_layout, strict=True):
            flops = max_over_ranks(results, "flops")
            step = results[0]["step_time_s"]
            serial = results[0]["serial_step_time_s"] if cfg.ablate_overlap else None
            records.append(
                AttentionRecord(
                    layout=name,
                    cp=topology.cp,
                    bp=topology.bp,
                    seq_len=cfg.seq_len,
                    block_size=cfg.block_size,
                    nproc=nproc,
                    window=cfg.window,
                    transport=_transport_used(topology, layout_cfg, halo=results[0]["halo"] > 0),
                    doc_length=cfg.doc_length,
                    step_time_s=step,
                    kv_bytes_per_rank=max_over_ranks(results, "kv_bytes"),
                    attn_flops_per_rank=flops,
                    peak_mem_bytes=max_over_ranks(results, "peak"),
                    time_per_gflop_s=step / (flops / 1e9) if flops else float("nan"),
                    hidden_size=cfg.num_heads * cfg.head_dim,
                    num_layers=cfg.num_layers,
                    num_heads=cfg.num_heads,
                    num_kv_heads=cfg.num_kv_heads,
                    head_dim=cfg.head_dim,
                    serialized_step_time_s=serial,
                    overlap_ratio=overlap_ratio(step, serial),
                    step_times_s=repeats_of(results[0]),
                    serialized_step_times_s=repeats_of(results[0], "serial_repeat_"),
                )
            )
    return records


def _transport_used(topology: Topology, cfg: AttentionBenchConfig, *, halo: bool) -> str:
    """What actually moved K/V: CSBP switches to the halo all-to-all with a window or documents
    where it pays (``transports.factory.halo_pays``), cp-aware is the halo one; every rank of the
    benchmark's one sample decides alike."""
    if topology.layout == "bp":
        return "-"
    return "halo" if halo else ("collective" if cfg.transport == "halo" else cfg.transport)


TABLE_COLUMNS = [
    Column("seq_len", "seq_len", ">8"),
    Column("layout", "layout", "<13"),
    Column("step s", "step_time_s", ">9.3f", vs_cp=True, times="step_times_s", spread=True),
    Column("KV MiB/rank", "kv_bytes_per_rank", ">12.2f", vs_cp=True, shown=lambda v: v / 2**20),
    Column("GFLOP/rank", "attn_flops_per_rank", ">11.3f", vs_cp=True, shown=lambda v: v / 1e9),
    Column("peak MiB", "peak_mem_bytes", ">9.1f", vs_cp=True, shown=lambda v: v / 2**20),
    Column("s/TFLOP", "time_per_gflop_s", ">8.2f", vs_cp=True, shown=lambda v: v * 1e3, times="step_times_s",
           per="attn_flops_per_rank"),
]


def format_table(records: list[AttentionRecord]) -> str:
    """A text table with each metric and its ratio to CP-only at the same sequence length."""
    ablated = any(r.serialized_step_time_s is not None for r in records)
    return format_ratio_table(records, ("seq_len",), TABLE_COLUMNS + (OVERLAP_COLUMNS if ablated else []))


# ----------------------------------------------------------------------------- CLI


def register_attention_bench(kinds: argparse._SubParsersAction) -> None:
    """Add ``csbp bench attention`` to the ``csbp bench`` sub-subcommands."""
    attn = kinds.add_parser("attention", help="CP-only vs BP-only vs CSBP attention (fwd+bwd)")
    add_layout_options(
        attn,
        seq_lens=[1024, 2048, 4096, 8192, 16384],
        csbp_cp_help="CP degree of the CSBP layout (default nproc)",
        extra_layouts=BALANCED_LAYOUTS,
    )
    add_transport_option(attn)
    attn.add_argument("--window", type=positive_int, default=None, help="sliding window W (tokens)")
    add_head_options(attn)
    attn.add_argument("--num-layers", type=positive_int, default=1)
    attn.add_argument(
        "--backend", choices=("auto", "tiles", "flex"), default="auto",
        help="attention backend, the run config's attention.backend (auto: flex on CUDA, tiles on CPU)",
    )
    add_diagonal_option(attn)
    add_clean_option(attn)
    add_overlap_ablation_option(attn)
    add_output_options(attn)
    attn.set_defaults(func=run_attention_bench_command)


def run_attention_bench_command(args: argparse.Namespace) -> int:
    check_head_options(args)  # before anything is printed or launched
    check_device_option(args)
    backend = check_backend_trains_on(args.backend, args.device, where="--backend")
    check_diagonal_backend(args.diagonal, backend, where="--diagonal")
    header = (
        f"csbp bench attention: nproc={args.nproc} block={args.block_size} heads={args.num_heads}/"
        f"{args.num_kv_heads}x{args.head_dim} layers={args.num_layers} window={args.window} "
        f"transport={args.transport} doc_length={args.doc_length} (1 thread per process, median of "
        f"{counted(args.repeats, 'repeat')}, ± half their range)"
    )
    records = run_attention_bench(
        args.seq_lens,
        header=header,
        nproc=args.nproc,
        device=args.device,
        layouts=args.layouts,
        csbp_cp=args.csbp_cp,
        block_size=args.block_size,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        num_layers=args.num_layers,
        window=args.window,
        transport=args.transport,
        backend=backend,
        diagonal=args.diagonal,
        clean=args.clean,
        doc_length=args.doc_length,
        warmup=args.warmup,
        repeats=args.repeats,
        ablate_overlap=args.ablate_overlap,
    )
    write_outputs(format_table(records), records, args)
    return 0
