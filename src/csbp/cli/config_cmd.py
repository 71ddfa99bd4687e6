"""``csbp config validate CONFIG [--set KEY=VALUE ...] [--print]``: check a run config offline;
``csbp config fields [NAME ...] [--markdown]``: the field reference (``csbp.config.reference``).

``CONFIG`` is a YAML file or a packaged recipe name. Validation needs no GPU and no data: it
checks the schema, the topology and the cross-section rules, prints a short summary, and notes
input paths that do not exist (not an error: the data may be prepared later). When every input
exists it also runs the checks ``csbp train`` runs against them (seq_len, vocabulary, mask token,
rows per step; not the run directory or this machine's devices), and prints to stderr the
warnings ``csbp train`` prints for them. ``--print`` writes
the validated config (every default explicit) as it would be saved to ``<run_dir>/config.yaml``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from csbp.cli.options import add_override_argument, positive_int
from csbp.config import RunConfig, dump_config
from csbp.config.schema import DOCUMENT_MASK_DEFAULTS
from csbp.recipes import load_run_config
from csbp.wording import counted


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("config", help="validate and print run configs")
    actions = parser.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    validate = actions.add_parser("validate", help="validate a config file or recipe (no GPU needed)")
    validate.add_argument("config", metavar="CONFIG", help="YAML config file, or a packaged recipe name")
    add_override_argument(validate)
    validate.add_argument(
        "--print", action="store_true", dest="print_config", help="print the validated config"
    )
    validate.add_argument(
        "--nproc", type=positive_int, default=None, metavar="N",
        help="with topology: auto, plan the layout for N processes per node as csbp train --nproc N would, then "
        "validate the config with it",
    )
    validate.add_argument(
        "--nnodes", type=positive_int, default=1, metavar="M", help="with --nproc: nodes of N processes (default 1)"
    )
    validate.set_defaults(func=run_validate)
    fields = actions.add_parser(
        "fields", help="list the config fields: type or choices, default and what each does",
        description="Every run config field, from the schema csbp train validates against.",
    )
    fields.add_argument(
        "names", nargs="*", metavar="NAME", help="sections or fields to list (e.g. attention, train.max_steps); default all"
    )
    fields.add_argument("--markdown", action="store_true", help="print docs/config.md (one table per section)")
    fields.set_defaults(func=run_fields)


def run_fields(args: argparse.Namespace) -> int:
    from csbp.config.reference import field_rows, format_markdown, format_text, select

    rows = select(field_rows(), args.names)
    print(format_markdown(rows) if args.markdown else format_text(rows), end="")
    return 0


def run_validate(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.nproc is not None:  # topology: auto resolved as csbp train resolves it (its line on stdout)
        from csbp.plan.auto import resolve_auto_topology, wants_auto

        if not wants_auto(args.config, overrides):
            raise ValueError(
                f"--nproc {args.nproc}: {args.config} sets its topology, so there is no layout to plan (fix: drop "
                "--nproc, or validate it with --set topology=auto)"
            )
        overrides = resolve_auto_topology(args.config, overrides, nproc=args.nproc, nnodes=args.nnodes)
    cfg = load_run_config(args.config, overrides)
    if args.print_config:
        print(dump_config(cfg), end="")
        return 0
    notes = missing_path_notes(cfg)
    checked = None
    if not notes:  # the inputs exist: the data checks `csbp train` runs before starting any process
        from csbp.training.mask_data import check_mask_token_data
        from csbp.training.preflight import check_run

        # the warnings csbp train prints for this config (an init_from context extension, an export
        # tokenizer or chat template that is lost), one line each on stderr, worded as train words them
        inputs = check_run(cfg, check_device=False, warn=_warn)
        # an artifact without a supervised_mask_tokens record (older csbp) is scanned, as csbp train does
        check_mask_token_data(cfg, inputs.mask_token_id, read_files=True)
        checked = inputs.artifact.directory
    print(f"config ok: {args.config}")
    for key, value in summary_rows(cfg):
        print(f"  {key:<10} {value}")
    for note in notes:
        print(f"  note: {note}")
    if checked is not None:
        print(f"  inputs     {checked} fits (seq_len, vocabulary, mask token, rows per step)")
    return 0


def _warn(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def checkpoint_architecture(directory: Path) -> str:
    """The ``architectures`` entry of a HF checkpoint's ``config.json`` (the family ``model.init_from``
    trains; ``model.arch`` does not apply to it), or ``a checkpoint`` when it cannot be read."""
    import json  # noqa: PLC0415

    try:
        names = json.loads((directory / "config.json").read_text(encoding="utf-8")).get("architectures")
    except (OSError, ValueError, AttributeError):
        return "a checkpoint"
    return str(names[0]) if isinstance(names, list) and names else "a checkpoint"


def summary_rows(cfg: RunConfig) -> list[tuple[str, str]]:
    """Short human-readable ``(topic, text)`` rows describing a validated config."""
    model, obj, topo = cfg.model, cfg.objective, cfg.topology
    if obj.name == "dflash" and obj.dflash is not None:
        model_text = (
            f"DFlash drafter, {counted(obj.dflash.num_draft_layers, 'draft layer')}, shape from target "
            f"{obj.dflash.target}, {model.dtype}"
        )
    elif model.init_from is not None:
        model_text = f"{checkpoint_architecture(Path(model.init_from))} from {model.init_from}"
        if model.rope_scaling is not None:
            model_text += f", RoPE replaced by {model.rope_scaling.type} x{model.rope_scaling.factor:g}"
    else:
        model_text = (
            f"{model.arch}, {counted(model.num_layers or 0, 'layer')}, hidden {model.hidden_size}, "
            f"heads {model.num_heads}/{model.num_kv_heads} x {model.head_dim}, {model.dtype}"
        )
    if obj.name == "dflash" and obj.dflash is not None and obj.block_size is not None:
        blocks = f", block_size {obj.block_size}, up to {obj.dflash.max_anchors} anchor blocks per sequence"
    elif obj.block_size is not None and obj.name != "ar":
        count = cfg.data.seq_len // obj.block_size
        blocks = f", block_size {obj.block_size} " + (
            "(the whole sequence)" if count == 1 else f"({count} blocks per sequence)"
        )
    else:
        blocks = ""
    if obj.name == "bd3":
        blocks += f", t in [{obj.t_min:g}, {obj.t_max:g}]" + (", masked fractions resampled into it" if obj.resample else "")
        blocks += f", searched over {len(obj.clip_search_widths)} widths at validation" if obj.clip_search_widths else ""
    layout = topo.to_topology().layout
    launched = f", {cfg.num_local_processes} local processes" if cfg.train.nproc is not None else ""
    global_batch = topo.dp * cfg.train.micro_batch_size * cfg.train.grad_accum
    return [
        ("run", f"{cfg.run.name} (seed {cfg.run.seed})"),
        ("model", model_text),
        ("objective", f"{obj.name}{blocks}"),
        ("data", f"seq_len {cfg.data.seq_len}, train {cfg.data.train}"),
        ("documents", document_mask_text(cfg)),
        (
            "topology",
            f"{layout} layout: dp={topo.dp} cp={topo.cp} bp={topo.bp}, world size {cfg.world_size}{launched}",
        ),
        (
            "train",
            f"{counted(cfg.train.max_steps, 'step')}, {counted(global_batch, 'sequence')} per step, "
            f"{cfg.train.precision}",
        ),
        ("optim", f"lr {cfg.optim.lr:g} ({cfg.optim.schedule}, {counted(cfg.optim.warmup_steps, 'warm-up step')})"
         + ("" if cfg.optim.ema_decay is None else f", weight average {cfg.optim.ema_decay:g} for validation and export")),
    ]


def document_mask_text(cfg: RunConfig) -> str:
    """What ``data.document_mask`` does in this run, and why when it is the objective's default."""
    on = cfg.document_mask
    what = (
        "masked: packed documents never attend to each other; traffic and FLOPs follow the mask"
        if on else "not masked: a token attends to the documents packed before it in its row"
    )
    if cfg.data.document_mask is None:
        reason = DOCUMENT_MASK_DEFAULTS[cfg.objective.name][1]
        what += f" (default for {cfg.objective.name}: {reason}{_document_mask_change(cfg)})"
    if on and cfg.data.reset_positions:
        what += "; RoPE positions restart at every document"
    return what


