"""``csbp dflash eval``'s argument checks on the workspace of ``test_dflash_cli`` (a tiny target,
an untrained drafter, an artifact and JSONL prompts): what it refuses before loading any weights, the
positions it may run the target at, and how much of a JSONL prompt it keeps."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from csbp.data.artifact import open_artifact
from test_dflash_cli import WORDS, _eval_argv, build_workspace, run_cli


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_workspace(tmp_path_factory.mktemp("dflash_eval_cli"))


def test_eval_refuses_positions_beyond_the_target_max_position_embeddings(
    workspace: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # like csbp generate: the kept tokens of a P-token prompt and N new tokens need P + N - 1
    # target positions; beyond max_position_embeddings the target was silently run out of range
    target = tmp_path / "target"
    shutil.copytree(workspace["target"], target)
    config = json.loads((target / "config.json").read_text())
    config["max_position_embeddings"] = 16
    (target / "config.json").write_text(json.dumps(config))
    argv = [
        "dflash", "eval", "--target", str(target), "--drafter", str(workspace["drafter"]),
        "--data", str(workspace["artifact"]), "--num-prompts", "1", "--prompt-len", "8", "--ignore-eos",
    ]
    assert run_cli([*argv, "--max-new-tokens", "9"]) == 0
    capsys.readouterr()
    assert run_cli([*argv, "--max-new-tokens", "10"]) == 2
    err = capsys.readouterr().err
    assert "max_position_embeddings 16" in err and "--max-new-tokens 9 or less" in err


def test_eval_refuses_bad_arguments_before_loading_the_target(
    workspace: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # dflash eval loaded the target (minutes for a large one) and the drafter before it looked at
    # --drafter, the data, the prompts or --eos-id; an --eos-id outside the vocabulary also printed
    # the run's header line before the error.
    import csbp.models.hf_io as hf_io

    def no_loading(*args, **kwargs):
        raise AssertionError("the target's weights were loaded")

    monkeypatch.setattr(hf_io, "load_hf_checkpoint", no_loading)
    data = ["--data", str(workspace["artifact"])]
    cases = [
        (["--drafter", str(tmp_path / "none"), *data], "--drafter"),
        (["--drafter", str(workspace["target"]), *data], "(fix: pass a `csbp dflash export` directory)"),
        (["--drafter", str(workspace["drafter"]), "--data", str(tmp_path / "none")], "no manifest.json"),
        (["--drafter", str(workspace["drafter"]), "--prompts", str(tmp_path / "none.jsonl")], "--prompts"),
        (["--drafter", str(workspace["drafter"]), *data, "--context-lengths", "99"], "exceeds the artifact's seq_len"),
        (["--drafter", str(workspace["drafter"]), *data, "--eos-id", "100000"], "--eos-id 100000 is outside"),
        # both stop flags: --ignore-eos silently won over --eos-id
        (["--drafter", str(workspace["drafter"]), *data, "--eos-id", "3", "--ignore-eos"], "--ignore-eos and --eos-id 3"),
        # flags that were silently ignored: a second prompt length, the other prompt source's options
        (["--drafter", str(workspace["drafter"]), *data, "--context-lengths", "4", "--prompt-len", "8"],
         "--context-lengths and --prompt-len both set the prompt length"),
        (["--drafter", str(workspace["drafter"]), *data, "--tokenizer", str(workspace["target"])],
         "--tokenizer applies to --prompts, not --data (fix: drop --tokenizer)"),
        (["--drafter", str(workspace["drafter"]), "--prompts", str(workspace["prompts"]), "--split", "train"],
         "--split applies to --data, not --prompts (fix: drop --split)"),
    ]
    for extra, message in cases:
        assert run_cli(["dflash", "eval", "--target", str(workspace["target"]), *extra]) == 2
        captured = capsys.readouterr()
        (line,) = captured.err.splitlines()
        assert line.startswith("csbp: error: ") and message in line, line
        assert captured.out == ""


def test_eval_keeps_whole_jsonl_prompts_unless_asked(
    workspace: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # --prompts silently kept only the last 64 tokens of every prompt (the --data default length),
    # so a real prompt was evaluated as its tail
    prompts = tmp_path / "long.jsonl"
    prompts.write_text(json.dumps({"prompt": " ".join(WORDS * 6)}) + "\n")
    length = len(open_artifact(workspace["artifact"]).load_tokenizer().encode(" ".join(WORDS * 6)))
    assert length > 64
    argv = _eval_argv(workspace, "--prompts", str(prompts), "--max-new-tokens", "3", "--no-check-lossless")
    for extra, kept in (([], length), (["--prompt-len", "5"], 5)):
        assert run_cli([*argv, *extra]) == 0
        row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("line 1 "))
        assert int(row.split()[2]) == kept, row


def test_eval_of_jsonl_prompts_stops_at_the_generation_config_eos_ids(
    workspace: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a chat target's end of turn is listed in generation_config.json's eos_token_id (csbp generate
    # and HF generate stop there); dflash eval --prompts stopped at the tokenizer's EOS alone, so its
    # acceptance length counted rounds decoded past the end of the turn. --data keeps the artifact's
    # EOS (what training validation stops at) and --eos-id replaces every default.
    target = tmp_path / "target"
    shutil.copytree(workspace["target"], target)
    eos = open_artifact(workspace["artifact"]).special_ids["eos"]
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 5, 7]}))
    base = ["dflash", "eval", "--target", str(target), "--drafter", str(workspace["drafter"]), "--max-new-tokens", "3"]
    for extra, header in (
        (["--prompts", str(workspace["prompts"])], f"eos [{eos}, 5, 7],"),
        (["--prompts", str(workspace["prompts"]), "--eos-id", "5"], "eos 5,"),
        (["--data", str(workspace["artifact"]), "--num-prompts", "1"], f"eos {eos},"),
    ):
        assert run_cli([*base, *extra]) == 0
        assert header in capsys.readouterr().out.splitlines()[0]
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 100000]}))
    assert run_cli([*base, "--prompts", str(workspace["prompts"])]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "generation_config.json: eos_token_id 100000 is not a token id" in line


def test_eval_refuses_an_artifact_prompt_id_past_the_target_vocabulary(
    workspace: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A token file changed after csbp data prepare (same size: it opens) with an id the target does
    not embed: --prompts' ids were checked before any weights load, --data's only by the decoder
    after the target and the drafter had loaded (one line without a fix, naming no prompt)."""
    import numpy as np

    import csbp.models.hf_io as hf_io

    def no_loading(*args: object, **kwargs: object) -> None:
        raise AssertionError("the target's weights were loaded")

    monkeypatch.setattr(hf_io, "load_hf_checkpoint", no_loading)

    data = shutil.copytree(workspace["artifact"], tmp_path / "artifact")
    tokens = np.memmap(data / "val.tokens.bin", dtype="<u4", mode="r+")
    tokens[3] = 300  # row 0, position 3; the target embeds [0, 300)
    tokens.flush()
    del tokens
    argv = ["dflash", "eval", "--target", str(workspace["target"]), "--drafter", str(workspace["drafter"]),
            "--data", str(data), "--num-prompts", "1", "--prompt-len", "8", "--max-new-tokens", "3"]
    assert run_cli(argv) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        f"csbp: error: --data {data} row 0: token id 300 is outside the target vocabulary [0, 300) (fix: its "
        "token files changed since csbp data prepare: check with csbp data inspect --verify)"
    )


