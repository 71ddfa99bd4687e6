"""The benchmarks keep every timed repeat and say when a ratio is within their spread.

They once reported only the median of ``--repeats`` steps, so a 1.05x ratio and the machine's noise
read the same. Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_bench_spread.py -q``
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest

from csbp.bench.common import (
    OVERLAP_COLUMNS,
    Column,
    StepMeasurement,
    StepSeries,
    format_ratio_table,
    repeats_of,
)
from csbp.bench.dflash_target import TargetPassRecord, format_target_table
from csbp.bench.kernel_summary import format_verdicts, shape_verdicts, target_line
from csbp.bench.plot import speedup_range
from csbp.bench.spread import NOISE_NOTE, format_spread, ratio_range, spread_percent, within_noise


def test_spread_and_overlap() -> None:
    assert spread_percent([0.9, 1.0, 1.1]) == pytest.approx(10.0)
    assert math.isnan(spread_percent([1.0]))
    assert format_spread([0.9, 1.0, 1.1]) == "±10%" and format_spread([1.0]).strip() == "-"
    assert within_noise([1.0, 1.2], [1.1, 1.3])
    assert not within_noise([1.0, 1.05], [1.1, 1.3])
    assert not within_noise([1.0], [1.0])  # one repeat: no spread to be within
    assert ratio_range([1.0, 2.0], [4.0, 8.0]) == (0.125, 0.5)


def test_step_series_repeats_survive_a_worker_result() -> None:
    series = StepSeries()
    for seconds in (0.3, 0.1, 0.2):
        series.add(StepMeasurement(seconds=seconds))
    result = {"step_time_s": series.median_s(), **series.repeats_s(), "serial_repeat_0": 9.0}
    assert repeats_of(result) == (0.3, 0.1, 0.2)
    assert repeats_of(result, "serial_repeat_") == (9.0,)


@dataclass(frozen=True)
class _Row:
    layout: str
    seq_len: int
    step_time_s: float
    step_times_s: tuple[float, ...]
    serialized_step_time_s: float | None = None
    overlap_ratio: float | None = None
    serialized_step_times_s: tuple[float, ...] = ()


COLUMNS = [
    Column("layout", "layout", "<6"),
    Column("step s", "step_time_s", ">8.3f", vs_cp=True, times="step_times_s", spread=True),
]


def test_the_table_marks_a_ratio_within_the_spread_and_not_a_clear_one() -> None:
    rows = [
        _Row("cp", 1, 1.00, (0.95, 1.00, 1.05)),
        _Row("bp", 1, 1.02, (0.98, 1.02, 1.10)),  # overlaps cp: noise
        _Row("csbp", 1, 0.50, (0.49, 0.50, 0.51)),  # clear speedup
    ]
    lines = format_ratio_table(rows, ("seq_len",), COLUMNS).splitlines()
    assert "±" in lines[0]
    cp, bp, csbp = lines[2:5]
    assert "±5%" in cp and cp.rstrip().endswith("1.00")
    assert bp.rstrip().endswith("1.02~")
    assert csbp.rstrip().endswith("0.50") and "~" not in csbp
    assert lines[-1] == NOISE_NOTE


def test_no_note_without_a_noisy_ratio_and_none_for_single_repeats() -> None:
    rows = [_Row("cp", 1, 1.0, (1.0,)), _Row("bp", 1, 1.01, (1.01,))]
    table = format_ratio_table(rows, ("seq_len",), COLUMNS)
    assert "~" not in table and NOISE_NOTE not in table


def test_the_overlap_ablation_marks_a_serial_ratio_within_the_spread() -> None:
    noisy = _Row("cp", 1, 1.0, (0.9, 1.1), 1.05, 1.0 / 1.05, (1.0, 1.2))
    clear = _Row("cp", 2, 1.0, (0.95, 1.05), 2.0, 0.5, (1.9, 2.1))
    lines = format_ratio_table([noisy, clear], ("seq_len",), COLUMNS + OVERLAP_COLUMNS).splitlines()
    assert lines[2].endswith("~") and not lines[3].endswith("~")


def test_the_attention_tables_time_per_flop_ratio_is_marked_by_its_seconds_per_flop() -> None:
    """``bench attention``'s ``s/TFLOP`` ``x cp`` (time per allowed FLOP, a rate over different work) was
    never marked: BP-only's 0.91x read as more efficient per FLOP although its seconds per FLOP overlap
    CP-only's over the repeats."""
    from csbp.bench.attention import AttentionRecord, format_table

    def record(layout: str, flops: float, times: tuple[float, ...]) -> AttentionRecord:
        step = sorted(times)[1]
        return AttentionRecord(layout, 4, 1, 1024, 16, 4, None, "collective", step, 0, int(flops), 1 << 20,
                               step / (flops / 1e9), step_times_s=times)

    cp = record("cp", 1e9, (1.0, 1.1, 1.2))  # 1.0-1.2 ns per FLOP
    bp = record("bp", 2.5e9, (2.4, 2.5, 2.75))  # 0.96-1.1 ns per FLOP: overlaps; the step time does not
    line = format_table([cp, bp]).splitlines()[3]
    step_ratio, flop_ratio = line.split()[4], line.split()[-1]
    assert (step_ratio, flop_ratio) == ("2.27", "0.91~")


