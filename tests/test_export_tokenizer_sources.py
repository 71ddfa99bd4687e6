"""Which directory an export's tokenizer files come from, and what is rewritten in them (mutation audit
of :mod:`csbp.training.export_tokenizer`): the cases ``test_export_tokenizer.py`` leaves open.

* The first candidate directory that holds the data's tokenizer supplies the companion files, not a
  later one; a DFlash run's target is a candidate.
* A ``data.tokenizer`` that is a tokenizer file of another name than ``tokenizer.json`` brings no
  companion files from its directory (they need not belong to it); a bare file given to
  ``csbp data prepare`` is no lost directory (no warning).
* A run mask id that is a plain vocabulary entry is never named ``mask_token`` (transformers would
  split it out of text): the source's other ``mask_token`` is dropped, one naming that very id is kept.
* An ``eos_token`` written as an AddedToken dict is read (the generation config's end-of-turn stop).
* When the data was rendered with another chat template than the source directory's, no stale copy of
  the source's ships: neither its ``chat_template.json`` nor the ``chat_template`` key of its
  ``tokenizer_config.json``, even when nothing else in that config changes.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_export_tokenizer_sources.py -q``
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from csbp.config import config_from_dict
from csbp.data.artifact import Artifact, open_artifact
from csbp.data.prepare import PrepareConfig, prepare_artifact
from csbp.training.export_tokenizer import export_tokenizer, export_tokenizer_for_run
from test_export_tokenizer import CHATML, OTHER_TEMPLATE, auto, chat_data, chat_tokenizer, imported  # noqa: F401
from test_training_run import config_dict

CONFIG = "tokenizer_config.json"


def copy_with_config(source: Path, target: Path, **changes: Any) -> Path:
    """A copy of tokenizer directory ``source`` whose tokenizer_config.json has ``changes`` (None: removed)."""
    shutil.copytree(source, target)
    config = json.loads((target / CONFIG).read_text())
    config.update(changes)
    config = {key: value for key, value in config.items() if value is not None}
    (target / CONFIG).write_text(json.dumps(config))
    return target


def config_of(files: dict[str, bytes]) -> dict[str, Any]:
    return json.loads(files[CONFIG].decode("utf-8"))


def artifact_of(imported: dict[str, Path]) -> Artifact:  # noqa: F811
    return open_artifact(imported["art"])


def mask_of(imported: dict[str, Path]) -> int:  # noqa: F811
    return Tokenizer.from_file(str(imported["art"] / "tokenizer.json")).token_to_id("<|mask|>")


def test_the_first_candidate_holding_the_tokenizer_supplies_the_files(
    imported: dict[str, Path], tmp_path: Path  # noqa: F811
) -> None:
    first = copy_with_config(imported["ext"], tmp_path / "first", model_max_length=111)
    second = copy_with_config(imported["ext"], tmp_path / "second", model_max_length=222)
    exported = export_tokenizer(artifact_of(imported), None, [("a", tmp_path / "gone"), ("b", first), ("c", second)],
                                mask_token_id=mask_of(imported))  # fmt: skip
    assert exported.source == first and config_of(exported.files)["model_max_length"] == 111


def test_a_dflash_target_supplies_the_tokenizer_files(imported: dict[str, Path], tmp_path: Path) -> None:  # noqa: F811
    art = tmp_path / "art"
    shutil.copytree(imported["art"], art)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["tokenizer"]["source"] = str(tmp_path / "gone")  # prepare's directory is no longer there
    (art / "manifest.json").write_text(json.dumps(manifest))
    target = copy_with_config(imported["ext"], tmp_path / "target", model_max_length=333)
    data = config_dict(art, **{"objective.name": "dflash", "model": {"dtype": "float32"},
                               "objective.dflash": {"target": str(target)}})  # fmt: skip
    exported = export_tokenizer_for_run(config_from_dict(data), open_artifact(art), None, warn=None)
    assert exported.source == target and config_of(exported.files)["model_max_length"] == 333


def test_a_tokenizer_file_of_another_name_brings_no_companion_files(
    imported: dict[str, Path], tmp_path: Path  # noqa: F811
) -> None:
    foreign = copy_with_config(imported["base"], tmp_path / "dir", tokenizer_class="SomeOtherTokenizer")
    named = foreign / "data-tokenizer.json"
    shutil.copy2(imported["ext"] / "tokenizer.json", named)  # the data's tokenizer, beside another's files
    exported = export_tokenizer(artifact_of(imported), named, [], mask_token_id=mask_of(imported))
    assert exported.source is None and config_of(exported.files)["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert exported.files["chat_template.jinja"] == CHATML.encode()  # the recorded template file still ships


def test_a_bare_tokenizer_file_given_to_prepare_is_not_reported_lost(tmp_path: Path) -> None:
    directory = tmp_path / "tok"
    directory.mkdir()
    chat_tokenizer(tmp_path / "src", mask=True)
    bare = directory / "mine.json"
    shutil.copy2(tmp_path / "src" / "tokenizer.json", bare)
    art = tmp_path / "art"
    prepare_artifact(PrepareConfig(inputs=(chat_data(tmp_path / "chat.jsonl"),), out_dir=art, seq_len=32,
                                   tokenizer_path=bare, chat_template=str(tmp_path / "src" / "chat_template.jinja"),
                                   val_fraction=0.1))  # fmt: skip
    warnings: list[str] = []
    exported = export_tokenizer(open_artifact(art), None, [], mask_token_id=None, warn=warnings.append)
    assert warnings == [] and exported.source is None


def test_a_plain_vocabulary_mask_id_is_never_named(imported: dict[str, Path], tmp_path: Path) -> None:  # noqa: F811
    backend = Tokenizer.from_file(str(imported["art"] / "tokenizer.json"))
    plain = max(backend.get_vocab().values()) - 1  # a merged BPE token, no added token
    assert plain not in backend.get_added_tokens_decoder()
    # ext names <|mask|> (another id): dropped rather than left naming a token that is not the model's
    exported = export_tokenizer(artifact_of(imported), imported["ext"], [], mask_token_id=plain)
    assert "mask_token" not in config_of(exported.files)
    assert auto_from(exported.files, tmp_path / "a").mask_token_id is None
    # a source naming that very vocabulary entry keeps it
    same = copy_with_config(imported["ext"], tmp_path / "same", mask_token=backend.id_to_token(plain))
    exported = export_tokenizer(artifact_of(imported), same, [], mask_token_id=plain)
    assert config_of(exported.files)["mask_token"] == backend.id_to_token(plain)


def auto_from(files: dict[str, bytes], directory: Path) -> Any:
    directory.mkdir()
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return auto(directory)


def test_an_eos_token_written_as_an_added_token_dict_is_read(imported: dict[str, Path], tmp_path: Path) -> None:  # noqa: F811
    eos = {"content": "<|im_end|>", "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
           "special": True, "__type": "AddedToken"}  # fmt: skip
    source = copy_with_config(imported["ext"], tmp_path / "tok", eos_token=eos)
    exported = export_tokenizer(artifact_of(imported), source, [], mask_token_id=mask_of(imported))
    backend = Tokenizer.from_file(str(imported["art"] / "tokenizer.json"))
    assert exported.eos_id == backend.token_to_id("<|im_end|>") == auto(source).eos_token_id


def artifact_with_other_template(imported: dict[str, Path], tmp_path: Path) -> Path:  # noqa: F811
    """Chat data prepared with the imported tokenizer and ``OTHER_TEMPLATE`` (not the source's ChatML)."""
    template_file = tmp_path / "other.jinja"
    template_file.write_text(OTHER_TEMPLATE, encoding="utf-8")
    art = tmp_path / "art"
    prepare_artifact(PrepareConfig(inputs=(chat_data(tmp_path / "chat.jsonl"),), out_dir=art, seq_len=32,
                                   tokenizer_path=imported["ext"], chat_template=str(template_file),
                                   val_fraction=0.1))  # fmt: skip
    return art


def test_no_stale_copy_of_the_sources_chat_template_ships(
    imported: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    art = artifact_with_other_template(imported, tmp_path)
    # the source keeps its ChatML template the legacy ways: in tokenizer_config.json and chat_template.json
    source = copy_with_config(imported["ext"], tmp_path / "tok", chat_template=CHATML)
    (source / "chat_template.jinja").unlink()
    (source / "chat_template.json").write_text(json.dumps({"chat_template": CHATML}))
    exported = export_tokenizer(open_artifact(art), source, [], mask_token_id=None)  # ar: no mask rewrite
    assert sorted(exported.files) == ["chat_template.jinja", "tokenizer.json", CONFIG]
    assert exported.files["chat_template.jinja"] == OTHER_TEMPLATE.encode()
    assert "chat_template" not in config_of(exported.files)
    chat = [{"role": "user", "content": "hi"}]
    assert auto_from(exported.files, tmp_path / "out").apply_chat_template(chat, tokenize=False) == (
        "<|im_start|>user: hi<|im_end|>\n")  # fmt: skip


def test_the_template_transformers_renders_decides_whether_the_source_template_is_the_datas(
    imported: dict[str, Path], tmp_path: Path  # noqa: F811
) -> None:
    """A source with ``chat_template.jinja`` (ChatML) and another template in ``tokenizer_config.json``:
    transformers renders the ``.jinja`` one, so data rendered with the config's template needs a rewrite."""
    art = artifact_with_other_template(imported, tmp_path)
    source = copy_with_config(imported["ext"], tmp_path / "tok", chat_template=OTHER_TEMPLATE)
    chat = [{"role": "user", "content": "hi"}]
    assert auto(source).apply_chat_template(chat, tokenize=False) == "<|im_start|>user\nhi<|im_end|>\n"  # .jinja wins
    exported = export_tokenizer(open_artifact(art), source, [], mask_token_id=None)
    assert auto_from(exported.files, tmp_path / "out").apply_chat_template(chat, tokenize=False) == (
        "<|im_start|>user: hi<|im_end|>\n")  # fmt: skip
