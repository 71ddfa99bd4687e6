"""``metrics.jsonl``, TensorBoard, the console line, the loss curve and the end-of-run summary, against
hand-written records and the kernel's own numbers.

Each test kills a mutant of :mod:`csbp.training.metrics` or :mod:`csbp.training.summary` that the other
tests let live (a mutation audit). No training runs: the writer and the summary get records directly.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from csbp.training import metrics as metrics_module
from csbp.training.metrics import MetricsWriter, peak_memory_bytes, plot_loss_curve, read_metrics, step_line
from csbp.training.summary import RunHistory, TrainSummary

RECORD = {"step": 1, "loss": 2.0, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 10.0, "peak_mem_bytes": 7}


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_each_number_goes_to_its_tensorboard_tag_and_a_resume_keeps_its_own_step(tmp_path: Path) -> None:
    """Tags by name (``train/loss`` is the loss, ...); a resume from step 2 replaces steps after 2 and
    keeps step 2 itself, as ``metrics.jsonl`` does (a mutant purging from step 2 dropped it)."""
    writer = MetricsWriter(tmp_path, enabled=True, start_step=0, total_steps=3)
    for step in (1, 2, 3):
        writer.log({**RECORD, "step": step, "loss": float(step), "val_nelbo": 4.0 + step, "val_ppl_bound": 60.0})
    writer.close()
    # TensorBoard reads event files in name order: <seconds>.<host>.<pid>.<writer count>. A resume in the
    # same second and process could sort first ("...10" < "...9") and read as the older run; a real resume
    # comes later, so the first run's file is dated back.
    for events in (tmp_path / "tb").glob("events.out.tfevents.*"):
        parts = events.name.split(".")
        parts[3] = "0000000001"
        events.rename(events.with_name(".".join(parts)))
    writer = MetricsWriter(tmp_path, enabled=True, start_step=2, total_steps=3)
    writer.log({**RECORD, "step": 3, "loss": 9.0})
    writer.close()
    seen = scalars(tmp_path)
    assert seen["train/loss"] == [(1, 1.0), (2, 2.0), (3, 9.0)]
    assert seen["train/lr"] == [(1, pytest.approx(1e-3)), (2, pytest.approx(1e-3)), (3, pytest.approx(1e-3))]
    assert seen["train/grad_norm"][0] == (1, 0.5) and seen["system/peak_mem_bytes"][0] == (1, 7.0)
    assert seen["val/nelbo"] == [(1, 5.0), (2, 6.0)] and seen["val/ppl_bound"][0] == (1, 60.0)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_a_record_is_on_disk_as_soon_as_it_is_logged(tmp_path: Path) -> None:
    """A crash (or a reader such as ``csbp compare``) must find every logged step without ``close``."""
    writer = MetricsWriter(tmp_path, enabled=True, start_step=0, total_steps=2)
    writer.log(RECORD)
    assert json.loads((tmp_path / "metrics.jsonl").read_text(encoding="utf-8")) == RECORD
    writer.close()


def test_a_disabled_writer_touches_nothing(tmp_path: Path) -> None:
    """Ranks other than 0 must not truncate rank 0's file or delete its TensorBoard events."""
    (tmp_path / "tb").mkdir()
    (tmp_path / "tb" / "events.out.tfevents.1").write_text("x")
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0, "val_loss": 1.0}) + "\n")
    writer = MetricsWriter(tmp_path, enabled=False, start_step=0, total_steps=2)
    writer.log(RECORD)
    writer.close()
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["events.out.tfevents.1", "metrics.jsonl", "tb"]
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 0, "val_loss": 1.0}]


def test_only_records_with_an_integer_step_are_read(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 1.0}\n{"note": "x"}\n{"step": "2"}\n[3]\n{"step": 3}\n')
    assert [r["step"] for r in read_metrics(path)] == [1, 3]


def test_the_step_line_has_the_gradient_norm_and_the_validation_numbers() -> None:
    record = {**RECORD, "val_loss": 2.5, "val_nelbo": 3.25, "tokens_per_s": 5.0}
    assert step_line(record) == "step 1: loss 2.0000 lr 1.000e-03 grad_norm 0.500 val_loss 2.5000 val_nelbo 3.2500"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_the_cpu_peak_memory_is_the_kernels_high_water_mark_in_bytes() -> None:
    """Linux's ``ru_maxrss`` is KiB: the number is ``VmHWM`` (kB) x 1024, not 1024 times less."""
    peak = peak_memory_bytes(torch.device("cpu"))
    status = Path("/proc/self/status").read_text().splitlines()
    high_water_kib = int(next(line for line in status if line.startswith("VmHWM:")).split()[1])
    assert peak == pytest.approx(high_water_kib * 1024, rel=0.05)


def test_the_loss_curve_draws_the_train_and_the_validation_losses(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    drawn: list[Any] = []
    monkeypatch.setattr(metrics_module, "save_figure", lambda figure, path: drawn.append(figure) or Path(path))
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": 0, "val_loss": 5.0}, {"step": 1, "loss": 4.0}, {"step": 2, "loss": None, "skipped": True},
            {"step": 3, "loss": 3.0, "val_loss": 3.5}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    plot_loss_curve(path, tmp_path / "loss.png")
    lines = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in drawn[0].axes[0].get_lines()}
    assert lines == {"train loss": ([1, 3], [4.0, 3.0]), "val loss": ([0, 3], [5.0, 3.5])}


def test_a_resumed_summary_reads_first_and_last_across_the_resume() -> None:
    """First numbers from the earlier invocation, last ones from this one; the NELBO line's perplexity
    bound is ``exp`` of the last NELBO; five skipped steps are all named, without ``...``."""
    records = [{"step": 1, "loss": 5.0}, {"step": 2, "loss": 4.0, "val_loss": 4.5, "val_nelbo": 3.0},
               {"step": 3, "loss": None, "skipped": True}, {"step": 4, "loss": 9.0}]
    earlier = RunHistory.from_records(records, up_to_step=3)
    assert earlier == RunHistory([5.0, 4.0], [(2, 4.5)], [(2, 3.0)], [3])
    summary = TrainSummary(Path("run"), 3, 6, 6, 1.0, [3.0, 2.0], [(6, 2.5)], None, None,
                           val_nelbos=[(6, 2.0)], skipped_steps=[4, 5, 6, 7], earlier=earlier)
    assert (summary.first_loss, summary.last_loss) == (5.0, 2.0)
    lines = summary.format().splitlines()
    assert "train loss  first 5.0000  last 2.0000" in lines
    assert "skipped     5 steps with no update (3, 4, 5, 6, 7; train.nan_policy: skip)" in lines
    assert "val loss    first 4.5000 (step 2)  last 2.5000 (step 6)" in lines
    bound = f"{math.exp(2.0):.2f}"
    assert f"val nelbo   first 3.0000  last 2.0000  (unclipped, nats/token; perplexity <= {bound})" in lines
    assert lines[-1] == "val_loss: 4.5000 -> 2.5000"