def test_the_kernel_verdict_says_when_the_speedup_is_noise() -> None:
    def row(form: str, time_s: float, times: list[float]) -> dict[str, object]:
        return {"seq_len": 64, "block_size": 8, "backend": "tiles", "form": form, "time_s": time_s, "times_s": times,
                "vs_dense": 0.5, "diagonal": "sdpa" if form == "decomposed" else "-", "clean": "generic"}

    noisy = format_verdicts(shape_verdicts([row("mixed", 1.0, [0.9, 1.1]), row("decomposed", 0.95, [0.9, 1.0])]))
    assert "no measurable difference" in noisy
    clear = format_verdicts(shape_verdicts([row("mixed", 1.0, [0.9, 1.1]), row("decomposed", 0.5, [0.45, 0.55])]))
    assert "no measurable difference" not in clear
    legacy = [{k: v for k, v in r.items() if k != "times_s"} for r in (row("mixed", 1.0, []), row("decomposed", 0.5, []))]
    assert "= 2.00x" in format_verdicts(shape_verdicts(legacy))  # older JSON without repeats still reads


def _kernel_row(form: str, times: list[float], pairs: int, **extra: object) -> dict[str, object]:
    """A ``bench kernels --json`` row at L = 16384, B = 128 (inside the kernel targets' range)."""
    return {"seq_len": 16384, "block_size": 128, "backend": "sdpa" if form == "dense" else "flex", "form": form,
            "time_s": sorted(times)[len(times) // 2], "times_s": times, "useful_pairs": pairs,
            "diagonal": "sdpa" if form == "decomposed" else "-", "clean": "pieces" if form == "decomposed" else "-",
            **extra}


def test_the_kernel_summary_marks_a_rate_within_dense_rates_noise() -> None:
    """``x dense`` (a rate per allowed pair over dense's) was never marked ``~``: a 0.95x whose repeats
    overlap dense's per pair read like a measured slowdown, in the table, the verdict and #8's target line."""
    from csbp.bench.kernel_summary import TARGET_NOISE_NOTE

    dense = _kernel_row("dense", [1.9, 2.0, 2.1], 1000, vs_dense=1.0)
    # half the pairs: seconds per pair 1.9e-3..2.2e-3 overlap dense's 1.9e-3..2.1e-3 -> ~
    mixed = _kernel_row("mixed-ag", [0.95, 1.05, 1.1], 500, vs_dense=0.95)
    # seconds per pair 1.2e-3..1.3e-3: clearly faster than dense per pair -> no mark
    decomposed = _kernel_row("decomposed", [0.6, 0.62, 0.65], 500, vs_dense=1.6)
    verdict = shape_verdicts([dense, mixed, decomposed])[0]
    assert verdict.mixed_vs_dense_within_noise and not verdict.decomposed_vs_dense_within_noise
    line = format_verdicts([verdict])
    assert "fastest mixed (mixed-ag) 0.95x~ dense's rate;" in line and "1.60x dense's rate" in line
    targets = target_line([dense, mixed, decomposed])
    assert targets.startswith("targets at L = 16384: worst mixed 0.95x~ and decomposed 1.60x dense's rate")
    assert targets.endswith(TARGET_NOISE_NOTE)
    # the decomposed/mixed speedup at the target's B = 128 is clear: unmarked
    assert "decomposed/mixed worst 1.69x (>= 1.0x), at B=128 1.69x (>= 1.2x)" in targets
    legacy = [{k: v for k, v in row.items() if k != "times_s"} for row in (dense, mixed, decomposed)]
    assert "~" not in target_line(legacy)  # older JSON without repeats: nothing to be within


def test_the_kernel_table_marks_x_dense_and_the_json_agrees_with_the_summary(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from csbp.bench.kernel_summary import vs_dense_within_noise
    from csbp.bench.kernels import KernelRecord
    from csbp.bench.kernels_cli import format_row
    from csbp.cli.main import main

    def record(vs_dense: float, noisy: bool) -> KernelRecord:
        return KernelRecord("cpu", "float32", 64, 8, "tiles", "mixed", "-", "-", 1.0, 10, 1.0, vs_dense, math.nan,
                            0.0, 0, times_s=(0.9, 1.0, 1.1), vs_dense_within_noise=noisy)

    assert " 0.97~ " in format_row(record(0.97, True)) and " 0.50  " in format_row(record(0.5, False))
    out = tmp_path / "k.json"
    assert main(["bench", "kernels", "--seq-lens", "32", "--block-sizes", "8", "--repeats", "3", "--warmup", "0",
                 "--num-heads", "2", "--num-kv-heads", "1", "--head-dim", "8", "--diagonals", "sdpa",
                 "--clean-kernels", "generic", "--no-op-count", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    dense = next(r for r in rows if r["form"] == "dense")
    for row in rows:  # the record's mark is the summary's definition, recomputed from the JSON's repeats
        assert row["vs_dense_within_noise"] == (row is not dense and vs_dense_within_noise(row, dense))


def test_the_target_pass_table_marks_a_time_ratio_within_the_spread() -> None:
    records = [
        TargetPassRecord(64, "replicated", 1.0, 10, 0.1, 1.0, 0, (0.9, 1.0, 1.1)),
        TargetPassRecord(64, "sharded", 0.98, 5, 0.05, 0.5, 8, (0.95, 0.98, 1.0)),
    ]
    table = format_target_table(records)
    assert " 0.980~" in table and table.endswith(NOISE_NOTE)


def test_the_target_pass_time_is_the_median_of_each_steps_slowest_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """``time_s`` was the slowest rank's median while ``times_s`` (and the ``~`` marks) held each step's
    slowest rank: with rank 0 slow in step 0 and rank 1 in step 2, every rank's median was 1 s although
    two of the three steps took 9 s. Now ``time_s`` is the median of ``times_s`` on both sides of
    ``time_x``."""
    import csbp.bench.dflash_target as target
    from csbp.models.config import DecoderConfig

    ranks = [
        {"replicated": (100, 0, 0, [9.0, 1.0, 1.0]), "sharded": (60, 0, 8, [2.0, 2.0, 2.0])},
        {"replicated": (100, 0, 0, [1.0, 1.0, 9.0]), "sharded": (40, 0, 8, [2.0, 3.0, 2.0])},
    ]
    monkeypatch.setattr(target, "run_local", lambda *args, **kwargs: ranks)
    config = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                           num_kv_heads=2, head_dim=8)
    replicated, sharded = target.run_target_pass_bench([64], nproc=2, config=config)
    assert replicated.times_s == (9.0, 1.0, 9.0) and replicated.time_s == 9.0  # was 1.0
    assert sharded.times_s == (2.0, 3.0, 2.0) and sharded.time_s == 2.0
    assert sharded.attention_pairs == 60 and sharded.bytes_moved == 8
    assert " 0.222~ " in target.format_target_table([replicated, sharded])  # 2 / 9 (was 2 / 1), within the range


def test_the_speedup_plot_range_spans_every_pair_of_repeats() -> None:
    rows = [
        {"layout": "cp", "seq_len": 64, "step_time_s": 2.0, "step_times_s": [1.8, 2.0, 2.2]},
        {"layout": "csbp", "seq_len": 64, "step_time_s": 1.0, "step_times_s": [0.9, 1.0, 1.1]},
        {"layout": "bp", "seq_len": 64, "step_time_s": 1.0},  # an older record without repeats
    ]
    assert speedup_range(rows, "csbp", None, None) == ([64], [pytest.approx(1.8 / 1.1)], [pytest.approx(2.2 / 0.9)])
    assert speedup_range(rows, "bp", None, None) == ([64], [2.0], [2.0])


@pytest.mark.multiprocess
def test_bench_attention_records_every_repeat(tmp_path: Path) -> None:
    from csbp.cli.main import main

    out = tmp_path / "attention.json"
    argv = ["bench", "attention", "--nproc", "2", "--seq-lens", "64", "--block-size", "8", "--layouts", "cp", "csbp",
            "--repeats", "3", "--warmup", "0", "--num-heads", "2", "--num-kv-heads", "1", "--head-dim", "8",
            "--ablate-overlap", "--json", str(out)]
    assert main(argv) == 0
    for record in json.loads(out.read_text()):
        assert len(record["step_times_s"]) == 3 and len(record["serialized_step_times_s"]) == 3
        assert record["step_time_s"] == sorted(record["step_times_s"])[1]


SMALL = ["--seq-lens", "64", "--repeats", "1"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "kernels", "--warmup", "-1", *SMALL, "--block-sizes", "8"], "--warmup: -1 must be >= 0"),
        (["bench", "attention", "--warmup", "-1", *SMALL, "--nproc", "2", "--block-size", "8", "--layouts", "cp"],
         "--warmup: -1 must be >= 0"),
        (["bench", "attention", "--nproc", "1", "--seq-lens", "64", "--block-size", "8"], "nproc must be >= 2"),
    ],
)
def test_bad_repeat_counts_and_one_process_fail_before_any_work(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--warmup -1`` once crashed (``kernels``: IndexError; ``attention``: a worker's StatisticsError)
    or silently timed fewer repeats; ``bench attention --nproc 1`` blamed ``replicate_clean_prefix``."""
    from csbp.cli.main import main

    assert main(argv) != 0
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""


@pytest.mark.parametrize("mode", ["--target-pass", "--teacher-rows"])
def test_a_bad_last_length_is_refused_before_the_first_runs(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``bench dflash --target-pass|--teacher-rows --seq-lens 64 65`` ran 64 and only then refused 65."""
    import csbp.bench.dflash_target as target
    import csbp.bench.dflash_teacher as teacher
    from csbp.cli.main import main

    launched: list[object] = []
    for module in (target, teacher):
        monkeypatch.setattr(module, "run_local", lambda *args, **kwargs: launched.append(args) or [])
    assert main(["bench", "dflash", mode, "--nproc", "2", "--seq-lens", "64", "65", "--anchors", "4"]) != 0
    assert launched == []


def test_a_single_repeat_is_one_repeat_in_every_header(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--repeats 1`` printed "median of 1 repeats" (and ``--target-pass`` "of 1 steps") in the header
    of every benchmark; counted nouns go through ``csbp.wording.counted``."""
    import csbp.bench.attention as attention
    import csbp.bench.dflash_cli as dflash_cli
    import csbp.bench.dflash_target as target
    import csbp.bench.train_cli as train_cli
    from csbp.cli.main import main

    headers: list[str] = []

    def fake(*args: object, header: str | None = None, **kwargs: object) -> list:
        headers.append(header or "")
        raise KeyboardInterrupt  # stop before anything runs: csbp exits 130 ("csbp: interrupted")

    monkeypatch.setattr(attention, "run_attention_bench", fake)
    monkeypatch.setattr(train_cli, "run_train_bench", fake)
    monkeypatch.setattr(dflash_cli, "run_dflash_bench", fake)
    one = ["--seq-lens", "64", "--repeats", "1"]
    for argv in (["bench", "attention", "--nproc", "2", "--block-size", "8", "--layouts", "cp", *one],
                 ["bench", "train", "--nproc", "2", "--block-size", "8", "--layouts", "cp", *one],
                 ["bench", "dflash", "--nproc", "2", "--block-size", "8", "--layouts", "cp", *one]):
        assert main(argv) == 130
    assert len(headers) == 3 and all("median of 1 repeat," in h for h in headers), headers

    monkeypatch.setattr(target, "run_target_pass_bench", lambda *args, **kwargs: [])
    monkeypatch.setattr(target, "format_target_table", lambda records: "")
    assert main(["bench", "dflash", "--target-pass", "--nproc", "2", *one]) == 0
    assert main(["bench", "kernels", "--block-sizes", "8", "--num-heads", "2", "--num-kv-heads", "1",
                 "--head-dim", "8", "--diagonals", "sdpa", "--clean-kernels", "generic", "--no-op-count", *one]) == 0
    out = capsys.readouterr().out
    assert "median of 1 step," in out and "median of 1 repeat," in out and " 1 repeats" not in out
    assert " 1 steps" not in out
