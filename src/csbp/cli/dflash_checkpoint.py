"""Where ``csbp dflash export`` finds a drafter: a run directory's ``final/`` or newest intact checkpoint,
and a ``DFlashDrafter`` rebuilt from a DCP checkpoint (shapes from its metadata, the rest from the run
config it recorded, verified before a tensor is read)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from csbp.config import ConfigError
from csbp.config.yaml_reading import read_yaml_text
from csbp.models.hf_io import read_json_object

if TYPE_CHECKING:
    from csbp.dflash.config import DFlashConfig
    from csbp.dflash.drafter import DFlashDrafter
    from csbp.models.config import DecoderConfig
    from csbp.models.decoder import Decoder


def run_dir_source(run_dir: Path) -> tuple[Path | None, Path | None]:
    """``(drafter_dir, None)`` for ``RUN/final`` holding a drafter, else ``(None, latest checkpoint)``."""
    from csbp.dflash.export import ARCHITECTURES
    from csbp.training.checkpoint_integrity import find_resume_checkpoint

    if not run_dir.is_dir():
        raise ValueError(f"--run-dir {run_dir} is not a directory")
    final_config = run_dir / "final" / "config.json"
    if final_config.is_file():
        architectures = read_json_object(final_config).get("architectures") or []
        if architectures and architectures[0] in ARCHITECTURES:
            return run_dir / "final", None
        raise ValueError(f"{final_config} is not a DFlash drafter ({architectures}); was this a dflash run?")
    latest = find_resume_checkpoint(
        run_dir, warn=lambda line: print(line, file=sys.stderr), caller="--run-dir",
        fix="restore the files, or pass --drafter or --checkpoint",
    )
    if latest is None:
        raise ValueError(
            f"--run-dir {run_dir} has neither final/ nor a checkpoint; pass --drafter or --checkpoint"
        )
    return None, latest


def _resolved_config(checkpoint: Path) -> dict[str, Any]:
    """The ``resolved_config`` of the checkpoint's ``trainer_state.json`` (empty if none: an older one)."""
    state_file = checkpoint / "trainer_state.json"
    resolved = read_json_object(state_file).get("resolved_config") if state_file.is_file() else None
    if resolved is not None and not isinstance(resolved, dict):
        raise ValueError(f"{state_file}: resolved_config is not a mapping; the checkpoint is damaged")
    return resolved or {}


def _run_config(checkpoint: Path) -> dict[str, Any]:
    """The run config recorded in the checkpoint's ``trainer_state.json`` (empty if none)."""
    state_file = checkpoint / "trainer_state.json"
    if not state_file.is_file():
        return {}
    text = read_json_object(state_file).get("config_yaml") or ""
    try:  # the config reader's own YAML rules, alias-bomb limit included
        loaded = read_yaml_text(text, source=str(state_file)) if isinstance(text, str) and text else None
    except ConfigError as exc:
        raise ValueError(f"{exc.lines[0]} (config_yaml; the checkpoint is damaged)") from None
    return loaded if isinstance(loaded, dict) else {}


def check_checkpoint_target(checkpoint: Path, target: Path) -> None:
    """``ValueError`` (one line) when ``target`` is not the target drafter checkpoint ``checkpoint`` was
    trained against, by the content fingerprint its ``trainer_state.json`` records for
    ``objective.dflash.target`` (a moved copy passes); nothing to check when none is recorded. The export
    records the target it is given as the drafter's (``csbp_target``), so a wrong one must not pass."""
    from csbp.training.input_identity import directory_fingerprint

    state_file = checkpoint / "trainer_state.json"
    recorded = read_json_object(state_file).get("input_fingerprints") if state_file.is_file() else None
    expected = recorded.get("objective.dflash.target") if isinstance(recorded, dict) else None
    if isinstance(expected, str) and directory_fingerprint(Path(target)) != expected:
        raise ValueError(
            f"--target {target} is not the target checkpoint {checkpoint} was trained against (its files differ "
            "from the fingerprint the checkpoint records) (fix: drop --target to use the run's "
            "objective.dflash.target, or pass that target or a copy of it)"
        )


