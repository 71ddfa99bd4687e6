"""Bad inputs over every CLI surface: exit code 2, one ``csbp...: error:`` line naming the file, field
or flag, no traceback, and nothing left behind.

Each case runs ``csbp`` in-process in its own working directory (``work/``) next to shared, read-only
fixtures (a tiny artifact, a tiny HF model, a drafter-less run config). The directory listing of the
work directory and of the fixtures is compared before and after: a failed command writes nothing.
Planted pickles write a sentinel file when unpickled; the sentinel must never appear.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from csbp.cli.main import main
from csbp.data.artifact import content_fingerprint, open_artifact
from csbp.data.prepare_manifest import write_manifest
from csbp.models.config import DecoderConfig
from csbp.models.decoder import Decoder
from csbp.models.hf_io import export_hf_checkpoint
from test_training_run import config_dict, make_artifact

SENTINEL_NAME = "PWNED"


class Planted:
    """Unpickling this calls ``os.system`` (the crafted-checkpoint attack)."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.sentinel}",))


@dataclass(frozen=True)
class Fixtures:
    root: Path
    artifact: Path
    model: Path
    config: Path
    sentinel: Path

    def copy_artifact(self, target: Path) -> Path:
        shutil.copytree(self.artifact, target)
        return target


@pytest.fixture(scope="module")
def fx(tmp_path_factory: pytest.TempPathFactory) -> Fixtures:
    root = tmp_path_factory.mktemp("fixtures")
    artifact = make_artifact(root / "art")
    vocab = open_artifact(artifact).vocab_size
    torch.manual_seed(0)
    config = DecoderConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=8,
    )
    model = export_hf_checkpoint(Decoder(config), config, root / "model", tokenizer_dir=artifact)
    run_config = root / "run.yaml"
    run_config.write_text(yaml.safe_dump(config_dict(artifact, **{"topology.dp": 1})), encoding="utf-8")
    return Fixtures(root, artifact, model, run_config, root / SENTINEL_NAME)


def write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    return path


def planted_checkpoint(fx: Fixtures, directory: Path, *, with_state: bool = True) -> Path:
    """``directory`` as a DCP checkpoint whose ``.metadata`` runs code when unpickled."""
    directory.mkdir(parents=True)
    (directory / ".metadata").write_bytes(pickle.dumps(Planted(fx.sentinel)))
    (directory / "__0_0.distcp").write_bytes(b"\0" * 64)
    if with_state:
        write(directory / "trainer_state.json", json.dumps({"format_version": 1, "step": 1}))
    return directory


def planted_run(fx: Fixtures, run_dir: Path) -> Path:
    planted_checkpoint(fx, run_dir / "checkpoints" / "step_0000001")
    write(run_dir / "checkpoints" / "latest", "step_0000001\n")
    return run_dir


def real_run(fx: Fixtures, run_dir: Path) -> Path:
    """A one-step single-process run (module cache: built once, copied per case)."""
    cache = fx.root / "one-step-run"
    if not cache.exists():
        assert main(["train", str(fx.config), "--run-dir", str(cache), "--max-steps", "2"]) == 0
    shutil.copytree(cache, run_dir)
    return run_dir


def damaged_run(fx: Fixtures, run_dir: Path, damage: Callable[[Path], None]) -> Path:
    real_run(fx, run_dir)
    for checkpoint in (run_dir / "checkpoints").glob("step_*"):
        damage(checkpoint)
    return run_dir


