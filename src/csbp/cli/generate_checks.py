"""What ``csbp generate`` refuses before it loads the model, each a ``ValueError`` naming the flag and
the fix: a ``--samples`` count greedy decoding or the generator's 32-bit seeds would make repeat, a
block longer than the model's positions, a prompt and ``--max-new-tokens`` past them, a prompt the
sampler cannot continue (empty under token shift, or holding the mask token), a ``--tokenizer``
other than the model's own, and an ``--eos-token`` the model never learnt to end with.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from csbp.cli.options import LARGEST_INT_OPTION
from csbp.generation.run_settings import TOKEN_SHIFT_OBJECTIVES, position_limit

if TYPE_CHECKING:
    from csbp.data.tokenizer import CsbpTokenizer


DISTINCT_SEEDS = 2**32
"""Seeds that draw differently: the sampler's CPU generator (mt19937) is seeded with the seed's low 32
bits, so seeds ``s`` and ``s + 2**32`` draw the same tokens."""


def check_same_tokenizer(model_dir: Path, given: Path | None, fingerprint: str) -> None:
    """``ValueError`` when ``--tokenizer`` names another tokenizer than the one exported with the
    model: its ids would mean other words to the model, and the sample would be noise."""
    from csbp.data.tokenizer import fingerprint_bytes

    own = model_dir / "tokenizer.json"
    if given is None or not own.is_file() or fingerprint_bytes(own.read_bytes()) == fingerprint:
        return
    raise ValueError(
        f"--tokenizer {given}: not the tokenizer {model_dir} was exported with ({own}; fingerprints differ), so "
        "its ids would mean other words to the model (fix: drop --tokenizer to use the model's own)"
    )


def check_prompt(
    prompt_ids: list[int], objective: str, mask_token_id: int, mask_name: str, *, where: str = "--prompt"
) -> None:
    """``ValueError`` for a prompt the sampler cannot continue, found before the model is loaded; ``where``
    names it (``--prompt``, or ``FILE:LINE`` of ``--prompts``)."""
    if TOKEN_SHIFT_OBJECTIVES[objective] and not prompt_ids:
        raise ValueError(
            f"{where}: empty, but {objective} predicts each token from the one before it (fix: give a prompt)"
        )
    if mask_token_id in prompt_ids:
        raise ValueError(
            f"{where}: holds the mask token {mask_name} (id {mask_token_id}), which the model reads as a "
            "position to fill, not as text (fix: remove it from the prompt)"
        )


def check_eos_token(
    args: argparse.Namespace, tokenizer: CsbpTokenizer, model_dir: Path, run_settings: dict[str, Any], listed: list[int]
) -> None:
    """``ValueError`` when an explicit ``--eos-token`` is not the EOS the run's data ended documents
    with (its recorded ``eos_token_id``) nor another stop of the export's ``generation_config.json``
    (``listed``: a chat model's end of turn): the model never learnt to end a completion with it. Nothing is
    checked for an export that records no EOS id (written before the record, or not by csbp)."""
    recorded = run_settings.get("eos_token_id")
    chosen = tokenizer.eos_id
    if recorded is None or args.eos_token is None or chosen == recorded or chosen in listed:
        return
    trained = tokenizer.backend.id_to_token(recorded)
    raise ValueError(
        f"--eos-token {args.eos_token}: id {chosen} of {args.tokenizer or model_dir}, but the model was trained "
        f"with EOS id {recorded}{f' ({trained})' if trained else ''} ({model_dir / 'config.json'}), and its "
        "generation_config.json lists no such stop (fix: drop --eos-token to use the run's)"
    )


def check_samples(samples: int, seed: int, temperature: float) -> None:
    """``ValueError`` for a ``--samples`` count that cannot be meaningful, refused before any work:
    greedy draws the same completion from every seed, the generator's seeds repeat after
    :data:`DISTINCT_SEEDS`, and a sample's seed must be one ``--seed`` takes, to draw it again."""
    if samples > 1 and temperature == 0:
        raise ValueError(
            f"--samples {samples}: --temperature 0 is greedy, so every sample would be the same completion "
            "(fix: --temperature above 0 to draw different ones, or drop --samples)"
        )
    if samples > DISTINCT_SEEDS:
        raise ValueError(
            f"--samples {samples}: the sampler's generator reads a seed's low 32 bits, so only 2^32 seeds draw "
            f"differently and the rest would repeat them (fix: --samples {DISTINCT_SEEDS} or less)"
        )
    if seed + samples - 1 > LARGEST_INT_OPTION:
        raise ValueError(
            f"--seed {seed} --samples {samples}: the last sample's seed {seed + samples - 1} is past 2^63 - 1, the "
            f"largest --seed takes, so it could not be drawn again (fix: --seed {LARGEST_INT_OPTION - samples + 1} or less)"
        )


def check_block_size(model_dir: Path, block_size: int, given: bool) -> None:
    """``ValueError`` naming ``--block-size`` (``given``) when one block is longer than the model's
    positions (``max_position_embeddings``): the sampler runs whole blocks, so no prompt or
    ``--max-new-tokens`` could fit (it blamed ``--max-new-tokens``, with the fix "a prompt shorter than 0 tokens")."""
    limit, source = position_limit(model_dir)
    if block_size <= limit:
        return
    what = f"--block-size {block_size}" if given else f"block size {block_size}"
    raise ValueError(
        f"{what}: the sampler runs whole blocks, and one block of {block_size} positions is past "
        f"max_position_embeddings {limit} {source} (fix: the block size the model was trained with, at most {limit})"
    )


def check_positions(
    model_dir: Path, prompt_len: int, max_new_tokens: int, block_size: int, *, where: str = "--prompt"
) -> None:
    """``ValueError`` unless the prompt and ``max_new_tokens`` fit the model's positions
    (:func:`position_limit`: ``max_position_embeddings``, else transformers' default). The sampler runs
    whole blocks, so the positions used end at the block boundary after the last new token. ``where``
    names the (longest) prompt when it is a line of ``--prompts``."""
    from csbp.generation.sampler import positions_used

    limit, source = position_limit(model_dir)
    used = positions_used(prompt_len, max_new_tokens, block_size)
    if used <= limit:
        return
    room = limit // block_size * block_size - prompt_len
    fix = f"--max-new-tokens {room} or less" if room >= 1 else f"a prompt shorter than {limit // block_size * block_size} tokens"
    which = "the prompt's" if where == "--prompt" else f"the prompt of {where}:"
    raise ValueError(
        f"--max-new-tokens {max_new_tokens}: {which} {prompt_len} tokens and {max_new_tokens} new ones fill "
        f"blocks of {block_size} up to position {used}, beyond max_position_embeddings {limit} {source} (fix: {fix})"
    )