def recorded_target(run_dir: Path | None, checkpoint: Path | None) -> Path:
    """The ``objective.dflash.target`` a run recorded (``RUN/config.yaml``, else the checkpoint's own
    config), for an export given no ``--target``; one ``ValueError`` naming the fix when none is recorded."""
    if run_dir is not None and (run_dir / "config.yaml").is_file():
        config_file = run_dir / "config.yaml"
        try:
            loaded = read_yaml_text(config_file.read_text(encoding="utf-8"), source=str(config_file))
        except ConfigError as exc:
            raise ValueError(f"{exc.lines[0]} (fix: pass --target)") from None
        source = str(config_file)
    elif checkpoint is not None:
        loaded, source = _run_config(checkpoint), f"{checkpoint / 'trainer_state.json'} config_yaml"
    else:
        raise ValueError("--target is required with --drafter: a drafter directory records no target "
                         "(fix: pass --target, the target's HF checkpoint directory)")
    objective = loaded.get("objective") if isinstance(loaded, dict) else None
    dflash = objective.get("dflash") if isinstance(objective, dict) else None
    target = dflash.get("target") if isinstance(dflash, dict) else None
    if not isinstance(target, str) or not target:
        raise ValueError(f"{source} records no objective.dflash.target (fix: pass --target, the target's HF "
                         "checkpoint directory)")
    return Path(target)


def checkpoint_seq_len(checkpoint: Path) -> int | None:
    """The ``data.seq_len`` the checkpoint's run trained at (None when it records no run config)."""
    data = _run_config(checkpoint).get("data")
    seq_len = data.get("seq_len") if isinstance(data, dict) else None
    return seq_len if type(seq_len) is int else None


def checkpoint_context(checkpoint: Path) -> str | None:
    """The ``objective.dflash.context`` the checkpoint's run trained with (the schema's ``strict``
    when its recorded config leaves it unset); None when the checkpoint records no run config."""
    run = _run_config(checkpoint)
    if not run:
        return None
    objective = run.get("objective") if isinstance(run.get("objective"), dict) else {}
    dflash = objective.get("dflash") if isinstance(objective.get("dflash"), dict) else {}
    context = dflash.get("context", "strict")
    return str(context) if context is not None else "strict"


def checkpoint_tokenizer_files(checkpoint: Path, mask_token_id: int) -> dict[str, bytes]:
    """The tokenizer files the run of drafter checkpoint ``checkpoint`` exports with (its ``final/``'s:
    :mod:`csbp.training.export_tokenizer`, resolved from the run config it recorded and its data
    artifact); empty, with one note on stderr saying why, when that config or artifact is not at hand."""
    from csbp.config import config_from_dict
    from csbp.data.artifact import open_artifact
    from csbp.training.export_tokenizer import export_tokenizer_for_run

    def warn(line: str) -> None:
        print(line, file=sys.stderr)

    run = _run_config(checkpoint)
    try:
        if not run:
            raise ValueError(f"{checkpoint / 'trainer_state.json'} records no run config")
        cfg = config_from_dict(run, source=str(checkpoint / "trainer_state.json"))
        artifact = open_artifact(cfg.data.train)
    except ValueError as exc:
        reason = exc.lines[0] if isinstance(exc, ConfigError) else str(exc)
        warn(
            f"note: the export carries no tokenizer files: {reason} (fix: copy the run's final/ tokenizer files "
            "into it, or export where the run's data artifact is)"
        )
        return {}
    return export_tokenizer_for_run(cfg, artifact, mask_token_id, warn).files


