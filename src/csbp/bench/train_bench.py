"""``csbp bench train``: full training steps of CP-only (generic and mask-aware ``cp-aware``),
BP-only and CSBP side by side, optionally over packed documents (``--doc-length N``).

For every objective (``bd3``, ``fast_dllm_v2``) and sequence length, each layout runs complete
training steps of a small decoder on ``nproc`` gloo processes of one thread: forward over the
rows the rank holds, the chunked LM-head loss, backward, gradient averaging over all ranks and an
AdamW step. Per layout it records the median step time over ``repeats`` steps after ``warmup``
(the slowest rank bounds a step; every repeat in ``step_times_s``, the table's ``±`` their spread and
``~`` a ratio within it), clean tokens per second, the peak memory growth per rank and
the attention bytes each rank sends in the last timed step (from the counted collectives layer;
``bytes_step``: with ``--doc-length`` the documents are drawn per step, so the bytes depend on
``warmup + repeats``, not only on the code).

The data is random tokens (ids ``0 .. V-2``; ``V-1`` is the mask token), the same on every rank
and fresh each step; corruption is drawn before the timer starts, as a data loader would. Step
time does not depend on the token values, so random data measures exactly what real data would.
Fast-dLLM v2 doubles the batch (two complementary views of each sample); ``tokens_per_s`` counts
the clean tokens of the samples, ``samples * seq_len`` per step, for both objectives.

All layouts of one (objective, length) cell run in the same ``nproc`` processes, their steps
interleaved round-robin on the same batches. Peak memory is the growth of each rank's resident set
over a step (``csbp.bench.measure.PeakMemory``), measured with a fixed glibc mmap threshold so that
freed activations return to the OS between steps.

The step-0 loss is recorded too: every layout starts from the same weights and batch, so it must
agree across layouts (a cheap sanity check that the timed steps compute the same thing).

``--activation-checkpointing none full`` runs every layout twice in the same processes, plain and
with every decoder layer checkpointed (:mod:`csbp.training.activation_checkpointing`), and adds a
table of the peak memory per rank with and without it (the cut) and the step-time cost; the bytes
the recompute sends again are reported as ``recompute MiB/rank``; ``selective`` (keep each layer's
attention results, recompute the rest) adds its rows and its step time against ``full``'s. ``--compile none layers`` likewise
runs every layout eagerly and with ``train.compile: layers`` (:mod:`csbp.training.compile_regions`;
the compilation falls in the untimed warmup step) and adds a table of the step time of each.

``--backend`` (auto, tiles, flex), ``--diagonal`` (``csbp.attention.diagonal``) and ``--clean``
(``csbp.attention.flash_pieces``) are the run config's ``attention`` section, so on a GPU ``--backend
tiles``, ``--backend flex --diagonal sdpa`` and ``--backend flex --clean pieces-cudnn`` compare the
training step per attention kernel; all are recorded in ``--json``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from csbp.attention.backends import check_backend, check_clean
from csbp.attention.diagonal import check_diagonal_backend
from csbp.attention.documents import packed_doc_ids
from csbp.bench.common import (
    BENCH_DTYPES,
    StepSeries,
    bench_documents,
    check_cell_sequence,
    check_run_options,
    launch_cell,
    layout_schedule,
    layout_transport,
    max_over_ranks,
    measured_step,
    print_header,
    repeats_of,
    require_parallel,
    select_topologies,
)
from csbp.devices import backend_device, tensors_to
from csbp.engine.block_diffusion import DocumentPlanner, RankPlan, build_rank_plan, rank_loss
from csbp.engine.context import build_parallel_context
from csbp.engine.grads import average_gradients
from csbp.models.config import DecoderConfig
from csbp.models.decoder import Decoder
from csbp.objectives import CorruptedBatch, build_objective, corruption_generator
from csbp.parallel.comm import RECOMPUTE_PREFIX
from csbp.topology import Topology
from csbp.training.activation_checkpointing import ACTIVATION_CHECKPOINTING_MODES, checkpoint_layers
from csbp.training.compile_regions import COMPILE_MODES, compile_layers

TRAIN_BENCH_OBJECTIVES: tuple[str, ...] = ("bd3", "fast_dllm_v2")


@dataclass(frozen=True)
class TrainBenchConfig:
    """Model and problem shared by every layout of one (objective, sequence length) cell."""

    objective: str
    seq_len: int
    block_size: int = 16
    samples: int = 1
    vocab_size: int = 512
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    dtype: str = "float32"
    transport: str = "collective"
    backend: str = "auto"  # attention.backend of the run config (csbp.attention.backends)
    diagonal: str = "auto"  # attention.diagonal (csbp.attention.diagonal)
    clean: str = "generic"  # attention.clean (csbp.attention.backends.CLEAN_KERNELS)
    doc_length: int | None = None
    layout_transports: tuple[str, ...] = ()  # per layout of the cell (``layout_transport``)
    layout_schedules: tuple[str, ...] = ()  # per layout of the cell (``layout_schedule``)
    activation_checkpointing: tuple[str, ...] = ("none",)
    compile: tuple[str, ...] = ("none",)  # train.compile modes (csbp.training.compile_regions)
    lr: float = 1e-4
    warmup: int = 1
    repeats: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        if self.objective not in TRAIN_BENCH_OBJECTIVES:
            raise ValueError(f"objective {self.objective!r} is not one of {TRAIN_BENCH_OBJECTIVES}")
        check_run_options(self, at_least_one=("samples", "repeats", "vocab_size"))
        check_diagonal_backend(self.diagonal, check_backend(self.backend), where="--diagonal")
        check_clean(self.clean, where="--clean")
        bad = [m for m in self.activation_checkpointing if m not in ACTIVATION_CHECKPOINTING_MODES]
        if bad or not self.activation_checkpointing or len(set(self.activation_checkpointing)) != len(
            self.activation_checkpointing
        ):
            raise ValueError(
                f"--activation-checkpointing {list(self.activation_checkpointing)}: give distinct modes "
                f"from {ACTIVATION_CHECKPOINTING_MODES}"
            )
        if not self.compile or len(set(self.compile)) != len(self.compile) or not set(self.compile) <= set(COMPILE_MODES):
            raise ValueError(f"--compile {list(self.compile)}: give distinct modes from {COMPILE_MODES}")
        if self.compile != ("none",) and self.warmup < 1:  # the first step compiles: never timed
            raise ValueError(f"--compile {' '.join(self.compile)} needs --warmup 1 or more (the first step compiles)")

    def model_config(self) -> DecoderConfig:
        return DecoderConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
        )


@dataclass(frozen=True)
class TrainRecord:
    """One row of the benchmark table (and of the ``--json`` output)."""

    objective: str
    layout: str
    cp: int
    bp: int
    seq_len: int
    block_size: int
    nproc: int
    samples: int
    step_time_s: float
    tokens_per_s: float
    peak_mem_bytes: int
    attention_bytes_per_rank: int
    gradient_bytes_per_rank: int
    loss_step0: float
    activation_checkpointing: str = "none"
    compile: str = "none"
    recompute_bytes_per_rank: int = 0
    # the fastest repeat (least disturbed by other load) and the model's shape, so `csbp plan
    # calibrate` can fit its cost model to these records
    step_time_min_s: float = 0.0
    hidden_size: int = 0
    intermediate_size: int = 0
    num_layers: int = 0
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    vocab_size: int = 0
    dtype: str = "float32"
    transport: str = "collective"
    doc_length: int | None = None  # mean packed-document length (None: one document per sample)
    backend: str = "auto"
    diagonal: str = "auto"
    clean: str = "generic"
    step_times_s: tuple[float, ...] = ()  # every timed repeat (the slowest rank's), in run order
    # the step (0-based, warmup included: warmup + repeats - 1) whose bytes *_bytes_per_rank count
    bytes_step: int = 0


def _attention_bytes(counter_snapshot: dict[str, dict[str, int]]) -> int:
    return sum(entry["bytes"] for name, entry in counter_snapshot.items() if name.startswith("attention"))


class _LayoutRunner:
    """One layout's model, optimizer, rows and process groups on this rank."""

    def __init__(
        self,
        topology: Topology,
        cfg: TrainBenchConfig,
        transport: str,
        activation_checkpointing: str,
        schedule: str = "dual_end",
        compile_mode: str = "none",
    ) -> None:
        self.ctx = build_parallel_context(topology)
        self.plan: RankPlan | DocumentPlanner
        attention = {"backend": cfg.backend, "diagonal": cfg.diagonal, "clean": cfg.clean, "schedule": schedule}
        if cfg.doc_length is None:
            self.plan = build_rank_plan(self.ctx, cfg.seq_len, cfg.block_size, transport=transport, **attention)  # type: ignore[arg-type]
        else:
            self.plan = DocumentPlanner(self.ctx, cfg.seq_len, cfg.block_size, transport=transport, **attention)  # type: ignore[arg-type]
        self.model = Decoder(cfg.model_config(), dtype=BENCH_DTYPES[cfg.dtype], seed=cfg.seed, device=self.ctx.device)
        compile_layers(self.model.layers, compile_mode)
        checkpoint_layers(self.model.layers, activation_checkpointing, self.ctx.counter)  # type: ignore[arg-type]
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=0.0)
        self.series = StepSeries()
        self.attention_bytes = self.gradient_bytes = self.recompute_bytes = 0
        self.loss_step0 = float("nan")

    def step(self, corrupted: CorruptedBatch, *, measured: bool, first: bool) -> None:
        """One timed training step; the slowest rank's time is the step time."""
        ctx = self.ctx
        with measured_step(ctx.counter) as timed:
            self.optimizer.zero_grad(set_to_none=True)
            loss, ce_sum = rank_loss(
                self.model,
                corrupted,
                self.plan,
                global_denominator=corrupted.denominator(),
                world_size=ctx.world_size,
            )
            loss.backward()
            average_gradients(self.model.parameters(), ctx.world_comm("gradients"))
            self.optimizer.step()
        if first:
            total = ce_sum.detach().to(torch.float64).reshape(1)
            dist.all_reduce(total)
            self.loss_step0 = float(total[0]) / corrupted.denominator()
        if measured:
            self.series.add(timed)
            self.attention_bytes = _attention_bytes(ctx.counter.snapshot())
            self.gradient_bytes = ctx.counter.bytes("gradients")
            self.recompute_bytes = _attention_bytes(
                {name[len(RECOMPUTE_PREFIX) :]: entry for name, entry in ctx.counter.snapshot().items()
                 if name.startswith(RECOMPUTE_PREFIX)}
            )

    def summary(self) -> dict[str, float]:
        return {
            "step_time_s": self.series.median_s(),
            "step_time_min_s": min(self.series.times_s),
            "peak": float(self.series.peak_bytes),
            "attention_bytes": float(self.attention_bytes),
            "gradient_bytes": float(self.gradient_bytes),
            "recompute_bytes": float(self.recompute_bytes),
            "loss_step0": self.loss_step0,
            **self.series.repeats_s(),
        }


