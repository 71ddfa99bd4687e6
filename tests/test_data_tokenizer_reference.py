"""Special-token resolution and encoding of local tokenizers, checked against transformers.

Each tokenizer is built here with the ``tokenizers`` library; the reference is what transformers'
``AutoTokenizer`` loads from the same files (``local_files_only=True``), so these pin csbp to the
files' meaning, not to csbp's own reading of them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from csbp.data.tokenizer import SpecialTokens, load_tokenizer, train_bpe_tokenizer

transformers = pytest.importorskip("transformers")


def _reference(directory: Path) -> Any:
    """What transformers loads from ``directory`` (never the hub, never the directory's code)."""
    return transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)


def _wordlevel(directory: Path, tokens: list[str], *, bos: str | None = None) -> Path:
    """``directory/tokenizer.json``: a whitespace word-level tokenizer of ``tokens`` (ids in order);
    with ``bos``, a post-processor that puts it in front of every encoding (as Llama's does)."""
    backend = Tokenizer(models.WordLevel({token: i for i, token in enumerate(tokens)}, unk_token=tokens[0]))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    if bos is not None:
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))]
        )
    backend.save(str(directory / "tokenizer.json"))
    return directory


def test_special_tokens_map_outranks_tokenizer_config_as_transformers_reads_them(tmp_path: Path) -> None:
    """Both config files name eos/pad/mask and disagree: transformers takes special_tokens_map.json's."""
    tokens = ["[UNK]", "</s>", "[EOS2]", "[MASK]", "[MASK2]", "[PAD]", "[PAD2]", "word"]
    directory = _wordlevel(tmp_path, tokens)
    (directory / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "</s>", "pad_token": {"content": "[PAD]"}, "mask_token": "[MASK]"})
    )
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "[EOS2]", "pad_token": "[PAD2]",
                    "mask_token": "[MASK2]"})
    )
    reference = _reference(directory)
    tok = load_tokenizer(directory)
    assert tok.special_names == {"eos": reference.eos_token, "mask": reference.mask_token, "pad": reference.pad_token}
    assert (tok.eos_id, tok.mask_token_id, tok.pad_id) == (
        reference.eos_token_id, reference.mask_token_id, reference.pad_token_id) == (1, 3, 5)


def test_csbp_s_default_name_is_tried_before_the_config_s(tmp_path: Path) -> None:
    """The config's names stand in only for a default name the vocabulary lacks: with both present,
    ``<|endoftext|>`` stays EOS though the config (and so transformers) says ``</s>``."""
    directory = _wordlevel(tmp_path, ["[UNK]", "</s>", "<|endoftext|>", "<|mask|>", "[MASK]"])
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "mask_token": "[MASK]"})
    )
    reference = _reference(directory)
    assert (reference.eos_token, reference.mask_token) == ("</s>", "[MASK]")  # the config does disagree
    tok = load_tokenizer(directory)
    assert tok.special_names["eos"] == "<|endoftext|>" and tok.eos_id == reference.convert_tokens_to_ids("<|endoftext|>")
    assert tok.special_names["mask"] == "<|mask|>" and tok.mask_token_id == reference.convert_tokens_to_ids("<|mask|>")


def test_pad_falls_back_to_eos_in_ids_and_names(tmp_path: Path) -> None:
    """Without a pad token, pad is EOS: its recorded name too (the manifest's ``special_names``)."""
    directory = _wordlevel(tmp_path, ["[UNK]", "<|endoftext|>", "<|mask|>", "word"])
    reference = _reference(directory)
    assert reference.pad_token is None  # no pad of its own
    tok = load_tokenizer(directory)
    assert tok.pad_id == tok.eos_id == reference.convert_tokens_to_ids("<|endoftext|>")
    assert tok.special_names == {"eos": "<|endoftext|>", "mask": "<|mask|>", "pad": "<|endoftext|>"}


def test_a_recorded_mask_id_is_named_by_its_token_and_moves_only_the_mask(tmp_path: Path) -> None:
    """``load_tokenizer(mask_id=N)`` (the id a run trained with): the mask is id N, named by the
    token transformers reads at N; EOS, pad and the role markers keep their own ids."""
    tokens = ["[UNK]", "<|endoftext|>", "<|mask|>", "<|pad|>", "<|user|>", "[TRAINED_MASK]"]
    directory = _wordlevel(tmp_path, tokens)
    reference = _reference(directory)
    tok = load_tokenizer(directory, mask_id=5)
    assert tok.mask_token_id == 5
    assert tok.special_names["mask"] == reference.convert_ids_to_tokens(5) == "[TRAINED_MASK]"
    expected = {name: reference.convert_tokens_to_ids(token)
                for name, token in (("eos", "<|endoftext|>"), ("pad", "<|pad|>"), ("user", "<|user|>"))}
    assert {"eos": tok.eos_id, "pad": tok.pad_id, "user": tok.role_ids["user"]} == expected == {"eos": 1, "pad": 3, "user": 4}
    assert tok.special_names["eos"] == "<|endoftext|>" and tok.special_names["pad"] == "<|pad|>"


def test_encoding_adds_no_bos_of_a_post_processor(tmp_path: Path) -> None:
    """A tokenizer.json whose post-processor prepends ``<s>``: csbp's ids are transformers' with
    ``add_special_tokens=False``, one text at a time and in a batch (a BOS would land mid-row)."""
    directory = _wordlevel(tmp_path, ["[UNK]", "<s>", "<|endoftext|>", "<|mask|>", "hello", "world"], bos="<s>")
    reference = _reference(directory)
    texts = ["hello world", "world", "hello hello world"]
    assert reference(texts[0])["input_ids"][0] == 1  # the post-processor does add a BOS
    plain = [reference(text, add_special_tokens=False)["input_ids"] for text in texts]
    tok = load_tokenizer(directory)
    assert [tok.encode(text) for text in texts] == plain
    assert tok.encode_batch(texts) == plain


def test_transformers_mask_token_stands_in_for_the_default(tmp_path: Path) -> None:
    """A directory without tokenizer.json (GPT-2 style vocab.json + merges.txt) whose mask is
    ``<mask>``: csbp's ``<|mask|>`` is absent, so the mask is transformers' ``mask_token``."""
    trained = train_bpe_tokenizer(["hello world, the lazy fox"] * 5, vocab_size=300, special=SpecialTokens(mask="<mask>"))
    trained.backend.model.save(str(tmp_path))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>", "mask_token": "<mask>"})
    )
    assert not (tmp_path / "tokenizer.json").exists()
    reference = _reference(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert tok.special_names["mask"] == reference.mask_token == "<mask>"
    assert tok.mask_token_id == reference.mask_token_id == trained.mask_token_id
