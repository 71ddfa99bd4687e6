"""``csbp dflash prepare-features|export|eval`` end to end through ``csbp.cli.main.main``.

Fixtures: a byte-level BPE tokenizer trained on a tiny corpus and an artifact prepared with it
(seq_len 32, a val split), a tiny random target exported with ``export_hf_checkpoint`` (with the
tokenizer) and an untrained drafter exported with ``export_dflash`` (``B = 4``, target layers 0, 2).
The commands must: write validated features equal to the online capture; re-export a drafter
directory, a run's ``final/`` and a ``torch.distributed.checkpoint`` checkpoint to identical tensors;
evaluate with a passing lossless check and ``acceptance_length: <value>`` as the last line; exit 1
when speculative and greedy outputs differ; and reject mismatched target/drafter pairs with one
``csbp: error:`` line (exit 2).
Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_dflash_cli.py -q``
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import yaml
from safetensors.torch import load_file

import csbp.cli.main as cli_main
from csbp.data.artifact import open_artifact
from csbp.data.prepare import PrepareConfig, prepare_artifact
from csbp.dflash.config import DFlashConfig
from csbp.dflash.drafter import DFlashDrafter
from csbp.dflash.export import export_dflash
from csbp.dflash.features import capture_target_features, open_features, recorded_target
from csbp.dflash.speculative import GreedyResult
from csbp.dflash.target_fingerprint import checkpoint_fingerprint, checkpoint_identity
from csbp.models.config import DecoderConfig
from csbp.models.decoder import Decoder
from csbp.models.hf_io import export_hf_checkpoint

WORDS = "the cat sat on a mat while the dog ran to the park and back again".split()


def run_cli(argv: list[str]) -> int:
    return cli_main.main(argv)


def _target_config(vocab_size: int, hidden_size: int = 32) -> DecoderConfig:
    return DecoderConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=64,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
    )


def _drafter(config: DecoderConfig, mask_token_id: int) -> DFlashDrafter:
    drafter_config = DFlashConfig.from_target(
        config, num_layers=1, block_size=4, mask_token_id=mask_token_id, target_layer_ids=(0, 2)
    )
    return DFlashDrafter(drafter_config, seed=3)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_workspace(tmp_path_factory.mktemp("dflash_cli"))


def build_workspace(root: Path) -> dict[str, Path]:
    """The artifact, target, drafter and prompts of the module docstring, under ``root``."""
    corpus = root / "corpus.jsonl"
    generator = torch.Generator().manual_seed(0)
    with corpus.open("w") as handle:
        for _ in range(24):
            words = [WORDS[int(i)] for i in torch.randint(0, len(WORDS), (30,), generator=generator)]
            handle.write(json.dumps({"text": " ".join(words)}) + "\n")
    artifact_dir = root / "artifact"
    prepare_artifact(
        PrepareConfig(
            inputs=(corpus,),
            out_dir=artifact_dir,
            seq_len=32,
            train_tokenizer=True,
            vocab_size=300,
            val_fraction=0.25,
        )
    )
    artifact = open_artifact(artifact_dir)
    tokenizer = artifact.load_tokenizer()
    config = _target_config(tokenizer.vocab_size)
    target = Decoder(config, seed=1)
    target_dir = export_hf_checkpoint(target, config, root / "target", tokenizer_dir=artifact_dir)
    drafter_dir = export_dflash(_drafter(config, tokenizer.mask_token_id), root / "drafter")
    prompts = root / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"prompt": "the cat sat on", "group": "animals"})
        + "\n"
        + json.dumps({"prompt": "the park and back"})
        + "\n"
    )
    return {
        "root": root,
        "artifact": artifact_dir,
        "target": target_dir,
        "drafter": drafter_dir,
        "prompts": prompts,
    }


def _eval_argv(ws: dict[str, Path], *extra: str) -> list[str]:
    return ["dflash", "eval", "--target", str(ws["target"]), "--drafter", str(ws["drafter"]), *extra]


def test_eval_on_artifact_and_jsonl_prompts(
    workspace: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = _eval_argv(
        workspace, "--data", str(workspace["artifact"]), "--num-prompts", "2", "--prompt-len", "8"
    )
    assert run_cli([*argv, "--max-new-tokens", "10", "--ignore-eos"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert re.fullmatch(r"acceptance_length: \d+\.\d{3}", out[-1]), out[-1]
    assert 1.0 <= float(out[-1].split()[1]) <= 4.0
    assert "lossless check passed: 2/2 identical" in out and "[val]" in out
    assert any(line.startswith("target forwards: speculative") for line in out)

    argv = _eval_argv(workspace, "--data", str(workspace["artifact"]), "--num-prompts", "2")
    assert run_cli([*argv, "--context-lengths", "4", "12", "--max-new-tokens", "6", "--no-check-lossless"]) == 0
    out = capsys.readouterr().out
    assert "[val ctx 4]" in out and "[val ctx 12]" in out and "per-position acceptance [" in out
    assert run_cli([*argv, "--context-lengths", "0"]) == 2
    assert "csbp: error: --context-lengths" in capsys.readouterr().err

    argv = _eval_argv(workspace, "--prompts", str(workspace["prompts"]), "--max-new-tokens", "6")
    assert run_cli(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert "[animals]" in out and "[prompts]" in out
    assert out[-1].startswith("acceptance_length: ")


def test_eval_exits_1_when_outputs_differ(
    workspace: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def wrong_greedy(target, prompt_ids, *, max_new_tokens, eos_id=None):  # noqa: ANN001, ANN202
        return GreedyResult([0] * max_new_tokens, max_new_tokens, False)

    monkeypatch.setattr("csbp.dflash.evaluate.greedy_generate", wrong_greedy)
    argv = _eval_argv(
        workspace, "--prompts", str(workspace["prompts"]), "--max-new-tokens", "5", "--ignore-eos"
    )
    assert run_cli(argv) == 1
    captured = capsys.readouterr()
    assert "csbp: error: lossless check failed for line 1" in captured.err
    assert "lossless check FAILED" in captured.out
    assert captured.out.strip().splitlines()[-1].startswith("acceptance_length: ")
    # without the check the same run passes
    assert run_cli([*argv, "--no-check-lossless"]) == 0
    assert "lossless check skipped" in capsys.readouterr().out


def _edit_config(source: Path, dest: Path, edit) -> Path:  # noqa: ANN001
    dest.mkdir()
    (dest / "model.safetensors").write_bytes((source / "model.safetensors").read_bytes())
    config = json.loads((source / "config.json").read_text())
    edit(config)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def test_mismatched_target_and_drafter_are_one_line_errors(
    workspace: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    root, vocab = workspace["root"], open_artifact(workspace["artifact"]).vocab_size
    wide = export_dflash(_drafter(_target_config(vocab, hidden_size=48), 1), root / "wide_drafter")
    other_vocab = export_dflash(_drafter(_target_config(vocab + 8), 1), root / "vocab_drafter")
    no_mask = _edit_config(
        workspace["drafter"], root / "no_mask", lambda c: c["dflash_config"].pop("mask_token_id")
    )
    bad_ids = _edit_config(
        workspace["drafter"], root / "bad_ids", lambda c: c["dflash_config"].update(target_layer_ids=[0, 4])
    )
    cases = {
        wide: "drafter hidden_size=48 differs from the target's 32",
        other_vocab: f"drafter vocab_size={vocab + 8} differs from the target's {vocab}",
        no_mask: "no mask_token_id",
        bad_ids: r"target_layer_ids=\[0, 4\]",
    }
    for drafter_dir, message in cases.items():
        argv = ["dflash", "eval", "--target", str(workspace["target"]), "--drafter", str(drafter_dir)]
        assert run_cli([*argv, "--prompts", str(workspace["prompts"])]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("csbp: error: ") and re.search(message, err[0]), err


def test_prepare_features_matches_online_capture(
    workspace: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    out = workspace["root"] / "features"
    argv = [
        "dflash",
        "prepare-features",
        "--target",
        str(workspace["target"]),
        "--data",
        str(workspace["artifact"]),
    ]
    argv += [
        "--out",
        str(out),
        "--drafter",
        str(workspace["drafter"]),
        "--split",
        "val",
        "--feature-dtype",
        "float32",
    ]
    assert run_cli(argv) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    artifact = open_artifact(workspace["artifact"])
    split = artifact.split("val")
    target_config = _target_config(artifact.vocab_size)
    weights = checkpoint_fingerprint(workspace["target"])
    assert recorded_target(out) == checkpoint_identity(workspace["target"])  # lets training skip the re-read
    store = open_features(out, target_config=target_config, target_weights=weights, split=split, layer_ids=(0, 2))
    target = Decoder(target_config, seed=1)
    ids = torch.from_numpy(split.tokens[:1].astype("int64"))
    docs = torch.from_numpy(split.doc_ids[:1].astype("int64"))
    expected = capture_target_features(target, ids, (0, 2), doc_ids_SL=docs).features
    torch.testing.assert_close(store.rows([0]).features, expected, rtol=0, atol=1e-6)

    bad = [
        "dflash",
        "prepare-features",
        "--target",
        str(workspace["target"]),
        "--data",
        str(workspace["artifact"]),
    ]
    assert run_cli([*bad, "--out", str(out) + "2", "--layer-ids", "0", "9"]) == 2
    assert "--layer-ids [9] are outside the target's layers [0, 4)" in capsys.readouterr().err


def _same_tensors(a: Path, b: Path) -> None:
    left, right = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert left.keys() == right.keys()
    for name in left:
        assert torch.equal(left[name], right[name]), name


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_export_from_drafter_run_final_and_checkpoint(
    workspace: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    root, target = workspace["root"], str(workspace["target"])
    again = root / "exported"
    assert (
        run_cli(
            [
                "dflash",
                "export",
                "--drafter",
                str(workspace["drafter"]),
                "--target",
                target,
                "--out",
                str(again),
            ],
        )
        == 0
    )
    assert "DFlash drafter, 1 layer, block_size 4, target_layer_ids [0, 2]" in capsys.readouterr().out
    _same_tensors(workspace["drafter"], again)
    # carried through, with the context it serves: the target's (no max_position_embeddings was written)
    assert json.loads((again / "config.json").read_text()) == {
        **json.loads((workspace["drafter"] / "config.json").read_text()),
        "max_position_embeddings": json.loads((workspace["target"] / "config.json").read_text())["max_position_embeddings"],
    }

    run = root / "run"
    export_dflash(_drafter(_target_config(open_artifact(workspace["artifact"]).vocab_size), 7), run / "final")
    assert (
        run_cli(
            ["dflash", "export", "--run-dir", str(run), "--target", target, "--out", str(root / "from_run")],
        )
        == 0
    )
    _same_tensors(run / "final", root / "from_run")

    # a torch.distributed.checkpoint checkpoint as the trainer writes it: {"model": ..., "optim": ...}
    vocab = open_artifact(workspace["artifact"]).vocab_size
    drafter = _drafter(_target_config(vocab), 11)
    step_dir = root / "ckpt_run" / "checkpoints" / "step_0000010"
    dcp.save({"model": drafter.state_dict(), "optim": {}}, checkpoint_id=str(step_dir), no_dist=True)
    run_config = {
        "objective": {
            "name": "dflash",
            "block_size": 4,
            "mask_token_id": 1,
            "dflash": {"target_layer_ids": [0, 2]},
        }
    }
    (step_dir / "trainer_state.json").write_text(
        json.dumps({"step": 10, "config_yaml": yaml.safe_dump(run_config)})
    )
    (step_dir.parent / "latest").write_text("step_0000010\n")
    out = root / "from_checkpoint"
    assert (
        run_cli(
            [
                "dflash",
                "export",
                "--run-dir",
                str(root / "ckpt_run"),
                "--target",
                target,
                "--out",
                str(out),
                "--dtype",
                "bfloat16",
            ],
        )
        == 0
    )
    stored = load_file(str(out / "model.safetensors"))
    assert stored.keys() == drafter.state_dict().keys()
    for name, tensor in drafter.state_dict().items():
        assert stored[name].dtype == torch.bfloat16 and torch.equal(
            stored[name], tensor.to(torch.bfloat16)
        ), name
    config = json.loads((out / "config.json").read_text())
    assert config["dflash_config"] == {
        "mask_token_id": 1,
        "target_layer_ids": [0, 2],
        "sliding_window_causal": True,
    }

    (step_dir / "trainer_state.json").write_text(json.dumps({"step": 10, "config_yaml": "run: {name: x}\n"}))
    argv = ["dflash", "export", "--checkpoint", str(step_dir), "--target", target, "--out", str(root / "x")]
    assert run_cli(argv) == 2
    assert "pass --block-size and --mask-token-id" in capsys.readouterr().err
    assert run_cli([*argv, "--block-size", "4", "--mask-token-id", "1"]) == 2
    assert "do not match the drafter's fc width 64; pass --layer-ids" in capsys.readouterr().err
    assert run_cli([*argv, "--block-size", "4", "--mask-token-id", "1", "--layer-ids", "0", "2"]) == 0
    assert "note: the export carries no tokenizer files: " in capsys.readouterr().err  # no data.train recorded
    stored = load_file(str(root / "x" / "model.safetensors"))
    assert all(torch.equal(stored[name], tensor) for name, tensor in drafter.state_dict().items())

    # The recorded config is read by the config reader's rules: an alias bomb is one line, not a hang.
    bomb = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
        f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n"
        for i in range(9)
    )
    (step_dir / "trainer_state.json").write_text(json.dumps({"step": 10, "config_yaml": bomb}))
    assert run_cli([*argv, "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "the checkpoint is damaged" in err and len(err.strip().splitlines()) == 1


def test_dtype_flags_match_the_other_commands_and_old_spellings_still_parse(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Model weights: ``--dtype`` as in generate/eval/export (``--model-dtype`` where a second dtype
    exists); the old spellings still parse, with one warning line naming the current flag."""
    from csbp.cli.main import build_parser

    parser = build_parser()
    base = ["dflash", "eval", "--target", "t", "--drafter", "d", "--data", "a"]
    assert parser.parse_args([*base, "--dtype", "float64"]).model_dtype == "float64"
    assert parser.parse_args(base).model_dtype == "auto"
    assert capsys.readouterr().err == ""
    assert parser.parse_args([*base, "--model-dtype", "bfloat16"]).model_dtype == "bfloat16"
    assert capsys.readouterr().err == "csbp: warning: --model-dtype is deprecated here; use --dtype\n"
    prep = ["dflash", "prepare-features", "--target", "t", "--data", "a", "--out", "o"]
    args = parser.parse_args([*prep, "--model-dtype", "float32", "--feature-dtype", "float16"])
    assert (args.model_dtype, args.feature_dtype) == ("float32", "float16")
    assert (parser.parse_args(prep).model_dtype, parser.parse_args(prep).feature_dtype) == ("auto", "bfloat16")
    assert capsys.readouterr().err == ""
    assert parser.parse_args([*prep, "--dtype", "float32"]).feature_dtype == "float32"
    assert capsys.readouterr().err == "csbp: warning: --dtype is deprecated here; use --feature-dtype\n"
    for command in (["generate", "--model", "m", "--prompt", "p"], ["eval", "--model", "m", "--data", "a"]):
        assert parser.parse_args([*command, "--dtype", "float32"]).dtype == "float32"
    help_text = parser._subparsers._group_actions[0].choices["dflash"]._subparsers._group_actions[0].choices[
        "eval"
    ].format_help()
    assert "--dtype" in help_text and "--model-dtype" not in help_text


