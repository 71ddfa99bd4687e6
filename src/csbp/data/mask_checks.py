"""Checks that the mask token of ``csbp data prepare`` is a token of its own, and their messages.

Training takes every position holding the mask token's id for a masked one, so that id must be no
other special token's (EOS, pad, a role marker) and must not occur in the data; the messages name
the token and the fix (another ``--mask-token``, or removing it from the data).
"""

from __future__ import annotations

from csbp.data.tokenizer import CsbpTokenizer, SpecialTokens


def check_mask_token_of_its_own(tokenizer: CsbpTokenizer) -> None:
    """``ValueError`` unless the mask token's id is no other special token's (EOS, pad, a role marker):
    an EOS that is also ``[M]`` is supervised in every document, which training refuses mid-run."""
    which, fix = mask_of(tokenizer)
    for special, token_id in tokenizer.special_ids().items():
        if special != "mask" and token_id == tokenizer.mask_token_id:
            raise ValueError(shared_mask_message(which, special, tokenizer.special_names[special], fix))


def mask_of(tokenizer: CsbpTokenizer) -> tuple[str, str]:
    """How messages name ``tokenizer``'s mask token, and the fix they offer."""
    name = tokenizer.special_names["mask"]
    default_available = tokenizer.source == "trained" or tokenizer.backend.token_to_id(DEFAULT_MASK) is not None
    return f"the mask token {name!r} (id {tokenizer.mask_token_id})", mask_fix(name, default_available)


DEFAULT_MASK = SpecialTokens().mask


def mask_fix(mask_name: str, default_available: bool) -> str:
    if mask_name == DEFAULT_MASK:
        return f"remove {DEFAULT_MASK} from the data, or pass --mask-token naming another token the data never holds"
    if default_available:
        return f"pass --mask-token naming a token the data never holds, such as the default {DEFAULT_MASK}"
    return "pass --mask-token naming a token of the tokenizer that the data never holds"


def shared_mask_message(which: str, field: str, other_name: str, fix: str) -> str:
    flag = f"--{field}-token" if field in ("eos", "pad") else f"the {field} role marker"
    return (
        f"{which} is also the {field} token {other_name!r} ({flag}): training would take every {field} token "
        f"for a masked position (fix: {fix})"
    )


def mask_in_text_message(which: str, fix: str) -> str:
    return f"{which} occurs in the text: training would take it for a masked position (fix: {fix})"