def _document_mask_change(cfg: RunConfig) -> str:
    """How to turn the default document mask of ``cfg`` around, checked against the config rules: no
    offer where the objective refuses the other value (dflash), the other fields it needs named."""
    from csbp.config.rules import cross_section_violations

    other = not cfg.document_mask
    flipped = cfg.model_copy(update={"data": cfg.data.model_copy(update={"document_mask": other})})
    refused = cross_section_violations(flipped)
    if any(field == "data.document_mask" for field, _, _ in refused):
        return f"; {cfg.objective.name} refuses data.document_mask: {str(other).lower()}"
    also = sorted({field for field, _, _ in refused})
    needs = f" (with {', '.join(also)} changed)" if also else ""
    return f"; set data.document_mask: {str(other).lower()}{needs} to change it"


def missing_path_notes(cfg: RunConfig) -> list[str]:
    """Notes for configured input paths that do not exist ("yet" only for the data artifacts)."""
    inputs = {
        "data.train": cfg.data.train,
        "data.val": cfg.data.val,
        "data.tokenizer": cfg.data.tokenizer,
        "model.init_from": cfg.model.init_from,
        "objective.dflash.target": cfg.objective.dflash.target if cfg.objective.dflash else None,
        "objective.dflash.init_from": cfg.objective.dflash.init_from if cfg.objective.dflash else None,
    }
    from csbp.training.input_hints import artifact_under_cwd, is_checkpoint, missing_input_hint

    notes = []
    for field, value in inputs.items():
        if value is not None and not Path(value).exists():
            if field in ("data.train", "data.val"):  # artifacts, which csbp data prepare may still make
                notes.append(f"{field} does not exist yet: {value}{missing_input_hint(Path(value))}")
                continue
            checkpoint = field in ("model.init_from", "objective.dflash.init_from")
            nearby = artifact_under_cwd(Path(value), is_checkpoint) if checkpoint else None
            what = "a HF checkpoint" if field == "model.init_from" else "a drafter"
            hint = "" if nearby is None else (
                f" (but {nearby} is {what} directory: relative paths resolve against the config file's directory)"
            )
            notes.append(f"{field} does not exist: {value}{hint}")  # not made by csbp here: no "yet"
    return notes
