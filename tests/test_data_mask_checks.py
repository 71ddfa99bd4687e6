"""csbp.data.mask_checks: how a mask token shared with another special token is named, and which fix
is offered (the default mask token only where the tokenizer has it or is trained here). A mutation
audit found these unpinned."""

from __future__ import annotations

from pathlib import Path

import pytest

from csbp.data.mask_checks import check_mask_token_of_its_own, mask_of
from csbp.data.tokenizer import SpecialTokens, load_tokenizer, train_bpe_tokenizer

TEXTS = ["the quick brown fox", "jumps over the lazy dog"] * 4


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return train_bpe_tokenizer(TEXTS, vocab_size=280).save(tmp_path_factory.mktemp("tok"))


def test_a_mask_shared_with_the_pad_token_names_the_pad_flag(tokenizer_file: Path) -> None:
    tokenizer = load_tokenizer(tokenizer_file, special=SpecialTokens(mask="<|pad|>"))
    with pytest.raises(ValueError, match=r"^the mask token '<\|pad\|>' \(id 2\) is also the pad token '<\|pad\|>' "
                       r"\(--pad-token\): training would take every pad token for a masked position \(fix: pass "
                       r"--mask-token naming a token the data never holds, such as the default <\|mask\|>\)$"):
        check_mask_token_of_its_own(tokenizer)


def test_the_default_mask_is_offered_where_the_tokenizer_has_it(tokenizer_file: Path) -> None:
    """A loaded tokenizer holding <|mask|> while another mask is named: offered; one without it: not."""
    loaded = load_tokenizer(tokenizer_file, special=SpecialTokens(mask="<|user|>"))
    assert mask_of(loaded) == ("the mask token '<|user|>' (id 4)", "pass --mask-token naming a token the data "
                               "never holds, such as the default <|mask|>")
    bare = train_bpe_tokenizer(TEXTS, vocab_size=280, special=SpecialTokens(mask="<|m|>"))
    assert bare.backend.token_to_id("<|mask|>") is None
    # trained here: a run without --mask-token trains <|mask|> into it
    assert mask_of(bare)[1].endswith("such as the default <|mask|>")
    directory = tokenizer_file.parent.parent / "bare"
    directory.mkdir(exist_ok=True)
    loaded_bare = load_tokenizer(bare.save(directory), special=SpecialTokens(mask="<|m|>"))
    assert mask_of(loaded_bare)[1] == "pass --mask-token naming a token of the tokenizer that the data never holds"
