"""``topology: auto``: let the planner choose the layout of a run for the processes it launches.

``csbp train run.yaml --nproc 8`` with ``topology: auto`` in the file (or ``--set topology=auto``)
plans the run's model at its ``data.seq_len`` on ``nproc x nnodes`` devices of this machine's
kind (the CUDA device name picks the GPU preset; no CUDA: ``cpu``), prints the chosen layout with
its prediction, and hands the launcher ``--set topology.dp=... topology.cp=... topology.bp=...``
overrides: the run then validates and trains like any explicit layout. The search keeps the
config's micro-batch, gradient accumulation and FSDP setting (``run_search``: ``csbp plan --model
run.yaml`` searches the same space, so its table's first row is the layout ``auto`` picks), and
proposes activation checkpointing only when the config schema has ``train.activation_checkpointing``.

With ``data.document_mask`` the plan is costed on the real documents of the run's training artifact
(``data.train``; ``csbp.plan.artifact_documents``, what ``csbp plan --data`` uses), so it may pick
CP-only ``cp-aware`` (``topology.transport: halo``) or ``topology.schedule: balanced``; the
``topology: auto -> ...`` line names the rows it assumed, and the K/V overlap the prediction
assumed for the chosen layout (``csbp plan``'s ``overlap:`` line in brief). Without the document mask: one document
per row.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from csbp.plan.artifact_documents import run_config_documents
from csbp.plan.calibration import Calibration, packaged_calibration
from csbp.plan.hardware import PRESETS, hardware
from csbp.plan.layout import Checkpointing, Layout, Sharding
from csbp.plan.model import GIB, collective_overlap
from csbp.plan.remedy import AUTO_SETTINGS, Search, nothing_fits
from csbp.plan.run_config_workload import run_config_workload
from csbp.plan.search import candidate_layouts, describe, rank
from csbp.wording import counted

if TYPE_CHECKING:
    from csbp.config.schema import RunConfig

AUTO = "auto"


@dataclass(frozen=True)
class RunSearch:
    """What a run config fixes of the layout search (``topology: auto`` and ``csbp plan --model
    run.yaml`` alike): its state sharding (``train.fsdp``: FSDP2, else DDP), its per-replica
    ``train.micro_batch_size`` and ``train.grad_accum`` (so a layout with ``dp`` replicas trains
    ``dp x micro_batch x grad_accum`` sequences per optimizer step), and the checkpointing choices."""

    sharding: Sharding
    micro_batch: int
    grad_accum: int
    checkpointing: tuple[Checkpointing, ...]



def run_search(cfg: RunConfig) -> RunSearch:
    """The search space ``cfg`` fixes (:class:`RunSearch`)."""
    from csbp.config.schema import TrainSection

    has_ckpt = "activation_checkpointing" in TrainSection.model_fields
    return RunSearch(
        sharding="fsdp2" if cfg.train.fsdp else "ddp",
        micro_batch=cfg.train.micro_batch_size,
        grad_accum=cfg.train.grad_accum,
        checkpointing=("full", "none") if has_ckpt else ("none",),
    )


def load_plannable_config(config: str, overrides: Sequence[str]) -> RunConfig:
    """The run config ``config`` with ``overrides``, its ``topology: auto`` (file or ``--set``) left
    empty: the planner chooses the topology, so it plans the rest of the run."""
    from csbp.recipes import load_run_config

    if not wants_auto(config, overrides):
        return load_run_config(config, list(overrides))
    kept = [item for item in overrides if item.replace(" ", "") != "topology=auto"]
    return load_run_config(config, [*kept, "topology={}"])


def wants_auto(config: str, overrides: Sequence[str]) -> bool:
    """True when ``--set topology=auto`` is given or the config file/recipe says ``topology: auto``."""
    if any(item.replace(" ", "") == "topology=auto" for item in overrides):
        return True
    if any(item.split("=", 1)[0].strip().startswith("topology") for item in overrides):
        return False  # an explicit --set topology.* wins over the file
    path = Path(config)
    if not path.is_file():
        from csbp.recipes import list_recipes, recipe_path

        if config not in list_recipes():
            return False
        path = recipe_path(config)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))  # one key is read: aliases never expand
    except (yaml.YAMLError, UnicodeDecodeError):
        return False  # loading the config reports it in one line (it was a traceback)
    return isinstance(data, dict) and data.get("topology") == AUTO


def gpu_preset() -> str:
    """This machine's hardware preset: the CUDA device's name, or ``cpu``. Only the SXM parts the presets
    describe match: a GH200, a PCIe or NVL card (other links) or a smaller-memory part (an A100 40GB) would
    be planned with the wrong bandwidth or memory, so they are refused like an unknown GPU."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    shown = torch.cuda.get_device_name(0)
    name = shown.upper()
    found = re.search(r"(?<![A-Z0-9])(H200|H100|A100)(?![0-9])", name)
    other_links = re.search(r"PCIE|\bNVL\b", name)
    if found is not None and other_links is None:
        preset = found[1].lower()
        device_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
        if device_gib >= PRESETS[preset].mem_gib:
            return preset
        why = f"it has {device_gib:.0f} GiB, the {preset} preset plans with {PRESETS[preset].mem_gib:.0f}"
    elif found is not None:
        why = f"its links are not the {found[1].lower()} preset's SXM NVLink"
    else:
        why = "no preset describes it"
    raise ValueError(
        f"topology: auto has no hardware preset for {shown!r} ({why}): "
        "set topology.dp/cp/bp (or pick one with `csbp plan --gpu h100|h200|a100`)"
    )


