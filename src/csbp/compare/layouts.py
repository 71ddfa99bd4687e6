"""The run config of each layout ``csbp compare`` trains.

Every layout keeps the run's seed, data, model, objective, optimizer and *global* batch
(``dp * micro_batch_size``); the loader's state is global, so every layout reads the same rows in
the same order. Only the topology (and, when ``dp`` changes, the micro-batch per replica) differs.
On ``nproc`` processes with the run's ``dp``, ``local = nproc / dp`` ranks hold one sample:

=========  ==========================================================================
``data``   ``dp = nproc`` (every rank a replica; single-stream objectives ``mdlm``/``ar``)
``cp``     CP-only: ``cp = local`` (zigzag over ``[x_t ; x_0]``; DFlash: every rank drafts every anchor)
``bp``     BP-only: ``bp = local`` with the clean prefix replicated
``csbp``   the run's own CSBP topology when it is one on ``nproc`` processes, else ``cp = bp = local``
=========  ==========================================================================

Transport, window and schedule are the run's. Each layout config is validated like any run
config, so a layout the objective cannot train (``mdlm`` with ``cp``) fails before any process
starts, with one line naming it.
"""

from __future__ import annotations

from typing import Any

from csbp.config.loading import config_from_dict
from csbp.config.schema import RunConfig

LAYOUT_NAMES: tuple[str, ...] = ("data", "cp", "bp", "csbp")
SINGLE_STREAM = ("mdlm", "ar")
"""Objectives without a clean stream or blocks: data parallel only."""


def layout_topology(cfg: RunConfig, name: str, nproc: int) -> dict[str, Any]:
    """``dp``/``cp``/``bp``/``replicate_clean_prefix`` of layout ``name`` on ``nproc`` processes."""
    topo = cfg.topology
    if name not in LAYOUT_NAMES:
        raise ValueError(f"--layouts: unknown layout {name!r}; choose from {', '.join(LAYOUT_NAMES)}")
    if name == "data":
        return {"dp": nproc, "cp": 1, "bp": 1, "replicate_clean_prefix": False}
    if cfg.objective.name in SINGLE_STREAM:
        raise ValueError(
            f"--layouts: objective {cfg.objective.name} is data parallel only, so layout {name!r} does not "
            "apply (fix: --layouts data, or compare a bd3 / fast_dllm_v2 / dflash run)"
        )
    if nproc % topo.dp != 0 or nproc // topo.dp < 2:
        raise ValueError(
            f"--nproc {nproc}: layout {name!r} needs nproc = dp x local with local >= 2 ranks per sample "
            f"(run dp={topo.dp}); fix: --nproc {2 * topo.dp} or a multiple of it"
        )
    local = nproc // topo.dp
    if name == "cp":
        return {"dp": topo.dp, "cp": local, "bp": 1, "replicate_clean_prefix": False}
    if name == "bp":
        return {"dp": topo.dp, "cp": 1, "bp": local, "replicate_clean_prefix": True}
    if topo.cp > 1 and topo.bp > 1 and topo.world_size == nproc:
        return {"dp": topo.dp, "cp": topo.cp, "bp": topo.bp, "replicate_clean_prefix": False}
    return {"dp": topo.dp, "cp": local, "bp": local, "replicate_clean_prefix": False}


def layout_config(cfg: RunConfig, name: str, nproc: int) -> RunConfig:
    """``cfg`` trained in layout ``name`` on ``nproc`` processes (module docstring).

    The trainer's own periodic evaluation, checkpointing and sampling are off (``csbp compare``
    evaluates and checkpoints at its time points), so ``objective.clip_search_widths`` is refused.
    """
    if cfg.objective.clip_search_widths:
        raise ValueError(
            "objective.clip_search_widths: csbp compare validates at its time points, not on a train.eval_every "
            "schedule, so there is no schedule to search the noise window at (and each layout would move it at "
            "other steps) (fix: remove objective.clip_search_widths, and set objective.t_min/t_max to the window "
            "to compare at, e.g. the val_clip_t_min/val_clip_t_max a training run chose)"
        )
    topology = layout_topology(cfg, name, nproc)
    global_batch = cfg.topology.dp * cfg.train.micro_batch_size
    if global_batch % topology["dp"] != 0:
        raise ValueError(
            f"layout {name!r}: the global batch dp x train.micro_batch_size = {global_batch} does not split "
            f"over dp={topology['dp']} replicas (fix: a train.micro_batch_size that makes it a multiple)"
        )
    data = cfg.model_dump(mode="json")
    data["topology"].update(topology)
    data["train"].update(
        micro_batch_size=global_batch // topology["dp"],
        eval_every=0,
        save_every=0,
        keep_checkpoints=1,
        generate_after=False,
        nproc=None,
    )
    return config_from_dict(data, source=f"layout {name!r}")
