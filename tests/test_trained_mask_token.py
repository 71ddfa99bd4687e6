"""Which mask token ``csbp generate`` and ``csbp eval`` use: the one the model was trained with.

A run whose ``config.yaml`` leaves ``objective.mask_token_id`` unset trains with the data artifact's
mask token; the export records that id (``config.json``: ``csbp_training.objective.mask_token_id``
and the top-level ``mask_token_id``). ``csbp generate --model RUN/final`` read only the run config
there and fell back to the tokenizer's ``<|mask|>``: the right id only while the tokenizer's
``<|mask|>`` happens to be it. Both commands now take the most authoritative record (the export's
``csbp_training``, then the run config, then ``config.json``'s ``mask_token_id``) and refuse two
records that disagree.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from csbp.data.artifact import open_artifact
from csbp.data.tokenizer import load_tokenizer
from csbp.generation.run_settings import EXPORT_KEY, trained_mask_token
from csbp.models.hf_io import read_hf_config
from test_generate_cli import export_tiny_run, parse
from test_training_run import make_artifact


def _record(final: Path, mask: int | None, *, top_level: int | None = None) -> Path:
    """``final/config.json`` with a bd3 training record holding ``mask`` (and ``top_level`` as the
    top-level ``mask_token_id``), as ``csbp train`` exports it."""
    config_file = final / "config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    config[EXPORT_KEY] = {"objective": {"name": "bd3", "block_size": 4, "mask_token_id": mask}, "data": {"seq_len": 32}}
    if top_level is not None:
        config["mask_token_id"] = top_level
    config_file.write_text(json.dumps(config), encoding="utf-8")
    return config_file


def _sampled_mask(model: Path, monkeypatch: pytest.MonkeyPatch) -> object:
    seen: list[object] = []

    def recording_generate(model: object, prompt_ids: list[int], **options: object) -> object:
        seen.append(options["mask_token_id"])
        raise SystemExit(0)

    monkeypatch.setattr("csbp.generation.sampler.generate_batch", recording_generate)
    argv = ["generate", "--model", str(model), "--prompt", "the", "--max-new-tokens", "4", "--device", "cpu"]
    with pytest.raises(SystemExit):
        parse(argv).func(parse(argv))
    return seen[0]


def test_generate_samples_with_the_export_s_mask_token_when_the_run_config_leaves_it_unset(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    final = export_tiny_run(tmp_path / "run")
    tokenizer = load_tokenizer(final)
    recorded = tokenizer.eos_id + 5  # the artifact's mask token: an id other than the tokenizer's <|mask|>
    assert recorded != tokenizer.mask_token_id
    config_file = _record(final, recorded, top_level=recorded)
    (tmp_path / "run" / "config.yaml").write_text("objective:\n  name: bd3\n  block_size: 4\n")
    assert trained_mask_token(final) == (recorded, config_file)
    assert _sampled_mask(final, monkeypatch) == recorded  # RUN/final
    moved = shutil.copytree(final, tmp_path / "moved")  # a bare export, away from its run
    assert _sampled_mask(moved, monkeypatch) == recorded
    run_dir = parse(["generate", "--model", str(tmp_path / "run"), "--prompt", "the"])  # the run itself: pointed to final/
    with pytest.raises(ValueError, match=rf"^--model {tmp_path / 'run'} is a run directory \(fix: --model "):
        run_dir.func(run_dir)


def test_generate_samples_with_a_checkpoint_s_own_mask_token_id(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint csbp did not train that declares ``mask_token_id`` in its ``config.json`` (as ``csbp
    eval`` already read it) is sampled with that id, not the tokenizer's ``<|mask|>``."""
    final = export_tiny_run(tmp_path / "run")
    tokenizer = load_tokenizer(final)
    declared = tokenizer.eos_id + 7
    config_file = final / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "mask_token_id": declared}))
    assert trained_mask_token(final) == (declared, config_file)
    assert _sampled_mask(final, monkeypatch) == declared


def test_generate_and_eval_refuse_records_that_disagree(tmp_path: Path) -> None:
    from csbp.evaluation import resolve_settings

    artifact = open_artifact(make_artifact(tmp_path / "art"))
    final = export_tiny_run(tmp_path / "run")
    config_file = _record(final, 7, top_level=7)
    run_config = tmp_path / "run" / "config.yaml"
    run_config.write_text("objective:\n  name: bd3\n  block_size: 4\n  mask_token_id: 9\n")
    message = (
        f"{config_file}: {EXPORT_KEY}.objective.mask_token_id is 7, but {run_config}: objective.mask_token_id "
        "is 9, and a model trains with one mask token (fix: correct or remove the record that is not the id it "
        "was trained with)"
    )
    argv = ["generate", "--model", str(final), "--prompt", "the", "--device", "cpu"]
    with pytest.raises(ValueError) as info:
        parse(argv).func(parse(argv))
    assert str(info.value) == message
    model_config = replace(read_hf_config(final), vocab_size=max(artifact.vocab_size, 64))
    with pytest.raises(ValueError) as info:
        resolve_settings(final, model_config, artifact)
    assert str(info.value) == message
    run_config.unlink()
    _record(final, 7, top_level=8)
    with pytest.raises(ValueError, match=rf"{EXPORT_KEY}\.objective\.mask_token_id is 7, but .*config\.json: mask_token_id is 8"):
        trained_mask_token(final)
    _record(final, "7")
    with pytest.raises(ValueError, match=rf"config\.json: {EXPORT_KEY}\.objective\.mask_token_id is '7', not a token id"):
        trained_mask_token(final)
