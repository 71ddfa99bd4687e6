"""``--resume`` with a changed config (``csbp.training.resume_config``): what defines the trained
model is refused before anything runs, with one line naming the field and both values; a changed
``optim`` section, ``max_steps`` or batch applies from the resumed step (it used to be silently
replaced by the checkpoint's); layout and bookkeeping changes leave the run bit-identical."""

from __future__ import annotations

import math
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from csbp.config.schema import OptimSection
from csbp.data.artifact import open_artifact
from csbp.models.decoder import Decoder
from csbp.models.hf_io import export_hf_checkpoint
from csbp.training import launch_training, train
from csbp.training.input_identity import SAMPLE_BYTES, directory_fingerprint
from csbp.training.lr_schedule import build_lr_scheduler, lr_multiplier
from csbp.training.optim import apply_optim_config, build_optimizer
from csbp.training.preflight import check_run
from test_rope_config import _from, _qwen2_checkpoint
from test_training_run import copy_run, make_artifact, metric_rows, tiny_config, trajectory


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_artifact(tmp_path_factory.mktemp("data") / "art")


@pytest.fixture(scope="module")
def run_at_step2(artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("half") / "run"
    train(tiny_config(artifact), run_dir=run_dir, max_steps=2)
    return run_dir


def listing(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"objective.name": "mdlm", "objective.block_size": 32}, r"objective\.name: .* trained with objective\.name=bd3, the config sets mdlm"),
        ({"objective.block_size": 8}, r"objective\.block_size: .*\(step 2\) was trained with objective\.block_size=4, the config sets 8; .*fix: set objective\.block_size: 4"),
        ({"run.seed": 3}, r"run\.seed: .* trained with run\.seed=0, the config sets 3"),
        ({"topology.window": 8}, r"topology\.window: .* trained with topology\.window=null, the config sets 8"),
        ({"model.rope_scaling": {"type": "linear", "factor": 2.0}}, r"model\.rope_scaling: .* the config sets \{type: linear, factor: 2\.0\}"),
        ({"model.num_kv_heads": 4}, r"model\.num_kv_heads: .* trained with model\.num_kv_heads=2, the config sets 4"),
        ({"data.document_mask": True}, r"data\.document_mask: .* trained with data\.document_mask=false, the config sets true"),
        ({"train.precision": "fp64", "model.dtype": "float64"}, r"train\.precision: .* trained with train\.precision=fp32"),
    ],
)
def test_a_resume_refuses_what_defines_the_model(
    changes: dict[str, Any], message: str, run_at_step2: Path, artifact: Path, tmp_path: Path
) -> None:
    run_dir = copy_run(run_at_step2, tmp_path)
    before = listing(run_dir)
    with pytest.raises(ValueError, match=message) as caught:
        launch_training(tiny_config(artifact, **changes), run_dir=run_dir, resume=True)
    assert "\n" not in str(caught.value)
    assert listing(run_dir) == before  # failed before any work


def test_a_refused_change_is_reported_before_nothing_is_left_to_do(run_at_step2: Path, artifact: Path) -> None:
    """A finished run resumed with a changed field said only "nothing is left to do"; the change was
    refused only after max_steps was raised. The config comparison now comes first."""
    changed = tiny_config(artifact, **{"objective.block_size": 8})
    with pytest.raises(ValueError, match=r"^objective\.block_size: checkpoint .* \(step 2\) was trained with"):
        check_run(changed, run_dir=run_at_step2, resume=True, stop_step=2)
    with pytest.raises(ValueError, match=r"^--resume: .* is at step 2, nothing is left to do before step 2"):
        check_run(tiny_config(artifact), run_dir=run_at_step2, resume=True, stop_step=2)
    notes: list[str] = []  # an applied change is not announced before a refusal: the refusal is the one line
    with pytest.raises(ValueError, match=r"nothing is left to do before step 2"):
        check_run(tiny_config(artifact, **{"optim.lr": 1e-3}), run_dir=run_at_step2, resume=True, stop_step=2, warn=notes.append)
    assert notes == []


def test_changed_optimisation_applies_from_the_resumed_step(
    run_at_step2: Path, artifact: Path, tmp_path: Path
) -> None:
    run_dir = copy_run(run_at_step2, tmp_path)
    changes = {"optim.lr": 1e-3, "optim.warmup_steps": 1, "train.max_steps": 6, "train.micro_batch_size": 1}
    cfg = tiny_config(artifact, **changes)
    notes: list[str] = []
    check_run(cfg, run_dir=run_dir, resume=True, warn=notes.append)
    assert notes == [
        "resume: optim.lr 0.003 -> 0.001 from step 2 on",
        "resume: train.max_steps 4 -> 6 from step 2 on",
        "resume: train.micro_batch_size 2 -> 1 from step 2 on",
    ]
    train(cfg, run_dir=run_dir, resume=True, max_steps=3)
    step3 = next(row for row in metric_rows(run_dir) if row["step"] == 3)
    expected = 1e-3 * lr_multiplier(2, warmup_steps=1, max_steps=6, schedule="cosine", min_lr_ratio=0.1)
    assert math.isclose(step3["lr"], expected, rel_tol=1e-12)  # not the checkpoint's 3e-3 schedule


