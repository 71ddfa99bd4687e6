"""The tokenizer an export carries (:mod:`csbp.training.export_tokenizer`): ``AutoTokenizer.from_pretrained``
on a run's export must be the tokenizer the data was tokenized with (same ids, special tokens, the
run's mask token, the chat template the data was rendered with), for a trained tokenizer and for a
Hugging Face tokenizer directory given to ``csbp data prepare`` (with ``model.init_from`` and
without ``data.tokenizer``), and a tokenizer that is not the data's is never shipped.

Before, the export copied ``data.tokenizer``'s directory or else the artifact's bare
``tokenizer.json``: the chat template and special tokens of an imported chat model were lost, and
transformers 5 loaded the bare file of a ``qwen3`` export as a ``Qwen2Tokenizer`` whose own
pre-tokenizer gives other ids. Small tokenizers are built here; nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from csbp.data.artifact import open_artifact
from csbp.data.prepare import PrepareConfig, prepare_artifact
from csbp.models.decoder import Decoder
from csbp.models.hf_io import export_hf_checkpoint
from csbp.training.export import export_decoder
from csbp.training.preflight import check_run
from test_export_generation_config import SHAPE_FREE
from test_training_run import tiny_config

transformers = pytest.importorskip("transformers")

CHATML = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
OTHER_TEMPLATE = CHATML.replace("<|im_start|>{{ message['role'] }}\n", "<|im_start|>{{ message['role'] }}: ")
TEXTS = [f"In {1990 + i % 30} the fox said: it's {i * 7} and\n\nthe dog's {i % 13} won't." for i in range(60)]
CHAT = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "It's 4.\n\nSure."}]
RESERVED = "<|reserved|>"  # an added token the data never holds (id 3)
SAMPLE = "Year 2024: the fox's 99 dogs\n\n  won't <|im_end|> stop."


def chat_tokenizer(directory: Path, *, mask: bool) -> Path:
    """A ChatML tokenizer saved by transformers (``tokenizer_config.json``, ``chat_template.jinja``);
    ``mask``: with a ``<|mask|>`` added after its ids, as the docs tell users to add one."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", RESERVED]
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator(TEXTS, trainer=trainer)
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = CHATML
    if mask:
        hf.add_special_tokens({"mask_token": "<|mask|>"})
    hf.save_pretrained(str(directory))
    return directory


def chat_data(path: Path) -> Path:
    records = [{"messages": [{"role": "user", "content": t}, {"role": "assistant", "content": t[::-1]}]} for t in TEXTS]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")
    return path


def export_of(cfg: Any, out: Path, warnings: list[str] | None = None) -> Path:
    """A freshly drawn model of ``cfg`` exported as the end of its run would."""
    inputs = check_run(cfg, warn=warnings.append if warnings is not None else None)
    model = Decoder(inputs.decoder_config, dtype=torch.float32, seed=0)
    return export_decoder(cfg, inputs, model, out, overwrite=False)


def auto(directory: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)


def assert_same_tokenizer(export: Path, reference: Tokenizer, *, template: str | None) -> Any:
    """``AutoTokenizer`` on ``export`` encodes like ``reference``, names config.json's special ids and
    renders ``template`` (None: has none)."""
    tokenizer = auto(export)
    hf_config = json.loads((export / "config.json").read_text())
    for text in (SAMPLE, *TEXTS[:5]):
        assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(text, add_special_tokens=False).ids
    assert tokenizer.mask_token_id == hf_config["mask_token_id"]
    assert tokenizer.pad_token_id == hf_config["pad_token_id"]
    if template is None:
        assert not tokenizer.chat_template
    else:
        rendered = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
        assert rendered == transformers.PreTrainedTokenizerFast(tokenizer_object=reference, chat_template=template) \
            .apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)  # fmt: skip
    return tokenizer


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """An imported chat checkpoint (``init``, tokenizer without a mask token), its tokenizer with
    ``<|mask|>`` added (``ext``), and chat data prepared with ``--tokenizer ext`` (``art``)."""
    root = tmp_path_factory.mktemp("imported")
    base = chat_tokenizer(root / "base", mask=False)
    ext = chat_tokenizer(root / "ext", mask=True)
    art = root / "art"
    prepare_artifact(PrepareConfig(inputs=(chat_data(root / "chat.jsonl"),), out_dir=art, seq_len=32,
                                   tokenizer_path=ext, val_fraction=0.1))  # fmt: skip
    shape = check_run(tiny_config(art)).decoder_config
    init = export_hf_checkpoint(Decoder(shape, seed=1), shape, root / "init", tokenizer_dir=base)
    return {"root": root, "base": base, "ext": ext, "art": art, "init": init}


