"""Exports never pass on a remote-code pointer: the ``auto_map`` of a copied ``tokenizer_config.json``
(a released model's or drafter's directory) is left out, by ``export_hf_checkpoint(tokenizer_dir=...)``
and by ``export_dflash`` (``csbp dflash export --drafter DIR`` carries DIR's tokenizer files), as a
run's exports already do (``csbp.training.export_tokenizer``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from csbp.dflash.export import export_dflash
from csbp.dflash.verify import DFlashVerifyCase, build_models
from csbp.models import Decoder, DecoderConfig, export_hf_checkpoint
from csbp.models.hf_io import without_auto_map

AUTO_MAP = {"AutoTokenizer": ["someone/repo--tokenization_x.XTokenizer", None]}
TOKENIZER_CONFIG = {"auto_map": AUTO_MAP, "eos_token": "<|im_end|>", "model_max_length": 4096}


def tokenizer_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "tok"
    directory.mkdir()
    (directory / "tokenizer.json").write_text('{"version": "1.0"}')
    (directory / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG))
    return directory


def exported_tokenizer_config(out: Path) -> dict[str, object]:
    return json.loads((out / "tokenizer_config.json").read_text())


def test_hf_export_drops_the_auto_map_of_a_copied_tokenizer(tmp_path: Path) -> None:
    config = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4,
                           num_kv_heads=2, head_dim=8)
    out = export_hf_checkpoint(Decoder(config), config, tmp_path / "out", tokenizer_dir=tokenizer_dir(tmp_path))
    kept = {key: value for key, value in TOKENIZER_CONFIG.items() if key != "auto_map"}
    assert exported_tokenizer_config(out) == kept  # was copied with the auto_map
    assert (out / "tokenizer.json").read_text() == '{"version": "1.0"}'


def test_dflash_export_drops_the_auto_map_of_carried_tokenizer_files(tmp_path: Path) -> None:
    _, drafter = build_models(DFlashVerifyCase())
    directory = tokenizer_dir(tmp_path)
    files = {name: (directory / name).read_bytes() for name in ("tokenizer.json", "tokenizer_config.json")}
    out = export_dflash(drafter, tmp_path / "drafter", tokenizer_files=files)
    assert "auto_map" not in exported_tokenizer_config(out)
    assert exported_tokenizer_config(out)["eos_token"] == "<|im_end|>"


def test_without_auto_map_leaves_other_files_alone_and_names_a_broken_config() -> None:
    plain = {"tokenizer_config.json": b'{"eos_token": "</s>"}', "tokenizer.json": b"{}"}
    assert without_auto_map(plain) == (plain, False)  # byte for byte
    mentioned = {"tokenizer_config.json": b'{"comment": "no auto_map here"}'}
    assert without_auto_map(mentioned) == (mentioned, False)
    with pytest.raises(ValueError, match="tokenizer_config.json is not a JSON object"):
        without_auto_map({"tokenizer_config.json": b'["auto_map"]'})


def test_dflash_export_cli_says_it_leaves_the_auto_map_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from csbp.cli import main as cli_main

    target, drafter = build_models(DFlashVerifyCase(), dtype=torch.float32)
    target_dir = export_hf_checkpoint(target, target.config, tmp_path / "target")
    directory = tokenizer_dir(tmp_path)
    files = {name: (directory / name).read_bytes() for name in ("tokenizer.json", "tokenizer_config.json")}
    released = tmp_path / "released"
    export_dflash(drafter, released)
    for name, data in files.items():  # a drafter directory as released, its tokenizer naming remote code
        (released / name).write_bytes(data)
    out = tmp_path / "out"
    argv = ["dflash", "export", "--drafter", str(released), "--target", str(target_dir), "--out", str(out)]
    assert cli_main.main(argv) == 0
    assert "tokenizer_config.json names remote code (auto_map); the export leaves it out" in capsys.readouterr().err
    assert "auto_map" not in exported_tokenizer_config(out)
