"""``csbp bench dflash``: DFlash drafter training steps under CP-only, BP-only and CSBP side by side
(csbp.md §14-§15), and with packed documents (``--doc-length``) the mask-aware ``cp-aware``.

For every (anchor count, context length) cell each layout runs complete drafter training steps on
``nproc`` gloo processes of one thread: the drafter forward over the rank's anchor blocks and
context shard (``DFlashStep``), the chunked LM-head loss, backward and gradient averaging over all
ranks. The frozen target is tiny and random; its features are captured before the timer (as an
offline feature store would provide them), or with ``target_capture`` ``sharded``/``replicated``
(``--target-capture``) by the step itself inside the timer (the online pass of
``objective.dflash.target_capture``; its ``dflash.target`` bytes are recorded), the data is random tokens, fully supervised, one
document per row, or with ``doc_length`` random documents of that mean length per row
(``csbp.bench.common.bench_documents``). Anchors are drawn per sample from a generator seeded by
(seed, step, sample), so every layout trains on identical blocks and the step-0 loss must agree
across layouts.

With documents CSBP moves only the context rows its anchors may see (``csbp.dflash.exchange``), and
so does ``cp-aware`` (CP-only's topology with ``transport: halo``); ``cp`` all-gathers whole
context shards, as generic context parallelism does. With ``sliding_window`` (``--sliding-window
W``: every draft layer slides) CSBP exchanges only its anchors' window rows with one document per
row too; ``csbp-gather`` is CSBP with the all-gather kept (``topology.transport: streaming``, which
DFlash runs as the all-gather), so the two exchanges' bytes stand side by side in one run.

Per layout it records the median step time over ``repeats`` steps after ``warmup`` (the slowest
rank; every repeat in ``step_times_s``, the table's ``±`` their spread and ``~`` a ratio within it; with ``--ablate-overlap`` also with the collectives serialized, the two alternating step by
step in the same processes), the attention bytes a rank sends in the last timed step (context K/V
over the CP ring; ``bytes_step``: documents and anchors are drawn per step, so with documents the
bytes depend on ``warmup + repeats``, not only on the code), the peak memory
growth per rank and ``drafter_flops_per_rank``, counted from the rank's actual packet
(``csbp.bench.dflash_flops``).

CP-only ranks process *all* anchors of a sample (only context is sharded), so their block-path
FLOPs are ``cp`` times those of a CSBP rank: that replication is what CSBP removes.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist

from csbp.attention.documents import packed_doc_ids
from csbp.bench.common import (
    BENCH_DTYPES,
    OVERLAP_COLUMNS,
    Column,
    StepSeries,
    bench_documents,
    check_run_options,
    format_ratio_table,
    launch_cell,
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
)
from csbp.bench.dflash_flops import drafter_step_flops
from csbp.devices import backend_device
from csbp.dflash.anchors import segment_starts
from csbp.dflash.config import DFlashConfig, DFlashObjectiveConfig, default_target_layer_ids
from csbp.dflash.drafter import DFlashDrafter
from csbp.dflash.features import TargetFeatures, capture_target_features
from csbp.dflash.layouts import context_positions, owned_packet
from csbp.dflash.rank_plan import build_dflash_rank_plan
from csbp.dflash.step import DFlashBatch, DFlashStep, sample_batch_anchors
from csbp.dflash.target_shard import TARGET_CAPTURES, TARGET_CATEGORY
from csbp.engine.context import build_parallel_context
from csbp.engine.grads import average_gradients
from csbp.models.config import DecoderConfig
from csbp.models.decoder import Decoder
from csbp.topology import Topology

TARGET_CAPTURE_CHOICES = ("offline", *TARGET_CAPTURES)
"""``--target-capture``: features captured before the timer, or the step's online target pass."""

