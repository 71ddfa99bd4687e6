"""Numbers of the training loop: gradient accumulation equals the big batch, validation scores
each row at most once, and a skipped non-finite last step still validates and checkpoints.

A tiny decoder (hidden 32, 2 layers) on tiny artifacts (seq_len 32, a trained 300-id BPE), one CPU
process.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from csbp.data import open_artifact
from csbp.data.prepare import PrepareConfig, prepare_artifact
from csbp.training import train
from csbp.training.metrics import METRICS_FILE, read_metrics
from csbp.training.preflight import check_run
from csbp.training.step import StepRunner
from csbp.training.summary import RunHistory, TrainSummary
from test_training_run import WORDS, make_artifact, metric_rows, tiny_config

AR_FP64 = {
    "objective.name": "ar",
    "objective.block_size": None,
    "train.precision": "fp64",
    "model.dtype": "float64",
    "train.save_every": 0,
}


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_artifact(tmp_path_factory.mktemp("data") / "art")


@pytest.fixture(scope="module")
def prompt_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Prompt/completion records: only completions are supervised, so rows supervise 0 to ~16 tokens."""
    root = tmp_path_factory.mktemp("prompts")
    generator = torch.Generator().manual_seed(1)

    def words(low: int, high: int) -> str:
        count = int(torch.randint(low, high, (1,), generator=generator))
        return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (count,), generator=generator).tolist())

    records = [json.dumps({"prompt": words(3, 25), "completion": words(1, 12)}) for _ in range(40)]
    (root / "records.jsonl").write_text("\n".join(records) + "\n", encoding="utf-8")
    out = root / "art"
    prepare_artifact(
        PrepareConfig(inputs=(root / "records.jsonl",), out_dir=out, seq_len=32, train_tokenizer=True, vocab_size=300)
    )
    return out


def test_gradient_accumulation_equals_the_big_batch(prompt_artifact: Path, tmp_path: Path) -> None:
    """4 rows in one micro-batch and the same rows as 4 micro-batches of 1, whose supervised token
    counts differ: every micro-step is normalised by the step's total count, so the losses and
    gradient norms agree (float64; ar has no noise draw that depends on the micro-step)."""
    split = open_artifact(prompt_artifact).split("train")
    counts = np.asarray(split.loss_mask).reshape(split.num_rows, -1).sum(1)
    assert len(set(counts.tolist())) > 3  # unequal token counts per row, some rows with none
    runs = {}
    for name, (rows, accum) in {"big": (4, 1), "accumulated": (1, 4)}.items():
        cfg = tiny_config(
            prompt_artifact,
            **AR_FP64,
            **{"train.max_steps": 3, "train.eval_every": 0, "train.micro_batch_size": rows, "train.grad_accum": accum},
        )
        train(cfg, run_dir=tmp_path / name)
        runs[name] = [(r["loss"], r["grad_norm"]) for r in metric_rows(tmp_path / name)]
    assert len(runs["big"]) == 3
    for big, accumulated in zip(runs["big"], runs["accumulated"], strict=True):
        assert accumulated == pytest.approx(big, rel=1e-12, abs=0.0)


def test_validation_rows_past_the_val_split_are_refused(artifact: Path) -> None:
    """The unshuffled validation loader wraps around past the split's end: 12 row slots over 10 rows
    would score 2 rows twice (val_loss 5.70997 instead of 5.70671 on this artifact). Refused."""
    val_rows = open_artifact(artifact).split("val").num_rows
    assert val_rows == 10
    check_run(tiny_config(artifact, **{"train.micro_batch_size": 5, "train.eval_batches": 2}))  # exactly 10
    with pytest.raises(ValueError, match=r"train\.eval_batches: 3 x micro_batch_size 4 x topology\.dp 1 = 12 "
                       r"validation rows per pass, but the val split has only 10: .*\(fix: set train\.eval_batches <= 2\)"):
        check_run(tiny_config(artifact, **{"train.micro_batch_size": 4, "train.eval_batches": 3}))
    with pytest.raises(ValueError, match=r"topology\.dp 2 = 12 .*eval_batches <= 2"):
        check_run(tiny_config(artifact, **{"topology.dp": 2, "train.micro_batch_size": 2, "train.eval_batches": 3}))
    with pytest.raises(ValueError, match=r"fix: lower train\.micro_batch_size or topology\.dp"):
        check_run(tiny_config(artifact, **{"train.micro_batch_size": 11, "train.eval_batches": 1}))
    check_run(tiny_config(artifact, **{"train.micro_batch_size": 11, "train.eval_every": 0}))  # no validation


