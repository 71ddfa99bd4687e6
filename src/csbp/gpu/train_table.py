"""The single-GPU training table of the device check: a Qwen3-0.6B-shaped decoder (random weights,
the real dimensions) trained with BD3 in bf16 with activation checkpointing at 8K-64K tokens, and a
DFlash drafter step at 64K tokens with 512 anchors.

Each row builds the model on the device, runs ``warmup`` untimed steps and ``repeats`` timed steps
(forward, backward, AdamW; CUDA synchronised around the timer) and reports the median step time
(every timed step in ``step_times_s``; the table's ``±`` is half their min-max range in % of the
median, ``csbp.bench.spread``, ``-`` with one timed step), clean tokens per second (``L`` per sample; BD3 processes ``2L`` rows), achieved TFLOP/s and model
FLOP utilisation against the GPU's dense bf16 peak (``csbp.gpu.flops``), and the peak memory
(``torch.cuda.max_memory_allocated``; on the CPU, the growth of the resident set).

Rows run shortest first inside a time budget: a row whose predicted time exceeds what is left is
reported as skipped, never silently dropped. The prediction (``predict_row_seconds``) keeps the
previous row's one-time costs (model build, the warmup step's compilation of a new shape) as they
were and scales its step time by the square of the length ratio, so a first row dominated by
compilation does not crowd out the next ones. Activation checkpointing is the trainer's
``train.activation_checkpointing`` (``csbp.training.activation_checkpointing``); ``backend`` and
``diagonal`` are its ``attention.backend`` and ``attention.diagonal`` (default ``auto``: flex on
CUDA, tiles on the CPU, as ``csbp train`` runs), checked before the first row (``flex`` cannot
train on the CPU). After the BD3 rows, ``bd3 decomposed`` rows (``decomposed_seq_lens``) train the
same model with CSBP's decomposed attention (the clean context as ``decomposed_clean`` pieces, the noisy
blocks by ``decomposed_diagonal``: ``auto`` is ``flex`` on CUDA, which folds them into the pieces' one Flex
residual, ``csbp.attention.flash_pieces``): on the first H200 run that form's kernel (then with a separate
block-diagonal partial) was 1.25-1.35x one Flex call at 64K-128K, and these rows say what that is worth in
a training step. Then ``bd3 compiled`` rows (``compiled_seq_lens``) train the BD3 rows' model with
``train.compile: layers`` (``csbp.training.compile_regions``: the layers' norms, projections with RoPE
and MLP compiled; the attention as in the BD3 rows): the first H200 table's MFU was 14-20%, and these
rows say how much of the rest the eager elementwise work was. The compilation falls in the warmup step.
Then ``bd3 selective`` rows (``selective_seq_lens``) train it with ``train.activation_checkpointing:
selective`` (each layer's attention results kept, the rest recomputed): against the BD3 rows' ``full``,
what not running the attention twice saves in a step, and what keeping its results costs in memory.

A BD3 row (plain, decomposed or compiled) at one of ``profile_seq_lens`` then runs its step three more
times after its timed steps (``csbp.bench.kernel_profile.profile_step``: one counting the synchronising
calls, one timed, one under ``torch.profiler``; the timing is not disturbed, and the budget's prediction
of the next row counts them among the row's one-time costs): kernels launched, the device's busy time against the step's wall time and the host's time
to issue it, its synchronising calls, the share in matmul and attention kernels, and the costliest
kernels. That answers what the MFU alone cannot: whether the rest of a step is element-wise work (what
compiling removes), the host falling behind the device (launch-bound: busy well under wall), or syncs.

The same code runs on the CPU at tiny sizes (the test suite's dry run); the numbers only mean
something on a GPU.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from csbp.attention.backends import check_backend_trains_on
from csbp.attention.diagonal import check_diagonal_backend
from csbp.bench.kernel_profile import StepProfile, format_profile, profile_step
from csbp.bench.measure import PeakMemory
from csbp.bench.spread import format_spread
from csbp.devices import synchronize, tensors_to
from csbp.dflash.anchors import segment_starts
from csbp.dflash.config import DFlashConfig, DFlashObjectiveConfig, default_target_layer_ids
from csbp.dflash.drafter import DFlashDrafter
from csbp.dflash.features import capture_target_features
from csbp.dflash.layouts import full_packet
from csbp.dflash.rank_plan import build_dflash_rank_plan
from csbp.dflash.step import DFlashBatch, DFlashStep, sample_batch_anchors
from csbp.engine.block_diffusion import build_rank_plan, rank_loss
from csbp.engine.context import single_process_context
from csbp.gpu.flops import QWEN3_0_6B, bd3_step_flops, model_flop_utilisation
from csbp.models.config import DecoderConfig
from csbp.models.decoder import Decoder
from csbp.objectives import build_objective, corruption_generator
from csbp.plan.layout import SHORT_LABELS
from csbp.training.activation_checkpointing import checkpoint_layers
from csbp.training.compile_regions import check_compile_runs_on, compile_layers
from csbp.training.step import autocast_for

StepFn = Callable[[int], float]  # step index -> loss

COMPILE_ALLOWANCE_S = 60.0
"""Seconds a ``bd3 compiled`` row's prediction adds for compiling the layers' regions (forward and
backward, Triton on a GPU: tens of seconds; a new length compiles dynamic shapes once more): the plain row
it is predicted from compiled none of it."""


@dataclass(frozen=True)
class TableConfig:
    """What the table trains (defaults: the device check's rows)."""

    seq_lens: tuple[int, ...] = (8192, 16384, 32768, 65536)
    block_size: int = 16
    model: DecoderConfig = QWEN3_0_6B
    precision: str = "bf16"
    activation_checkpointing: str = "full"
    backend: str = "auto"
    diagonal: str = "auto"
    clean: str = "generic"
    decomposed_seq_lens: tuple[int, ...] = ()  # the device check asks for 32K and 64K
    decomposed_diagonal: str = "auto"  # flex on CUDA: the noisy blocks folded into the clean pieces' Flex residual
    decomposed_clean: str = "pieces-cudnn"
    compiled_seq_lens: tuple[int, ...] = ()  # the device check asks for 8K (non-attention work weighs most) and 32K
    compile: str = "none"  # train.compile of the BD3 rows ("bd3 compiled" rows: layers)
    selective_seq_lens: tuple[int, ...] = ()  # "bd3 selective" rows (the device check: 32K and 64K)
    profile_seq_lens: tuple[int, ...] = ()  # BD3 rows profiled after timing (the device check: 8K)
    profile_top: int = 8
    dflash_seq_len: int | None = 65536
    dflash_anchors: int = 512
    dflash_draft_layers: int = 5
    warmup: int = 1
    repeats: int = 2
    long_step_s: float = 20.0
    budget_s: float = 300.0
    peak_tflops: float | None = None
    seed: int = 0


@dataclass(frozen=True)
class TableRow:
    """One row; the measured fields are None unless ``status == "ok"``."""

    kind: str
    seq_len: int
    status: str
    checkpointing: str
    step_time_s: float | None = None
    tokens_per_s: float | None = None
    tflops: float | None = None
    mfu: float | None = None
    peak_mem_bytes: int | None = None
    loss: float | None = None
    step_times_s: tuple[float, ...] | None = None  # every timed step; ``step_time_s`` is their median
    profile: StepProfile | None = None  # a profiled step after the timed ones (``profile_seq_lens``)



class _PeakBytes:
    """Absolute peak allocated bytes on CUDA, resident-set growth on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.bytes = device, 0
        self._cpu = PeakMemory("cpu")

    def __enter__(self) -> _PeakBytes:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._cpu.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            self.bytes = torch.cuda.max_memory_allocated(self.device)
        else:
            self._cpu.__exit__(*exc)
            self.bytes = self._cpu.bytes


@dataclass(frozen=True)
class Measured:
    """The timed steps of one row."""

    times_s: tuple[float, ...]  # every timed step, in run order
    peak_bytes: int
    loss: float  # the last step's

    @property
    def step_time_s(self) -> float:
        return statistics.median(self.times_s)

    @property
    def steps(self) -> int:
        return len(self.times_s)


def _measure(step: StepFn, cfg: TableConfig, device: torch.device) -> Measured:
    """The timed steps, peak bytes and last loss of ``warmup`` + ``repeats`` steps; a step longer than
    ``long_step_s`` is timed and ends the row (its one-time costs are small against its length, and
    the budget is better spent on the next row). Under ``compile: layers`` the first step compiles the
    layers (tens of seconds on a GPU): it is never timed, and the rule starts from the second step."""
    times: list[float] = []
    peak, loss = 0, float("nan")
    compiling = cfg.compile != "none"
    for index in range(max(cfg.warmup, int(compiling)) + cfg.repeats):
        synchronize(device)
        with _PeakBytes(device) as memory:
            start = time.perf_counter()
            loss = step(index)
            synchronize(device)
            elapsed = time.perf_counter() - start
        if compiling and index == 0:
            continue
        if index >= cfg.warmup or elapsed > cfg.long_step_s:
            times.append(elapsed)
            peak = max(peak, memory.bytes)
        if elapsed > cfg.long_step_s:
            break
    return Measured(tuple(times), peak, loss)


def _optimizer(model: torch.nn.Module, device: torch.device) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.optim.AdamW(params, lr=1e-5, weight_decay=0.0, fused=device.type == "cuda")


def bd3_step_fn(cfg: TableConfig, seq_len: int, device: torch.device) -> tuple[StepFn, str]:
    """A BD3 training step of the table's model at ``seq_len`` and the checkpointing applied."""
    model = Decoder(cfg.model, dtype=torch.float32, device=device, seed=cfg.seed)
    compile_layers(model.layers, cfg.compile)
    checkpoint_layers(model.layers, cfg.activation_checkpointing)  # type: ignore[arg-type]
    plan = build_rank_plan(
        single_process_context(device), seq_len, cfg.block_size, backend=cfg.backend, diagonal=cfg.diagonal,
        clean=cfg.clean,
    )
    mask_token_id = cfg.model.vocab_size - 1
    objective = build_objective("bd3", mask_token_id=mask_token_id, block_size=cfg.block_size)
    optimizer = _optimizer(model, device)
    data = torch.Generator().manual_seed(cfg.seed + 1)

    def step(index: int) -> float:
        ids = torch.randint(0, mask_token_id, (1, seq_len), generator=data)
        batch = objective.corrupt({"input_ids": ids}, corruption_generator(cfg.seed, index, 0))
        batch = tensors_to(batch, device)
        with autocast_for(cfg.precision, device):
            loss, ce_sum = rank_loss(model, batch, plan, global_denominator=batch.denominator(), world_size=1)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(ce_sum) / batch.denominator()

    return step, cfg.activation_checkpointing


def dflash_step_fn(cfg: TableConfig, device: torch.device) -> tuple[StepFn, str, int]:
    """A DFlash drafter step against a frozen target of the table's shape (features captured
    before the timer, as from an offline store), the checkpointing applied and its model FLOPs."""
    from csbp.bench.dflash_flops import drafter_step_flops

    seq_len, model_cfg = int(cfg.dflash_seq_len or 0), cfg.model
    target = Decoder(model_cfg, dtype=torch.float32, device=device, seed=cfg.seed + 1).eval()
    target.requires_grad_(False)
    layer_ids = default_target_layer_ids(model_cfg.num_layers, cfg.dflash_draft_layers)
    drafter_cfg = DFlashConfig.from_target(
        model_cfg, num_layers=cfg.dflash_draft_layers, block_size=cfg.block_size,
        mask_token_id=model_cfg.vocab_size - 1, target_layer_ids=layer_ids,
    )
    drafter = DFlashDrafter(drafter_cfg, target=target, dtype=torch.float32, device=device, seed=cfg.seed + 2)
    checkpoint_layers(drafter.layers, cfg.activation_checkpointing)  # type: ignore[arg-type]
    objective = DFlashObjectiveConfig(max_anchors=cfg.dflash_anchors)
    ctx = single_process_context(device)
    plan = build_dflash_rank_plan(ctx, objective, backend=cfg.backend, diagonal=cfg.diagonal)
    dflash_step = DFlashStep(drafter, objective, plan)
    optimizer = _optimizer(drafter, device)
    ids = torch.randint(0, model_cfg.vocab_size - 1, (1, seq_len), generator=torch.Generator().manual_seed(cfg.seed))
    batch = DFlashBatch(ids, torch.ones_like(ids, dtype=torch.bool), torch.zeros_like(ids))
    with torch.no_grad(), autocast_for(cfg.precision, device):
        features = capture_target_features(target, ids, layer_ids)
    anchors = sample_batch_anchors(batch, objective, cfg.block_size, corruption_generator(cfg.seed, 0, 0))[0]
    packet = full_packet(anchors, segment_starts(batch.doc_ids[0])[anchors])
    flops = drafter_step_flops(drafter_cfg, packet, seq_len, seq_len, model_flops=True)  # MFU as the BD3 rows

    def step(index: int) -> float:
        with autocast_for(cfg.precision, device):
            out = dflash_step(batch, corruption_generator(cfg.seed, 0, 0), features=features)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return out.loss_value

    return step, cfg.activation_checkpointing, flops


def _ok_row(kind: str, seq_len: int, checkpointing: str, measured: Measured, flops: int,
            peak_tflops: float | None, profile: StepProfile | None = None) -> TableRow:
    step_time = measured.step_time_s
    return TableRow(
        profile=profile,
        kind=kind, seq_len=seq_len, status=f"ok ({measured.steps} timed)", checkpointing=checkpointing,
        step_time_s=step_time, tokens_per_s=seq_len / step_time, tflops=flops / step_time / 1e12,
        mfu=model_flop_utilisation(flops, step_time_s=step_time, peak_tflops=peak_tflops),
        peak_mem_bytes=measured.peak_bytes, loss=measured.loss, step_times_s=measured.times_s,
    )


def _run_row(kind: str, seq_len: int, build: Callable[[], TableRow], device: torch.device) -> TableRow:
    """``build()``, reporting out-of-memory and errors as the row's status instead of ending the table."""
    try:
        return build()
    except torch.OutOfMemoryError:
        return TableRow(kind=kind, seq_len=seq_len, status="out of memory", checkpointing="-")
    except Exception as exc:  # noqa: BLE001 - one broken row must not hide the others
        first_line = (str(exc).splitlines() or [""])[0]
        return TableRow(kind=kind, seq_len=seq_len, status=f"error: {type(exc).__name__}: {first_line}",
                        checkpointing="-")
    finally:
        if device.type == "cuda":
            torch.cuda.empty_cache()


def predict_row_seconds(
    prev_seq_len: int, prev_seconds: float, prev_step_s: float | None, seq_len: int, cfg: TableConfig
) -> float:
    """Predicted wall time of a row at ``seq_len`` from the previous row's (``prev_seconds`` in all, its
    median step ``prev_step_s``; None when it measured nothing): its one-time costs plus the steps
    scaled by the square of the length ratio (attention's share grows quadratically, the rest
    linearly: an upper bound); one step when that step will exceed ``long_step_s`` (``_measure``)."""
    growth = (seq_len / prev_seq_len) ** 2
    if prev_step_s is None:
        return prev_seconds * growth
    one_time = max(0.0, prev_seconds - cfg.repeats * prev_step_s)
    step = prev_step_s * growth
    steps = 1 if step > cfg.long_step_s else cfg.warmup + cfg.repeats
    return one_time + steps * step


def run_train_table(
    cfg: TableConfig, device: torch.device, *, progress: Callable[[TableRow], None] | None = None
) -> list[TableRow]:
    """Every BD3 row (shortest first) and the DFlash row, inside ``cfg.budget_s`` (module docstring);
    a backend or diagonal that cannot train on ``device`` fails before the first row."""
    backend = check_backend_trains_on(cfg.backend, device, where="backend")
    check_diagonal_backend(cfg.diagonal, backend, where="diagonal")
    if cfg.decomposed_seq_lens:
        check_diagonal_backend(cfg.decomposed_diagonal, backend, where="decomposed diagonal")
    if cfg.compiled_seq_lens:
        check_compile_runs_on("layers", device, where="compiled rows' train.compile")
    started, rows = time.perf_counter(), []
    previous: tuple[int, float, float | None] | None = None  # (seq_len, seconds the row took, its step time)

    def run(kind: str, seq_len: int, build: Callable[[], TableRow], extra_s: float = 0.0) -> None:
        nonlocal previous
        left = cfg.budget_s - (time.perf_counter() - started)
        predicted = extra_s + (0.0 if previous is None else predict_row_seconds(*previous, seq_len, cfg))
        if left <= 0 or predicted > left:
            row = TableRow(kind=kind, seq_len=seq_len, checkpointing="-",
                           status=f"skipped: predicted {predicted:.0f} s > {max(left, 0):.0f} s left of the budget")
        else:
            row_start = time.perf_counter()
            row = _run_row(kind, seq_len, build, device)
            previous = (seq_len, time.perf_counter() - row_start, row.step_time_s)
        rows.append(row)
        if progress is not None:
            progress(row)

    def bd3_row(kind: str, row_cfg: TableConfig, seq_len: int) -> Callable[[], TableRow]:
        def build() -> TableRow:
            step, checkpointing = bd3_step_fn(row_cfg, seq_len, device)
            flops = bd3_step_flops(cfg.model, seq_len=seq_len, block_size=cfg.block_size)
            measured = _measure(step, row_cfg, device)  # row_cfg: a compiled row's first step is never timed
            profiled = None
            if seq_len in cfg.profile_seq_lens and measured.steps:
                after = cfg.warmup + cfg.repeats  # the next step indices: fresh batches, as in training
                profiled = profile_step(lambda: step(after), device, top=cfg.profile_top)
            return _ok_row(kind, seq_len, checkpointing, measured, flops, cfg.peak_tflops, profiled)

        return build

    plain: dict[int, tuple[int, float, float | None]] = {}  # seq_len -> the plain BD3 row's `previous`
    for seq_len in sorted(cfg.seq_lens):
        run("bd3", seq_len, bd3_row("bd3", cfg, seq_len))
        if previous is not None and previous[0] == seq_len:
            plain[seq_len] = previous
    decomposed = dataclasses.replace(cfg, diagonal=cfg.decomposed_diagonal, clean=cfg.decomposed_clean)
    for seq_len in sorted(cfg.decomposed_seq_lens):
        # predicted from the plain row of the same length (the same model; only the attention kernels differ)
        previous = plain.get(seq_len, previous)
        run("bd3 decomposed", seq_len, bd3_row("bd3 decomposed", decomposed, seq_len))
    compiled = dataclasses.replace(cfg, compile="layers")
    for seq_len in sorted(cfg.compiled_seq_lens):
        previous = plain.get(seq_len, previous)  # as above, plus the compilation in the warmup step
        run("bd3 compiled", seq_len, bd3_row("bd3 compiled", compiled, seq_len), extra_s=COMPILE_ALLOWANCE_S)
    selective = dataclasses.replace(cfg, activation_checkpointing="selective")
    for seq_len in sorted(cfg.selective_seq_lens):
        previous = plain.get(seq_len, previous)  # the same model; at most the plain row's time
        run("bd3 selective", seq_len, bd3_row("bd3 selective", selective, seq_len))
    if cfg.dflash_seq_len:
        def dflash() -> TableRow:
            step, checkpointing, flops = dflash_step_fn(cfg, device)
            measured = _measure(step, cfg, device)
            return _ok_row(f"dflash a={cfg.dflash_anchors}", int(cfg.dflash_seq_len or 0), checkpointing,
                           measured, flops, cfg.peak_tflops)

        previous = None  # a different model: no prediction from the BD3 rows
        run(f"dflash a={cfg.dflash_anchors}", cfg.dflash_seq_len, dflash)
    return rows


def rows_as_dicts(rows: list[TableRow]) -> list[dict[str, object]]:
    return [dataclasses.asdict(row) for row in rows]


def _cell(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def format_train_table(rows: list[TableRow]) -> str:
    """The table as text: one line per row (``±``: the spread of its timed steps), skipped and failed rows
    with their reason, a profiled row's profile on an indented line under it."""
    header = (
        f"{'model':<14} {'tokens':>7} {'ckpt':<5} {'step s':>8} {'±':>4} {'tok/s':>9} {'TFLOP/s':>8} "
        f"{'MFU':>6} {'peak GiB':>9}  status"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        tokens = f"{row.seq_len // 1024}K" if row.seq_len % 1024 == 0 else str(row.seq_len)
        lines.append(
            f"{row.kind:<14} {tokens:>7} {SHORT_LABELS.get(row.checkpointing, row.checkpointing):<5} {_cell(row.step_time_s, '8.3f')} "
            f"{format_spread(row.step_times_s or ())} "
            f"{_cell(row.tokens_per_s, '9.0f')} {_cell(row.tflops, '8.1f')} {_percent(row.mfu):>6} "
            f"{_cell(row.peak_mem_bytes, '9.2f', 2.0**-30)}  {row.status}"
        )
        if row.profile is not None:
            lines.append(format_profile(row.profile))
    return "\n".join(lines)
