"""The training loop: ``train(cfg, run_dir=..., resume=..., max_steps=...) -> TrainSummary``.

Call it on every rank of an initialised process group whose world size is the topology's
``dp * max(cp, bp)`` (or in a plain single process for a world of one); :mod:`csbp.training.launcher`
does that for ``csbp train``. Order of work:

1. lock the run directory on global rank 0 (:mod:`~csbp.training.train_lock`), validate the config
   against its data and the run directory (:func:`~csbp.training.preflight.check_run`);
2. build the parallel context, the model (FSDP-sharded when ``train.fsdp``), AdamW, the lr
   schedule, and the train loader keyed by ``dp_rank`` (every rank of one replica loads the same
   batch);
3. with ``resume``, restore the latest checkpoint (model, optimizer, scheduler, loader cursor, RNG,
   the ``train.nan_policy: skip`` streak);
4. run steps ``start + 1 .. stop`` (:mod:`csbp.training.step_loop`, one step in
   :mod:`csbp.training.step`); gradients are averaged over all ranks while the last backward of the
   step runs (:mod:`csbp.engine.grad_buckets`; FSDP: its own reduce-scatter hooks), then clip, step
   the optimizer and the scheduler (a non-finite step: :mod:`csbp.training.nan_policy`); log,
   evaluate and checkpoint on schedule;
5. at the end: validate (when validation is on), checkpoint, export ``final/`` as a Hugging Face
   checkpoint with the tokenizer, print a sample (``train.generate_after``), draw ``loss.png``.

``objective.name: dflash`` trains a DFlash drafter against a frozen target instead
(:mod:`csbp.training.drafter`, :mod:`csbp.training.dflash_step`): the model that is optimised,
averaged, checkpointed and resumed is the drafter; ``final/`` is the public DFlash drafter format.

``max_steps`` stops the run after that global step (default ``train.max_steps``) without changing
the learning-rate schedule, so ``--max-steps k`` then ``--resume`` reproduces an uninterrupted run.
Only rank 0 writes ``config.yaml``, metrics, plots and the export; all ranks write their DCP shards.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from csbp.attention.backends import check_backend_trains_on
from csbp.attention.diagonal import check_diagonal_backend
from csbp.attention.flex_backward import set_flex_backward
from csbp.config.loading import write_config
from csbp.config.schema import RunConfig
from csbp.data.loader import PackedLoader
from csbp.devices import device_for_rank, select_device
from csbp.dflash.drafter import DFlashDrafter
from csbp.engine.block_diffusion import DocumentPlanner, RankPlan, build_rank_plan
from csbp.engine.context import ParallelContext, build_parallel_context
from csbp.parallel.groups import release_process_groups
from csbp.training.activation_checkpointing import checkpoint_layers
from csbp.training.checkpoint import load_checkpoint
from csbp.training.compile_regions import check_compile_runs_on, compile_layers
from csbp.training.dflash_step import DFlashStepRunner
from csbp.training.drafter import build_drafter, dflash_eval_hint
from csbp.training.finish import finish_on_rank0
from csbp.training.lr_schedule import build_lr_scheduler
from csbp.training.metrics import METRICS_FILE, MetricsWriter, read_metrics
from csbp.training.model_factory import build_model, with_trained_arch
from csbp.training.model_flops import corrupted_flops
from csbp.training.nan_policy import MAX_SKIPPED_STEPS, NonFiniteTraining, SkipStreak
from csbp.training.optim import apply_optim_config, build_optimizer
from csbp.training.out_of_memory import named_out_of_memory
from csbp.training.parallelize import apply_fsdp, gradient_sync_for
from csbp.training.preflight import RunInputs, check_run
from csbp.training.step import StepRunner
from csbp.training.step_loop import StepHook, StepLoop
from csbp.training.stop_request import StopRequest, stop_on_sigusr1, stopped_line
from csbp.training.summary import RunHistory, TrainSummary
from csbp.training.train_lock import train_run_dir_lock
from csbp.training.weight_average import WeightAverage, weights_record

__all__ = [
    "MAX_SKIPPED_STEPS",
    "STARTUP_TIMEOUT_S",
    "NonFiniteTraining",
    "StepHook",
    "TrainSummary",
    "default_run_dir",
    "stop_step_of",
    "train",
    "training_device",
]

STARTUP_TIMEOUT_S = 300.0
"""World-group limit outside the step loop (start-up, resume, the final export); see ``collective_timeout``."""
def default_run_dir(cfg: RunConfig) -> Path:
    """``run.run_dir``, else ``runs/<run.name>`` under the working directory."""
    return Path(cfg.run.run_dir) if cfg.run.run_dir is not None else Path("runs") / cfg.run.name


@contextlib.contextmanager
def collective_timeout(seconds: float) -> Iterator[None]:
    """Bound the world group's collectives (barriers, DCP) by ``seconds`` during the step loop.

    Before it (start-up, resume) and after it (rank 0 alone writes ``final/`` while the others wait)
    the launch's longer start-up limit applies; the sub-groups carry ``seconds`` from creation. All
    ranks enter together (a barrier), so rank-0-only set-up such as opening TensorBoard is not
    mistaken for a stalled rank."""
    if not dist.is_initialized():
        yield
        return
    dist.barrier()
    _set_world_timeout(timedelta(seconds=seconds))
    try:
        yield
    finally:
        _set_world_timeout(timedelta(seconds=max(seconds, STARTUP_TIMEOUT_S)))


def _set_world_timeout(timeout: timedelta) -> None:
    """Set the world group's collective timeout: ``dist.set_timeout`` where torch has it (2.14 on; it
    deprecates the private ``_set_pg_timeout`` with a FutureWarning every rank would print), else that."""
    set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout
    set_timeout(timeout)


def stop_step_of(cfg: RunConfig, max_steps: int | None) -> int:
    """The global step this invocation stops after."""
    if max_steps is not None and max_steps < 1:
        raise ValueError(f"--max-steps: {max_steps} must be >= 1")
    if max_steps is not None and max_steps > cfg.train.max_steps:
        raise ValueError(
            f"--max-steps: {max_steps} is past the schedule's end, train.max_steps={cfg.train.max_steps} "
            f"(fix: --set train.max_steps={max_steps} to train longer, or --max-steps <= {cfg.train.max_steps})"
        )
    return cfg.train.max_steps if max_steps is None else max_steps


def training_device() -> torch.device:
    """``cuda:<LOCAL_RANK>`` (made the current device) when CUDA is available, else the CPU."""
    kind = "cuda" if torch.cuda.is_available() else "cpu"
    device = device_for_rank(kind, int(os.environ.get("LOCAL_RANK", "0")))
    select_device(device)
    return device


def rank_plan_for(cfg: RunConfig, ctx: ParallelContext) -> RankPlan | DocumentPlanner:
    """This rank's rows and attention for the run's objective and topology (per sample's documents
    when ``data.document_mask`` is on)."""
    obj, topo, seq_len = cfg.objective, cfg.topology, cfg.data.seq_len
    single_stream = obj.name in ("mdlm", "ar")
    block_size = seq_len if obj.name == "mdlm" else 1 if obj.name == "ar" else int(obj.block_size or 0)
    if cfg.document_mask:
        return DocumentPlanner(
            ctx, seq_len, block_size, uses_clean_stream=not single_stream, causal=obj.name == "ar",
            transport=topo.transport, window=topo.window, schedule=topo.schedule,
            reset_positions=cfg.data.reset_positions, backend=cfg.attention.backend,
            diagonal=cfg.attention.diagonal, clean=cfg.attention.clean,
        )
    return build_rank_plan(
        ctx,
        seq_len,
        block_size,
        uses_clean_stream=not single_stream,
        causal=obj.name == "ar",
        transport=topo.transport,
        window=topo.window,
        schedule=topo.schedule,
        backend=cfg.attention.backend,
        diagonal=cfg.attention.diagonal,
        clean=cfg.attention.clean,
    )


def train(
    cfg: RunConfig,
    *,
    run_dir: str | Path | None = None,
    resume: bool = False,
    max_steps: int | None = None,
    hook: StepHook | None = None,
    lock_run_dir: bool = True,
) -> TrainSummary:
    """Train ``cfg`` on this rank (see the module docstring); ``hook`` may stop the run early.
    Global rank 0 holds ``run_dir``'s lock throughout (:mod:`csbp.training.train_lock`), unless
    ``lock_run_dir`` is False because the caller holds it (``csbp train``'s launcher does)."""
    run_dir = Path(run_dir) if run_dir is not None else default_run_dir(cfg)
    device = training_device()  # selected before any process group is created
    request = StopRequest()
    # SIGUSR1 is noted from start-up (a resume's load can take minutes) through the export: outside the
    # step loop it ended the process by the signal's default action, silently, with no final/
    with train_run_dir_lock(run_dir, resume=resume, enabled=lock_run_dir), stop_on_sigusr1(request):
        return _train(cfg, run_dir, device, request, resume=resume, max_steps=max_steps, hook=hook)


def _train(
    cfg: RunConfig, run_dir: Path, device: torch.device, request: StopRequest, *, resume: bool, max_steps: int | None,
    hook: StepHook | None,
) -> TrainSummary:
    stop_step = stop_step_of(cfg, max_steps)
    inputs = check_run(cfg, run_dir=run_dir, resume=resume, stop_step=stop_step)
    if inputs.dflash is None:  # record the arch of the model trained (an init_from checkpoint's own)
        cfg = with_trained_arch(cfg, inputs.decoder_config)
    started = time.perf_counter()
    backend = check_backend_trains_on(cfg.attention.backend, device, float64=cfg.train.precision == "fp64")
    check_diagonal_backend(cfg.attention.diagonal, backend, where="attention.diagonal")  # auto resolved here
    if backend == "flex":
        set_flex_backward(cfg.attention.flex_backward)  # process-wide, like torch's SDPA kernel choice
    check_compile_runs_on(cfg.train.compile, device)
    if dist.is_initialized():
        dist.barrier()  # every rank is past its pre-flight: group creation below is quick everywhere
    ctx = build_parallel_context(
        cfg.topology.to_topology(), device, timeout=timedelta(seconds=cfg.train.collective_timeout_s)
    )
    is_rank0 = ctx.coords.rank == 0
    torch.manual_seed(cfg.run.seed)

    model: torch.nn.Module
    if inputs.dflash is not None:
        model = build_drafter(cfg, inputs.dflash, device=device, resume=resume)
        compile_layers(model.layers, cfg.train.compile)
        compile_layers(model.target.layers, cfg.train.compile)  # the frozen target's feature pass
        checkpoint_layers(model.layers, cfg.train.activation_checkpointing, ctx.counter)
    else:
        shard = (lambda decoder: apply_fsdp(decoder, ctx, device)) if cfg.train.fsdp else None
        model = build_model(cfg, inputs.decoder_config, device=device, shard=shard, counter=ctx.counter)
    optimizer = build_optimizer(model, cfg.optim, device)
    average = WeightAverage(model, cfg.optim.ema_decay) if cfg.optim.ema_decay is not None else None
    scheduler = build_lr_scheduler(optimizer, cfg.optim, max_steps=cfg.train.max_steps)
    loader = PackedLoader(
        inputs.artifact.split("train"),
        batch_size=cfg.train.micro_batch_size,
        seed=cfg.run.seed,
        dp_rank=ctx.coords.dp_rank,
        dp_size=cfg.topology.dp,
    )
    start_step, skips_in_a_row = 0, 0
    if resume:
        state = load_checkpoint(
            run_dir,
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            loader=loader,
            data_fingerprint=inputs.artifact.fingerprint,
            average=average,
        )
        apply_optim_config(optimizer, scheduler, cfg.optim)  # a changed optim section applies from here
        start_step, skips_in_a_row = state.step, state.nan_skips_in_a_row
    if is_rank0:
        write_config(cfg, run_dir)
    runner = step_runner_for(cfg, inputs, ctx, model, device)
    if resume and state.clip_window is not None and isinstance(runner, StepRunner):  # the window the search chose
        runner.objective = dataclasses.replace(runner.objective, t_min=state.clip_window[0], t_max=state.clip_window[1])
    runner.grad_sync = gradient_sync_for(model, ctx, fsdp=cfg.train.fsdp)
    writer = MetricsWriter(run_dir, enabled=is_rank0, start_step=start_step, total_steps=cfg.train.max_steps)
    note = first_step_note(cfg.train.compile, backend)
    if note is not None:
        writer.message(note)
    if inputs.dflash is not None and cfg.train.generate_after:
        writer.message(f"note: train.generate_after does not apply to dflash; {dflash_eval_hint(cfg, run_dir)}")
    if resume:
        note = weight_average_note(state.ema_updates, average, state.step)
        if note is not None:
            writer.message(note)
    streak = SkipStreak(cfg.train.nan_policy, in_a_row=skips_in_a_row)
    loop = StepLoop(
        cfg, inputs, ctx, runner, model, optimizer, scheduler, loader, writer, run_dir, device, hook, streak, average,
        request,
    )
    try:
        with collective_timeout(cfg.train.collective_timeout_s), named_out_of_memory(
            cfg, rank=ctx.coords.rank, device=device, step=lambda: loop.last_step
        ):
            last_checkpoint = loop.run(start_step, stop_step, started)
        stop_step = loop.last_step
        final_dir, sample = None, None
        if loop.stopped_by_signal:  # checkpointed, not finished: no final/ (csbp.training.stop_request)
            writer.message(stopped_line(stop_step, last_checkpoint, run_dir))
        else:
            weights = None if average is None else weights_record(True, average.decay, average.updates)
            with average.swapped_in() if average is not None else contextlib.nullcontext():  # export the average
                final_dir, sample = finish_on_rank0(cfg, inputs, model, run_dir, is_rank0=is_rank0, weights=weights)
        if ctx.groups is not None and not cfg.train.fsdp:  # every rank is past finish's barrier
            # FSDP's groups stay: torch's DTensor caches key meshes by their ranks, not their groups,
            # so a later FSDP run in this process over the same ranks would reach the destroyed ones
            release_process_groups(ctx.groups)
    except BaseException:
        # the run's own error is the one to report: on a full disk drawing loss.png fails too
        with contextlib.suppress(Exception):
            writer.close()
        raise
    writer.close()
    return TrainSummary(
        run_dir=run_dir,
        start_step=start_step,
        end_step=stop_step,
        total_steps=cfg.train.max_steps,
        elapsed_s=time.perf_counter() - started,
        losses=loop.losses,
        val_losses=loop.val_losses,
        checkpoint=last_checkpoint,
        final_dir=final_dir,
        sample=sample,
        val_nelbos=loop.val_nelbos,
        skipped_steps=loop.skipped_steps,
        speeds=loop.speeds,
        ema_decay=cfg.optim.ema_decay,
        earlier=RunHistory.from_records(read_metrics(run_dir / METRICS_FILE), up_to_step=start_step)
        if is_rank0 and start_step > 0 else RunHistory(),
        stopped_by_signal=loop.stopped_by_signal,
    )


def weight_average_note(stored_updates: int | None, average: WeightAverage | None, step: int) -> str | None:
    """The note a resume prints when ``optim.ema_decay`` was switched on or off since the checkpoint."""
    if average is not None and stored_updates is None:
        return (f"note: optim.ema_decay: the checkpoint of step {step} has no weight average; it starts from the "
                "resumed weights")
    if average is None and stored_updates is not None:
        return f"note: optim.ema_decay is unset: the weight average of step {step}'s checkpoint is dropped"
    return None


def first_step_note(compile_mode: str, backend: str) -> str | None:
    """The start-up note for a run whose first step compiles (``train.compile``, the flex backend), or
    None: a first step of seconds to minutes must not read as a hang, nor its rate as the run's."""
    compiled = ([f"train.compile={compile_mode} compiles the layers"] if compile_mode != "none" else []) + (
        ["attention.backend flex compiles its FlexAttention kernels"] if backend == "flex" else []
    )
    if not compiled:
        return None
    return (
        f"note: {' and '.join(compiled)} during the first step and the first validation pass (slower: that "
        "step's tokens_per_s and mfu include it); later steps reuse the compiled code"
    )


def step_runner_for(
    cfg: RunConfig, inputs: RunInputs, ctx: ParallelContext, model: torch.nn.Module, device: torch.device
) -> StepRunner | DFlashStepRunner:
    """The per-rank step/validation runner of the run's objective."""
    if inputs.dflash is not None:
        assert isinstance(model, DFlashDrafter)
        return DFlashStepRunner(
            model,
            inputs.dflash.objective,
            ctx,
            device=device,
            precision=cfg.train.precision,
            seed=cfg.run.seed,
            total_steps=cfg.train.max_steps,
            features=inputs.dflash.feature_store(inputs.artifact.split("train")),
            backend=cfg.attention.backend,
            diagonal=cfg.attention.diagonal,
            clean=cfg.attention.clean,
            transport=cfg.topology.transport,
            eos_id=inputs.artifact.special_ids["eos"],
            served_prompts=cfg.objective.dflash.eval_prompts if cfg.objective.dflash is not None else 0,
            served_new_tokens=cfg.objective.dflash.eval_new_tokens if cfg.objective.dflash is not None else 64,
        )
    return StepRunner(
        model,
        inputs.build_objective(),
        rank_plan_for(cfg, ctx),
        ctx,
        device=device,
        precision=cfg.train.precision,
        seed=cfg.run.seed,
        ce_chunk_rows=cfg.objective.ce_chunk_rows,
        flops=functools.partial(
            corrupted_flops, config=inputs.decoder_config, causal=cfg.objective.name == "ar",
            window=cfg.topology.window, document_mask=cfg.document_mask,
        ),
    )
