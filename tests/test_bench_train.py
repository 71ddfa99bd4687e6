"""``csbp bench train``: a smoke run of full training steps in every layout, plus the table and plot.

The smoke run (seq len 64, block 16, 2 gloo processes, bd3, one warmup and one measured step) goes
through the command itself, so the JSON and PNG outputs are checked as a user gets them. Beyond
"it runs", it checks properties the layouts must have: the same step-0 loss in every layout (same
weights and batch; float32, 1e-5 relative), no attention traffic in BP-only (the clean prefix is
replicated), and less attention traffic in CSBP than in CP-only (only clean rows move).
Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_bench_train.py -q``
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from csbp.bench.plot import plot_speedups, speedup_series
from csbp.bench.train_bench import TrainRecord, run_train_bench
from csbp.bench.train_cli import register_train_bench
from csbp.bench.train_tables import format_table

RECORD_KEYS = {
    "objective",
    "layout",
    "cp",
    "bp",
    "seq_len",
    "block_size",
    "nproc",
    "samples",
    "step_time_s",
    "tokens_per_s",
    "peak_mem_bytes",
    "attention_bytes_per_rank",
    "gradient_bytes_per_rank",
    "loss_step0",
    "activation_checkpointing",
    "compile",
    "recompute_bytes_per_rank",
    # fastest repeat and model shape, for `csbp plan calibrate`
    "step_time_min_s",
    "step_times_s",
    "bytes_step",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "vocab_size",
    "dtype",
    "transport",
    "doc_length",
    "backend",
    "diagonal",
    "clean",
}


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="csbp bench")
    register_train_bench(parser.add_subparsers(dest="bench_command"))
    return parser.parse_args(argv)


@pytest.mark.multiprocess
def test_smoke_run_writes_records_table_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "bench" / "train.json"
    args = parse(
        [
            "train",
            "--seq-lens",
            "64",
            "--nproc",
            "2",
            "--repeats",
            "1",
            "--warmup",
            "1",
            "--objectives",
            "bd3",
            "--layouts",
            "cp",
            "csbp",
            "bp",
            "--activation-checkpointing",
            "none",
            "full",
            "--json",
            str(out),
        ]
    )
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "x cp" in printed and f"wrote {out}" in printed
    assert "activation checkpointing: peak memory per rank" in printed

    everything = json.loads(out.read_text())
    assert [(r["layout"], r["activation_checkpointing"]) for r in everything] == [
        (layout, mode) for layout in ("cp", "csbp", "bp") for mode in ("none", "full")
    ]
    records = [r for r in everything if r["activation_checkpointing"] == "none"]
    for plain, checkpointed in zip(records, everything[1::2], strict=True):
        # same step, same first-pass traffic; the recompute repeats the forward's attention collectives
        assert checkpointed["loss_step0"] == plain["loss_step0"]
        assert checkpointed["attention_bytes_per_rank"] == plain["attention_bytes_per_rank"]
        assert plain["recompute_bytes_per_rank"] == 0
        assert (checkpointed["recompute_bytes_per_rank"] > 0) == (plain["attention_bytes_per_rank"] > 0)
    for record in records:
        assert set(record) == RECORD_KEYS
        assert record["objective"] == "bd3" and record["seq_len"] == 64 and record["nproc"] == 2
        assert record["step_time_s"] >= record["step_time_min_s"] > 0
        assert record["step_times_s"] == [record["step_time_s"]]  # every repeat (--repeats 1)
        assert record["tokens_per_s"] == pytest.approx(64 / record["step_time_s"])
        assert record["peak_mem_bytes"] >= 0 and record["gradient_bytes_per_rank"] > 0
    by_layout = {r["layout"]: r for r in records}
    assert (by_layout["cp"]["cp"], by_layout["cp"]["bp"]) == (2, 1)
    assert (by_layout["csbp"]["cp"], by_layout["csbp"]["bp"]) == (2, 2)
    assert (by_layout["bp"]["cp"], by_layout["bp"]["bp"]) == (1, 2)
    losses = [r["loss_step0"] for r in records]
    assert max(losses) - min(losses) <= 1e-5 * abs(losses[0])
    assert by_layout["bp"]["attention_bytes_per_rank"] == 0
    assert 0 < by_layout["csbp"]["attention_bytes_per_rank"] < by_layout["cp"]["attention_bytes_per_rank"]

    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_compile_modes_run_side_by_side_with_the_same_step(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "train.json"
    args = parse(["train", "--seq-lens", "64", "--nproc", "2", "--repeats", "1", "--warmup", "1", "--objectives",
                  "bd3", "--layouts", "cp", "csbp", "--compile", "none", "layers", "--json", str(out)])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    assert "train.compile: step time per layout, eager (none) vs compiled (layers)" in printed
    everything = json.loads(out.read_text())
    assert [(r["layout"], r["compile"]) for r in everything] == [
        (layout, mode) for layout in ("cp", "csbp") for mode in ("none", "layers")]
    for eager, compiled in zip(everything[::2], everything[1::2], strict=True):
        # the same step on the same batch: the compiled regions compute the eager ones' values
        assert compiled["loss_step0"] == pytest.approx(eager["loss_step0"], rel=1e-6)
        assert compiled["attention_bytes_per_rank"] == eager["attention_bytes_per_rank"]
    with pytest.raises(ValueError, match=r"--compile layers needs --warmup 1 or more"):
        run_train_bench([64], objectives=["bd3"], layouts=["cp"], nproc=2, compile=("layers",), warmup=0)
    with pytest.raises(ValueError, match=r"--compile \['none', 'none'\]: give distinct modes"):
        run_train_bench([64], objectives=["bd3"], layouts=["cp"], nproc=2, compile=("none", "none"))


@pytest.mark.multiprocess
def test_documents_run_every_layout_with_equal_loss_and_less_traffic() -> None:
    """``--doc-length``: the same step-0 loss in cp, cp-aware, csbp and bp (and their balanced block
    schedule) on packed documents; the mask-aware layouts send less than generic CP."""
    records = run_train_bench(
        [64], objectives=["bd3"], layouts=["cp", "cp-aware", "csbp", "bp", "csbp-balanced", "bp-balanced"], nproc=2,
        doc_length=8,
        repeats=1, warmup=0,
    )
    by_layout = {r.layout: r for r in records}
    losses = [r.loss_step0 for r in records]
    assert max(losses) - min(losses) <= 1e-5 * abs(losses[0])
    assert all(r.doc_length == 8 for r in records)
    assert all(r.bytes_step == 0 for r in records)  # the documents are drawn per step: the bytes are step 0's
    cp_bytes = by_layout["cp"].attention_bytes_per_rank
    assert 0 < by_layout["cp-aware"].attention_bytes_per_rank < cp_bytes
    assert 0 < by_layout["csbp"].attention_bytes_per_rank < by_layout["cp-aware"].attention_bytes_per_rank
    assert by_layout["bp"].attention_bytes_per_rank == 0


def record(objective: str, layout: str, seq_len: int, step: float) -> TrainRecord:
    return TrainRecord(
        objective, layout, 4, 4, seq_len, 16, 4, 1, step, seq_len / step, 1 << 20, 1 << 10, 1 << 10, 3.0
    )


def test_table_and_speedups_relative_to_cp(tmp_path: Path) -> None:
    records = [
        record("bd3", "cp", 512, 2.0),
        record("bd3", "csbp", 512, 1.0),
        record("bd3", "bp", 512, 4.0),
        record("bd3", "cp", 1024, 3.0),
        record("bd3", "csbp", 1024, 1.0),
        record("fast_dllm_v2", "cp", 512, 1.0),
        record("fast_dllm_v2", "csbp", 512, 0.5),
    ]
    rows_of_table = [line.split() for line in format_table(records).splitlines()[2:]]
    # bd3 csbp at 512: half the CP-only step time, twice its tokens per second
    # after the step time its spread over the repeats ("-": none recorded), then its ratio to cp
    assert rows_of_table[1][:3] == ["bd3", "512", "csbp"] and rows_of_table[1][5] == "0.50"
    assert rows_of_table[1][7] == "2.00"
    assert rows_of_table[2][5] == "2.00" and rows_of_table[2][7] == "0.50"  # bp: twice as slow
    rows = [r.__dict__ for r in records]
    assert speedup_series(rows, "csbp", "bd3", "objective") == ([512, 1024], [2.0, 3.0])
    assert speedup_series(rows, "bp", "bd3", "objective") == ([512], [0.5])
    assert speedup_series(rows, "csbp", "fast_dllm_v2", "objective") == ([512], [2.0])
    path = plot_speedups(rows, tmp_path / "speedup.png", group_by="objective")
    assert path.read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="CP-only"):
        plot_speedups([r for r in rows if r["layout"] != "cp"], tmp_path / "none.png")


def test_speedup_plot_draws_the_mask_aware_cp_baseline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """When the records hold ``cp-aware`` (the strongest CP baseline, in the default layouts) the plot
    draws it next to CSBP; it used to draw CSBP and BP-only against generic CP-only only."""
    from matplotlib.axes import Axes

    drawn: list[str] = []
    plot = Axes.plot

    def recording_plot(self: Axes, *args: object, **kwargs: object) -> object:
        drawn.append(str(kwargs.get("label")))
        return plot(self, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", recording_plot)
    rows = [record("bd3", name, 512, t).__dict__ for name, t in (("cp", 2.0), ("cp-aware", 1.0), ("csbp", 1.0))]
    plot_speedups(rows, tmp_path / "speedup.png", group_by="objective")
    assert drawn == ["CSBP", "CP-only, mask-aware"]


def test_invalid_requests_fail_before_launching() -> None:
    with pytest.raises(ValueError, match="--seq-lens 72 is not a multiple of --block-size 16"):
        run_train_bench([72], objectives=["bd3"], layouts=["cp", "csbp"], nproc=2)
    with pytest.raises(ValueError, match="objective"):
        run_train_bench([64], objectives=["mdlm"], layouts=["cp"], nproc=2)
    with pytest.raises(ValueError, match="layout"):
        run_train_bench([64], objectives=["bd3"], layouts=["tp"], nproc=2)
    with pytest.raises(ValueError, match="nproc"):
        run_train_bench([64], objectives=["bd3"], layouts=["cp"], nproc=1)


def test_backend_and_diagonal_options_parse_and_fail_closed() -> None:
    args = parse(["train"])
    assert (args.backend, args.diagonal) == ("auto", "auto")
    args = parse(["train", "--backend", "flex", "--diagonal", "sdpa_fold"])
    assert (args.backend, args.diagonal) == ("flex", "sdpa_fold")
    for bad in (["--backend", "triton"], ["--diagonal", "fast"]):
        with pytest.raises(SystemExit):
            parse(["train", *bad])
    for argv, message in [(["--backend", "flex"], "--backend=flex cannot train on cpu"),
                          (["--backend", "tiles", "--diagonal", "flex"], "--diagonal=flex needs attention.backend flex")]:
        args = parse(["train", *argv])
        with pytest.raises(ValueError, match=message):  # before anything is printed or launched
            args.func(args)
    with pytest.raises(ValueError, match="--diagonal=flex needs"):  # the API refuses it before launching too
        run_train_bench([64], objectives=["bd3"], layouts=["cp"], nproc=2, backend="tiles", diagonal="flex")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_tiles_backend_with_the_sdpa_diagonal_runs_every_layout_alike() -> None:
    """``--backend tiles --diagonal sdpa`` (B = 16): one tiny launch; the choice is recorded and every
    layout starts from the same step-0 loss (float32)."""
    records = run_train_bench(
        [64], objectives=["bd3"], layouts=["cp", "csbp"], nproc=2, block_size=16, backend="tiles",
        diagonal="sdpa", num_layers=1, warmup=0, repeats=1,
    )
    assert [(r.layout, r.backend, r.diagonal) for r in records] == [("cp", "tiles", "sdpa"), ("csbp", "tiles", "sdpa")]
    assert records[0].loss_step0 == pytest.approx(records[1].loss_step0, rel=1e-5)
    assert all(r.step_time_s > 0 for r in records)


@pytest.mark.parametrize("bench", ["attention", "train"])
def test_bad_input_prints_only_its_error_line(bench: str, capsys: pytest.CaptureFixture[str]) -> None:
    from csbp.cli.main import main

    assert main(["bench", bench, "--seq-lens", "1000", "--nproc", "4"]) == 2
    out, err = capsys.readouterr()  # the header waits until every input is checked
    assert out == ""
    assert err == ("csbp: error: --seq-lens 1000 is not a multiple of --block-size 16 (fix: --seq-lens 960 or 1024, or "
                   "--block-size 10 or 25)\n")  # each meets every rule of the layouts (992 was refused next)