def drafter_from_checkpoint(checkpoint: Path, target: Decoder, args: argparse.Namespace) -> DFlashDrafter:
    """A ``DFlashDrafter`` from a DCP checkpoint: shapes from its metadata, the rest from the run config."""
    from csbp.dflash.drafter import DFlashDrafter
    from csbp.training.checkpoint_integrity import checkpoint_problem, read_metadata, safe_dcp_load

    if not (checkpoint / ".metadata").is_file():
        raise ValueError(
            f"--checkpoint {checkpoint} is not a torch.distributed.checkpoint directory (.metadata not found)"
        )
    problem = checkpoint_problem(checkpoint, state_file=None)  # checksums first, when recorded
    if problem is not None:
        raise ValueError(f"--checkpoint {checkpoint}: {problem} (fix: restore its files, or pass another checkpoint)")
    metadata = read_metadata(checkpoint).state_dict_metadata  # restricted unpickler: no code runs
    anchors = [key for key in metadata if key.startswith("model.") and key.endswith("fc.weight")]
    if len(anchors) != 1:
        raise ValueError(
            f"{checkpoint}: no single drafter 'fc.weight' under 'model' (found {anchors}); not a dflash run?"
        )
    prefix = anchors[0][: -len("fc.weight")]
    shapes = {
        key[len(prefix) :]: (tuple(meta.size), meta.properties.dtype)  # type: ignore[union-attr]
        for key, meta in metadata.items()
        if key.startswith(prefix) and hasattr(meta, "size")
    }
    config = _checkpoint_drafter_config(
        {k: s for k, (s, _) in shapes.items()}, target.config, _run_config(checkpoint), args,
        recorded=_resolved_config(checkpoint), source=str(checkpoint / "trainer_state.json"),
    )
    drafter = DFlashDrafter(config, device="meta")
    expected = {name: tuple(t.shape) for name, t in drafter.state_dict().items()}
    found = {name: shape for name, (shape, _) in shapes.items()}
    if expected != found:
        diff = sorted(set(expected.items()) ^ set(found.items()))[:3]
        raise ValueError(f"{checkpoint}: drafter tensors do not match the inferred config, e.g. {diff}")
    template = {
        prefix[:-1]: {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype) in shapes.items()}
    }
    safe_dcp_load(template, checkpoint, no_dist=True)
    drafter.load_state_dict(template[prefix[:-1]], assign=True)
    drafter.attach_target(target)
    return drafter