def test_run_directories_and_swapped_models_name_the_directory_to_pass(
    workspace: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # a run directory where its export belongs, or the drafter and the target swapped, said only
    # "runs/x is not a DFlash drafter directory: config.json not found" or "unsupported architectures
    # ['DFlashDraftModel'] in config.json", naming neither the flag nor RUN/final
    run = tmp_path / "run"
    shutil.copytree(workspace["drafter"], run / "final")
    (run / "checkpoints").mkdir()
    target_run = tmp_path / "target-run"
    shutil.copytree(workspace["target"], target_run / "final")
    unexported = tmp_path / "unexported"
    (unexported / "checkpoints").mkdir(parents=True)
    target, drafter, data = str(workspace["target"]), str(workspace["drafter"]), str(workspace["artifact"])
    cases = [
        (["dflash", "eval", "--target", target, "--drafter", str(run), "--data", data],
         f"--drafter {run} is not a DFlash drafter directory: config.json not found (fix: it is a run directory: "
         f"pass its export, --drafter {run / 'final'})"),
        (["dflash", "eval", "--target", target, "--drafter", str(unexported), "--data", data],
         f"(fix: it is a run directory without final/: export it first, csbp dflash export --run-dir {unexported}"),
        (["dflash", "eval", "--target", str(target_run), "--drafter", drafter, "--data", data],
         f"--target {target_run} is not a HF checkpoint directory: config.json not found (fix: it is a run "
         f"directory: use its export, {target_run / 'final'})"),
        (["dflash", "eval", "--target", drafter, "--drafter", target, "--data", data],
         f"--target {drafter} is a DFlash drafter (DFlashDraftModel), not the model it drafts for (fix: pass it "
         "as --drafter"),
        (["dflash", "prepare-features", "--target", drafter, "--data", data, "--out", str(tmp_path / "f")],
         f"--target {drafter} is a DFlash drafter"),
        (["dflash", "export", "--drafter", str(run), "--out", str(tmp_path / "e")],
         f"pass its export, --drafter {run / 'final'}"),
    ]
    for argv, message in cases:
        assert run_cli(argv) == 2
        captured = capsys.readouterr()
        (line,) = captured.err.splitlines()
        assert line.startswith("csbp: error: ") and message in line, line
    assert not (tmp_path / "f").exists() and not (tmp_path / "e").exists()
