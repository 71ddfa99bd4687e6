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


def _gpt2_directory(directory: Path, texts: list[str], special: SpecialTokens, config: dict[str, str] | None,
                    config_file: str = "tokenizer_config.json") -> Path:
    """A directory without tokenizer.json: GPT-2 style vocab.json + merges.txt of a BPE trained on
    ``texts``, and ``config`` as ``config_file``."""
    train_bpe_tokenizer(texts, vocab_size=300, special=special).backend.model.save(str(directory))
    if config is not None:
        (directory / config_file).write_text(json.dumps(config))
    assert not (directory / "tokenizer.json").exists()
    return directory


def test_transformers_mask_and_pad_tokens_stand_in_for_the_defaults(tmp_path: Path) -> None:
    """Mask ``<mask>`` and pad ``<pad>``: csbp's ``<|mask|>`` and ``<|pad|>`` are absent, so they are
    transformers' ``mask_token`` and ``pad_token`` (pad is not EOS)."""
    config = {"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>", "mask_token": "<mask>", "pad_token": "<pad>"}
    _gpt2_directory(tmp_path, ["hello world, the lazy fox"] * 5, SpecialTokens(mask="<mask>", pad="<pad>"), config)
    reference = _reference(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert (tok.special_names["mask"], tok.special_names["pad"]) == (reference.mask_token, reference.pad_token)
    assert (tok.mask_token_id, tok.pad_id) == (reference.mask_token_id, reference.pad_token_id) == (1, 2)


def test_no_mask_token_is_no_mask_even_where_the_vocabulary_holds_none(tmp_path: Path) -> None:
    """transformers' ``mask_token`` is None here: that is no name to look up (the word ``None`` is a
    token of this vocabulary, and was never to become the mask)."""
    config = {"tokenizer_class": "GPT2Tokenizer", "eos_token": "<|endoftext|>"}
    _gpt2_directory(tmp_path, ["None"] * 20, SpecialTokens(mask="<mask>"), config)
    reference = _reference(tmp_path)
    assert reference.mask_token is None and reference.convert_tokens_to_ids("None") != reference.unk_token_id
    with pytest.raises(ValueError, match=r"has no mask token '<\|mask\|>' \(fix: "):
        load_tokenizer(tmp_path)


def test_a_model_directory_with_config_json_alone_loads_as_transformers_loads_it(tmp_path: Path) -> None:
    """No tokenizer.json nor tokenizer_config.json: transformers takes the tokenizer class from
    ``config.json``'s ``model_type``, and so does csbp (not "holds no tokenizer files")."""
    texts = ["hello world, the lazy fox"] * 5
    _gpt2_directory(tmp_path, texts, SpecialTokens(), {"model_type": "gpt2"}, config_file="config.json")
    reference = _reference(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert tok.encode("hello lazy fox") == reference("hello lazy fox", add_special_tokens=False)["input_ids"]
    assert tok.eos_id == reference.eos_token_id


def test_a_tokenizer_class_transformers_refuses_is_one_line(tmp_path: Path) -> None:
    """transformers raises ValueError (not OSError) for a ``tokenizer_class`` it cannot build: one
    line naming the directory, not a traceback."""
    _gpt2_directory(tmp_path, ["hello world"] * 5, SpecialTokens(), {"tokenizer_class": "NoSuchTokenizer"})
    with pytest.raises(ValueError) as raised:
        _reference(tmp_path)
    reason = " ".join(str(raised.value).split())
    with pytest.raises(ValueError, match=r"^could not load a tokenizer from ") as caught:
        load_tokenizer(tmp_path)
    assert str(caught.value) == (
        f"could not load a tokenizer from {tmp_path}: {reason} (fix: pass a directory holding tokenizer.json)"
    )