def test_a_target_with_another_rope_is_refused_before_any_work(
    workspace: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same weights under another RoPE (here linear x2) are another target: prepare-features for
    the drafter and dflash eval refuse them with one line instead of capturing / reporting."""
    scaled = tmp_path / "scaled target"
    shutil.copytree(workspace["target"], scaled)
    config = json.loads((scaled / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "linear", "factor": 2.0}
    config.pop("rope_parameters", None)
    (scaled / "config.json").write_text(json.dumps(config))
    out = tmp_path / "features"
    argv = ["dflash", "prepare-features", "--target", str(scaled), "--data", str(workspace["artifact"]),
            "--out", str(out), "--drafter", str(workspace["drafter"])]
    assert run_cli(argv) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"csbp: error: --drafter {workspace['drafter']}: drafter RoPE (theta=10000, no scaling) "
                           "differs from the target's (theta=10000, linear: factor=2.0)")
    assert not out.exists()
    assert run_cli(["dflash", "eval", "--target", str(scaled), "--drafter", str(workspace["drafter"]),
                    "--data", str(workspace["artifact"])]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert "drafter RoPE" in line and line.endswith("(fix: pass the target it was trained against, the "
                                                   "objective.dflash.target of its run)")


def test_eval_and_prepare_features_refuse_data_of_another_tokenizer(
    workspace: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # csbp train refuses a dflash run whose data another tokenizer prepared; eval and prepare-features
    # measured acceptance on (or captured features of) other tokens without a word when the vocabulary
    # sizes matched, and named `model vocab_size` as the fix when they did not.
    target = tmp_path / "target"
    shutil.copytree(workspace["target"], target)
    other = json.loads((target / "tokenizer.json").read_text())
    other["added_tokens"] = list(reversed(other["added_tokens"]))  # another tokenizer, same vocabulary size
    (target / "tokenizer.json").write_text(json.dumps(other))
    data = ["--data", str(workspace["artifact"])]
    commands = [
        ["dflash", "eval", "--target", str(target), "--drafter", str(workspace["drafter"]), *data],
        ["dflash", "prepare-features", "--target", str(target), *data, "--out", str(tmp_path / "f")],
    ]
    for argv in commands:
        assert run_cli(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("csbp: error: --data: the tokenizer of"), err
        assert "csbp data prepare --tokenizer" in err[0]
    assert not (tmp_path / "f").exists()


def test_prepare_features_refuses_bad_arguments_before_loading_the_target(
    workspace: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Loading a large target takes minutes: an --out that exists, a bad --rows-per-batch or --layer-ids
    # were refused only after it (the layer ids and batch size after the weights were in memory).
    import csbp.models.hf_io as hf_io

    def no_loading(*args, **kwargs):
        raise AssertionError("the target's weights were loaded")

    monkeypatch.setattr(hf_io, "load_hf_checkpoint", no_loading)
    existing = tmp_path / "existing"
    existing.mkdir()
    base = ["dflash", "prepare-features", "--target", str(workspace["target"]), "--data", str(workspace["artifact"])]
    cases = [
        (["--out", str(existing)], f"--out {existing}: already exists"),
        (["--out", str(tmp_path / "f"), "--rows-per-batch", "0"], "--rows-per-batch 0: must be >= 1"),
        (["--out", str(tmp_path / "f"), "--layer-ids", "0", "9"], "--layer-ids [9] are outside the target's layers"),
        (  # it built a tuple of 10**12 default ids: no end
            ["--out", str(tmp_path / "f"), "--num-draft-layers", str(10**12)],
            f"--num-draft-layers {10**12}: the default layer ids of a 4-layer target are at most 1 distinct layer (1 to "
            "1) (fix: --num-draft-layers 1 or less, or --layer-ids)",
        ),
    ]
    for extra, message in cases:
        assert run_cli([*base, *extra]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith("csbp: error: ") and message in line, line
    assert not (tmp_path / "f").exists()


def test_prepare_features_refuses_a_token_id_past_the_target_before_loading_it(
    workspace: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A token file changed after csbp data prepare (same size: it opens, and its manifest's vocab_size
    fits) with an id the target does not embed: an IndexError traceback once the target had loaded."""
    import numpy as np

    import csbp.cli.dflash_features_cmd as features_cmd

    data = shutil.copytree(workspace["artifact"], tmp_path / "artifact")
    tokens = np.memmap(data / "train.tokens.bin", dtype="<u4", mode="r+")
    tokens[40] = 300  # the target embeds [0, 300)
    tokens.flush()
    del tokens
    monkeypatch.setattr(features_cmd, "load_target", lambda *args: pytest.fail("the target was loaded"))
    argv = ["dflash", "prepare-features", "--target", str(workspace["target"]), "--data", str(data), "--out",
            str(tmp_path / "features")]
    assert run_cli(argv) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"csbp: error: --data {data} split train: token id 300 is outside the target vocabulary [0, 300) (fix: its "
        "token files changed since csbp data prepare: check with csbp data inspect --verify)"
    ]