def test_a_skipped_last_step_still_validates_and_checkpoints(
    artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = StepRunner.train_step

    def poisoned(self: StepRunner, batches: list, step: int):  # type: ignore[no-untyped-def]
        result = real(self, batches, step)
        return type(result)(**{**result.__dict__, "loss": math.nan}) if step == 4 else result

    monkeypatch.setattr(StepRunner, "train_step", poisoned)
    cfg = tiny_config(artifact, **{"train.nan_policy": "skip", "train.save_every": 0, "train.eval_every": 3})
    summary = train(cfg, run_dir=tmp_path / "run")
    assert summary.end_step == 4 and len(summary.losses) == 3
    assert [step for step, _ in summary.val_losses] == [0, 3, 4]  # the end-of-run validation ran
    assert summary.checkpoint is not None and summary.checkpoint.name == "step_0000004"
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_0000004"
    rows = metric_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]  # 0: the untrained validation; 4: skipped, recorded
    assert rows[-1]["skipped"] is True and rows[-1]["loss"] is None and rows[-1]["val_loss"] is not None
    # the summary's "train loss last" is step 3's: it said nothing of step 4 having changed nothing
    line = "skipped     1 step with no update (4; train.nan_policy: skip)"
    assert summary.skipped_steps == [4] and line in summary.format().splitlines()
    earlier = RunHistory.from_records(read_metrics(tmp_path / "run" / METRICS_FILE), up_to_step=4)
    assert earlier.skipped_steps == [4]  # a resumed run's summary counts them too
    resumed = TrainSummary(tmp_path, 4, 11, 11, 1.0, [1.0], [], None, None, skipped_steps=list(range(5, 12)),
                           earlier=earlier)
    assert "skipped     8 steps with no update (4, 5, 6, 7, 8, ...; train.nan_policy: skip)" in resumed.format()


def test_tensorboard_gets_the_dflash_validation_numbers(tmp_path: Path) -> None:
    """The served acceptance length is the number a DFlash run is judged by: TensorBoard shows it."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from csbp.training.metrics import MetricsWriter

    writer = MetricsWriter(tmp_path, enabled=True, start_step=0, total_steps=1)
    record = {"step": 1, "loss": 2.0, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 10.0, "val_loss": 2.5}
    writer.log({**record, "val_acceptance_length": 1.75, "val_selector_loss": 0.25, "val_candidate_recall": 0.5})
    writer.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"val/acceptance_length", "val/selector_loss", "val/candidate_recall", "val/loss"} <= tags
    assert events.Scalars("val/acceptance_length")[0].value == 1.75


def test_compare_refuses_validation_rows_past_the_val_split(artifact: Path, tmp_path: Path) -> None:
    """``csbp compare`` validates with ``train.eval_every`` off in its layouts, so the rule is its own."""
    from csbp.compare import CompareOptions
    from csbp.compare.runner import plan_layouts

    options = CompareOptions(layouts=("data",), budget_s=1.0, nproc=1, out_dir=tmp_path / "cmp", points=4)  # 4 steps
    fits = tiny_config(artifact, **{"train.eval_every": 0, "train.micro_batch_size": 5, "train.eval_batches": 2})
    assert [run.layout for run in plan_layouts(fits, options)[0]] == ["data"]  # round 1
    wraps = tiny_config(artifact, **{"train.eval_every": 0, "train.micro_batch_size": 4, "train.eval_batches": 3})
    with pytest.raises(ValueError, match=r"= 12 validation rows per pass, but the val split has only 10"):
        plan_layouts(wraps, options)
