"""``csbp bench kernels --layouts``: one rank's attention under each parallel layout, on one device.

The forms of ``csbp.bench.kernels`` are one device's view of a layout's kernels (``mixed``: CP-only's
rows, ``decomposed``: CSBP's). This module times what one rank of a real topology computes instead:
its packed rows from ``csbp.attention.layouts.rank_layout`` (dual-end block schedule), its transport
from ``csbp.attention.transports.factory.build_attention`` (the local partial, the remote partials over
the other ring members' rows, their fp32 merges, the backward from the merged statistics, the casts),
exactly as training builds them for that rank. Only the wire is left out: ``LocalRing`` stands in for
the ring's ``Comm``, its all-gather returning this rank's shard once per member (the bytes every member
would send), its reduce-scatter summing the gathered gradients locally and its ring shift handing back a
copy of what is sent (the streaming transport), so the row is the rank's kernel time, not its network's.

Per (length, block size, backend, topology) it times the *busiest* rank (the most allowed pairs; a
step waits for its slowest rank) and reports the rate per allowed pair against dense SDPA over all
pairs of the same shapes: the rank's query rows against every key row its partials read (its own rows
and the other members' exchanged rows). That is the issue's "every layout's attention" rate, measured
per layout rather than inferred from the two forms. Full attention over one document only: the halo
exchanges of sliding windows and packed documents move other rows, and ``csbp bench attention`` times
those layouts with their traffic.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from csbp.attention.diagonal import resolve_diagonal
from csbp.attention.flex_backward import flex_backward_mode, resolve_flex_backward
from csbp.attention.layouts import RankLayout, rank_layout
from csbp.attention.transports.factory import build_attention
from csbp.bench.kernel_timing import build_and_time, compiled_graphs, dense_sdpa_times, median
from csbp.bench.kernels import DTYPES, KernelRecord
from csbp.bench.measure import allowed_pairs, attention_flops
from csbp.bench.spread import rates_within_noise
from csbp.parallel.comm import Pending
from csbp.plan.layout import parse_topology
from csbp.topology import Topology


class LocalRing:
    """The collectives of a ring of ``size`` members, on one device and without the wire (see the module
    doc): the shapes, and the bytes that would arrive, of ``csbp.parallel.comm.Comm``'s (the collective
    transport's all-gather and reduce-scatter, the streaming transport's ring shift)."""

    def __init__(self, size: int, rank: int, category: str = "attention") -> None:
        self.size, self.rank, self.category = size, rank, category

    def all_gather(self, shard: Tensor, async_op: bool = False, *, category: str | None = None) -> tuple[Tensor, Pending]:
        """``[P*n, ...]``: this rank's shard once per member (a copy of what every member sends)."""
        out = shard.repeat(self.size, *([1] * (shard.dim() - 1)))
        return out, Pending([], out)

    def reduce_scatter(self, full: Tensor, async_op: bool = False, *, category: str | None = None) -> tuple[Tensor, Pending]:
        """``[n, ...]``: the ``P`` chunks of ``full`` summed (what the reduction computes somewhere)."""
        out = full.reshape(self.size, full.shape[0] // self.size, *full.shape[1:]).sum(0)
        return out, Pending([], out)

    def ring_shift_async(self, send: Tensor, direction: int = -1, *, category: str | None = None) -> Pending:
        """What the neighbour sends: a copy of ``send`` (every member holds this rank's shard, and the
        streaming transport's gradient accumulator comes back summed over every hop)."""
        return Pending([], send.clone())


def parse_topologies(texts: Sequence[str]) -> list[Topology]:
    """``["cp4", "bp8", "cp4/bp8"]`` -> one sample's topologies (no ``dp``: a rank's work does not depend
    on it); fails closed on an invalid layout or a ``dp`` axis."""
    topologies = []
    for text in texts:
        dp, cp, bp = parse_topology(text, name="--layouts")
        if dp != 1 or (cp, bp) == (1, 1):
            raise ValueError(f"--layouts {text!r}: name one sample's ranks, cpA, bpB or cpA/bpB (no dp), "
                             "e.g. cp4 bp4 cp4/bp8")
        topologies.append(Topology(cp=cp, bp=bp, replicate_clean_prefix=cp == 1))
    return topologies


def topology_name(topology: Topology) -> str:
    """``cp4/bp8``, ``cp4`` or ``bp4``: the text ``parse_topologies`` reads back."""
    return "/".join(f"{axis}{degree}" for axis, degree in (("cp", topology.cp), ("bp", topology.bp)) if degree > 1)


def check_layouts(topologies: Sequence[Topology], seq_lens: Sequence[int], block_sizes: Sequence[int]) -> None:
    """Every topology's sequence constraints at every (length, block size), before anything runs."""
    for topology in topologies:
        for seq_len in seq_lens:
            for block in block_sizes:
                try:
                    topology.validate_sequence(seq_len, block)
                except ValueError as error:
                    raise ValueError(f"--layouts {topology_name(topology)} at L={seq_len} B={block}: {error}") from None


def busiest_rank(topology: Topology, seq_len: int, block: int) -> tuple[int, RankLayout, int]:
    """``(local rank, its layout, its allowed pairs)`` of the rank with the most allowed pairs (the first
    of equals)."""
    best: tuple[int, RankLayout, int] | None = None
    for rank in range(topology.local):
        layout = rank_layout(topology, rank, seq_len, block)
        pairs = allowed_pairs(layout.rows, block_size=block)
        if best is None or pairs > best[2]:
            best = (rank, layout, pairs)
    assert best is not None
    return best


def key_rows(topology: Topology, layout: RankLayout, seq_len: int) -> int:
    """Key rows the rank's partials read: its own rows plus the other ring members' exchanged rows (CP-only
    exchanges all ``2L`` rows, CSBP the ``L`` clean ones, BP-only nothing)."""
    if topology.layout == "cp":
        return 2 * seq_len
    if topology.layout == "csbp":
        return layout.num_noisy + seq_len
    return len(layout.rows)


RING_TRANSPORTS = ("collective", "streaming")
"""The full-attention ring transports a rank row may run (``--layout-transports``)."""


def has_ring(topology: Topology) -> bool:
    """Whether ``topology``'s ranks exchange clean K/V over a ring (CP-only, CSBP): they run a transport."""
    return topology.layout in ("cp", "csbp")


def rank_step(
    topology: Topology, rank: int, layout: RankLayout, seq_len: int, block: int, inputs: tuple[Tensor, ...], *,
    backend: str, clean: str, diagonal: str = "auto", transport: str = "collective",
) -> Callable[[], None]:
    """One forward + backward of the rank's attention through its transport (``LocalRing`` for a ring)."""
    ring = LocalRing(topology.cp, rank % topology.cp) if has_ring(topology) else None
    device = inputs[0].device
    attention = build_attention(
        topology, rank, layout, ring, block_size=block, backend=backend, diagonal=diagonal, clean=clean, device=device,
        transport="collective" if transport == "-" else transport,  # type: ignore[arg-type]
    )  # type: ignore[arg-type]  # LocalRing has the collectives the ring transports call
    q, k, v, dout = inputs
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]

    def step() -> None:
        for leaf in leaves:
            leaf.grad = None
        attention(*leaves).backward(dout)

    return step