def truncate_distcp(checkpoint: Path) -> None:
    for file in checkpoint.glob("*.distcp"):
        with open(file, "r+b") as handle:
            handle.truncate(file.stat().st_size // 2)


def edited_artifact(fx: Fixtures, target: Path, *, vouch: bool, token: int | None = None) -> Path:
    """A copy of the artifact with one token changed; ``vouch`` rewrites the manifest's fingerprint."""
    fx.copy_artifact(target)
    opened = open_artifact(target)
    split = opened.split("train")
    tokens = np.memmap(target / "train.tokens.bin", dtype="<u4", mode="r+", shape=(split.num_rows, opened.seq_len))
    tokens[0, 0] = token if token is not None else (int(tokens[0, 0]) + 1) % opened.vocab_size
    tokens.flush()
    if vouch:
        manifest = json.loads((target / "manifest.json").read_text())
        manifest["content_fingerprint"] = content_fingerprint(target)
        write_manifest(target, manifest)
    return target


def supervised_token(fx: Fixtures) -> int:
    """A token id the fixture artifact holds at a supervised position (its first: plain text)."""
    opened = open_artifact(fx.artifact)
    split = opened.split("train")
    assert split.loss_mask[0, 0] == 1
    return int(split.tokens[0, 0])


def old_artifact(fx: Fixtures, target: Path, *, mask: int) -> Path:
    """A copy of the artifact as csbp wrote it before ``supervised_mask_tokens``, with mask id ``mask``
    (and, as ``--mask-token`` would have recorded it, that id's token as the mask's name)."""
    name = open_artifact(fx.artifact).load_tokenizer().backend.id_to_token(mask)

    def change(manifest: dict) -> None:
        manifest["special_ids"]["mask"] = mask
        manifest["tokenizer"]["special_names"]["mask"] = name
        for split in manifest["splits"].values():
            del split["supervised_mask_tokens"]

    return forged_manifest(fx, target, change)


def config_with(fx: Fixtures, path: Path, **changes: object) -> Path:
    data = yaml.safe_load(fx.config.read_text())
    for dotted, value in changes.items():
        *parents, last = dotted.split(".")
        node = data
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return write(path, yaml.safe_dump(data))


def symlink(link: Path, target: Path) -> Path:
    link.symlink_to(target, target_is_directory=True)
    return link


def broken_model(fx: Fixtures, target: Path, damage: Callable[[Path], None]) -> Path:
    shutil.copytree(fx.model, target)
    damage(target)
    return target


def forged_manifest(fx: Fixtures, target: Path, change: Callable[[dict], object]) -> Path:
    """A copy of the artifact whose manifest ``change`` edits (or replaces: a non-None return)."""
    fx.copy_artifact(target)
    manifest = json.loads((target / "manifest.json").read_text())
    replaced = change(manifest)
    write(target / "manifest.json", json.dumps(manifest if replaced is None else replaced))
    return target


def set_in(path: tuple[str, ...], value: object) -> Callable[[dict], None]:
    def change(manifest: dict) -> None:
        node = manifest
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return change


def forged_safetensors(header: bytes, payload: bytes = b"\0" * 16) -> Callable[[Path], None]:
    """Replace a model's weights with a safetensors file of this raw header."""
    return lambda m: write(m / "model.safetensors", len(header).to_bytes(8, "little") + header + payload)


ABSURD_SHAPE = json.dumps({"w": {"dtype": "F32", "shape": [10**12, 10**12], "data_offsets": [0, 16]}}).encode()
YAML_ALIAS_BOMB = "\n".join(
    ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    + [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 13)]
) + "\nrun: {name: bomb}\n"


Setup = Callable[[Fixtures, Path], list[str]]


@dataclass(frozen=True)
class Case:
    name: str
    setup: Setup
    expect: str  # a substring of the error line: the file, field or flag it names


W = Path  # readability alias for the work directory argument
UNWRITABLE = "/proc/csbp-unwritable"  # Linux: no file can be created under /proc

