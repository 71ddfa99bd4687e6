"""Fields of a run's Hugging Face export that no test pinned (mutation audit of ``csbp.training.export``
and ``csbp.models.hf_io``'s writer): each case here let a one-token change of the code pass every test.

* ``generation_config.json`` of a ``model.init_from`` checkpoint whose ``eos_token_id`` list lacks the
  run's EOS: the run's EOS replaces it (a list stays a list), and ``config.json``'s ``bos_token_id``
  is written when the checkpoint's generation config has none.
* ``max_position_embeddings`` of a from-scratch run longer than the 32768 default: ``data.seq_len``.
* ``--out`` equal to a run's ``checkpoints/`` itself is refused like a directory inside it.
* ``csbp export`` of a checkpoint whose tensors do not have the shapes its ``trainer_state.json``
  implies: one ``ValueError`` naming the tensor, not a ``load_state_dict`` traceback.
* ``generation_stop_ids``: a single ``eos_token_id`` is a stop id, the vocabulary size and the mask token
  are not.
* ``export_hf_checkpoint`` refuses ``tokenizer_dir`` with ``tokenizer_files``.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_export_fields.py -q``
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from csbp.data.artifact import open_artifact
from csbp.generation.run_settings import SAMPLING_KEY
from csbp.models.decoder import Decoder
from csbp.models.hf_io import export_hf_checkpoint, generation_stop_ids
from csbp.training.export import check_out_outside_checkpoints, export_checkpoint, export_decoder
from csbp.training.preflight import check_run
from csbp.training.trainer import train
from test_export_generation_config import SHAPE_FREE
from test_training_run import make_artifact, tiny_config


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_artifact(tmp_path_factory.mktemp("data") / "art")


def export_of(cfg: Any, out: Path, inputs_cfg: Any = None) -> Path:
    """A freshly drawn model of ``cfg`` exported as the end of its run would (inputs of ``inputs_cfg``)."""
    inputs = check_run(inputs_cfg or cfg)
    model = Decoder(inputs.decoder_config, dtype=torch.float32, seed=0)
    return export_decoder(cfg, inputs, model, out, overwrite=False)


def read(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def test_an_eos_list_without_the_runs_eos_is_replaced_and_bos_comes_from_config(artifact: Path, tmp_path: Path) -> None:
    special = open_artifact(artifact).special_ids
    base = Decoder(check_run(tiny_config(artifact)).decoder_config, dtype=torch.float32, seed=1)
    own = {"eos_token_id": [special["user"], special["system"]], "temperature": 0.5}  # no EOS, no bos
    init = export_hf_checkpoint(base, base.config, tmp_path / "hf", tokenizer_dir=artifact, generation_config=own,
                                extra_config={"bos_token_id": special["system"]})
    out = export_of(tiny_config(artifact, **SHAPE_FREE, **{"model.init_from": str(init)}), tmp_path / "out")
    # the trained tokenizer's eos_token is the data's EOS: one stop id, in the list form the checkpoint used
    generation = {k: v for k, v in read(out / "generation_config.json").items() if k != SAMPLING_KEY}
    assert generation == {"eos_token_id": [special["eos"]], "pad_token_id": special["pad"],
                          "bos_token_id": special["system"], "temperature": 0.5}
    assert read(out / "config.json")["bos_token_id"] == special["system"]


def test_a_run_longer_than_the_default_context_claims_its_length(artifact: Path, tmp_path: Path) -> None:
    cfg = tiny_config(artifact)
    long = cfg.model_copy(update={"data": cfg.data.model_copy(update={"seq_len": 40000})})
    out = export_of(long, tmp_path / "out", inputs_cfg=cfg)
    assert read(out / "config.json")["max_position_embeddings"] == 40000  # not the 32768 default


def test_out_may_not_be_a_runs_checkpoints_directory_itself(tmp_path: Path) -> None:
    checkpoints = tmp_path / "run" / "checkpoints"
    checkpoints.mkdir(parents=True)
    with pytest.raises(ValueError, match=r"^--out .*: is inside .*checkpoints, which holds a run's checkpoints"):
        check_out_outside_checkpoints(checkpoints, checkpoints)
    check_out_outside_checkpoints(tmp_path / "run" / "exports", checkpoints)  # beside it: fine


def test_a_checkpoint_whose_shapes_differ_from_its_config_is_one_error(artifact: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    train(tiny_config(artifact, **{"train.save_every": 1}), run_dir=run_dir, max_steps=1)
    checkpoint = next((run_dir / "checkpoints").glob("step_*"))
    state_file = checkpoint / "trainer_state.json"
    state = read(state_file)
    config = yaml.safe_load(state["config_yaml"])
    config["model"]["intermediate_size"] *= 2  # a config the stored tensors do not fit
    state["config_yaml"] = yaml.safe_dump(config)
    state_file.write_text(json.dumps(state))
    with pytest.raises(ValueError) as caught:
        export_checkpoint(checkpoint, tmp_path / "out")
    message = str(caught.value)
    assert "tensor 'model.layers.0.mlp.gate_proj.weight' is of shape" in message, message
    assert "(the checkpoint does not match its trainer_state.json)" in message
    assert not (tmp_path / "out").exists()


def test_generation_stop_ids_read_one_id_and_refuse_the_vocabulary_size(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5}))
    assert generation_stop_ids(tmp_path, 8) == [5]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert generation_stop_ids(tmp_path, 8) == [2, 7]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 8]}))
    with pytest.raises(ValueError, match=r"eos_token_id 8 is not a token id of the model vocabulary \[0, 8\)"):
        generation_stop_ids(tmp_path, 8)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    with pytest.raises(ValueError, match=r"eos_token_id 7 is the mask token, which is never generated"):
        generation_stop_ids(tmp_path, 8, mask_token_id=7)


def test_tokenizer_dir_and_tokenizer_files_together_are_refused(artifact: Path, tmp_path: Path) -> None:
    model = Decoder(check_run(tiny_config(artifact)).decoder_config, dtype=torch.float32, seed=1)
    files = {"tokenizer.json": (artifact / "tokenizer.json").read_bytes()}
    with pytest.raises(ValueError, match="pass tokenizer_dir or tokenizer_files, not both"):
        export_hf_checkpoint(model, model.config, tmp_path / "x", tokenizer_dir=artifact, tokenizer_files=files)
    assert not (tmp_path / "x").exists()


def test_an_export_whose_training_inputs_are_gone_says_what_it_needs(artifact: Path, tmp_path: Path) -> None:
    """``csbp export`` reads the run's data artifact (tokenizer, special ids) and ``model.init_from``
    (config and generation config). Gone, it was refused with ``csbp train``'s line (fix: "run from the
    directory holding your artifacts, or set data.train"), which no ``csbp export`` flag can follow."""
    import shutil  # noqa: PLC0415

    from test_rope_config import _from, _qwen2_checkpoint  # noqa: PLC0415

    data = tmp_path / "art"
    shutil.copytree(artifact, data)
    _qwen2_checkpoint(tmp_path / "hf", open_artifact(data).vocab_size)
    train(tiny_config(data, **_from(tmp_path / "hf")), run_dir=tmp_path / "run", max_steps=1)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_0000001"
    shutil.move(tmp_path / "hf", tmp_path / "hf-moved")
    with pytest.raises(ValueError, match=r"^model\.init_from: .*/hf, which the run was trained from, is gone; csbp "
                       r"export reads .* \(fix: restore it at .*/hf .*\)$") as caught:
        export_checkpoint(checkpoint, tmp_path / "out")
    assert "\n" not in str(caught.value)
    shutil.move(tmp_path / "hf-moved", tmp_path / "hf")
    shutil.move(data, tmp_path / "art-moved")
    with pytest.raises(ValueError, match=r"^data\.train: .*/art, which the run was trained on, is gone; csbp export "
                       r"reads .* \(fix: restore it at .*/art .*\)$"):
        export_checkpoint(checkpoint, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    shutil.move(tmp_path / "art-moved", data)
    export_checkpoint(checkpoint, tmp_path / "out")
    assert (tmp_path / "out" / "config.json").is_file()