def test_apply_optim_config_replaces_the_restored_hyperparameters() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    old = OptimSection(lr=3e-3, warmup_steps=2, weight_decay=0.01)
    optimizer = build_optimizer(model, old)
    scheduler = build_lr_scheduler(optimizer, old, max_steps=10)
    for _ in range(3):
        model(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        scheduler.step()
    saved = (optimizer.state_dict(), scheduler.state_dict())
    restored_lrs = [group["lr"] for group in optimizer.param_groups]

    for new, max_steps in ((old, 10), (OptimSection(lr=1e-4, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.1), 20)):
        optimizer2 = build_optimizer(model, new)
        scheduler2 = build_lr_scheduler(optimizer2, new, max_steps=max_steps)
        optimizer2.load_state_dict(saved[0])
        scheduler2.load_state_dict(saved[1])
        apply_optim_config(optimizer2, scheduler2, new)
        lrs = [group["lr"] for group in optimizer2.param_groups]
        if new is old:  # an unchanged config keeps the restored values exactly
            assert lrs == restored_lrs
            continue
        multiplier = lr_multiplier(3, warmup_steps=0, max_steps=20, schedule="cosine", min_lr_ratio=0.1)
        assert lrs == [1e-4 * multiplier] * 2 and scheduler2.get_last_lr() == lrs
        assert [g["weight_decay"] for g in optimizer2.param_groups] == [0.1, 0.0]
        assert all(g["betas"] == (0.8, 0.9) and g["eps"] == 1e-6 for g in optimizer2.param_groups)
        scheduler2.step()
        assert optimizer2.param_groups[0]["lr"] == 1e-4 * lr_multiplier(
            4, warmup_steps=0, max_steps=20, schedule="cosine", min_lr_ratio=0.1
        )


def test_bookkeeping_changes_keep_the_resume_exact(artifact: Path, run_at_step2: Path, tmp_path: Path) -> None:
    free = {"train.log_every": 1, "train.keep_checkpoints": 5, "train.collective_timeout_s": 60.0, "run.name": "renamed"}
    full = tmp_path / "full"
    train(tiny_config(artifact), run_dir=full)
    run_dir = copy_run(run_at_step2, tmp_path)
    notes: list[str] = []
    cfg = tiny_config(artifact, **free)
    check_run(cfg, run_dir=run_dir, resume=True, warn=notes.append)
    assert notes == []
    train(cfg, run_dir=run_dir, resume=True)
    assert trajectory(run_dir) == trajectory(full)


def test_a_moved_init_from_resumes_and_a_different_one_is_refused(artifact: Path, tmp_path: Path) -> None:
    """``model.init_from`` is identified by its contents (``input_fingerprints``), like data files:
    a moved copy resumes, another checkpoint of the same shape does not."""
    vocab = open_artifact(artifact).vocab_size
    config = _qwen2_checkpoint(tmp_path / "hf", vocab).config
    run_dir = tmp_path / "run"
    train(tiny_config(artifact, **_from(tmp_path / "hf")), run_dir=run_dir, max_steps=1)
    shutil.move(tmp_path / "hf", tmp_path / "moved")
    check_run(tiny_config(artifact, **_from(tmp_path / "moved")), run_dir=run_dir, resume=True)
    other = Decoder(config, dtype=torch.float32, seed=6)  # the same shape, other weights
    export_hf_checkpoint(other, config, tmp_path / "other", extra_config={"max_position_embeddings": 32, "bos_token_id": 1})
    with pytest.raises(ValueError, match=r"^model\.init_from: .* the config sets .*other \(its contents differ\); ") as caught:
        check_run(tiny_config(artifact, **_from(tmp_path / "other")), run_dir=run_dir, resume=True)
    assert "\n" not in str(caught.value)


def test_an_init_from_overwritten_in_place_is_refused(artifact: Path, tmp_path: Path) -> None:
    """The same ``model.init_from`` path is fingerprinted too: an unchanged directory resumes, one
    re-exported in place with other weights of the same shape is refused in one line."""
    vocab = open_artifact(artifact).vocab_size
    config = _qwen2_checkpoint(tmp_path / "hf", vocab).config
    run_dir = tmp_path / "run"
    cfg = tiny_config(artifact, **_from(tmp_path / "hf"))
    train(cfg, run_dir=run_dir, max_steps=1)
    check_run(cfg, run_dir=run_dir, resume=True)
    shutil.rmtree(tmp_path / "hf")
    other = Decoder(config, dtype=torch.float32, seed=6)
    export_hf_checkpoint(other, config, tmp_path / "hf", extra_config={"max_position_embeddings": 32, "bos_token_id": 1})
    with pytest.raises(ValueError, match=r"^model\.init_from: .*hf has changed since checkpoint .*\(step 1\)") as caught:
        check_run(cfg, run_dir=run_dir, resume=True)
    assert "\n" not in str(caught.value)


def test_model_arch_next_to_init_from_is_no_change(artifact: Path, tmp_path: Path) -> None:
    """With ``model.init_from`` the architecture comes from the checkpoint (``model.arch`` is not
    read): a run of a Qwen2 checkpoint under the default ``arch: qwen3``, resumed with ``arch: qwen2``
    (what it trains), was refused as 'trained with model.arch=qwen3'."""
    _qwen2_checkpoint(tmp_path / "hf", open_artifact(artifact).vocab_size)
    run_dir = tmp_path / "run"
    train(tiny_config(artifact, **_from(tmp_path / "hf", **{"model.arch": "qwen3"})), run_dir=run_dir, max_steps=1)
    notes: list[str] = []
    check_run(tiny_config(artifact, **_from(tmp_path / "hf", **{"model.arch": "qwen2"})), run_dir=run_dir,
              resume=True, warn=notes.append)
    assert notes == []


def test_the_run_records_the_init_from_checkpoints_arch(artifact: Path, tmp_path: Path) -> None:
    """RUN/config.yaml (and each checkpoint's config) recorded the recipe's ``model.arch: qwen3`` for a
    run of a Qwen2 checkpoint, misstating the model it trains; it records ``qwen2`` now, and the run
    still resumes from the config as written and from the recorded one."""
    from csbp.config import load_config

    _qwen2_checkpoint(tmp_path / "hf", open_artifact(artifact).vocab_size)
    run_dir = tmp_path / "run"
    written = tiny_config(artifact, **_from(tmp_path / "hf", **{"model.arch": "qwen3"}))
    train(written, run_dir=run_dir, max_steps=1)
    recorded = load_config(run_dir / "config.yaml")
    assert (recorded.model.arch, recorded.model.init_from) == ("qwen2", written.model.init_from)
    for cfg, steps in ((written, 2), (recorded, 3)):
        train(cfg, run_dir=run_dir, resume=True, max_steps=steps)
        assert load_config(run_dir / "config.yaml").model.arch == "qwen2"
    assert "arch: qwen2" in (run_dir / "checkpoints" / "step_0000003" / "trainer_state.json").read_text()


def test_a_directory_fingerprint_reads_only_both_ends_of_each_file(tmp_path: Path) -> None:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    (directory / "config.json").write_text("{}")
    weights = bytearray(3 * SAMPLE_BYTES)
    (directory / "model.safetensors").write_bytes(weights)
    first = directory_fingerprint(directory)
    shutil.copytree(directory, tmp_path / "copy")
    assert directory_fingerprint(tmp_path / "copy") == first
    weights[SAMPLE_BYTES + 5] = 1  # the unread middle
    (directory / "model.safetensors").write_bytes(weights)
    assert directory_fingerprint(directory) == first
    for position in (5, len(weights) - 5):  # either end
        changed = bytearray(weights)
        changed[position] = 1
        (directory / "model.safetensors").write_bytes(changed)
        assert directory_fingerprint(directory) != first
    assert directory_fingerprint(tmp_path / "none") is None


def test_a_refused_dflash_resume_offers_objective_dflash_init_from() -> None:
    # The fix line offered `csbp export RUN --out DIR, then model.init_from: DIR`, but csbp export
    # refuses a drafter checkpoint and a dflash config refuses model.init_from: a dead end. A drafter
    # export starts a new run through objective.dflash.init_from (tests/test_dflash_init_from.py).
    import yaml

    from csbp.config import config_from_dict
    from csbp.training.resume_config import resume_changes
    from test_config import dflash_changes, with_changes

    saved = config_from_dict(with_changes(dflash_changes()))
    changed = config_from_dict(with_changes(dflash_changes() | {"objective.dflash.conv_kernel_size": 2}))
    with pytest.raises(ValueError, match=r"objective\.dflash\.conv_kernel_size: .*fix: set objective\.dflash\."
                       r"conv_kernel_size: 0 to resume, or start a new run directory, from scratch or, for the same drafter "
                       r"architecture, from an export of this one: "
                       r"csbp dflash export --run-dir RUN --out DIR, then objective\.dflash\.init_from: DIR\)$") as caught:
        resume_changes(yaml.safe_dump(saved.model_dump(mode="json")), changed, Path("ckpt"), 2)
    assert "model.init_from" not in str(caught.value)


def test_chunking_capture_and_validation_size_may_change_on_resume() -> None:
    """They were refused as fields that "define the trained model": the loss's chunking (so a resume that ran
    out of memory could not lower it), the DFlash target's capture layout and its validation's size."""
    import yaml

    from csbp.config import config_from_dict
    from csbp.training.resume_config import resume_changes
    from test_config import dflash_changes, with_changes

    saved = config_from_dict(with_changes(dflash_changes()))
    free = {"objective.ce_chunk_rows": 64, "objective.dflash.target_capture": "replicated",
            "objective.dflash.eval_prompts": 1, "objective.dflash.eval_new_tokens": 8}
    for name, value in free.items():
        changed = config_from_dict(with_changes(dflash_changes() | {name: value}))
        assert flat_value(changed, name) != flat_value(saved, name)
        assert resume_changes(yaml.safe_dump(saved.model_dump(mode="json")), changed, Path("ckpt"), 2) == [], name


def flat_value(cfg: object, name: str) -> object:
    from csbp.training.resume_config import flat_config

    return flat_config(cfg.model_dump(mode="json"))[name]  # type: ignore[attr-defined]


def saved_yaml(changes: dict[str, Any]) -> str:
    """The ``config_yaml`` a checkpoint of the demo recipe with ``changes`` records."""
    import yaml

    from csbp.config import config_from_dict
    from test_config import with_changes

    return yaml.safe_dump(config_from_dict(with_changes(changes)).model_dump(mode="json"))


def demo_with(changes: dict[str, Any]) -> Any:
    from csbp.config import config_from_dict
    from test_config import with_changes

    return config_from_dict(with_changes(changes))


@pytest.mark.parametrize(
    "changes",
    [
        {"data.seq_len": 512},
        {"model.rope_theta": 10000.0},
        {"model.rms_norm_eps": 1e-5},
        {"model.tie_embeddings": True},
        {"model.intermediate_size": 1024},
        {"objective.t_min": 0.2},
        {"data.reset_positions": True, "data.document_mask": True},
    ],
)
def test_each_field_that_defines_the_trained_model_is_refused(changes: dict[str, Any]) -> None:
    """The module's third list, field by field (mutation audit: ``data.seq_len`` added to the free fields
    survived, since no resume test changed it)."""
    from csbp.training.resume_config import resume_changes

    name = next(iter(changes))
    with pytest.raises(ValueError, match=rf"^{re.escape(name)}: checkpoint ckpt \(step 2\) was trained with ") as caught:
        resume_changes(saved_yaml({}), demo_with(changes), Path("ckpt"), 2)
    assert "\n" not in str(caught.value)


def test_leaving_fp64_is_refused_as_entering_it_is() -> None:
    """fp64 keeps float64 master weights: a resume in fp32 or bf16 would round them (mutation audit:
    refusing only a change *to* fp64 survived)."""
    from csbp.training.resume_config import resume_changes

    fp64 = saved_yaml({"train.precision": "fp64", "model.dtype": "float64"})
    for precision in ("fp32", "bf16"):
        with pytest.raises(ValueError, match=rf"^train\.precision: .* trained with train\.precision=fp64, the config "
                           rf"sets {precision}; .*\(fix: set train\.precision: fp64 to resume"):
            resume_changes(fp64, demo_with({"train.precision": precision}), Path("ckpt"), 2)
    notes = resume_changes(saved_yaml({"train.precision": "bf16"}), demo_with({}), Path("ckpt"), 2)
    assert notes == ["resume: train.precision bf16 -> fp32 from step 2 on"]


def test_a_changed_directory_without_a_recorded_fingerprint_says_so() -> None:
    """A checkpoint older than the input fingerprints cannot tell a moved ``model.init_from`` from another
    one: the refusal says no fingerprint was recorded, not that the contents differ (mutation audit)."""
    from csbp.training.resume_config import resume_changes

    with pytest.raises(ValueError, match=r"the config sets /b \(no content fingerprint recorded\); "):
        resume_changes(saved_yaml({"model.init_from": "/a"}), demo_with({"model.init_from": "/b"}), Path("ckpt"), 2)