CASES: list[Case] = [
    # ------------------------------------------------------------------ config validate
    Case("config-missing-file", lambda fx, w: ["config", "validate", "nope.yaml"], "nope.yaml"),
    Case("config-yaml-syntax", lambda fx, w: ["config", "validate", str(write(w / "c.yaml", "run: [1,\n"))], "c.yaml"),
    Case("config-unknown-key", lambda fx, w: ["config", "validate", str(config_with(fx, w / "c.yaml", **{"train.bogus": 1}))], "train.bogus"),
    Case("config-lr-inf", lambda fx, w: ["config", "validate", str(fx.config), "--set", "optim.lr=.inf"], "optim.lr"),
    Case("config-lr-nan", lambda fx, w: ["config", "validate", str(fx.config), "--set", "optim.lr=.nan"], "optim.lr"),
    Case("config-timeout-inf", lambda fx, w: ["config", "validate", str(fx.config), "--set", "train.collective_timeout_s=.inf"], "train.collective_timeout_s"),
    Case("config-timeout-huge", lambda fx, w: ["config", "validate", str(fx.config), "--set", "train.collective_timeout_s=1e30"], "train.collective_timeout_s"),
    Case("config-grad-clip-nan", lambda fx, w: ["config", "validate", str(fx.config), "--set", "optim.grad_clip=.nan"], "optim.grad_clip"),
    Case("config-run-name-dotdot", lambda fx, w: ["config", "validate", str(fx.config), "--set", "run.name=../escape"], "run.name"),
    Case("config-run-name-slash", lambda fx, w: ["config", "validate", str(fx.config), "--set", "run.name=a/b"], "run.name"),
    Case("config-run-name-hidden", lambda fx, w: ["config", "validate", str(fx.config), "--set", "run.name=.x"], "run.name"),
    Case("config-bad-topology", lambda fx, w: ["config", "validate", str(fx.config), "--set", "topology.cp=3", "--set", "topology.bp=4"], "bp"),
    Case("config-bad-set-syntax", lambda fx, w: ["config", "validate", str(fx.config), "--set", "optim.lr"], "optim.lr"),
    Case("config-nan-policy", lambda fx, w: ["config", "validate", str(fx.config), "--set", "train.nan_policy=ignore"], "train.nan_policy"),
    # ------------------------------------------------------------------ recipes
    Case("recipes-show-unknown", lambda fx, w: ["recipes", "show", "no-such-recipe"], "no-such-recipe"),
    Case("recipes-copy-exists", lambda fx, w: ["recipes", "copy", "demo", str(write(w / "x.yaml", "keep\n"))], "x.yaml"),
    Case("recipes-copy-under-file", lambda fx, w: ["recipes", "copy", "demo", str(write(w / "f", "x") / "a.yaml")], "/f"),
    # ------------------------------------------------------------------ data prepare
    Case("prepare-missing-input", lambda fx, w: ["data", "prepare", "none.jsonl", "--out", "o", "--seq-len", "8", "--train-tokenizer", "--vocab-size", "300"], "none.jsonl"),
    Case("prepare-out-under-file", lambda fx, w: ["data", "prepare", str(fx.root / "art.jsonl"), "--out", str(write(w / "f", "x") / "o"), "--seq-len", "8", "--tokenizer", str(fx.artifact)], "/f"),
    Case("prepare-overwrite-foreign", lambda fx, w: ["data", "prepare", str(fx.root / "art.jsonl"), "--out", str(write(w / "mine" / "notes.txt", "x").parent), "--seq-len", "8", "--tokenizer", str(fx.artifact), "--overwrite"], "--overwrite"),
    Case("prepare-overwrite-cwd", lambda fx, w: ["data", "prepare", str(fx.root / "art.jsonl"), "--out", ".", "--seq-len", "8", "--tokenizer", str(fx.artifact), "--overwrite"], "--out ."),
    Case("prepare-overwrite-file", lambda fx, w: ["data", "prepare", str(fx.root / "art.jsonl"), "--out", str(write(w / "f", "x")), "--seq-len", "8", "--tokenizer", str(fx.artifact), "--overwrite"], "f"),
    Case("prepare-seq-len-1", lambda fx, w: ["data", "prepare", str(fx.root / "art.jsonl"), "--out", "o", "--seq-len", "1", "--tokenizer", str(fx.artifact)], "argument --seq-len"),
    Case("prepare-val-fraction", lambda fx, w: ["data", "prepare", str(fx.root / "art.jsonl"), "--out", "o", "--seq-len", "8", "--tokenizer", str(fx.artifact), "--val-fraction", "1.5"], "argument --val-fraction"),
    Case("prepare-vocab-without-train", lambda fx, w: ["data", "prepare", str(fx.root / "art.jsonl"), "--out", "o", "--seq-len", "8", "--tokenizer", str(fx.artifact), "--vocab-size", "9"], "--vocab-size"),
    Case("prepare-bad-tokenizer", lambda fx, w: ["data", "prepare", str(fx.root / "art.jsonl"), "--out", "o", "--seq-len", "8", "--tokenizer", str(write(w / "tok" / "tokenizer.json", "{not json"))], "tokenizer.json"),
    Case("prepare-missing-tokenizer", lambda fx, w: ["data", "prepare", str(fx.root / "art.jsonl"), "--out", "o", "--seq-len", "8", "--tokenizer", "no-tok"], "no-tok"),
    Case("prepare-lone-surrogate", lambda fx, w: ["data", "prepare", str(write(w / "s.jsonl", '{"text": "a \\ud800 b"}\n')), "--out", "o", "--seq-len", "8", "--tokenizer", str(fx.artifact)], "s.jsonl"),
    Case("prepare-bad-jsonl", lambda fx, w: ["data", "prepare", str(write(w / "b.jsonl", '{"text": "a"}\n{oops\n')), "--out", "o", "--seq-len", "8", "--tokenizer", str(fx.artifact)], "b.jsonl"),
    Case("prepare-not-parquet", lambda fx, w: ["data", "prepare", str(write(w / "x.parquet", "plain text")), "--out", "o", "--seq-len", "8", "--tokenizer", str(fx.artifact)], "x.parquet"),
    Case("prepare-no-documents", lambda fx, w: ["data", "prepare", str(write(w / "e.jsonl", "")), "--out", "o", "--seq-len", "8", "--tokenizer", str(fx.artifact)], "no non-empty documents"),
    Case("prepare-mask-token-is-eos", lambda fx, w: ["data", "prepare", str(fx.root / "art.jsonl"), "--out", "o", "--seq-len", "8", "--tokenizer", str(fx.artifact), "--mask-token", "<|endoftext|>"], "is also the eos token"),
    Case("prepare-mask-token-in-text", lambda fx, w: ["data", "prepare", str(fx.root / "art.jsonl"), "--out", "o", "--seq-len", "8", "--train-tokenizer", "--vocab-size", "300", "--mask-token", "fox"], "the mask token 'fox' occurs in the text"),
    Case("prepare-seq-len-beyond-data", lambda fx, w: ["data", "prepare", str(fx.root / "art.jsonl"), "--out", "o", "--seq-len", "100000", "--tokenizer", str(fx.artifact)], "--seq-len 100000 is longer than the"),
    Case("prepare-binary-txt", lambda fx, w: ["data", "prepare", str(write(w / "bin.txt", b"\xff\xfe\x00abc")), "--out", "o", "--seq-len", "8", "--tokenizer", str(fx.artifact)], "bin.txt"),
    # ------------------------------------------------------------------ data inspect / stats
    Case("inspect-missing", lambda fx, w: ["data", "inspect", "nowhere"], "nowhere"),
    Case("inspect-no-manifest", lambda fx, w: ["data", "inspect", str((w / "empty").mkdir() or w / "empty")], "empty"),
    Case("inspect-bad-manifest", lambda fx, w: ["data", "inspect", str(write(fx.copy_artifact(w / "a") / "manifest.json", "{oops").parent)], "manifest.json"),
    Case("inspect-truncated", lambda fx, w: ["data", "inspect", str(write(fx.copy_artifact(w / "a") / "train.tokens.bin", b"\0" * 12).parent)], "train.tokens.bin"),
    Case("inspect-rows-negative", lambda fx, w: ["data", "inspect", str(fx.artifact), "--rows", "-1"], "--rows"),
    Case("stats-verify-edited", lambda fx, w: ["data", "stats", str(edited_artifact(fx, w / "a", vouch=False)), "--verify"], "content_fingerprint"),
    # ------------------------------------------------------------------ train
    Case("train-missing-artifact", lambda fx, w: ["train", str(config_with(fx, w / "c.yaml", **{"data.train": str(w / "gone")})), "--run-dir", "r"], "data.train"),
    Case("train-run-dir-is-file", lambda fx, w: ["train", str(fx.config), "--run-dir", str(write(w / "f", "x"))], "--run-dir"),
    Case("train-run-dir-under-file", lambda fx, w: ["train", str(fx.config), "--run-dir", str(write(w / "f", "x") / "r")], "--run-dir"),
    Case("train-resume-nothing", lambda fx, w: ["train", str(fx.config), "--run-dir", "r", "--resume"], "--resume"),
    Case("train-resume-planted-pickle", lambda fx, w: ["train", str(fx.config), "--run-dir", str(planted_run(fx, w / "r")), "--resume"], ".metadata"),
    Case("train-resume-truncated", lambda fx, w: ["train", str(fx.config), "--run-dir", str(damaged_run(fx, w / "r", truncate_distcp)), "--resume", "--max-steps", "4"], ".distcp"),
    Case("train-resume-no-metadata", lambda fx, w: ["train", str(fx.config), "--run-dir", str(damaged_run(fx, w / "r", lambda c: (c / ".metadata").unlink())), "--resume", "--max-steps", "4"], ".metadata"),
    Case("train-resume-bad-state", lambda fx, w: ["train", str(fx.config), "--run-dir", str(damaged_run(fx, w / "r", lambda c: write(c / "trainer_state.json", "{oops"))), "--resume", "--max-steps", "4"], "trainer_state.json"),
    Case("train-fresh-over-checkpoint", lambda fx, w: ["train", str(fx.config), "--run-dir", str(real_run(fx, w / "r"))], "--resume"),
    Case("train-token-beyond-vocab", lambda fx, w: ["train", str(config_with(fx, w / "c.yaml", **{"data.train": str(edited_artifact(fx, w / "a", vouch=True, token=10**6))})), "--run-dir", "r"], "token id"),
    Case("train-edited-fingerprint", lambda fx, w: ["train", str(config_with(fx, w / "c.yaml", **{"data.train": str(edited_artifact(fx, w / "a", vouch=False))})), "--run-dir", "r"], "content_fingerprint"),
    Case("train-old-artifact-mask-is-eos", lambda fx, w: ["train", str(config_with(fx, w / "c.yaml", **{"data.train": str(old_artifact(fx, w / "a", mask=0))})), "--run-dir", "r"], "is also its eos token"),
    Case("train-old-artifact-mask-in-text", lambda fx, w: ["train", str(config_with(fx, w / "c.yaml", **{"data.train": str(old_artifact(fx, w / "a", mask=supervised_token(fx)))})), "--run-dir", "r"], "supervised positions (read from its token files)"),
    Case("config-old-artifact-mask-in-text", lambda fx, w: ["config", "validate", str(config_with(fx, w / "c.yaml", **{"data.train": str(old_artifact(fx, w / "a", mask=supervised_token(fx)))}))], "supervised positions"),
    Case("train-manifest-records-mask", lambda fx, w: ["train", str(config_with(fx, w / "c.yaml", **{"data.train": str(forged_manifest(fx, w / "a", set_in(("splits", "val", "supervised_mask_tokens"), 3)))})), "--run-dir", "r"], "at 3 supervised positions (manifest.json"),
    Case("train-config-mask-id-in-data", lambda fx, w: ["train", str(fx.config), "--set", f"objective.mask_token_id={supervised_token(fx)}", "--run-dir", "r"], "fix: remove objective.mask_token_id"),
    Case("config-mask-id-is-pad", lambda fx, w: ["config", "validate", str(fx.config), "--set", "objective.mask_token_id=2"], "is also its pad token"),
    Case("train-lr-inf", lambda fx, w: ["train", str(fx.config), "--set", "optim.lr=.inf", "--run-dir", "r"], "optim.lr"),
    Case("train-timeout-inf", lambda fx, w: ["train", str(fx.config), "--set", "train.collective_timeout_s=.inf", "--run-dir", "r"], "collective_timeout_s"),
    Case("train-run-name-escape", lambda fx, w: ["train", str(fx.config), "--set", "run.name=../../x"], "run.name"),
    Case("train-max-steps-0", lambda fx, w: ["train", str(fx.config), "--run-dir", "r", "--max-steps", "0"], "--max-steps"),
    Case("train-max-steps-past-schedule", lambda fx, w: ["train", str(fx.config), "--run-dir", "r", "--max-steps", "999"], "train.max_steps=999"),
    Case("train-nproc-mismatch", lambda fx, w: ["train", str(fx.config), "--run-dir", "r", "--nproc", "3"], "--nproc"),
    # ------------------------------------------------------------------ verify
    Case("verify-samples-0", lambda fx, w: ["verify", "--samples", "0"], "--samples"),
    Case("verify-bad-topology", lambda fx, w: ["verify", "--nproc", "4", "--cp", "3", "--bp", "4"], "bp"),
    Case("verify-seq-len", lambda fx, w: ["verify", "--nproc", "4", "--cp", "2", "--bp", "2", "--seq-len", "30"], "--seq-len"),
    # ------------------------------------------------------------------ generate
    Case("generate-missing-model", lambda fx, w: ["generate", "--model", "nomodel", "--prompt", "a"], "nomodel"),
    Case("generate-bad-config", lambda fx, w: ["generate", "--model", str(broken_model(fx, w / "m", lambda m: write(m / "config.json", "{oops"))), "--prompt", "a"], "config.json"),
    Case("generate-truncated-weights", lambda fx, w: ["generate", "--model", str(broken_model(fx, w / "m", lambda m: write(m / "model.safetensors", (m / "model.safetensors").read_bytes()[:200]))), "--prompt", "a"], "model.safetensors"),
    Case("generate-shard-escape", lambda fx, w: ["generate", "--model", str(broken_model(fx, w / "m", lambda m: write(m / "model.safetensors.index.json", json.dumps({"weight_map": {"lm_head.weight": "../model/model.safetensors"}})))), "--prompt", "a"], "model.safetensors.index.json"),
    Case("generate-cuda-missing", lambda fx, w: ["generate", "--model", str(fx.model), "--prompt", "a", "--device", "cuda"], "--device"),
    Case("generate-bad-device", lambda fx, w: ["generate", "--model", str(fx.model), "--prompt", "a", "--device", "tpu9"], "--device"),
    Case("generate-zero-tokens", lambda fx, w: ["generate", "--model", str(fx.model), "--prompt", "a", "--max-new-tokens", "0"], "--max-new-tokens"),
    Case("generate-steps-over-block", lambda fx, w: ["generate", "--model", str(fx.model), "--prompt", "a", "--block-size", "4", "--steps-per-block", "100"], "--steps-per-block 100"),
    Case("generate-beyond-positions", lambda fx, w: ["generate", "--model", str(fx.model), "--prompt", "a", "--max-new-tokens", "100000"], "max_position_embeddings 32768"),
    # ------------------------------------------------------------------ dflash
    Case("dflash-export-planted-pickle", lambda fx, w: ["dflash", "export", "--checkpoint", str(planted_checkpoint(fx, w / "ck")), "--target", str(fx.model), "--out", "o"], ".metadata"),
    Case("dflash-export-run-planted", lambda fx, w: ["dflash", "export", "--run-dir", str(planted_run(fx, w / "r")), "--target", str(fx.model), "--out", "o"], ".metadata"),
    Case("dflash-export-missing-metadata", lambda fx, w: ["dflash", "export", "--checkpoint", str((w / "ck").mkdir() or w / "ck"), "--target", str(fx.model), "--out", "o"], "--checkpoint"),
    Case("dflash-export-missing-target", lambda fx, w: ["dflash", "export", "--drafter", "d", "--target", "nope", "--out", "o"], "--target"),
    Case("dflash-export-missing-run", lambda fx, w: ["dflash", "export", "--run-dir", "nope", "--target", str(fx.model), "--out", "o"], "--run-dir"),
    Case("dflash-eval-missing-drafter", lambda fx, w: ["dflash", "eval", "--target", str(fx.model), "--drafter", "nope", "--data", str(fx.artifact)], "--drafter"),
    Case("dflash-eval-target-as-drafter", lambda fx, w: ["dflash", "eval", "--target", str(fx.model), "--drafter", str(fx.model), "--data", str(fx.artifact)], "model/config.json: architectures"),
    Case("dflash-eval-zero-prompts", lambda fx, w: ["dflash", "eval", "--target", str(fx.model), "--drafter", "d", "--data", str(fx.artifact), "--num-prompts", "0"], "--num-prompts"),
    Case("dflash-features-missing-data", lambda fx, w: ["dflash", "prepare-features", "--target", str(fx.model), "--data", "nope", "--out", "o"], "nope"),
    # ------------------------------------------------------------------ bench
    Case("bench-kv-heads", lambda fx, w: ["bench", "attention", "--num-kv-heads", "3"], "--num-kv-heads"),
    Case("bench-repeats-0", lambda fx, w: ["bench", "attention", "--repeats", "0"], "--repeats"),
    Case("bench-train-repeats-0", lambda fx, w: ["bench", "train", "--repeats", "0"], "--repeats"),
    Case("bench-dflash-repeats-0", lambda fx, w: ["bench", "dflash", "--repeats", "0"], "--repeats"),
    Case("bench-not-an-int", lambda fx, w: ["bench", "attention", "--repeats", "many"], "--repeats"),
    # these said "seq_len must be a positive integer, got -512", naming no flag
    Case("bench-seq-len-negative", lambda fx, w: ["bench", "attention", "--seq-lens", "-512"], "--seq-lens"),
    Case("bench-kernels-block-0", lambda fx, w: ["bench", "kernels", "--block-sizes", "0"], "--block-sizes"),
    Case("bench-train-layers-0", lambda fx, w: ["bench", "train", "--num-layers", "0"], "--num-layers"),
    Case("bench-dflash-anchors-0", lambda fx, w: ["bench", "dflash", "--anchors", "0"], "--anchors"),
    # ------------------------------------------------------------------ outputs nobody can write (checked first;
    # /proc refuses new files even to root, where os.access says yes)
    Case("train-run-dir-unwritable", lambda fx, w: ["train", str(fx.config), "--run-dir", f"{UNWRITABLE}/run"], "--run-dir"),
    Case("prepare-out-unwritable", lambda fx, w: ["data", "prepare", str(write(w / "b.jsonl", "{oops\n")), "--out", f"{UNWRITABLE}/o", "--seq-len", "8", "--tokenizer", str(fx.artifact)], "--out"),
    Case("recipes-copy-unwritable", lambda fx, w: ["recipes", "copy", "demo", f"{UNWRITABLE}/x.yaml"], "x.yaml"),
    Case("bench-json-unwritable", lambda fx, w: ["bench", "attention", "--json", f"{UNWRITABLE}/b.json"], "--json"),
    Case("plan-global-batch-0", lambda fx, w: ["plan", "--model", "nemotron-3b", "--seq-len", "4096", "--gpus", "8", "--global-batch", "0"], "--global-batch"),
    Case("plan-gpus-not-whole-nodes", lambda fx, w: ["plan", "--model", "nemotron-3b", "--seq-len", "4096", "--gpus", "8", "--gpus-per-node", "3"], "--gpus-per-node 3"),
    Case("plan-seq-len-no-layout", lambda fx, w: ["plan", "--model", "nemotron-3b", "--seq-len", "4097", "--gpus", "8"], "--seq-len 4097"),
    Case("plan-gpus-0", lambda fx, w: ["plan", "--model", "nemotron-3b", "--seq-len", "4096", "--gpus", "0"], "--gpus"),
    Case("plan-json-unwritable", lambda fx, w: ["plan", "--model", "nemotron-3b", "--seq-len", "4096", "--gpus", "8", "--json", f"{UNWRITABLE}/p.json"], "--json"),
    # ------------------------------------------------------------------ checked before the work they would follow
    Case("generate-run-dir-not-final", lambda fx, w: ["generate", "--model", str(real_run(fx, w / "r")), "--prompt", "a"], "r/final"),
    Case("generate-checkpoint-dir", lambda fx, w: ["generate", "--model", str(sorted((real_run(fx, w / "r") / "checkpoints").glob("step_*"))[-1]), "--prompt", "a"], "training checkpoints"),
    Case("eval-run-dir-not-final", lambda fx, w: ["eval", "--model", str(real_run(fx, w / "r")), "--data", str(fx.artifact)], "r/final"),
    Case("eval-json-unwritable", lambda fx, w: ["eval", "--model", str(fx.model), "--data", str(fx.artifact), "--json", f"{UNWRITABLE}/e.json"], "--json"),
    Case("train-config-copied-elsewhere", lambda fx, w: ["train", str(config_with(fx, w / "configs" / "run.yaml", **{"data.train": str(Path("artifacts") / fx.copy_artifact(w / "artifacts" / "a").name)})), "--run-dir", "r"], "fix: set data.train:"),
    Case("generate-known-words-missing", lambda fx, w: ["generate", "--model", str(fx.model), "--prompt", "a", "--known-words", "nowords.txt"], "--known-words"),
    Case("prepare-tokenizer-before-inputs", lambda fx, w: ["data", "prepare", str(write(w / "b.jsonl", "{oops\n")), "--out", "o", "--seq-len", "8", "--tokenizer", "no-tok"], "no-tok"),
    Case("prepare-vocab-too-small", lambda fx, w: ["data", "prepare", str(write(w / "b.jsonl", "{oops\n")), "--out", "o", "--seq-len", "8", "--train-tokenizer", "--vocab-size", "10"], "--vocab-size 10"),
    Case("config-seq-len-not-the-artifacts", lambda fx, w: ["config", "validate", str(fx.config), "--set", "data.seq_len=64"], "data.seq_len"),
    Case("compare-budget-0", lambda fx, w: ["compare", str(fx.config), "--budget-s", "0"], "--budget-s"),
    Case("verify-window-0", lambda fx, w: ["verify", "--nproc", "2", "--window", "0"], "--window"),
    # ------------------------------------------------------------------ security: forged inputs, bounded work
    Case("train-yaml-syntax", lambda fx, w: ["train", str(write(w / "c.yaml", "run: [1,\n")), "--run-dir", "r"], "c.yaml"),
    Case("config-yaml-alias-bomb", lambda fx, w: ["config", "validate", str(write(w / "bomb.yaml", YAML_ALIAS_BOMB))], "anchors/aliases"),
    Case("inspect-manifest-rows-1e12", lambda fx, w: ["data", "inspect", str(forged_manifest(fx, w / "a", set_in(("splits", "train", "rows"), 10**12)))], "train.tokens.bin"),
    Case("inspect-manifest-vocab-1e15", lambda fx, w: ["data", "inspect", str(forged_manifest(fx, w / "a", set_in(("tokenizer", "vocab_size"), 10**15)))], "tokenizer.vocab_size"),
    Case("inspect-manifest-seq-len-text", lambda fx, w: ["data", "inspect", str(forged_manifest(fx, w / "a", set_in(("seq_len",), "32")))], "seq_len"),
    Case("inspect-manifest-not-object", lambda fx, w: ["data", "inspect", str(forged_manifest(fx, w / "a", lambda m: [m]))], "manifest.json"),
    Case("train-manifest-vocab-forged", lambda fx, w: ["train", str(config_with(fx, w / "c.yaml", **{"data.train": str(forged_manifest(fx, w / "a", set_in(("tokenizer", "vocab_size"), 10**9)))})), "--run-dir", "r"], "tokenizer.vocab_size"),
    Case("generate-safetensors-absurd-shape", lambda fx, w: ["generate", "--model", str(broken_model(fx, w / "m", forged_safetensors(ABSURD_SHAPE))), "--prompt", "a"], "model.safetensors"),
    Case("generate-safetensors-huge-header", lambda fx, w: ["generate", "--model", str(broken_model(fx, w / "m", lambda m: write(m / "model.safetensors", (2**62).to_bytes(8, "little") + b"{}"))), "--prompt", "a"], "model.safetensors"),
    Case("train-run-dir-is-the-artifact", lambda fx, w: ["train", str(config_with(fx, w / "c.yaml", **{"data.train": str(fx.copy_artifact(w / "a"))})), "--run-dir", str(w / "a")], "manifest.json"),
    Case("train-run-dir-foreign", lambda fx, w: ["train", str(fx.config), "--run-dir", str(write(w / "mine" / "notes.txt", "x").parent)], "notes.txt"),
    Case("compare-resume-foreign-layout-dir", lambda fx, w: ["compare", str(fx.config), "--layouts", "data", "--nproc", "1", "--budget-s", "5", "--out", str(write(w / "o" / "data" / "notes.txt", "x").parent.parent), "--resume"], "no compare_options.json"),
    Case("prepare-overwrite-symlink", lambda fx, w: ["data", "prepare", str(fx.root / "art.jsonl"), "--out", str(symlink(w / "link", fx.copy_artifact(w / "a"))), "--seq-len", "8", "--tokenizer", str(fx.artifact), "--overwrite"], "symbolic link"),
    Case("prepare-jsonl-nested-deep", lambda fx, w: ["data", "prepare", str(write(w / "deep.jsonl", "[" * 200_000 + "]" * 200_000 + "\n")), "--out", "o", "--seq-len", "8", "--tokenizer", str(fx.artifact)], "deep.jsonl:1"),
    # ------------------------------------------------------------------ a new user's mistakes (audit g)
    Case("config-top-level-list", lambda fx, w: ["config", "validate", str(write(w / "l.yaml", "- run\n- model\n"))], "l.yaml: the top level must be a mapping of sections (run:, model:, ...), got a list (fix:"),
    Case("config-utf16", lambda fx, w: ["config", "validate", str(write(w / "u.yaml", fx.config.read_text().encode("utf-16")))], "u.yaml: not UTF-8 text (fix: save it as UTF-8"),
    Case("config-set-empty-value", lambda fx, w: ["config", "validate", str(fx.config), "--set", "run.name="], "run.name: expected str, got null"),
    Case("train-data-is-the-manifest", lambda fx, w: ["train", str(fx.config), "--set", f"data.train={fx.artifact / 'manifest.json'}", "--run-dir", "r"], "is the artifact's manifest file; data.train names the artifact directory (fix: set data.train:"),
    Case("train-recipe-from-a-subdirectory", lambda fx, w: [fx.copy_artifact(w.parent / "artifacts" / "demo-4k-64")] and ["train", "demo", "--run-dir", "r"], "(fix: run from "),
    Case("train-finished-resume-with-a-change", lambda fx, w: ["train", str(fx.config), "--run-dir", str(real_run(fx, w / "r")), "--resume", "--max-steps", "2", "--set", "objective.block_size=8"], "objective.block_size: checkpoint"),
    Case("generate-prompt-holds-the-mask", lambda fx, w: ["generate", "--model", str(fx.model), "--prompt", "a <|mask|> b"], "--prompt: holds the mask token"),
    Case("generate-top-k-0", lambda fx, w: ["generate", "--model", str(fx.model), "--prompt", "a", "--top-k", "0"], "argument --top-k"),
    Case("generate-temperature-negative", lambda fx, w: ["generate", "--model", str(fx.model), "--prompt", "a", "--temperature", "-1"], "argument --temperature"),
    Case("train-vocab-size-below-the-data", lambda fx, w: ["train", str(fx.config), "--set", "model.vocab_size=10", "--run-dir", "r"], "error: model.vocab_size: 10 ids, but the data artifact"),
    Case("train-empty-data-path", lambda fx, w: ["train", str(fx.config), "--set", 'data.train=""', "--run-dir", "r"], "data.train: String should have at least 1 character"),
    Case("eval-cp-bp-not-fused", lambda fx, w: ["eval", "--model", str(fx.model), "--data", str(fx.artifact), "--nproc", "4", "--cp", "3", "--bp", "4"], "--cp 3 --bp 4: not a fused CSBP layout: --bp must be a multiple of --cp (fix: e.g. --bp 6"),
    Case("verify-cp-bp-not-fused", lambda fx, w: ["verify", "--nproc", "8", "--cp", "4", "--bp", "2"], "--cp 4 --bp 2: not a fused CSBP layout"),
    Case("eval-data-is-a-file-of-the-artifact", lambda fx, w: ["eval", "--model", str(fx.model), "--data", str(fx.artifact / "manifest.json")], "manifest.json is a file of the data artifact"),
    Case("inspect-a-file-of-the-artifact", lambda fx, w: ["data", "inspect", str(fx.artifact / "train.tokens.bin")], "train.tokens.bin is a file of the data artifact"),
    Case("config-qk-norm-against-the-arch", lambda fx, w: ["config", "validate", str(fx.config), "--set", "model.arch=llama", "--set", "model.qk_norm=true"], "model.qk_norm: true does not fit model.arch: llama"),
    Case("plan-model-file-missing", lambda fx, w: ["plan", "--model", "run.yaml", "--gpus", "4"], "--model run.yaml: no such file or directory"),
    Case("prepare-overwrite-root", lambda fx, w: ["data", "prepare", str(fx.root / "art.jsonl"), "--out", "/", "--seq-len", "8", "--tokenizer", str(fx.artifact), "--overwrite"], "working directory"),
]


def listing(*roots: Path) -> dict[str, int]:
    """Every file under ``roots`` with its size (directories too, as -1)."""
    found: dict[str, int] = {}
    for root in roots:
        for path in root.rglob("*"):
            found[str(path)] = path.stat().st_size if path.is_file() else -1
    return found


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_bad_input_fails_closed(
    case: Case, fx: Fixtures, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    argv = case.setup(fx, work)
    before = listing(work, fx.root)
    capsys.readouterr()
    code = main(argv)
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, f"exit code {code}; stderr:\n{err}"
    assert "Traceback" not in err + out
    assert len(lines) == 1 and lines[0].startswith("csbp") and "error:" in lines[0], err
    assert case.expect in lines[0], lines[0]
    assert listing(work, fx.root) == before, "a failed command left files behind"
    assert not fx.sentinel.exists(), "a planted pickle ran code"


def test_the_table_is_large_enough() -> None:
    assert len(CASES) >= 122 and len({case.name for case in CASES}) == len(CASES)