GATHER_LAYOUTS = {"csbp-gather": "csbp"}
"""``csbp bench dflash`` layouts that run another's topology with the context all-gather kept
(``transport: streaming``): the baseline of CSBP's context exchange, in the same run."""


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
    doc_length: int | None = None  # mean packed-document length (None: one document per row)
    sliding_window: int | None = None  # every draft layer slides with this W (None: full attention)
    layout_transports: tuple[str, ...] = ()  # per layout of the cell (``layout_transport``)
    ablate_overlap: bool = False  # also time serialized collectives (``--ablate-overlap``)
    target_capture: str = "offline"  # offline: features captured before the timer; else the step's online pass

    def __post_init__(self) -> None:
        check_run_options(self, at_least_one=("samples", "repeats", "anchors", "block_size"))
        if self.target_capture not in TARGET_CAPTURE_CHOICES:
            raise ValueError(f"target_capture={self.target_capture!r} must be one of {TARGET_CAPTURE_CHOICES}")
        if self.doc_length is not None and self.doc_length < 2:
            raise ValueError(
                f"doc_length={self.doc_length} leaves no valid anchor (an anchor and its next token share a "
                "document): use --doc-length >= 2"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window={self.sliding_window} must be >= 1")
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
            **self._sliding(),
        )

    def _sliding(self) -> dict[str, object]:
        if self.sliding_window is None:
            return {}
        return {"layer_types": ("sliding_attention",) * self.num_draft_layers, "sliding_window": self.sliding_window}

    def objective(self) -> DFlashObjectiveConfig:
        online = self.target_capture != "offline"
        return DFlashObjectiveConfig(max_anchors=self.anchors, target_capture=self.target_capture if online else "sharded")


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
    # the drafter's shape, so `csbp plan calibrate` can fit its cost model to these records
    bench: str = "dflash"
    hidden_size: int = 0
    intermediate_size: int = 0
    num_layers: int = 0
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    vocab_size: int = 0
    feature_width: int = 0
    dtype: str = "float32"
    doc_length: int | None = None
    sliding_window: int | None = None
    serialized_step_time_s: float | None = None  # ``--ablate-overlap``: collectives waited for at issue
    overlap_ratio: float | None = None  # step_time_s / serialized_step_time_s
    target_capture: str = "offline"  # ``--target-capture``: offline features, or the step's online pass
    target_bytes_per_rank: int = 0  # dflash.target: the online sharded pass's K/V all-gathers
    step_times_s: tuple[float, ...] = ()  # every timed repeat (the slowest rank's), in run order
    serialized_step_times_s: tuple[float, ...] = ()  # ``--ablate-overlap``: every serialized repeat
    # the step (0-based, warmup included: warmup + repeats - 1) whose bytes *_bytes_per_rank count
    bytes_step: int = 0


def anchor_generator(seed: int, step: int, sample: int) -> torch.Generator:
    """The anchors of global sample ``sample`` at ``step``: the same in every layout."""
    return torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + sample)


def doc_ids(cfg: DFlashBenchConfig, sample: int, step: int) -> torch.Tensor:
    """``[1, L]`` document ids of global sample ``sample`` at ``step`` (zeros: one document)."""
    documents = bench_documents(cfg.seq_len, cfg.doc_length, cfg.seed + step, sample)
    if documents is None:
        return torch.zeros(1, cfg.seq_len, dtype=torch.long)
    return packed_doc_ids(documents)[None]


def _batch(ids_GL: torch.Tensor, doc_ids_GL: torch.Tensor, sample: int) -> DFlashBatch:
    """Sample ``sample`` as a one-row batch, fully supervised."""
    ids = ids_GL[sample : sample + 1]
    return DFlashBatch(ids, torch.ones_like(ids, dtype=torch.bool), doc_ids_GL[sample : sample + 1])


