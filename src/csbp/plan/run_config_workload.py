"""What a csbp run config trains, as a planner :class:`~csbp.plan.workload.Workload`: the decoder of
a validated ``RunConfig`` (its shape fields, or the ``config.json`` of ``model.init_from``), or the
DFlash drafter of ``objective.dflash`` shaped by its target, with the element sizes of
``train.precision``. ``csbp plan --model run.yaml``, ``topology: auto`` and the memory forecast read
runs through it; presets and Hugging Face configs are read in ``csbp.plan.workload``.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from csbp.plan.workload import OBJECTIVES, LayerGroup, ModelShape, Objective, Workload, hf_workload


def run_config_workload(cfg: Any) -> Workload:
    """A decoder from a validated ``RunConfig`` (shape fields set; ``init_from`` models are read
    through their ``config.json``). Element sizes follow what csbp trains in (``model.dtype`` is only
    the export's): activations and K/V in ``train.precision``'s compute dtype, dK/dV reduced in the
    float32 accumulation dtype (float64 under fp64), float32 master weights (float64 under fp64)."""
    m, obj = cfg.model, cfg.objective
    if obj.name not in OBJECTIVES and obj.name != "ar":
        raise ValueError(f"objective.name {obj.name!r} is not in the cost model ({', '.join(OBJECTIVES)})")
    if obj.name == "dflash":
        return _dflash_workload(cfg)
    block = obj.block_size or cfg.data.seq_len
    if m.init_from is not None:
        base = hf_workload(Path(m.init_from), objective=obj.name, block_size=block, source="model.init_from")
    else:
        missing = [
            k
            for k in ("hidden_size", "intermediate_size", "num_layers", "num_heads")
            if getattr(m, k) is None
        ]
        if missing:
            raise ValueError(
                f"model.{missing[0]} is unset: the planner needs the model's shape in the run config "
                "(or model.init_from)"
            )
        vocab = m.vocab_size if m.vocab_size is not None else _artifact_vocab(Path(cfg.data.train))
        heads = m.num_heads
        group = LayerGroup(
            m.num_layers, heads, m.num_kv_heads or heads, m.head_dim or m.hidden_size // heads, 0
        )
        model = ModelShape(
            name=cfg.run.name,
            d_model=m.hidden_size,
            vocab=vocab,
            ffn=m.intermediate_size,
            groups=(group,),
            tied_embeddings=bool(m.tie_embeddings),
        )
        base = Workload(model, Objective(obj.name, block=block, views=2 if obj.name == "fast_dllm_v2" else 1))
    window = cfg.topology.window
    dtype_bytes, master = _precision_bytes(cfg)
    objective = replace(base.objective, kv_grad_bytes=master)
    workload = Workload(base.model, objective, dtype_bytes, state_bytes=master, averaged=cfg.optim.ema_decay is not None)
    return workload.with_options(window=window) if window else workload


def _precision_bytes(cfg: Any) -> tuple[int, int]:
    """``(compute, master)`` element sizes of ``train.precision``: bf16 autocasts over float32
    master weights, fp32 and fp64 compute in the master dtype (``training.model_factory``)."""
    precision = cfg.train.precision
    master = 8 if precision == "fp64" else 4
    return (2 if precision == "bf16" else master), master


def _artifact_vocab(directory: Path) -> int:
    """The vocabulary of a prepared data artifact (its ``manifest.json``), for ``vocab_size: null``."""
    manifest = directory / "manifest.json"
    if not manifest.is_file():
        raise ValueError(
            f"model.vocab_size is unset and {manifest} does not exist: set model.vocab_size, or prepare the "
            "data first (csbp data prepare)"
        )
    return int(json.loads(manifest.read_text())["tokenizer"]["vocab_size"])


def _dflash_workload(cfg: Any) -> Workload:
    """The drafter of a DFlash run config: shaped by its target's ``config.json`` and
    ``objective.dflash`` (layers, widths, windows, anchors, fused target layers); csbp's step
    projects every context row a rank holds."""
    from csbp.dflash.config import default_target_layer_ids
    from csbp.plan.target_pass import TargetPass

    section = cfg.objective.dflash
    target = hf_workload(Path(section.target), source="objective.dflash.target")
    t, group = target.model, target.model.groups[0]  # the heads of every group are the same
    types = section.layer_types or ["full_attention"] * section.num_draft_layers
    sliding = sum(kind == "sliding_attention" for kind in types)
    groups = tuple(
        LayerGroup(count, group.n_heads, group.n_kv_heads, group.head_dim, window)
        for count, window in ((len(types) - sliding, 0), (sliding, section.sliding_window or 0))
        if count
    )
    ids = section.target_layer_ids or default_target_layer_ids(t.num_layers, section.num_draft_layers)
    feature_width = t.d_model * len(ids)
    model = ModelShape(
        name=f"DFlash({t.name})",
        d_model=t.d_model,
        vocab=t.vocab,
        ffn=section.intermediate_size or t.ffn,
        groups=groups,
        tied_embeddings=t.tied_embeddings,
        extra_params=feature_width * t.d_model,  # the fusion fc
    )
    objective = Objective(
        "dflash",
        block=cfg.objective.block_size,
        anchors=section.max_anchors,
        feature_width=feature_width,
        window=section.sliding_window or 0,
        selector_rank=section.selector_rank,
    )
    # what the step runs: offline features, else the online pass of objective.dflash.target_capture
    mode = "offline" if section.features is not None else section.target_capture
    layers = t.num_layers if section.loss == "kl" else max(ids) + 1
    dtype_bytes, master = _precision_bytes(cfg)
    return Workload(model, objective, dtype_bytes, state_bytes=master, target_pass=TargetPass(mode, t, layers))
