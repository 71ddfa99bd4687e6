"""``csbp eval`` of a Hugging Face checkpoint on data whose tokenizer adds a ``<|mask|>`` after the
checkpoint's ids (as docs/training.md says to prepare data for adaptation): accepted where training
accepts it as ``model.init_from`` (same ids for every token of the checkpoint's tokenizer, every id of
the data an embedding row). Before, any tokenizer other than the checkpoint's own was refused with
"evaluate on data prepared with the model's tokenizer", which ``csbp data prepare`` refuses in turn
(that tokenizer has no mask token)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from csbp.cli.main import main
from csbp.data.artifact import open_artifact
from csbp.models.decoder import Decoder
from csbp.models.hf_io import export_hf_checkpoint
from csbp.training.preflight import check_run
from test_export_tokenizer import chat_tokenizer, imported
from test_training_run import tiny_config

__all__ = ["imported"]  # the checkpoint with a tokenizer without a mask token, and data that adds one

EVAL = ["eval", "--objective", "bd3", "--block-size", "4", "--samples", "1", "--no-ltr", "--max-batches", "1",
        "--micro-batch-size", "2", "--device", "cpu"]  # fmt: skip


def test_eval_takes_data_whose_tokenizer_adds_the_mask_after_the_checkpoints_ids(
    imported: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "eval.json"
    assert main([*EVAL, "--model", str(imported["init"]), "--data", str(imported["art"]), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["objective"] == "bd3"
    capsys.readouterr()
    # a tokenizer that renumbers the checkpoint's tokens is still refused, naming a token that moved
    moved = tmp_path / "moved"
    chat_tokenizer(moved, mask=False)
    data = json.loads((moved / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.__getitem__)[10:12]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (moved / "tokenizer.json").write_text(json.dumps(data))
    model = tmp_path / "model"
    model.mkdir()
    for item in imported["init"].iterdir():
        (model / item.name).write_bytes(item.read_bytes())
    (model / "tokenizer.json").write_bytes((moved / "tokenizer.json").read_bytes())
    assert main([*EVAL, "--model", str(model), "--data", str(imported["art"])]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"csbp: error: --model: {model / 'tokenizer.json'} has token ") and "(fix: " in err, err


def test_eval_names_mask_token_when_the_checkpoint_has_no_row_for_the_mask(
    imported: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    artifact = open_artifact(imported["art"])
    shape = dataclasses.replace(check_run(tiny_config(imported["art"])).decoder_config, vocab_size=artifact.mask_token_id)
    init = export_hf_checkpoint(Decoder(shape, seed=1), shape, tmp_path / "init", tokenizer_dir=imported["base"])
    assert main([*EVAL, "--model", str(init), "--data", str(imported["art"])]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"csbp: error: --model: the checkpoint {init} embeds {artifact.mask_token_id} ids, and the "
                          "data's mask token '<|mask|>' is id ") and "--mask-token TOKEN)" in err, err