class _LayoutRunner:
    """One layout's drafter, step and process groups on this rank."""

    def __init__(self, topology: Topology, cfg: DFlashBenchConfig, target: Decoder, transport: str) -> None:
        self.cfg = cfg
        self.ctx = build_parallel_context(topology)
        self.objective = cfg.objective()
        self.plan = build_dflash_rank_plan(self.ctx, self.objective, transport=transport)
        self.drafter = DFlashDrafter(
            cfg.drafter_config(), target=target, dtype=BENCH_DTYPES[cfg.dtype], device=self.ctx.device,
            seed=cfg.seed,
        )
        self.step_fn = DFlashStep(self.drafter, self.objective, self.plan)
        per_replica = cfg.samples // topology.dp
        first = self.ctx.coords.dp_rank * per_replica
        self.samples = range(first, first + per_replica)
        layout = self.plan.layout
        self.context_rows = int(context_positions(cfg.seq_len, layout.cp, layout.cp_rank).numel())
        self.series, self.serial_series = StepSeries(), StepSeries()
        self.flops: list[int] = []
        self.attention_bytes = self.target_bytes = 0
        self.loss_step0 = float("nan")

    def _flops(self, batch: DFlashBatch, generator: torch.Generator) -> int:
        cfg, layout = self.cfg, self.plan.layout
        anchors = sample_batch_anchors(batch, self.objective, cfg.block_size, generator)[0]
        minimum = self.objective.anchor_bucket_minimum(layout.num_owners)
        doc_start = segment_starts(batch.doc_ids[0])[anchors]
        packet = owned_packet(anchors, doc_start, layout, context="strict", min_bucket=minimum)
        return drafter_step_flops(self.drafter.config, packet, self.context_rows, cfg.seq_len)

    def step(
        self, ids_GL: torch.Tensor, doc_ids_GL: torch.Tensor, features_GLF: torch.Tensor | None, index: int, *,
        measured: bool, serialized: bool = False,
    ) -> None:
        """One timed step over this replica's samples; the slowest rank's time is the step time.
        ``serialized``: collectives waited for at issue, timed into ``serial_series`` only."""
        layer_ids = tuple(self.drafter.config.target_layer_ids or ())
        with measured_step(self.ctx.counter) as timed, serialized_if(serialized):
            self.drafter.zero_grad(set_to_none=True)
            total, values = torch.zeros((), device=self.ctx.device), []
            for sample in self.samples:
                features = None  # online: the step runs the frozen target inside the timer
                if features_GLF is not None:
                    features = TargetFeatures(features_GLF[sample : sample + 1], None, layer_ids)
                out = self.step_fn(
                    _batch(ids_GL, doc_ids_GL, sample), anchor_generator(self.cfg.seed, index, sample),
                    features=features,
                )
                total = total + out.loss / len(self.samples)
                values.append(out.loss_value)
            total.backward()
            average_gradients(self.drafter.parameters(), self.ctx.world_comm("gradients"))
        if serialized:
            if measured:
                self.serial_series.add(timed)
            return
        if index == 0:  # every rank of a replica holds its replica's loss; average over replicas
            loss = torch.tensor([sum(values) / len(values)], dtype=torch.float64, device=self.ctx.device)
            dist.all_reduce(loss)
            self.loss_step0 = float(loss[0]) / dist.get_world_size()
        if measured:
            self.series.add(timed)
            self.flops.append(
                sum(
                    self._flops(_batch(ids_GL, doc_ids_GL, g), anchor_generator(self.cfg.seed, index, g))
                    for g in self.samples
                )
            )
            self.attention_bytes = self.ctx.counter.bytes("attention")
            self.target_bytes = self.ctx.counter.bytes(TARGET_CATEGORY)

    def summary(self) -> dict[str, float]:
        return {
            "step_time_s": self.series.median_s(),
            "flops": float(statistics.mean(self.flops)),
            "peak": float(self.series.peak_bytes),
            "attention_bytes": float(self.attention_bytes),
            "target_bytes": float(self.target_bytes),
            "loss_step0": self.loss_step0,
            "serial_step_time_s": self.serial_series.median_s() if self.serial_series.times_s else float("nan"),
            **self.series.repeats_s(),
            **{f"serial_{key}": value for key, value in self.serial_series.repeats_s().items()},
        }