def _worker(
    rank: int, world: int, topologies: list[Topology], cfg: TrainBenchConfig
) -> list[dict[str, float]]:
    """All layouts of one cell in the same processes, steps interleaved round-robin (layout A step
    i, layout B step i, ...) on the same batch, so slow drifts of the machine hit every layout alike;
    runners are ordered layout-major, then activation-checkpointing mode, then compile mode."""
    transports = cfg.layout_transports or (cfg.transport,) * len(topologies)
    schedules = cfg.layout_schedules or ("dual_end",) * len(topologies)
    runners = [
        _LayoutRunner(topology, cfg, transport, mode, schedule, compile_mode)
        for topology, transport, schedule in zip(topologies, transports, schedules, strict=True)
        for mode in cfg.activation_checkpointing
        for compile_mode in cfg.compile
    ]
    mask_token_id = cfg.vocab_size - 1
    objective = build_objective(cfg.objective, mask_token_id=mask_token_id, block_size=cfg.block_size)
    data_generator = torch.Generator().manual_seed(cfg.seed + 1)
    for step in range(cfg.warmup + cfg.repeats):
        ids_SL = torch.randint(0, mask_token_id, (cfg.samples, cfg.seq_len), generator=data_generator)
        batch = {"input_ids": ids_SL}
        if cfg.doc_length is not None:
            batch["doc_ids"] = torch.stack([
                packed_doc_ids(bench_documents(cfg.seq_len, cfg.doc_length, cfg.seed * 7919 + step, sample))
                for sample in range(cfg.samples)
            ])
        corrupted = objective.corrupt(batch, corruption_generator(cfg.seed, step, 0))
        corrupted = tensors_to(corrupted, backend_device())
        for runner in runners:
            runner.step(corrupted, measured=step >= cfg.warmup, first=step == 0)
    return [runner.summary() for runner in runners]