def _checkpoint_drafter_config(
    shapes: dict[str, tuple[int, ...]],
    target_config: DecoderConfig,
    run: dict[str, Any],
    args: argparse.Namespace,
    *,
    recorded: dict[str, Any],
    source: str,
) -> DFlashConfig:
    """Shapes (layers, widths, heads, DFlash2 modules) from the tensors; the rest from the run config
    (``objective.block_size``, ``objective.mask_token_id`` or the data artifact's, ``objective.dflash``),
    else from the command line (a flag that contradicts a recorded value is refused). The target
    layer ids are those the checkpoint trained with
    (``recorded``: its ``resolved_config``; :func:`csbp.training.dflash_layers.trained_layer_ids`)."""
    from csbp.dflash.config import DFlashConfig
    from csbp.training.dflash_layers import (
        LAYER_IDS_FIELD,
        ROUNDING_CHANGE,
        trained_layer_ids,
        unknown_ids_reason,
    )

    objective = run.get("objective") if isinstance(run.get("objective"), dict) else {}
    dflash = objective.get("dflash") if isinstance(objective.get("dflash"), dict) else {}
    hidden = target_config.hidden_size
    num_layers = len({key.split(".")[1] for key in shapes if key.startswith("layers.")})
    required = (
        "layers.0.self_attn.q_norm.weight",
        "layers.0.self_attn.q_proj.weight",
        "layers.0.mlp.gate_proj.weight",
    )
    if num_layers == 0 or shapes["fc.weight"][0] != hidden or any(k not in shapes for k in required):
        raise ValueError(
            f"the checkpoint's drafter (fc {shapes['fc.weight']}, {num_layers} layers) does not fit a "
            f"target of "
            f"hidden size {hidden}; pass the target it was trained against"
        )
    head_dim = shapes["layers.0.self_attn.q_norm.weight"][0]
    trained_mask = objective.get("mask_token_id")
    mask_source = f"{source} config_yaml objective.mask_token_id"
    if trained_mask is None:
        trained_mask = _artifact_mask_token(run)
        data = run.get("data") if isinstance(run.get("data"), dict) else {}
        mask_source = f"the mask token of its data.train {data.get('train')}"
    for flag, given, field, trained, where in (
        ("--block-size", args.block_size, "block_size", objective.get("block_size"), f"{source} config_yaml"),
        ("--mask-token-id", args.mask_token_id, "mask_token_id", trained_mask, mask_source),
    ):
        _refuse_contradiction(flag, given, field, trained, where)
    block_size = args.block_size if args.block_size is not None else objective.get("block_size")
    mask_token_id = args.mask_token_id if args.mask_token_id is not None else trained_mask
    if block_size is None or mask_token_id is None:
        raise ValueError(
            "the checkpoint's run config records no block_size or mask_token_id; "
            "pass --block-size and --mask-token-id"
        )
    layer_ids = args.layer_ids
    if layer_ids and (LAYER_IDS_FIELD in recorded or dflash.get("target_layer_ids") is not None):
        (trained,) = trained_layer_ids(
            recorded, dflash.get("target_layer_ids"), target_config.num_layers, num_layers, source=source
        )  # recorded: one tuple, the ids its fc weights were fitted to
        _refuse_contradiction("--layer-ids", list(layer_ids), "target_layer_ids", list(trained), source)
    if not layer_ids:
        candidates = trained_layer_ids(
            recorded, dflash.get("target_layer_ids"), target_config.num_layers, num_layers, source=source
        )
        if len(candidates) > 1:  # an older checkpoint at a depth where the default's rounding changed
            legacy, current = (" ".join(map(str, ids)) for ids in candidates)
            raise ValueError(
                f"--checkpoint: {unknown_ids_reason(candidates, target_config.num_layers, num_layers)}; which one "
                f"it trained with is unknown (fix: pass --layer-ids {legacy} if the run started under "
                f"{ROUNDING_CHANGE}, else --layer-ids {current})"
            )
        layer_ids = candidates[0]
    if len(layer_ids) * hidden != shapes["fc.weight"][1]:
        raise ValueError(
            f"target_layer_ids {list(layer_ids)} do not match the drafter's fc width "
            f"{shapes['fc.weight'][1]}; "
            "pass --layer-ids"
        )
    options: dict[str, Any] = {}
    if "layers.0.attn_conv.base" in shapes:
        taps = shapes["layers.0.attn_conv.base"][1]
        groups = shapes["layers.0.attn_conv.kernel_proj.weight"][0] // (2 * taps)
        options.update(conv_kernel_size=taps, conv_group_size=hidden // groups)
    if "selector.pred_embed" in shapes:
        options.update(
            selector_rank=shapes["selector.pred_embed"][1],
            selector_top_k=int(dflash.get("selector_top_k", 16)),
        )
    for key in ("layer_types", "sliding_window", "sliding_window_causal"):
        if dflash.get(key) is not None:
            options[key] = tuple(dflash[key]) if key == "layer_types" else dflash[key]
    return DFlashConfig(
        vocab_size=target_config.vocab_size,
        hidden_size=hidden,
        intermediate_size=shapes["layers.0.mlp.gate_proj.weight"][0],
        num_layers=num_layers,
        num_heads=shapes["layers.0.self_attn.q_proj.weight"][0] // head_dim,
        num_kv_heads=shapes["layers.0.self_attn.k_proj.weight"][0] // head_dim,
        head_dim=head_dim,
        num_target_layers=target_config.num_layers,
        mask_token_id=int(mask_token_id),
        block_size=int(block_size),
        target_layer_ids=tuple(int(i) for i in layer_ids),
        rope_theta=target_config.rope_theta,
        rope_scaling=target_config.rope_scaling,
        rms_norm_eps=target_config.rms_norm_eps,
        **options,
    )


def _refuse_contradiction(flag: str, given: Any, field: str, trained: Any, where: str) -> None:
    """``ValueError`` when ``flag`` gives ``field`` a value other than the one the checkpoint trained
    with (``trained``, read from ``where``): the export would describe a drafter that was never
    trained (another mask embedding, other target features, another block). The flags are for
    checkpoints whose run records none."""
    if given is None or trained is None or given == trained:
        return
    shown = " ".join(map(str, given)) if isinstance(given, list) else given
    raise ValueError(
        f"{flag} {shown}: the checkpoint trained with {field} {trained} ({where}) (fix: drop {flag} to export "
        "what it trained with; the flag is for checkpoints that record none)"
    )


def _artifact_mask_token(run: dict[str, Any]) -> int | None:
    data = run.get("data") if isinstance(run.get("data"), dict) else {}
    manifest = Path(str(data.get("train", ""))) / "manifest.json"
    if not data.get("train") or not manifest.is_file():
        return None
    special_ids = read_json_object(manifest).get("special_ids")
    mask = special_ids.get("mask") if isinstance(special_ids, dict) else None
    return None if mask is None else int(mask)


# ----------------------------------------------------------------------------- eval