def _worker(
    rank: int, world: int, topologies: list[Topology], cfg: DFlashBenchConfig
) -> list[dict[str, float]]:
    """All layouts of one cell in the same processes, steps interleaved round-robin on the same batch."""
    target = Decoder(cfg.target_config(), dtype=BENCH_DTYPES[cfg.dtype], seed=cfg.seed + 1, device=backend_device())
    transports = cfg.layout_transports or ("collective",) * len(topologies)
    runners = [
        _LayoutRunner(topology, cfg, target, transport) for topology, transport in zip(topologies, transports)
    ]
    layer_ids = cfg.drafter_config().target_layer_ids or ()
    data_generator = torch.Generator().manual_seed(cfg.seed + 2)
    for index in range(cfg.warmup + cfg.repeats):
        ids_GL = torch.randint(0, cfg.vocab_size - 1, (cfg.samples, cfg.seq_len), generator=data_generator)
        doc_ids_GL = torch.cat([doc_ids(cfg, sample, index) for sample in range(cfg.samples)])
        features_GLF = None
        if cfg.target_capture == "offline":
            features_GLF = capture_target_features(target, ids_GL, layer_ids, doc_ids_SL=doc_ids_GL).features
        for runner in runners:
            for serialized in overlap_modes(index, cfg.ablate_overlap):
                runner.step(ids_GL, doc_ids_GL, features_GLF, index, measured=index >= cfg.warmup, serialized=serialized)
    return [runner.summary() for runner in runners]


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
    device: str = "cpu",
    header: str | None = None,
    **cfg_kwargs: object,
) -> list[DFlashRecord]:
    """Run every (anchors, seq_len) cell, all ``layouts`` side by side in one launch per cell.
    ``header`` is printed once every input is checked, before anything runs (a bad input prints
    nothing but its error line)."""
    require_parallel(nproc)
    cell = select_topologies([GATHER_LAYOUTS.get(name, name) for name in layouts], nproc, csbp_cp, csbp_bp)
    samples = samples or max(t.dp for t in cell)
    if any(samples % t.dp for t in cell):
        raise ValueError(f"samples={samples} must be a multiple of every layout's dp {[t.dp for t in cell]}")
    transports = tuple(
        "streaming" if name in GATHER_LAYOUTS else layout_transport(name, "collective") for name in layouts
    )
    configs = [
        DFlashBenchConfig(seq_len=n, anchors=a, samples=samples, layout_transports=transports, **cfg_kwargs)  # type: ignore[arg-type]
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
    print_header(header)
    records: list[DFlashRecord] = []
    for cfg in configs:
        per_layout = launch_cell(_worker, nproc, cell, cfg, timeout_s=timeout_s, device=device)
        for name, topology, results in zip(layouts, cell, per_layout, strict=True):
            step = results[0]["step_time_s"]
            serial = results[0]["serial_step_time_s"] if cfg.ablate_overlap else None
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
                    drafter_flops_per_rank=max_over_ranks(results, "flops"),
                    attention_bytes_per_rank=max_over_ranks(results, "attention_bytes"),
                    peak_mem_bytes=max_over_ranks(results, "peak"),
                    loss_step0=results[0]["loss_step0"],
                    hidden_size=cfg.hidden_size,
                    intermediate_size=cfg.intermediate_size,
                    num_layers=cfg.num_draft_layers,
                    num_heads=cfg.num_heads,
                    num_kv_heads=cfg.num_kv_heads,
                    head_dim=cfg.head_dim,
                    vocab_size=cfg.vocab_size,
                    feature_width=cfg.drafter_config().feature_width,
                    dtype=cfg.dtype,
                    doc_length=cfg.doc_length,
                    sliding_window=cfg.sliding_window,
                    serialized_step_time_s=serial,
                    overlap_ratio=overlap_ratio(step, serial),
                    target_capture=cfg.target_capture,
                    target_bytes_per_rank=max_over_ranks(results, "target_bytes"),
                    step_times_s=repeats_of(results[0]),
                    serialized_step_times_s=repeats_of(results[0], "serial_repeat_"),
                    bytes_step=cfg.warmup + cfg.repeats - 1,
                )
            )
            if progress:
                print(f"  anchors={cfg.anchors} L={cfg.seq_len} {name}: {step:.3f} s/step", flush=True)
    return records


TABLE_COLUMNS = [
    Column("anchors", "anchors", ">7"),
    Column("seq_len", "seq_len", ">7"),
    Column("layout", "layout", "<11"),
    Column("cp", "cp", ">3"),
    Column("bp", "bp", ">3"),
    Column("dp", "dp", ">3"),
    Column("step s", "step_time_s", ">8.3f", vs_cp=True, times="step_times_s", spread=True),
    Column("GFLOP/rank", "drafter_flops_per_rank", ">10.3f", vs_cp=True, shown=lambda v: v / 1e9),
    Column("attn MiB/rank", "attention_bytes_per_rank", ">13.2f", vs_cp=True, shown=lambda v: v / 2**20),
    Column("peak MiB", "peak_mem_bytes", ">9.1f", vs_cp=True, shown=lambda v: v / 2**20),
    Column("loss0", "loss_step0", ">8.4f"),
]


def format_table(records: list[DFlashRecord]) -> str:
    """A text table with each metric and its ratio to CP-only at the same anchors and length."""
    ablated = any(r.serialized_step_time_s is not None for r in records)
    return format_ratio_table(records, ("anchors", "seq_len"), TABLE_COLUMNS + (OVERLAP_COLUMNS if ablated else []))
