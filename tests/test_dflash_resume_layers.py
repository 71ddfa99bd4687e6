"""A DFlash checkpoint's target layer ids: recorded as resolved, compared on ``--resume`` and export.

The default ``target_layer_ids`` stopped rounding exact halves up (commit 2967e9f); for 7 target layers
and 3 draft layers it went from ``[1, 3, 4]`` to ``[1, 2, 4]``. A run trained with one and resumed or
exported with the other fed its ``fc`` weights other hidden states, silently. Here a random 7-layer
target (hidden 32) and a 3-layer drafter with the ids left unset train 2 steps once; the tests edit
copies of its ``trainer_state.json`` to stand for a checkpoint of the old default, recorded
(``resolved_config``) or from before the record.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from csbp.cli.main import main
from csbp.data import open_artifact
from csbp.dflash.config import default_target_layer_ids
from csbp.dflash.feature_writer import prepare_features
from csbp.dflash.target_fingerprint import checkpoint_fingerprint
from csbp.models.config import DecoderConfig
from csbp.models.decoder import Decoder
from csbp.models.hf_io import export_hf_checkpoint, load_hf_checkpoint
from csbp.training import train
from csbp.training.checkpoint import find_latest_checkpoint, read_training_state
from csbp.training.dflash_layers import LAYER_IDS_FIELD, legacy_default_target_layer_ids, trained_layer_ids
from csbp.training.preflight import check_run
from test_training_dflash import dflash_config, one_line_error
from test_training_run import make_artifact

OLD, NEW = [1, 3, 4], [1, 2, 4]  # the default for 7 target layers x 3 draft layers, halves up / to even
RUN = {
    "objective.dflash.target_layer_ids": None,
    "objective.dflash.num_draft_layers": 3,
    "train.max_steps": 2,
    "train.eval_every": 0,
}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(artifact, 7-layer target directory)."""
    root = tmp_path_factory.mktemp("layers")
    artifact = make_artifact(root / "art")
    config = DecoderConfig(
        vocab_size=open_artifact(artifact).vocab_size, hidden_size=32, intermediate_size=64, num_layers=7,
        num_heads=4, num_kv_heads=2, head_dim=8,
    )  # fmt: skip
    target = export_hf_checkpoint(Decoder(config, seed=3), config, root / "target", tokenizer_dir=artifact)
    return artifact, target