def resolve_auto_topology(
    config: str, overrides: Sequence[str], *, nproc: int | None, nnodes: int = 1, echo: bool = True
) -> list[str]:
    """``overrides`` with ``topology=auto`` replaced by the planner's layout (unchanged when the run
    does not ask for ``auto``)."""
    if not wants_auto(config, overrides):
        return list(overrides)
    if nproc is None:
        raise ValueError("topology: auto needs the process count: pass --nproc N (per node) to csbp train")
    kept = [item for item in overrides if item.replace(" ", "") != "topology=auto"]
    cfg = load_plannable_config(config, overrides)
    workload = run_config_workload(cfg)
    documents = ""
    try:
        sample = run_config_documents(cfg)
    except ValueError as exc:
        raise ValueError(f"topology: auto with data.document_mask plans data.train's documents: {exc}") from None
    if sample is not None:
        workload = replace(workload, doc_length=sample)
        documents = f"; documents of {sample.describe()}"
    gpus = nproc * nnodes
    preset = gpu_preset()
    hw = hardware(preset, gpus=gpus, gpus_per_node=nproc)
    search = run_search(cfg)
    layouts = candidate_layouts(
        workload,
        gpus,
        cfg.data.seq_len,
        checkpointing=search.checkpointing,
        sharding=search.sharding,
        micro_batches=(search.micro_batch,),
    )
    cal = packaged_calibration(preset)
    plan = rank(workload, layouts, cfg.data.seq_len, hw, cal, grad_accum=search.grad_accum)
    best = plan.best
    if best is None and not plan.infeasible:
        raise ValueError(f"topology: auto found no layout for {gpus} processes: {plan.why}")
    if best is None:
        retry = Search(
            workload, gpus, cfg.data.seq_len, preset, cal, gpus_per_node=nproc, checkpointing=search.checkpointing,
            sharding=search.sharding, micro_batches=(search.micro_batch,), grad_accum=search.grad_accum,
            names=AUTO_SETTINGS,
        )
        raise ValueError(f"topology: auto: {nothing_fits(plan, retry, hardware_name=hw.name)}")
    lay = best.layout
    chosen = [
        "topology={}",
        f"topology.dp={lay.dp}",
        f"topology.cp={lay.cp}",
        f"topology.bp={lay.bp}",
        f"topology.replicate_clean_prefix={'true' if lay.kind == 'bp' else 'false'}",
        f"topology.transport={lay.transport}",
        f"topology.schedule={lay.schedule}",
    ]
    if len(search.checkpointing) > 1:
        chosen.append(f"train.activation_checkpointing={lay.checkpointing}")
    if echo:
        sequences = lay.dp * search.micro_batch * search.grad_accum
        print(
            f"topology: auto -> {describe(lay)} for {counted(gpus, 'process', 'processes')} at L={cfg.data.seq_len}: predicted "
            f"{best.step_s:.3f} s/step, {best.mem_bytes / GIB:.2f} of {best.capacity_bytes / GIB:.1f} GiB per process; "
            f"{sequences} sequences ({sequences * cfg.data.seq_len:,} tokens) per optimizer step, {lay.dp}x one "
            f"replica's {search.micro_batch} x {search.grad_accum} "
            f"({hw.name}{documents}; {_overlap_assumed(lay, cal)}; {plan.why})",
            flush=True,
        )
    return [*kept, *chosen]


def _overlap_assumed(layout: Layout, cal: Calibration) -> str:
    """The overlap the prediction assumed for ``layout``, briefly (``csbp plan``'s ``overlap:`` line
    says where each share comes from)."""
    if layout.kind not in ("cp", "csbp"):
        return "overlap: no K/V ring"
    if layout.transport == "streaming" and layout.cp > 1:  # the prediction's only overlap (plan.model)
        return f"overlap: streaming hides K/V traffic up to {cal.overlap_stream:.0%} of its ring attention (overlap_stream)"
    generic = layout.kind == "cp" and layout.transport == "collective"
    return f"overlap: {collective_overlap(layout, cal):.0%} of K/V traffic hidden ({'overlap_cp' if generic else 'overlap_csbp'})"
