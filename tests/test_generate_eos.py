"""``csbp generate --eos-token`` against the run's recorded EOS id.

An export records the data artifact's EOS id under ``csbp_training.data.eos_token_id``; an explicit
``--eos-token`` naming another token (not one the export's ``generation_config.json`` stops at
either) is refused as a contradicting ``--mask-token`` is. Exports written before the record stay
usable: nothing is checked for them.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from csbp.data.tokenizer import load_tokenizer
from csbp.generation.run_settings import EXPORT_KEY, run_objective_settings, training_record_of
from test_generate_cli import export_tiny_run, parse
from test_training_run import tiny_config


def _record(final: Path, eos: int | None) -> Path:
    """``final/config.json`` with a bd3 training record, its EOS id ``eos`` (None: an older export)."""
    config_file = final / "config.json"
    config = json.loads(config_file.read_text(encoding="utf-8"))
    record = {"objective": {"name": "bd3", "block_size": 4}, "data": {"seq_len": 32}}
    if eos is not None:
        record["data"]["eos_token_id"] = eos
    config_file.write_text(json.dumps({**config, EXPORT_KEY: record}), encoding="utf-8")
    (final / "generation_config.json").unlink(missing_ok=True)
    return config_file


def _run(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> list[object]:
    seen: list[object] = []

    def recording_generate(model: object, prompt_ids: list[int], **options: object) -> object:
        seen.append(options["eos_id"])
        raise SystemExit(0)

    monkeypatch.setattr("csbp.generation.sampler.generate_batch", recording_generate)
    with pytest.raises(SystemExit):
        parse(argv).func(parse(argv))
    return seen


def test_the_training_record_holds_the_data_s_eos_id(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path / "art")
    assert training_record_of(cfg, 1, eos_token_id=0)["data"]["eos_token_id"] == 0
    assert "eos_token_id" not in training_record_of(cfg, 1)["data"]  # not known: not recorded


def test_generate_refuses_an_eos_token_other_than_the_run_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    final = export_tiny_run(tmp_path / "run")
    tokenizer = load_tokenizer(final)
    recorded = tokenizer.eos_id
    config_file = _record(final, recorded)
    assert run_objective_settings(final)["eos_token_id"] == recorded
    base = ["generate", "--model", str(final), "--prompt", "the", "--max-new-tokens", "4", "--device", "cpu"]
    other = tokenizer.backend.id_to_token(recorded + 5)
    explicit = parse([*base, "--eos-token", other])
    with pytest.raises(ValueError) as info:
        explicit.func(explicit)
    name = tokenizer.backend.id_to_token(recorded)
    assert str(info.value) == (
        f"--eos-token {other}: id {recorded + 5} of {final}, but the model was trained with EOS id {recorded} "
        f"({name}) ({config_file}), and its generation_config.json lists no such stop (fix: drop --eos-token to "
        "use the run's)"
    )
    assert _run(base, monkeypatch) == [[recorded]]
    # RUN/final: the run's config.yaml has no EOS field; the refusal names config.json, where it is
    (tmp_path / "run" / "config.yaml").write_text("objective:\n  name: bd3\n  block_size: 4\n")
    with pytest.raises(ValueError, match=rf"trained with EOS id {recorded} \({re.escape(name)}\) \({re.escape(str(config_file))}\)"):
        explicit.func(explicit)
    (tmp_path / "run" / "config.yaml").unlink()
    assert _run([*base, "--eos-token", name], monkeypatch) == [[recorded]]
    # a token the export's generation_config.json stops at (a chat model's end of turn) is no contradiction
    (final / "generation_config.json").write_text(json.dumps({"eos_token_id": [recorded, recorded + 5]}))
    assert _run([*base, "--eos-token", other], monkeypatch) == [[recorded + 5, recorded]]


def test_an_export_without_the_record_takes_any_eos_token(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    final = export_tiny_run(tmp_path / "run")
    tokenizer = load_tokenizer(final)
    _record(final, None)
    assert "eos_token_id" not in run_objective_settings(final)
    other = tokenizer.backend.id_to_token(tokenizer.eos_id + 5)
    argv = ["generate", "--model", str(final), "--prompt", "the", "--max-new-tokens", "4", "--device", "cpu",
            "--eos-token", other]
    assert _run(argv, monkeypatch) == [[tokenizer.eos_id + 5]]


def test_a_malformed_eos_record_is_refused(tmp_path: Path) -> None:
    final = export_tiny_run(tmp_path / "run")
    config_file = _record(final, 0)
    config = json.loads(config_file.read_text())
    config[EXPORT_KEY]["data"]["eos_token_id"] = "0"
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"config\.json: csbp_training\.data\.eos_token_id is '0', not a token id"):
        run_objective_settings(final)
