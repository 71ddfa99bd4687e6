"""``csbp dflash export``: write a drafter in the public DFlash format.

It reads one of: ``--drafter DIR`` (a drafter in the public format, re-exported after validation
against the target), ``--run-dir RUN`` (``RUN/final`` when it holds a drafter, else the checkpoint
``RUN/checkpoints/latest`` names) or ``--checkpoint RUN/checkpoints/step_N`` (a
``torch.distributed.checkpoint`` directory whose ``model`` entry is the drafter's state dict; the
shapes come from the checkpoint, ``block_size``/``mask_token_id`` from the run config in
``trainer_state.json`` and ``target_layer_ids`` from the ids it recorded as trained with
(:mod:`csbp.training.dflash_layers`), or from ``--block-size``/``--mask-token-id``/``--layer-ids``).
DCP's ``.metadata`` is a pickle: it is read with a restricted unpickler that admits only the DCP
metadata classes, so a crafted checkpoint is refused instead of running code. The export carries the
tokenizer files of a ``--drafter`` directory (a run's ``final/``), or for a checkpoint those its run's
``final/`` would hold (:func:`csbp.cli.dflash_checkpoint.checkpoint_tokenizer_files`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from csbp.cli.dflash_checkpoint import (
    check_checkpoint_target,
    checkpoint_context,
    checkpoint_seq_len,
    checkpoint_tokenizer_files,
    drafter_from_checkpoint,
    recorded_target,
    run_dir_source,
)
from csbp.cli.dflash_common import DTYPES, INCLUSIVE_NOTE, load_target, require_drafter_directory
from csbp.models.hf_io import tokenizer_files_in, without_auto_map
from csbp.wording import counted


def served_positions(target: Path, drafter_dir: Path | None) -> int | None:
    """The context the export records (with ``seq_len``): the target's ``max_position_embeddings``, or a
    ``--drafter`` directory's own when that is larger (carried through); None when neither records one."""
    from csbp.dflash.export import recorded_max_positions

    known = [n for n in (recorded_max_positions(target), drafter_dir and recorded_max_positions(drafter_dir)) if n]
    return max(known) if known else None


def run_export(args: argparse.Namespace) -> int:
    """Export the drafter of ``--drafter``/``--run-dir``/``--checkpoint`` to ``--out`` and validate what was written."""
    from csbp.dflash.export import drafter_context, export_dflash, load_dflash, public_reader_window_note
    from csbp.dflash.target_record import recorded_target_record, target_record
    from csbp.training.export import check_out_outside_checkpoints, checkpoints_dir_of

    drafter_dir = args.drafter
    checkpoint = args.checkpoint
    if drafter_dir is not None and drafter_dir.is_dir():  # before the --target it needs: a run directory here
        require_drafter_directory(drafter_dir)  # names its export
    if args.run_dir is not None:
        drafter_dir, checkpoint = run_dir_source(args.run_dir)
        check_out_outside_checkpoints(args.out, args.run_dir / "checkpoints")
    else:
        check_out_outside_checkpoints(args.out, checkpoints_dir_of(checkpoint) if checkpoint is not None else None)
    overrides = [flag for flag, value in (("--block-size", args.block_size), ("--mask-token-id", args.mask_token_id),
                                          ("--layer-ids", args.layer_ids)) if value is not None]
    if drafter_dir is not None and overrides:  # a drafter's config.json records them: they were ignored
        raise ValueError(
            f"{' and '.join(overrides)} override{'s' * (len(overrides) == 1)} a checkpoint's run settings, but {drafter_dir} is a drafter "
            f"directory whose config.json records them (fix: drop {' and '.join(overrides)}, or export a --checkpoint)"
        )
    if args.target is None:
        args.target = recorded_target(args.run_dir, checkpoint)
        print(f"target: {args.target} (recorded by the run; --target overrides)", file=sys.stderr)
    target = load_target(args.target, args, device="cpu")  # only validates shapes and ids
    dtype = None if args.dtype == "auto" else DTYPES[args.dtype]
    seq_len = None  # the training length: a drafter directory records none
    if drafter_dir is not None:
        if not (drafter_dir / "config.json").is_file():
            raise ValueError(f"{drafter_dir} is not a DFlash drafter directory: config.json not found")
        drafter = load_dflash(drafter_dir, target, dtype=dtype)
        source, context = str(drafter_dir), drafter_context(drafter_dir)  # carried through
        trained_against = recorded_target_record(drafter_dir)  # carried through: --target only checks shapes
        tokenizer, dropped = without_auto_map(tokenizer_files_in(drafter_dir))  # carried through (final/ has them)
        if dropped:
            print(
                f"note: {drafter_dir / 'tokenizer_config.json'} names remote code (auto_map); the export leaves it "
                "out (csbp runs none; the tokenizer is tokenizer.json)",
                file=sys.stderr,
            )
    else:
        drafter = drafter_from_checkpoint(checkpoint, target, args)
        source, context = f"checkpoint {checkpoint}", checkpoint_context(checkpoint)
        tokenizer = checkpoint_tokenizer_files(checkpoint, drafter.config.mask_token_id)
        seq_len = checkpoint_seq_len(checkpoint)
        check_checkpoint_target(checkpoint, args.target)
        trained_against = target_record(args.target)
    out = export_dflash(
        drafter, args.out, dtype=dtype, overwrite=args.overwrite, context=context, tokenizer_files=tokenizer,
        seq_len=seq_len, target_positions=served_positions(args.target, drafter_dir), target=trained_against,
    )
    reloaded = load_dflash(out, target)  # validate what was written
    cfg = reloaded.config
    count = sum(p.numel() for p in reloaded.parameters())
    print(
        f"exported {source} -> {out}: {'DFlash2' if cfg.is_dflash2 else 'DFlash'} drafter, "
        f"{counted(cfg.num_layers, 'layer')}, block_size {cfg.block_size}, target_layer_ids {list(cfg.target_layer_ids or ())}, "
        f"mask_token_id {cfg.mask_token_id}, {count} parameters, context {context or 'not recorded'}, "
        f"{len(tokenizer)} tokenizer files"
    )
    if context == "inclusive":
        print(INCLUSIVE_NOTE.format(drafter=out), file=sys.stderr)
    window_note = public_reader_window_note(cfg, out)
    if window_note is not None:
        print(window_note, file=sys.stderr)
    return 0
