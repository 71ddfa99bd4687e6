"""Warn before launch when the cost model predicts that a run's own layout will not fit in memory.

:mod:`csbp.training.memory_fit` refuses a run whose weights, gradients and AdamW state alone exceed a
rank's memory: a lower bound, so it never refuses a run that could have fitted. Activations, the
gathered K/V and the logits chunk come on top, and at long context they are most of a step's peak;
a run that needs more than its GPUs have used to load its weights (minutes for a large model on
many ranks) and only then end at its first step with an out-of-memory error
(:mod:`csbp.training.out_of_memory`).

:func:`forecast_line` prices the run's explicit layout with ``csbp plan``'s cost model (the same
workload, calibration and hardware preset ``topology: auto`` uses) and, when the prediction exceeds
the device's usable memory, returns one warning line naming the predicted peak, its largest term
and the fix the planner checked: the layout ``topology: auto`` would pick for the same processes,
else the single changes predicted to fit (``csbp.plan.remedy``). It warns and does not refuse: the
model is an estimate (against the device check's Qwen3-0.6B-shaped BD3 steps on one H200 at 8K-64K
tokens, its terms other than the fixed 7.1 GiB allowance for the CUDA context and fragmentation came
within -13% to +9% of the allocator's measured peak; ``docs/training.md``), and a run it doubts may
still fit.

A machine without a hardware preset (a GPU the presets do not describe) gets no forecast: the
device's memory and speed would be guessed.
"""

from __future__ import annotations

from dataclasses import replace

from csbp.config.schema import RunConfig
from csbp.plan.artifact_documents import run_config_documents
from csbp.plan.auto import gpu_preset, run_search
from csbp.plan.calibration import packaged_calibration
from csbp.plan.hardware import hardware
from csbp.plan.layout import Layout
from csbp.plan.model import predict
from csbp.plan.remedy import AUTO_SETTINGS, Search, remedies
from csbp.plan.run_config_workload import run_config_workload
from csbp.plan.search import candidate_layouts, describe, rank
from csbp.plan.workload import Workload
from csbp.wording import counted, size

FORECAST_SETTINGS = {**AUTO_SETTINGS, "gpus": "{gpus} processes in all (--nproc x --nnodes)"}
"""How the fixes are named: as ``topology: auto`` names them, but more devices as a process count (the
run's node size is the user's to choose, where ``topology: auto`` keeps ``--nproc`` and adds nodes)."""


def run_layout(cfg: RunConfig) -> Layout:
    """The cost model's :class:`Layout` of the run ``cfg`` describes (csbp's packed rank order)."""
    topo = cfg.topology
    return Layout(
        topo.dp,
        topo.cp,
        topo.bp,
        transport=topo.transport,
        checkpointing=cfg.train.activation_checkpointing,
        micro_batch=cfg.train.micro_batch_size,
        sharding="fsdp2" if cfg.train.fsdp else "ddp",
        schedule=topo.schedule,
    )


def forecast_line(cfg: RunConfig, *, nproc: int, preset: str | None = None) -> str | None:
    """The warning line for a run predicted not to fit (module docstring), None when it is predicted to
    fit or this machine has no hardware preset, a note when the planner cannot price it. ``nproc``:
    processes per node; ``preset``: the hardware preset (default: this machine's, ``gpu_preset``)."""
    if preset is None:
        try:
            preset = gpu_preset()
        except ValueError:
            return None  # a GPU no preset describes: nothing to price it with
    try:
        return _forecast(cfg, nproc, preset)
    except ValueError as exc:  # a warning never stops a run the checks passed; the planner's reason is shown
        return f"note: csbp plan's cost model cannot price this run, so its memory is not forecast ({exc})"
    except Exception as exc:  # noqa: BLE001 - nor does a planner bug: named, so it gets reported
        return (
            "note: csbp plan's cost model failed on this run, so its memory is not forecast "
            f"({type(exc).__name__}: {exc}; please report it)"
        )


def _forecast(cfg: RunConfig, nproc: int, preset: str) -> str | None:
    workload = _workload(cfg)
    gpus, seq_len = cfg.world_size, cfg.data.seq_len
    hw = hardware(preset, gpus=gpus, gpus_per_node=nproc)
    cal = packaged_calibration(preset)
    accum = cfg.train.grad_accum
    layout = run_layout(cfg)
    mine = predict(workload, layout, seq_len, hw, cal, global_batch=layout.dp * layout.micro_batch * accum)
    if mine.fits:
        return None
    term = mine.largest_term
    holds = (
        f"{size(mine.capacity_bytes)} of this machine's RAM per process" if hw.processes
        else f"{size(mine.capacity_bytes)} an {hw.name} may hold"
    )
    return (
        f"warning: csbp plan's cost model predicts {size(mine.mem_bytes)} per device for this run's "
        f"{describe(layout)} at data.seq_len {seq_len:,}, more than the {holds} (largest term: {term}, "
        f"{size(mine.mem_terms[term])}), so it may run out of memory at its first step "
        f"(fix: {_fix(cfg, workload, nproc, preset)}; `csbp plan --model <config>` ranks every layout)"
    )


def _workload(cfg: RunConfig) -> Workload:
    """The run's workload, over its real documents under ``data.document_mask`` (as ``topology: auto``)."""
    workload = run_config_workload(cfg)
    try:
        sample = run_config_documents(cfg)
    except ValueError:
        return workload  # the data checks name an unreadable artifact; one document per row is priced here
    return workload if sample is None else replace(workload, doc_length=sample)


def _fix(cfg: RunConfig, workload: Workload, nproc: int, preset: str) -> str:
    """What the planner predicts would fit: activation checkpointing on the run's own layout, else the
    layout ``topology: auto`` would launch on the same processes, else the changes it checked."""
    search = run_search(cfg)
    gpus, seq_len = cfg.world_size, cfg.data.seq_len
    hw = hardware(preset, gpus=gpus, gpus_per_node=nproc)
    cal = packaged_calibration(preset)
    layout = run_layout(cfg)
    if layout.checkpointing != "full" and "full" in search.checkpointing and not workload.objective.is_drafter:
        batch = layout.dp * layout.micro_batch * search.grad_accum
        recomputed = predict(workload, replace(layout, checkpointing="full"), seq_len, hw, cal, global_batch=batch)
        if recomputed.fits:
            return f"--set train.activation_checkpointing=full, predicted at {size(recomputed.mem_bytes)}"
    layouts = candidate_layouts(
        workload, gpus, seq_len, checkpointing=search.checkpointing, sharding=search.sharding,
        micro_batches=(search.micro_batch,),
    )
    best = rank(workload, layouts, seq_len, hw, cal, grad_accum=search.grad_accum).best
    if best is not None:
        return f"--set topology=auto, which picks {describe(best.layout)}, predicted at {size(best.mem_bytes)}"
    retry = Search(
        workload, gpus, seq_len, preset, cal, gpus_per_node=nproc, checkpointing=search.checkpointing,
        sharding=search.sharding, micro_batches=(search.micro_batch,), grad_accum=search.grad_accum,
        names=FORECAST_SETTINGS,
    )
    found = remedies(retry)
    if found:
        return f"no layout of {counted(gpus, 'process', 'processes')} is predicted to fit as configured; --set topology=auto with " + (
            " or with ".join(found)
        )
    return f"no layout of {counted(gpus, 'process', 'processes')} is predicted to fit: use devices with more memory or a smaller model"
