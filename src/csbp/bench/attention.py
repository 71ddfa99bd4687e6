"""``csbp bench attention``: CP-only, BP-only and CSBP attention side by side on the same inputs.

For every sequence length, each layout runs a stack of attention layers (RMSNorm, q/k/v
projection, the layout's attention transport over the ``[x_t ; x_0]`` rows the rank holds,
output projection, residual) forward and backward on ``nproc`` gloo processes of one thread.
Per layout it records the median step time (the slowest rank), the attention K/V bytes each rank
sends per step (from the counted collectives layer), the peak memory growth per rank, the
attention FLOPs per rank counted on allowed (unmasked) pairs only, and time per useful FLOP.

All layouts of one sequence length run in the same invocation, one after the other, so ratios
to CP-only are measured side by side on the same machine state.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import nn

from csbp.bench.measure import PeakMemory, allowed_pairs, attention_flops, fixed_mmap_threshold
from csbp.engine.block_diffusion import build_rank_plan
from csbp.engine.context import build_parallel_context
from csbp.models.decoder import AttentionFn, RMSNorm
from csbp.parallel.launch import run_local
from csbp.topology import Topology


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
    warmup: int = 1
    repeats: int = 3
    seed: int = 0


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


def _worker(rank: int, world: int, topology: Topology, cfg: AttentionBenchConfig) -> dict[str, float]:
    ctx = build_parallel_context(topology)
    plan = build_rank_plan(
        ctx, cfg.seq_len, cfg.block_size, transport=cfg.transport, window=cfg.window  # type: ignore[arg-type]
    )
    width = cfg.num_heads * cfg.head_dim
    torch.manual_seed(cfg.seed)
    stack = AttentionStack(cfg, width)
    # Every rank draws the full 2L inputs with the same seed and keeps its own rows.
    full = torch.randn(2 * cfg.seq_len, width, generator=torch.Generator().manual_seed(cfg.seed + 1))
    logical = plan.rows.pos + plan.rows.clean.long() * cfg.seq_len
    x = full[logical].unsqueeze(0)
    times: list[float] = []
    bytes_per_step = 0
    peak = 0
    for it in range(cfg.warmup + cfg.repeats):
        ctx.counter.reset()
        xi = x.clone().requires_grad_(True)
        dist.barrier()
        with PeakMemory() as mem:
            start = time.perf_counter()
            out = stack(xi, plan.attention)
            out.sum().backward()
            elapsed = time.perf_counter() - start
        # the slowest rank bounds the step
        t = torch.tensor([elapsed], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        if it >= cfg.warmup:
            times.append(float(t.item()))
            bytes_per_step = ctx.counter.bytes("attention") + ctx.counter.bytes("attention_recompute")
            peak = max(peak, mem.bytes)
    pairs = allowed_pairs(plan.rows, block_size=cfg.block_size)
    flops = attention_flops(pairs, num_heads=cfg.num_heads, head_dim=cfg.head_dim) * cfg.num_layers
    return {
        "step_time_s": statistics.median(times),
        "kv_bytes": float(bytes_per_step),
        "flops": float(flops),
        "peak": float(peak),
    }


def layout_topologies(nproc: int, csbp_cp: int | None = None) -> dict[str, Topology]:
    """The three layouts compared at ``nproc`` processes (CSBP defaults to cp = bp = nproc)."""
    cp = csbp_cp or nproc
    return {
        "cp": Topology(cp=nproc),
        "bp": Topology(bp=nproc, replicate_clean_prefix=True),
        "csbp": Topology(cp=cp, bp=nproc),
    }


def run_attention_bench(
    seq_lens: list[int],
    *,
    nproc: int,
    layouts: list[str],
    csbp_cp: int | None = None,
    timeout_s: float = 1800.0,
    **cfg_kwargs: object,
) -> list[AttentionRecord]:
    """Run every (sequence length, layout) pair and return the records in run order."""
    topologies = layout_topologies(nproc, csbp_cp)
    unknown = [name for name in layouts if name not in topologies]
    if unknown:
        raise ValueError(f"unknown layout(s) {unknown}: choose from {sorted(topologies)}")
    configs = [AttentionBenchConfig(seq_len=n, **cfg_kwargs) for n in seq_lens]  # type: ignore[arg-type]
    for cfg in configs:  # fail closed before any process starts
        for name in layouts:
            topologies[name].validate_sequence(cfg.seq_len, cfg.block_size)
    records: list[AttentionRecord] = []
    for cfg in configs:
        for name in layouts:
            topology = topologies[name]
            with fixed_mmap_threshold():
                results = run_local(_worker, nproc, (topology, cfg), timeout_s=timeout_s)
            flops = max(r["flops"] for r in results)
            step = results[0]["step_time_s"]
            records.append(
                AttentionRecord(
                    layout=name,
                    cp=topology.cp,
                    bp=topology.bp,
                    seq_len=cfg.seq_len,
                    block_size=cfg.block_size,
                    nproc=nproc,
                    window=cfg.window,
                    transport=cfg.transport if name == "csbp" else "collective",
                    step_time_s=step,
                    kv_bytes_per_rank=int(max(r["kv_bytes"] for r in results)),
                    attn_flops_per_rank=int(flops),
                    peak_mem_bytes=int(max(r["peak"] for r in results)),
                    time_per_gflop_s=step / (flops / 1e9) if flops else float("nan"),
                )
            )
    return records


def format_table(records: list[AttentionRecord]) -> str:
    """A text table with each metric and its ratio to CP-only at the same sequence length."""
    base = {r.seq_len: r for r in records if r.layout == "cp"}
    header = (
        f"{'seq_len':>8} {'layout':<6} {'step s':>9} {'x cp':>6} {'KV MiB/rank':>12} {'x cp':>6} "
        f"{'GFLOP/rank':>11} {'x cp':>6} {'peak MiB':>9} {'x cp':>6} {'s/TFLOP':>8} {'x cp':>6}"
    )
    lines = [header, "-" * len(header)]

    def ratio(value: float, ref: float | None) -> str:
        return f"{value / ref:6.2f}" if ref else "     -"

    for r in records:
        b = base.get(r.seq_len)
        lines.append(
            f"{r.seq_len:>8} {r.layout:<6} {r.step_time_s:>9.3f} {ratio(r.step_time_s, b and b.step_time_s)} "
            f"{r.kv_bytes_per_rank / 2**20:>12.2f} {ratio(r.kv_bytes_per_rank, b and b.kv_bytes_per_rank)} "
            f"{r.attn_flops_per_rank / 1e9:>11.3f} {ratio(r.attn_flops_per_rank, b and b.attn_flops_per_rank)} "
            f"{r.peak_mem_bytes / 2**20:>9.1f} {ratio(r.peak_mem_bytes, b and b.peak_mem_bytes)} "
            f"{r.time_per_gflop_s * 1e3:>8.2f} {ratio(r.time_per_gflop_s, b and b.time_per_gflop_s)}"
        )
    return "\n".join(lines)


def records_as_dicts(records: list[AttentionRecord]) -> list[dict[str, object]]:
    return [asdict(r) for r in records]
