"""``csbp dflash prepare-features``: capture a target's hidden states of an artifact split once.

The layers come from ``--layer-ids``, a ``--drafter``'s config, or the default for
``--num-draft-layers``. The store records the fingerprints of the target's config and weight files
(``csbp train`` refuses a store of other weights) and the layer ids it holds, and the capture commits
its progress at least once a minute: run the same command again after an interruption and it resumes
(``csbp.dflash.feature_writer``). Every check reads configs (and the split's token ids) only; the
target's weights load once they all pass.
"""

from __future__ import annotations

import argparse

from csbp.cli.dflash_common import (
    load_target,
    read_target_config,
    require_drafter_directory,
    require_target_tokenizer,
)
from csbp.models.hf_io import read_json_object
from csbp.wording import counted

FEATURE_DTYPES = ("bfloat16", "float16", "float32")


def check_num_draft_layers(count: int, num_layers: int) -> None:
    """``ValueError`` naming ``--num-draft-layers`` when the default ids cannot be ``count`` distinct
    layers, before they are listed (``10**12`` built a tuple of as many ids: no end)."""
    most = max(1, num_layers - 3)
    if count > most:
        raise ValueError(
            f"--num-draft-layers {count}: the default layer ids of a {num_layers}-layer target are at most "
            f"{counted(most, 'distinct layer')} ({f'1 to {most}' if num_layers >= 4 else 'its middle one'}) (fix: --num-draft-layers "
            f"{most} or less, or --layer-ids)"
        )


def run_prepare_features(args: argparse.Namespace) -> int:
    """Validate the inputs, then capture the store at ``--out`` (module docstring)."""
    from csbp.data.artifact import max_token_id, open_artifact
    from csbp.dflash.config import default_target_layer_ids, validate_drafter_target
    from csbp.dflash.export import dflash_config_from_hf
    from csbp.dflash.feature_writer import check_output, prepare_features
    from csbp.dflash.target_fingerprint import checkpoint_identity

    # Every check reads configs only: a large target's weights are loaded (minutes) once they all pass.
    if args.layer_ids is not None and args.drafter is not None:
        raise ValueError("give --layer-ids or --drafter, not both")
    if args.rows_per_batch < 1:
        raise ValueError(f"--rows-per-batch {args.rows_per_batch}: must be >= 1")
    check_output(args.out, overwrite=args.overwrite)
    artifact = open_artifact(args.data)
    target_config = read_target_config(args.target)
    require_target_tokenizer(args.target, artifact)
    artifact.require_vocab_size(target_config.vocab_size)
    # the ids themselves: the manifest vouches for none in a token file changed since csbp data prepare
    # (same size, so it opens), and one past the target's embedding was an IndexError mid-capture
    largest = max_token_id(artifact.directory, args.split)
    if largest >= target_config.vocab_size:
        raise ValueError(
            f"--data {args.data} split {args.split}: token id {largest} is outside the target vocabulary "
            f"[0, {target_config.vocab_size}) (fix: its token files changed since csbp data prepare: check with "
            "csbp data inspect --verify)"
        )
    if args.drafter is not None:
        require_drafter_directory(args.drafter)
        drafter_config = dflash_config_from_hf(read_json_object(args.drafter / "config.json"))
        try:  # features for a drafter of another target (shape or RoPE) would train it on the wrong states
            validate_drafter_target(drafter_config, target_config)
        except ValueError as exc:
            raise ValueError(
                f"--drafter {args.drafter}: {exc} (fix: pass the --target it was trained against, or --layer-ids)"
            ) from None
        layer_ids = drafter_config.target_layer_ids
    elif args.layer_ids is not None:
        layer_ids = tuple(args.layer_ids)
    else:
        check_num_draft_layers(args.num_draft_layers, target_config.num_layers)
        layer_ids = default_target_layer_ids(target_config.num_layers, args.num_draft_layers)
    bad = [i for i in layer_ids or () if not 0 <= i < target_config.num_layers]
    if bad:
        raise ValueError(f"--layer-ids {bad} are outside the target's layers [0, {target_config.num_layers})")
    target = load_target(args.target, args)
    split = artifact.split(args.split)
    print(
        f"capturing layers {list(layer_ids or ())} of {args.target} for {split.num_rows} {args.split} rows",
        flush=True,
    )
    target_weights, target_files = checkpoint_identity(args.target)
    out = prepare_features(
        target,
        split,
        args.out,
        layer_ids=layer_ids or (),
        target_weights=target_weights,
        target_files=target_files,
        with_last_hidden=args.with_last_hidden,
        dtype=args.feature_dtype,
        rows_per_batch=args.rows_per_batch,
        overwrite=args.overwrite,
        progress=True,
    )
    print(f"wrote {out}")
    return 0