@pytest.fixture(scope="module")
def trained(inputs: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory of 2 steps with the default ids (a checkpoint at step 2)."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    train(dflash_config(*inputs, **RUN), run_dir=run_dir)
    return run_dir


def run_copy(trained: Path, tmp_path: Path, resolved: Any) -> Path:
    """A copy of ``trained`` whose checkpoint records ``resolved`` (None: no record, an older csbp)."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    state_file = find_latest_checkpoint(run_dir) / "trainer_state.json"  # type: ignore[operator]
    state = json.loads(state_file.read_text())
    state.pop("resolved_config", None)
    if resolved is not None:
        state["resolved_config"] = resolved
    state_file.write_text(json.dumps(state))
    return run_dir


def resumed(inputs: tuple[Path, Path], **changes: Any) -> Any:
    return dflash_config(*inputs, **{**RUN, "train.max_steps": 4, **changes})


def test_the_two_rounding_rules_and_what_a_checkpoint_trained_with() -> None:
    assert legacy_default_target_layer_ids(38, 5) == (1, 10, 18, 27, 35)
    assert default_target_layer_ids(38, 5) == (1, 10, 18, 26, 35)
    assert (legacy_default_target_layer_ids(7, 3), default_target_layer_ids(7, 3)) == (tuple(OLD), tuple(NEW))
    assert legacy_default_target_layer_ids(36, 5) == default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    recorded = {LAYER_IDS_FIELD: [1, 3, 4]}
    assert trained_layer_ids(recorded, None, 7, 3, source="s") == ((1, 3, 4),)  # the record decides
    assert trained_layer_ids({}, [0, 5, 6], 7, 3, source="s") == ((0, 5, 6),)  # configured: trained as set
    assert trained_layer_ids({}, None, 7, 2, source="s") == ((1, 4),)  # both rules agree at 7 x 2
    assert trained_layer_ids({}, None, 7, 3, source="s") == (tuple(OLD), tuple(NEW))  # unknown: both
    with pytest.raises(ValueError, match=r"^s resolved_config objective.dflash.target_layer_ids is 'x', not a list"):
        trained_layer_ids({LAYER_IDS_FIELD: "x"}, None, 7, 3, source="s")


def test_a_checkpoint_records_the_resolved_ids(inputs: tuple[Path, Path], trained: Path) -> None:
    state = read_training_state(find_latest_checkpoint(trained))  # type: ignore[arg-type]
    assert state.resolved_config == {LAYER_IDS_FIELD: NEW}
    assert json.loads((trained / "final" / "config.json").read_text())["dflash_config"]["target_layer_ids"] == NEW
    check_run(resumed(inputs), run_dir=trained, resume=True)  # the same default: resumes
    # spelling the trained ids out is no change (it used to be refused as null -> [1, 2, 4])
    check_run(resumed(inputs, **{LAYER_IDS_FIELD: NEW}), run_dir=trained, resume=True)


def test_resume_refuses_other_ids_than_the_checkpoint_recorded(
    inputs: tuple[Path, Path], trained: Path, tmp_path: Path
) -> None:
    """A run recorded with the old default's ids resumed under the new default: refused before any
    work, naming both lists and the fix; with the fix it resumes. It used to resume with [1, 2, 4]."""
    run_dir = run_copy(trained, tmp_path, {LAYER_IDS_FIELD: OLD})
    checkpoint = find_latest_checkpoint(run_dir)
    message = one_line_error(lambda: check_run(resumed(inputs), run_dir=run_dir, resume=True))
    assert message == (
        f"{LAYER_IDS_FIELD}: checkpoint {checkpoint} (step 2) was trained with target_layer_ids [1, 3, 4], this "
        "run resolves [1, 2, 4] (the default for 7 target layers x 3 draft layers); the drafter's fc weights would "
        f"read other target layers (fix: set {LAYER_IDS_FIELD}: [1, 3, 4] to resume, or start a new run directory, "
        "from scratch or, for the same drafter architecture, from an export of this one: csbp dflash export "
        "--run-dir RUN --out DIR, then objective.dflash.init_from: DIR)"
    )
    check_run(resumed(inputs, **{LAYER_IDS_FIELD: OLD}), run_dir=run_dir, resume=True)
    message = one_line_error(lambda: check_run(resumed(inputs, **{LAYER_IDS_FIELD: [0, 2, 4]}), run_dir=run_dir,
                                               resume=True))  # fmt: skip
    assert "trained with target_layer_ids [1, 3, 4], this run resolves [0, 2, 4] (as configured)" in message


def test_an_older_checkpoint_at_a_depth_where_the_default_changed(
    inputs: tuple[Path, Path], trained: Path, tmp_path: Path
) -> None:
    """No record and unset ids: both defaults are candidates, so the resume is refused until the
    config names one of them (then it resumes with a note)."""
    run_dir = run_copy(trained, tmp_path, None)
    checkpoint = find_latest_checkpoint(run_dir)
    message = one_line_error(lambda: check_run(resumed(inputs), run_dir=run_dir, resume=True))
    assert message.startswith(
        f"{LAYER_IDS_FIELD}: checkpoint {checkpoint} (step 2): it records no resolved target_layer_ids (written by "
        "an older csbp) and its config left them unset, and the default for 7 target layers x 3 draft layers is "
        "[1, 3, 4] (halves rounded up, csbp before commit 2967e9f (2026-12-03)) or [1, 2, 4] (halves to even, since)"
    )
    assert f"(fix: set {LAYER_IDS_FIELD} to the ids the run started with: [1, 3, 4] if it started under " in message
    for ids in (OLD, NEW):
        notes: list[str] = []
        check_run(resumed(inputs, **{LAYER_IDS_FIELD: ids}), run_dir=run_dir, resume=True, warn=notes.append)
        assert notes[-1] == (f"resume: checkpoint {checkpoint} (step 2) records no resolved {LAYER_IDS_FIELD}; "
                             f"continuing with the configured {ids}")  # fmt: skip
    notes = []  # its note is said once every check has passed: a refused resume is its one line
    with pytest.raises(ValueError, match=r"nothing is left to do before step 2"):
        check_run(resumed(inputs, **{LAYER_IDS_FIELD: OLD}), run_dir=run_dir, resume=True, stop_step=2, warn=notes.append)
    assert notes == []
    message = one_line_error(lambda: check_run(resumed(inputs, **{LAYER_IDS_FIELD: [0, 2, 4]}), run_dir=run_dir,
                                               resume=True))  # fmt: skip
    assert "which one it trained with is unknown" in message


def test_export_of_a_checkpoint_uses_the_ids_it_trained_with(
    inputs: tuple[Path, Path], trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``csbp dflash export --checkpoint`` takes the recorded ids (it used to fill in today's default)
    and refuses an older checkpoint whose ids are unknown, naming ``--layer-ids`` for both."""
    target = str(inputs[1])
    recorded = find_latest_checkpoint(run_copy(trained, tmp_path / "recorded", {LAYER_IDS_FIELD: OLD}))
    out = tmp_path / "out"
    assert main(["dflash", "export", "--checkpoint", str(recorded), "--target", target, "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["dflash_config"]["target_layer_ids"] == OLD
    older = find_latest_checkpoint(run_copy(trained, tmp_path / "older", None))
    capsys.readouterr()
    assert main(["dflash", "export", "--checkpoint", str(older), "--target", target, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "--checkpoint: it records no resolved target_layer_ids" in err and len(err.strip().splitlines()) == 1
    assert "(fix: pass --layer-ids 1 3 4 if the run started under csbp before commit 2967e9f" in err
    assert "else --layer-ids 1 2 4)" in err and not (tmp_path / "x").exists()
    out = tmp_path / "chosen"
    assert main(["dflash", "export", "--checkpoint", str(older), "--target", target, "--out", str(out),
                 "--layer-ids", "1", "3", "4"]) == 0  # fmt: skip
    assert json.loads((out / "config.json").read_text())["dflash_config"]["target_layer_ids"] == OLD


def test_a_store_of_the_old_default_names_its_ids_in_the_fix(inputs: tuple[Path, Path], tmp_path: Path) -> None:
    """A feature store captured for [1, 3, 4] and a config leaving the ids to today's default: the
    fix names the store's ids (it only said to re-run prepare-features)."""
    artifact, target = inputs
    split = open_artifact(artifact).split("train")
    store = prepare_features(load_hf_checkpoint(target)[0], split, tmp_path / "features", layer_ids=tuple(OLD),
                             dtype="float32", target_weights=checkpoint_fingerprint(target))  # fmt: skip
    message = one_line_error(lambda: check_run(dflash_config(artifact, target, **RUN, **{
        "objective.dflash.features": str(store)})))  # fmt: skip
    assert "layer_ids=[1, 3, 4] but expected [1, 2, 4]" in message
    assert message.endswith(
        f"(fix: set {LAYER_IDS_FIELD}: [1, 3, 4] (the layers the store holds; the default here is [1, 2, 4]), or "
        "re-run `csbp dflash prepare-features` with --layer-ids 1 2 4)"
    )
    check_run(dflash_config(artifact, target, **{**RUN, LAYER_IDS_FIELD: OLD, "objective.dflash.features": str(store)}))


def test_an_older_checkpoint_trained_on_a_feature_store_takes_its_ids(
    inputs: tuple[Path, Path], tmp_path: Path
) -> None:
    """No record and unset ids at a depth where the default changed, but the run trained on a feature
    store the checkpoint fingerprinted: the store's ids are the trained ones, so it resumes as is; with
    that fingerprint gone (an older checkpoint still) both candidates stay unknown."""
    artifact, target = inputs
    split = open_artifact(artifact).split("train")
    store = prepare_features(load_hf_checkpoint(target)[0], split, tmp_path / "features", layer_ids=tuple(NEW),
                             dtype="float32", target_weights=checkpoint_fingerprint(target))  # fmt: skip
    with_store = {"objective.dflash.features": str(store)}
    trained = tmp_path / "trained"
    train(dflash_config(*inputs, **RUN, **with_store), run_dir=trained)
    run_dir = run_copy(trained, tmp_path, None)
    check_run(resumed(inputs, **with_store), run_dir=run_dir, resume=True)
    state_file = find_latest_checkpoint(run_dir) / "trainer_state.json"  # type: ignore[operator]
    state = json.loads(state_file.read_text())
    del state["input_fingerprints"]["objective.dflash.features"]
    state_file.write_text(json.dumps(state))
    message = one_line_error(lambda: check_run(resumed(inputs, **with_store), run_dir=run_dir, resume=True))
    assert "which one it trained with is unknown" in message


def test_a_damaged_record_is_named(inputs: tuple[Path, Path], trained: Path, tmp_path: Path) -> None:
    for number, (damaged, problem) in enumerate((([1, 2, 4], "resolved_config is not a mapping"),
                             ({LAYER_IDS_FIELD: "1 2 4"}, "resolved_config objective.dflash.target_layer_ids is "
                                                          "'1 2 4', not a list of layer ids"))):  # fmt: skip
        run_dir = run_copy(trained, tmp_path / str(number), damaged)
        message = one_line_error(lambda run_dir=run_dir: check_run(resumed(inputs), run_dir=run_dir, resume=True))
        assert problem in message and "the checkpoint is" in message, message


def test_export_refuses_checkpoint_flags_that_contradict_what_it_trained_with(
    inputs: tuple[Path, Path], trained: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--block-size``/``--mask-token-id``/``--layer-ids`` replaced a checkpoint's recorded values
    without a word: ``--mask-token-id 7`` exported a drafter whose mask embedding was never trained,
    ``--layer-ids`` of the right count fed its fc other target layers. The same values are accepted."""
    checkpoint = find_latest_checkpoint(run_copy(trained, tmp_path / "recorded", {LAYER_IDS_FIELD: OLD}))
    state = read_training_state(checkpoint)  # type: ignore[arg-type]
    source = f"{checkpoint}/trainer_state.json"
    block = int(dflash_config(*inputs, **RUN).objective.block_size)  # type: ignore[arg-type]
    mask = open_artifact(inputs[0]).mask_token_id
    base = ["dflash", "export", "--checkpoint", str(checkpoint), "--target", str(inputs[1])]
    cases = [
        (["--layer-ids", "1", "2", "4"], f"--layer-ids 1 2 4: the checkpoint trained with target_layer_ids {OLD} ({source})"),
        (["--block-size", str(block * 2)], f"--block-size {block * 2}: the checkpoint trained with block_size {block} ({source} config_yaml)"),
        (["--mask-token-id", str(mask + 7)], f"--mask-token-id {mask + 7}: the checkpoint trained with mask_token_id {mask} ("),
    ]
    assert state.config_yaml
    for extra, start in cases:
        capsys.readouterr()
        assert main([*base, "--out", str(tmp_path / "x"), *extra]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith(f"csbp: error: {start}"), line
        assert line.endswith(f"(fix: drop {extra[0]} to export what it trained with; the flag is for checkpoints that record none)")
        assert not (tmp_path / "x").exists()
    same = ["--layer-ids", *map(str, OLD), "--block-size", str(block), "--mask-token-id", str(mask)]
    assert main([*base, "--out", str(tmp_path / "same"), *same]) == 0


@pytest.mark.parametrize("objective", ["dflash", "[1, 2]"])
def test_a_recorded_objective_that_is_no_mapping_is_read_as_unconfigured(objective: str) -> None:
    """``(loaded.get("objective") or {}).get("dflash")`` raised AttributeError (a traceback) when the
    checkpoint's config_yaml held objective as a string or list; the recorded resolved ids still decide."""
    from types import SimpleNamespace

    from csbp.training.dflash_layers import check_resumed_layer_ids

    state = SimpleNamespace(config_yaml=f"objective: {objective}\n", resolved_config={LAYER_IDS_FIELD: NEW}, step=2)
    drafter = SimpleNamespace(target_layer_ids=tuple(NEW), num_target_layers=7, num_layers=3)
    dflash = SimpleNamespace(drafter_config=drafter, layer_ids_configured=False)
    check_resumed_layer_ids(state, Path("ckpt"), dflash, restart="start a new run")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"was trained with target_layer_ids \[1, 3, 4\], this run resolves"):
        check_resumed_layer_ids(
            SimpleNamespace(**{**vars(state), "resolved_config": {LAYER_IDS_FIELD: OLD}}),  # type: ignore[arg-type]
            Path("ckpt"), dflash, restart="start a new run",  # type: ignore[arg-type]
        )
