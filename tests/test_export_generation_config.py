"""``generation_config.json`` of a run's export: the run's special token ids, the ``model.init_from``
checkpoint's own sampling defaults carried through, and for block-diffusion objectives how
``csbp generate`` samples the model (``csbp_block_diffusion``). Before, no export had one: the
chat end-of-turn ids and sampling defaults of an imported checkpoint were lost, and nothing in the
export said how to sample it as a block-diffusion model."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from csbp.cli import generate_checks, generate_cmd
from csbp.data.artifact import open_artifact
from csbp.generation.run_settings import GENERATE_DEFAULTS, SAMPLING_KEY
from csbp.models.decoder import Decoder
from csbp.models.hf_io import export_hf_checkpoint, read_generation_config
from csbp.training.export import export_decoder
from csbp.training.preflight import check_run
from test_training_run import make_artifact, tiny_config

SHAPE_FREE: dict[str, Any] = {
    f"model.{k}": None for k in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
}


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_artifact(tmp_path_factory.mktemp("data") / "art")


def export_of(cfg: Any, out: Path) -> dict[str, Any]:
    """Export a freshly drawn model of ``cfg`` as the run's end would; its generation_config.json."""
    inputs = check_run(cfg)
    model = Decoder(inputs.decoder_config, dtype=torch.float32, seed=0)
    export_decoder(cfg, inputs, model, out, overwrite=False)
    return json.loads((out / "generation_config.json").read_text())


def test_a_block_diffusion_export_records_its_token_ids_and_how_csbp_generate_samples_it(
    artifact: Path, tmp_path: Path
) -> None:
    special = open_artifact(artifact).special_ids
    generation = export_of(tiny_config(artifact, **{"objective.name": "fast_dllm_v2"}), tmp_path / "fd")
    assert generation == {
        "eos_token_id": special["eos"],
        "pad_token_id": special["pad"],
        SAMPLING_KEY: {
            "objective": "fast_dllm_v2", "block_size": 4, "mask_token_id": special["mask"], "token_shift": True,
            "window": None, "steps_per_block": 4, "threshold": None, "temperature": 0.0, "top_k": None,
            "top_p": 1.0, "unmask_order": "confidence", "sub_block_size": None,
        },
    }  # fmt: skip
    hf_config = json.loads((tmp_path / "fd" / "config.json").read_text())
    assert (hf_config["eos_token_id"], hf_config["pad_token_id"]) == (special["eos"], special["pad"])
    mdlm = export_of(tiny_config(artifact, **{"objective.name": "mdlm", "objective.block_size": None}), tmp_path / "m")
    assert mdlm[SAMPLING_KEY]["block_size"] == mdlm[SAMPLING_KEY]["steps_per_block"] == 32  # one block: seq_len
    ar = export_of(tiny_config(artifact, **{"objective.name": "ar", "objective.block_size": None}), tmp_path / "ar")
    assert ar == {"eos_token_id": special["eos"], "pad_token_id": special["pad"]}  # csbp generate does not sample it


def test_the_recorded_sampling_defaults_are_csbp_generates_own() -> None:
    """The record describes ``csbp generate``'s flag defaults: this fails when one of them changes alone."""
    parser = argparse.ArgumentParser()
    generate_cmd.register(parser.add_subparsers())
    args = parser.parse_args(["generate", "--model", "m", "--prompt", "p"])
    assert {name: getattr(args, name) for name in GENERATE_DEFAULTS} == GENERATE_DEFAULTS
    assert args.steps_per_block is None  # csbp generate: one step per position of the block, as recorded


def test_the_init_from_checkpoints_generation_config_is_carried_through(artifact: Path, tmp_path: Path) -> None:
    """A chat model's ``eos_token_id`` list (end of turn and end of text) and its sampling defaults
    survive fine-tuning; ids the run fixes are the run's; ``transformers_version`` is not claimed."""
    art = open_artifact(artifact)
    special = art.special_ids
    base_cfg = tiny_config(artifact)
    base = Decoder(check_run(base_cfg).decoder_config, dtype=torch.float32, seed=1)
    own = {"eos_token_id": [special["user"], special["eos"]], "pad_token_id": 7, "bos_token_id": special["system"],
           "temperature": 0.7, "top_p": 0.8, "do_sample": True, "transformers_version": "4.51.0"}  # fmt: skip
    export_hf_checkpoint(base, base.config, tmp_path / "hf", tokenizer_dir=artifact, generation_config=own,
                         extra_config={"bos_token_id": special["system"]})  # fmt: skip
    assert read_generation_config(tmp_path / "hf") == own
    cfg = tiny_config(artifact, **SHAPE_FREE, **{"model.init_from": str(tmp_path / "hf")})
    generation = export_of(cfg, tmp_path / "tuned")
    assert {k: v for k, v in generation.items() if k != SAMPLING_KEY} == {
        "eos_token_id": [special["user"], special["eos"]], "pad_token_id": special["pad"],
        "bos_token_id": special["system"], "temperature": 0.7, "top_p": 0.8, "do_sample": True,
    }  # fmt: skip
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps({**own, "eos_token_id": 99}))
    assert export_of(cfg, tmp_path / "other-eos")["eos_token_id"] == special["eos"]  # a list only when it has it


def test_a_damaged_generation_config_of_init_from_fails_before_training(artifact: Path, tmp_path: Path) -> None:
    base = Decoder(check_run(tiny_config(artifact)).decoder_config, dtype=torch.float32, seed=1)
    export_hf_checkpoint(base, base.config, tmp_path / "hf", tokenizer_dir=artifact, generation_config={})
    (tmp_path / "hf" / "generation_config.json").write_text('{"eos_token_id": ')
    cfg = tiny_config(artifact, **SHAPE_FREE, **{"model.init_from": str(tmp_path / "hf")})
    with pytest.raises(ValueError, match=r"generation_config\.json: malformed JSON"):
        check_run(cfg)


def test_transformers_reads_the_exported_generation_config(artifact: Path, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    special = open_artifact(artifact).special_ids
    export_of(tiny_config(artifact), tmp_path / "bd3")
    read = transformers.GenerationConfig.from_pretrained(str(tmp_path / "bd3"), local_files_only=True)
    assert (read.eos_token_id, read.pad_token_id) == (special["eos"], special["pad"])
    assert getattr(read, SAMPLING_KEY)["block_size"] == 4


def test_the_export_admits_the_positions_the_run_trained_at(artifact: Path, tmp_path: Path) -> None:
    """A run at ``data.seq_len`` 32 from a checkpoint that claims 16 positions: its export claims 32.
    Before, it kept the checkpoint's 16, and ``csbp generate`` refused lengths the model was trained at."""
    base = Decoder(check_run(tiny_config(artifact)).decoder_config, dtype=torch.float32, seed=1)
    for claimed, expected in ((16, 32), (40960, 40960)):
        init = export_hf_checkpoint(base, base.config, tmp_path / f"hf{claimed}", tokenizer_dir=artifact,
                                    extra_config={"max_position_embeddings": claimed})  # fmt: skip
        cfg = tiny_config(artifact, **SHAPE_FREE, **{"model.init_from": str(init)})
        assert cfg.data.seq_len == 32
        export_of(cfg, tmp_path / f"out{claimed}")
        assert json.loads((tmp_path / f"out{claimed}" / "config.json").read_text())["max_position_embeddings"] == expected
    generate_checks.check_positions(tmp_path / "out16", prompt_len=8, max_new_tokens=24, block_size=4)  # 32 positions