def rank_inputs(
    num_rows: int, num_keys: int, *, heads: int, kv_heads: int, head_dim: int, device: torch.device,
    dtype: torch.dtype, seed: int,
) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """``(q, k, v, dout)`` over the rank's rows and ``(q, k, v, dout)`` of dense attention over its shapes
    (``num_rows`` queries x ``num_keys`` keys)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def draw(h: int, n: int) -> Tensor:
        return torch.randn(1, h, n, head_dim, device=device, dtype=dtype, generator=gen)

    mine = (draw(heads, num_rows), draw(kv_heads, num_rows), draw(kv_heads, num_rows), draw(heads, num_rows))
    dense = (mine[0], draw(kv_heads, num_keys), draw(kv_heads, num_keys), mine[3])
    return mine, dense


def rank_rate(
    times: Sequence[float], pairs: int, dense_times: Sequence[float], dense_pairs: int, num_heads: int, head_dim: int
) -> tuple[float, float, bool]:
    """``(TFLOP/s on allowed pairs, that rate / dense's, whether the two overlap over the repeats)``."""
    step_s, dense_s = median(times), median(dense_times)
    flops = {"num_heads": num_heads, "head_dim": head_dim}
    rate = attention_flops(pairs, **flops) / step_s / 1e12
    dense_rate = attention_flops(dense_pairs, **flops) / dense_s / 1e12
    return rate, rate / dense_rate, rates_within_noise(list(times), pairs, list(dense_times), dense_pairs)


def run_rank_rows(
    seq_lens: Sequence[int],
    block_sizes: Sequence[int],
    backends: Sequence[str],
    topologies: Sequence[Topology],
    *,
    device: torch.device,
    dtype: str,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    warmup: int,
    repeats: int,
    clock: str,
    clean_kernels: Sequence[str] = ("generic",),
    transports: Sequence[str] = ("collective",),
    flex_backward: str = "auto",
    progress: Callable[[KernelRecord], None] | None = None,
) -> list[KernelRecord]:
    """Per length and block size, per variant (backend, clean-context kernel, ring transport) and per
    topology, in that order (every layout with the first variant before any with the second: a run cut
    short by a time limit has them all), the busiest rank's attention step (``form="rank"``), its rate per
    allowed pair and that rate against dense SDPA over the rank's shapes (timed once per length, block size
    and topology). BP-only has no ring: it runs once per backend and clean kernel, transport ``-``. Inputs
    are checked by the caller (``run_kernel_bench``'s checks plus ``check_layouts`` and
    ``check_clean_kernels``)."""
    resolved = resolve_flex_backward(flex_backward, where="--flex-backward")
    heads = {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim}
    timing = {"warmup": warmup, "repeats": repeats, "clock": clock}
    variants = [(b, c, t) for b in dict.fromkeys(backends) for c in clean_kernels for t in transports]
    records: list[KernelRecord] = []
    with flex_backward_mode(flex_backward):  # merged flex partials differentiate this way, as in the forms
        for seq_len in seq_lens:
            for block in block_sizes:
                ranks: dict[int, _PreparedRank] = {}  # per topology (index), built on first use
                for backend, clean, transport in variants:
                    for index, topology in enumerate(topologies):
                        transport_here = transport if has_ring(topology) else "-"
                        if transport_here == "-" and transport != transports[0]:
                            continue  # no ring: timed once, with the first transport's turn
                        if index not in ranks:
                            ranks[index] = _prepare_rank(topology, seq_len, block, device, DTYPES[dtype], heads, timing)
                        prepared = ranks[index]
                        graphs_before = compiled_graphs()
                        _, build_s, first_s, times = build_and_time(
                            functools.partial(rank_step, topology, prepared.rank, prepared.layout, seq_len, block,
                                              prepared.inputs, backend=backend, clean=clean, transport=transport_here),
                            device, warmup, repeats, clock, label=f"L={seq_len} B={block} {backend} "
                            f"{topology_name(topology)} rank {prepared.rank} {clean} {transport_here}",
                        )
                        record = _rank_record(
                            str(device), dtype, topology, prepared.rank, prepared.layout, seq_len, block, backend,
                            clean, transport_here, pairs=prepared.pairs, num_keys=prepared.num_keys, times=times,
                            dense_times=prepared.dense_times, first_s=first_s, build_s=build_s,
                            graphs=compiled_graphs() - graphs_before,
                            flex_backward=resolved if backend == "flex" else "-", **heads,
                        )
                        records.append(record)
                        if progress is not None:
                            progress(record)
    return records


@dataclass(frozen=True)
class _PreparedRank:
    """One topology's busiest rank at one (length, block size): its layout, inputs and dense baseline."""

    rank: int
    layout: RankLayout
    pairs: int
    num_keys: int
    inputs: tuple[Tensor, ...]
    dense_times: tuple[float, ...]


def _prepare_rank(
    topology: Topology, seq_len: int, block: int, device: torch.device, dtype: torch.dtype, heads: dict[str, int],
    timing: dict[str, object],
) -> _PreparedRank:
    rank, layout, pairs = busiest_rank(topology, seq_len, block)
    num_keys = key_rows(topology, layout, seq_len)
    inputs, dense_inputs = rank_inputs(
        len(layout.rows), num_keys, heads=heads["num_heads"], kv_heads=heads["num_kv_heads"],
        head_dim=heads["head_dim"], device=device, dtype=dtype, seed=seq_len + block,
    )
    dense_times = dense_sdpa_times(*dense_inputs, device, timing["warmup"], timing["repeats"], timing["clock"])
    return _PreparedRank(rank, layout, pairs, num_keys, inputs, dense_times)


def _rank_record(
    device: str, dtype: str, topology: Topology, rank: int, layout: RankLayout, seq_len: int, block: int,
    backend: str, clean: str, transport: str, *, pairs: int, num_keys: int, times: tuple[float, ...],
    dense_times: tuple[float, ...], first_s: float, build_s: float, graphs: int, flex_backward: str,
    num_heads: int, num_kv_heads: int, head_dim: int,
) -> KernelRecord:
    """One rank row: its median time, its rate per allowed pair and that rate against dense over its shapes."""
    rate, vs_dense, noisy = rank_rate(times, pairs, dense_times, len(layout.rows) * num_keys, num_heads, head_dim)
    return KernelRecord(
        device, dtype, seq_len, block, backend, "rank", resolve_diagonal("auto", backend, block), clean,
        median(times), pairs, rate, vs_dense, math.nan, build_s, 0, first_s, graphs, flex_backward,
        times_s=times, vs_dense_within_noise=noisy, topology=topology_name(topology), rank=rank,
        dense_shape=(len(layout.rows), num_keys), transport=transport,
    )