def test_an_imported_chat_model_keeps_its_tokenizer_template_and_gets_the_mask_token(
    imported: dict[str, Path], tmp_path: Path
) -> None:
    # data.tokenizer unset: the directory csbp data prepare read (the manifest's source) supplies the files
    cfg = tiny_config(imported["art"], **SHAPE_FREE, **{"model.init_from": str(imported["init"])})
    warnings: list[str] = []
    out = export_of(cfg, tmp_path / "out", warnings)
    assert warnings == []
    assert sorted(p.name for p in out.iterdir() if "token" in p.name or "template" in p.name) == [
        "chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]  # fmt: skip
    reference = Tokenizer.from_file(str(imported["ext"] / "tokenizer.json"))
    tokenizer = assert_same_tokenizer(out, reference, template=CHATML)
    original = auto(imported["ext"])
    assert (tokenizer.eos_token, tokenizer.pad_token, tokenizer.mask_token) == (
        original.eos_token, original.pad_token, "<|mask|>")  # fmt: skip
    assert type(tokenizer) is type(original)
    # the same files whichever way the directory is named: data.tokenizer, or its tokenizer.json
    for named in (imported["ext"], imported["ext"] / "tokenizer.json"):
        again = export_of(tiny_config(imported["art"], **{"data.tokenizer": str(named)}), tmp_path / f"n{len(str(named))}")
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            assert (again / name).read_bytes() == (out / name).read_bytes()


def test_a_tokenizer_directory_that_changed_or_is_gone_is_not_shipped(imported: dict[str, Path], tmp_path: Path) -> None:
    root = tmp_path / "copy"
    shutil.copytree(imported["root"], root)
    # the init_from checkpoint's tokenizer (no mask token) is another one: passed over, never shipped
    cfg = tiny_config(root / "art", **SHAPE_FREE, **{"model.init_from": str(root / "init")})
    manifest = json.loads((root / "art" / "manifest.json").read_text())
    manifest["tokenizer"]["source"] = str(root / "ext")
    manifest["chat_template"]["source"] = str(root / "ext" / "chat_template.jinja")
    (root / "art" / "manifest.json").write_text(json.dumps(manifest))
    ext = root / "ext"
    shutil.copy2(root / "base" / "tokenizer.json", ext / "tokenizer.json")  # the directory now holds another tokenizer
    warnings: list[str] = []
    out = export_of(cfg, tmp_path / "changed", warnings)
    assert len(warnings) == 1 and "holds another tokenizer now (nor does model.init_from hold it)" in warnings[0]
    assert "fix: set data.tokenizer" in warnings[0]
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast" and "chat_template" not in config
    data_tokenizer = Tokenizer.from_file(str(root / "art" / "tokenizer.json"))
    # the template the data was rendered with is still there, unchanged (its sha256): it ships
    assert_same_tokenizer(out, data_tokenizer, template=CHATML)
    shutil.rmtree(ext)
    warnings.clear()
    out = export_of(cfg, tmp_path / "gone", warnings)
    assert len(warnings) == 2 and "is not found (nor" in warnings[0] and "exports carry no chat template" in warnings[1]
    assert not (out / "chat_template.jinja").exists()
    assert_same_tokenizer(out, data_tokenizer, template=None)
    # data.tokenizer naming another tokenizer fails closed, before anything is written
    with pytest.raises(ValueError, match=r"^data\.tokenizer: .* is not the tokenizer"):
        export_of(tiny_config(root / "art", **{"data.tokenizer": str(root / "base")}), tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_the_exported_chat_template_is_the_one_the_data_was_rendered_with(
    imported: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # --chat-template PATH: the data's records follow PATH's format, so the export's template is PATH's
    template_file = tmp_path / "other.jinja"
    template_file.write_text(OTHER_TEMPLATE, encoding="utf-8")
    art = tmp_path / "art"
    monkeypatch.chdir(tmp_path)  # a relative --chat-template, and the export run from another directory
    prepare_artifact(PrepareConfig(inputs=(chat_data(tmp_path / "chat.jsonl"),), out_dir=art, seq_len=32,
                                   tokenizer_path=imported["ext"], chat_template="other.jinja", val_fraction=0.1))  # fmt: skip
    monkeypatch.chdir(imported["root"])
    out = export_of(tiny_config(art), tmp_path / "out")
    assert (out / "chat_template.jinja").read_text(encoding="utf-8") == OTHER_TEMPLATE
    assert_same_tokenizer(out, Tokenizer.from_file(str(art / "tokenizer.json")), template=OTHER_TEMPLATE)
    # the recorded template edited after prepare: none is shipped rather than another (one warning)
    template_file.write_text(CHATML + " ", encoding="utf-8")
    warnings: list[str] = []
    out = export_of(tiny_config(art), tmp_path / "edited", warnings)
    assert len(warnings) == 1 and "is not found; exports carry no chat template" in warnings[0]
    assert not (out / "chat_template.jinja").exists()
    assert "chat_template" not in json.loads((out / "tokenizer_config.json").read_text())


def test_the_run_mask_token_is_named_in_the_tokenizer_config(imported: dict[str, Path], tmp_path: Path) -> None:
    # objective.mask_token_id names another added token than the data's <|mask|>: so does the tokenizer
    reserved = Tokenizer.from_file(str(imported["art"] / "tokenizer.json")).token_to_id(RESERVED)
    out = export_of(tiny_config(imported["art"], **{"objective.mask_token_id": reserved}), tmp_path / "other-mask")
    assert json.loads((out / "tokenizer_config.json").read_text())["mask_token"] == RESERVED
    assert auto(out).mask_token_id == reserved == json.loads((out / "config.json").read_text())["mask_token_id"]
    # ar: no mask token in the run; the source's settings are kept as they are
    ar = export_of(tiny_config(imported["art"], **{"objective.name": "ar", "objective.block_size": None}), tmp_path / "ar")
    assert (ar / "tokenizer_config.json").read_bytes() == (imported["ext"] / "tokenizer_config.json").read_bytes()


def test_a_trained_tokenizer_exports_with_a_generated_config(tmp_path: Path) -> None:
    data = tmp_path / "text.jsonl"
    data.write_text("\n".join(json.dumps({"text": t}) for t in TEXTS) + "\n", encoding="utf-8")
    art = tmp_path / "art"
    prepare_artifact(PrepareConfig(inputs=(data,), out_dir=art, seq_len=32, train_tokenizer=True, vocab_size=300,
                                   val_fraction=0.1))  # fmt: skip
    for arch in ("qwen3", "llama"):
        warnings: list[str] = []
        out = export_of(tiny_config(art, **{"model.arch": arch}), tmp_path / arch, warnings)
        assert warnings == []
        config = json.loads((out / "tokenizer_config.json").read_text())
        assert config == {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
                          "eos_token": "<|endoftext|>", "pad_token": "<|pad|>", "mask_token": "<|mask|>"}  # fmt: skip
        tokenizer = assert_same_tokenizer(out, Tokenizer.from_file(str(art / "tokenizer.json")), template=None)
        assert tokenizer.eos_token_id == json.loads((out / "config.json").read_text())["eos_token_id"]


def test_a_damaged_artifact_tokenizer_is_refused(imported: dict[str, Path], tmp_path: Path) -> None:
    art = tmp_path / "art"
    shutil.copytree(imported["art"], art)
    (art / "tokenizer.json").write_bytes((imported["base"] / "tokenizer.json").read_bytes())
    with pytest.raises(ValueError, match=r"tokenizer\.json is not the tokenizer its manifest records"):
        check_run(tiny_config(art))


def test_an_auto_map_naming_code_is_not_carried(imported: dict[str, Path], tmp_path: Path) -> None:
    """csbp reads ``tokenizer.json`` and never runs a directory's code; the export does not point at
    code it does not hold."""
    directory = tmp_path / "tok"
    shutil.copytree(imported["ext"], directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["auto_map"] = {"AutoTokenizer": ["tokenization_x.XTokenizer", "tokenization_x.XTokenizer"]}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    out = export_of(tiny_config(imported["art"], **{"data.tokenizer": str(directory)}), tmp_path / "out")
    assert "auto_map" not in json.loads((out / "tokenizer_config.json").read_text())
    assert_same_tokenizer(out, Tokenizer.from_file(str(imported["art"] / "tokenizer.json")), template=CHATML)


def test_generation_stops_at_the_chat_tokenizers_eos_and_at_the_data_eos(imported: dict[str, Path], tmp_path: Path) -> None:
    """The chat tokenizer's ``eos_token`` (``<|im_end|>``) is not the data's EOS (``<|endoftext|>``,
    ``config.json``'s ``eos_token_id``): ``generation_config.json`` lists both. Before, it held the
    data's EOS alone, so ``generate`` on a fine-tuned chat model no longer stopped at the end of a turn,
    although the ``model.init_from`` checkpoint's own generation config did."""
    init = tmp_path / "init"
    shutil.copytree(imported["init"], init)
    (init / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "temperature": 0.7}))
    cfg = tiny_config(imported["art"], **SHAPE_FREE, **{"model.init_from": str(init)})
    out = export_of(cfg, tmp_path / "out")
    tokenizer = auto(out)
    data_eos = json.loads((out / "config.json").read_text())["eos_token_id"]
    assert (tokenizer.eos_token, tokenizer.eos_token_id, data_eos) == ("<|im_end|>", 2, 0)
    generation = transformers.GenerationConfig.from_pretrained(str(out), local_files_only=True)
    assert (generation.eos_token_id, generation.temperature) == ([0, 2], 0.7)
    # a list that already holds both is kept as it is
    (init / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    assert json.loads((export_of(cfg, tmp_path / "kept") / "generation_config.json").read_text())["eos_token_id"] == [2, 0]


def test_a_mask_token_past_the_checkpoints_embedding_names_a_fix_that_works(
    imported: dict[str, Path], tmp_path: Path
) -> None:
    """A checkpoint whose embedding has no row for the ``<|mask|>`` the docs tell users to add: the fix
    was "prepare the data with the checkpoint's tokenizer", which has no mask token, so ``csbp data
    prepare`` refused that in turn. It names the mask token and ``--mask-token`` now."""
    artifact = open_artifact(imported["art"])
    assert artifact.mask_token_id == artifact.vocab_size - 1
    shape = dataclasses.replace(check_run(tiny_config(imported["art"])).decoder_config, vocab_size=artifact.mask_token_id)
    init = export_hf_checkpoint(Decoder(shape, seed=1), shape, tmp_path / "init", tokenizer_dir=imported["base"])
    cfg = tiny_config(imported["art"], **SHAPE_FREE, **{"model.init_from": str(init)})
    with pytest.raises(ValueError, match=rf"^model\.init_from: .* the data's mask token '<\|mask\|>' is id "
                       rf"{artifact.mask_token_id}, past the embedding: .*\(fix: .*--mask-token") as caught:
        check_run(cfg)
    assert "\n" not in str(caught.value)


def test_the_sample_after_training_stops_where_csbp_generate_stops(
    imported: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``train.generate_after`` stopped at the data's EOS alone, so a chat model's sample ran past the
    end of its turn (``<|im_end|>``, the tokenizer's ``eos_token``) where ``csbp generate`` stops."""
    from csbp.models.hf_io import stop_token_ids
    from csbp.training import sample

    cfg = tiny_config(imported["art"], **SHAPE_FREE, **{"model.init_from": str(imported["init"])})
    inputs = check_run(cfg)
    model = Decoder(inputs.decoder_config, dtype=torch.float32, seed=0)
    out = export_decoder(cfg, inputs, model, tmp_path / "out", overwrite=False)
    used: list[Any] = []
    real = sample.generate
    monkeypatch.setattr(sample, "generate", lambda *a, **k: used.append(k["eos_id"]) or real(*a, **k))
    assert " => " in sample.sample_after_training(cfg, inputs, model, out)
    data_eos = inputs.artifact.special_ids["eos"]
    assert used == [stop_token_ids(out, data_eos, inputs.decoder_config.vocab_size, inputs.mask_token_id)]
    assert sorted(used[0]) == [0, 2]  # <|endoftext|> and <|im_end|>