def run_train_bench(
    seq_lens: list[int],
    *,
    objectives: list[str],
    layouts: list[str],
    nproc: int,
    csbp_cp: int | None = None,
    timeout_s: float = 1800.0,
    progress: bool = False,
    device: str = "cpu",
    header: str | None = None,
    **cfg_kwargs: object,
) -> list[TrainRecord]:
    """Run every (objective, sequence length) cell, all ``layouts`` side by side in one launch of
    ``nproc`` processes per cell, and return the records in run order.
    ``header`` is printed once every input is checked, before anything runs (a bad input prints
    nothing but its error line)."""
    require_parallel(nproc)
    bases, schedules = zip(*(layout_schedule(name) for name in layouts), strict=True) if layouts else ((), ())
    cell = select_topologies(list(bases), nproc, csbp_cp)
    transports = tuple(layout_transport(name, str(cfg_kwargs.get("transport", "collective"))) for name in layouts)
    configs = [
        TrainBenchConfig(
            objective=name, seq_len=n, layout_transports=transports, layout_schedules=tuple(schedules), **cfg_kwargs  # type: ignore[arg-type]
        )
        for name in objectives
        for n in seq_lens
    ]
    for cfg in configs:  # fail closed before any process starts
        check_cell_sequence(cell, cfg.seq_len, cfg.block_size)
    print_header(header)
    records: list[TrainRecord] = []
    for cfg in configs:
        per_runner = launch_cell(_worker, nproc, cell, cfg, timeout_s=timeout_s, device=device)
        runs = [(name, topology, mode, compile_mode) for name, topology in zip(layouts, cell, strict=True)
                for mode in cfg.activation_checkpointing for compile_mode in cfg.compile]
        for (name, topology, mode, compile_mode), results in zip(runs, per_runner, strict=True):
            step = results[0]["step_time_s"]
            records.append(
                TrainRecord(
                    objective=cfg.objective,
                    layout=name,
                    cp=topology.cp,
                    bp=topology.bp,
                    seq_len=cfg.seq_len,
                    block_size=cfg.block_size,
                    nproc=nproc,
                    samples=cfg.samples,
                    doc_length=cfg.doc_length,
                    step_time_s=step,
                    tokens_per_s=cfg.samples * cfg.seq_len / step,
                    peak_mem_bytes=max_over_ranks(results, "peak"),
                    attention_bytes_per_rank=max_over_ranks(results, "attention_bytes"),
                    gradient_bytes_per_rank=max_over_ranks(results, "gradient_bytes"),
                    loss_step0=results[0]["loss_step0"],
                    activation_checkpointing=mode,
                    compile=compile_mode,
                    recompute_bytes_per_rank=max_over_ranks(results, "recompute_bytes"),
                    step_time_min_s=results[0]["step_time_min_s"],
                    hidden_size=cfg.hidden_size,
                    intermediate_size=cfg.intermediate_size,
                    num_layers=cfg.num_layers,
                    num_heads=cfg.num_heads,
                    num_kv_heads=cfg.num_kv_heads,
                    head_dim=cfg.head_dim,
                    vocab_size=cfg.vocab_size,
                    dtype=cfg.dtype,
                    transport=layout_transport(name, cfg.transport),
                    backend=cfg.backend,
                    diagonal=cfg.diagonal,
                    clean=cfg.clean,
                    step_times_s=repeats_of(results[0]),
                    bytes_step=cfg.warmup + cfg.repeats - 1,
                )
            )
            if progress:
                print(f"  {cfg.objective} L={cfg.seq_len} {name} ac={mode} compile={compile_mode}: {step:.3f} s/step",
                      flush=True)
    return records
