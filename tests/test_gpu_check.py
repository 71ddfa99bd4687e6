"""The device check's CPU-testable parts: the no-CUDA line, stage selection and the stage runner,
the summary table and ``gpu-check.json``, the FLOP / MFU arithmetic, a dry run of the training
table at tiny sizes, and what ``csbp doctor`` reports for GPUs."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import pytest
import torch

from csbp.attention.layouts import reference_layout
from csbp.bench.kernel_summary import KERNEL_TARGETS
from csbp.bench.measure import allowed_pairs
from csbp.cli.doctor_cmd import collect_environment
from csbp.gpu import check
from csbp.gpu.check import StageResult, format_summary, select_stages
from csbp.gpu.flops import (
    QWEN3_0_6B,
    bd3_attention_pairs,
    bd3_step_flops,
    gpu_bf16_peak_tflops,
    layer_matmul_params,
    model_flop_utilisation,
)
from csbp.gpu.profile import CPU_DRY_RUN, KERNEL_BENCH_ARGS, LAYOUT_BENCH_ARGS
from csbp.gpu.stage import CheckEnv, Stage, command_stage
from csbp.gpu.train_table import TableConfig, TableRow, format_train_table, rows_as_dicts, run_train_table
from csbp.models.config import DecoderConfig


def _env(tmp_path: Path, seconds: float = 60.0) -> CheckEnv:
    return CheckEnv(gpus=1, device_name="NVIDIA H200", peak_tflops=989.0, repo=tmp_path,
                    args=argparse.Namespace(flex_backward="auto"), deadline=time.perf_counter() + seconds,
                    out_dir=tmp_path)


def test_without_cuda_it_prints_one_line_and_exits_0(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert check.main(["--json", str(tmp_path / "gpu-check.json")]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith("gpu-check: no CUDA device is visible")
    assert not (tmp_path / "gpu-check.json").exists()


def test_stage_selection_and_listing(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    names = [stage.name for stage in check.STAGES]
    assert names[-1] == "train-table" and {"cuda-tests", "verify", "kernels"} <= set(names)
    kernels = next(s for s in check.STAGES if s.name == "kernels")
    assert kernels.run(_env(tmp_path, seconds=0.5)).summary == "no time left in the budget"
    argv = check._kernels(_env(tmp_path))
    assert argv[2:5] == ["csbp", "bench", "kernels"]
    assert argv[-4:] == ["--json", str(tmp_path / "gpu-kernels.json"), "--flex-backward", "auto"]
    assert [s.name for s in select_stages(["train-table", "cuda-tests"])] == ["cuda-tests", "train-table"]
    assert select_stages(None) == check.STAGES
    with pytest.raises(ValueError, match=r"unknown or no stage\(s\) \['kernel'\]"):
        select_stages(["kernel"])
    assert check.main(["--stages", "nope"]) == 2
    assert "unknown or no stage" in capsys.readouterr().err
    assert check.main(["--list"]) == 0
    assert "train-table" in capsys.readouterr().out


def test_flex_backward_is_checked_first_and_handed_to_the_stages(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``--flex-backward recompute``: the way to rerun the kernels and training-table stages should the
    direct kernel fail to compile on a device; ``direct`` where torch cannot trace it is one line, exit 2."""
    import csbp.attention.flex_backward as flex_backward

    monkeypatch.setattr(flex_backward, "_mode", flex_backward._mode)  # restored after the test
    env = _env(tmp_path)
    env.args.flex_backward = "recompute"
    assert check._kernels(env)[-2:] == ["--flex-backward", "recompute"]
    monkeypatch.setattr(flex_backward, "direct_backward_support", lambda: (False, "no tracing here"))
    assert check.main(["--flex-backward", "direct", "--json", str(tmp_path / "gpu-check.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--flex-backward" in err and "no tracing here" in err
    assert check.main(["--flex-backward", "recompute", "--dry-run-cpu", "--stages", "train-table",
                       "--json", str(tmp_path / "gpu-check.json")]) == 0
    assert "flex backward recompute" in capsys.readouterr().out
    assert flex_backward.current_flex_backward() == "recompute"  # the in-process training table ran with it


def test_kernels_stage_options_parse_and_compare_both_block_diagonal_kernels() -> None:
    from csbp.cli.main import build_parser

    args = build_parser().parse_args(["bench", "kernels", *KERNEL_BENCH_ARGS])
    assert (args.device, args.backends, args.dtype) == ("cuda", ["flex"], "bfloat16")
    assert args.diagonals == ["sdpa", "flex"] and args.block_sizes == [16, 128]
    # the primary decomposed forms (the first two, clean-major: cuDNN pieces with the sdpa diagonal or the noisy
    # blocks folded into the pieces' Flex residual), measured at every length before the others
    assert args.clean_kernels == ["pieces-cudnn", "pieces", "generic"] and args.primary_first == 2
    assert args.seq_lens == [16384, 131072, 65536, 32768, 8192] and args.json is None  # the stage adds it
    # the targets' range ends come first: a stage cut short by its budget still has the verdict's upper end
    # and the issue's range (8K-128K) is covered, the lengths outside the targets' range last
    assert tuple(args.seq_lens[:2]) == KERNEL_TARGETS.seq_lens and set(args.seq_lens) <= set(range(8192, 131073))
    assert args.seq_lens[-1] == 8192 and min(args.seq_lens) == 8192 and max(args.seq_lens) == 131072
    dry = build_parser().parse_args(["bench", "kernels", *CPU_DRY_RUN.kernels])
    assert (dry.device, dry.backends, dry.primary_first) == ("cpu", ["tiles"], 1)


def test_layouts_stage_times_each_layouts_busiest_rank_after_the_kernels(tmp_path: Path) -> None:
    """The ``layouts`` stage: only the ``--layouts`` rows, CSBP first, each layout's training default
    (``generic``) before the cuDNN pieces, its JSON beside the report, before the training table."""
    from csbp.cli.main import build_parser

    names = [stage.name for stage in check.STAGES]
    assert names.index("kernels") < names.index("layouts") < names.index("train-table")
    args = build_parser().parse_args(["bench", "kernels", *LAYOUT_BENCH_ARGS])
    assert args.no_forms and args.layouts == ["cp4/bp8", "cp4", "bp4"] and args.layout_clean[0] == "generic"
    assert (args.device, args.backends, args.seq_lens, args.block_sizes) == ("cuda", ["flex"], [65536], [128])
    assert check._layouts(_env(tmp_path))[-4:] == ["--json", str(tmp_path / "gpu-layouts.json"), "--flex-backward",
                                                   "auto"]
    dry = build_parser().parse_args(["bench", "kernels", *CPU_DRY_RUN.layouts])
    assert (dry.device, dry.backends, dry.no_forms) == ("cpu", ["tiles"], True)


def test_command_stages_report_status_summary_and_skips(tmp_path: Path) -> None:
    ok = command_stage("ok", "", lambda env: [sys.executable, "-c", "print('first'); print('all good')"], timeout_s=60)
    bad = command_stage("bad", "", lambda env: [sys.executable, "-c", "import sys; sys.exit(3)"], timeout_s=60)
    slow = command_stage("slow", "", lambda env: [sys.executable, "-c", "import time; time.sleep(30)"], timeout_s=2)
    skip = command_stage("skip", "", lambda env: "needs at least 2 GPUs, 1 visible", timeout_s=60)
    env = _env(tmp_path)
    assert (ok.run(env).status, ok.run(env).summary) == ("ok", "all good")
    failed = bad.run(env)
    assert failed.status == "failed" and failed.details["returncode"] == 3
    timed_out = slow.run(env)
    assert timed_out.status == "failed" and timed_out.summary == "timed out after 2 s"
    assert skip.run(env) == StageResult("skip", "skipped", 0.0, "needs at least 2 GPUs, 1 visible")
    assert ok.run(_env(tmp_path, seconds=0.5)).summary == "no time left in the budget"
    verify = next(s for s in check.STAGES if s.name == "verify")
    assert verify.run(env).summary == "needs at least 2 GPUs, 1 visible"
    assert next(s for s in check.STAGES if s.name == "cuda-tests").run(env).status == "skipped"  # no tests/ here


def test_main_runs_the_stages_writes_json_and_prints_the_table(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    rows = [TableRow("bd3", 8192, "ok (2 timed)", "full", 1.0, 8192.0, 100.0, 0.1, 2**30, 11.0)]
    stages = [
        Stage("a", "first", lambda env: StageResult("a", "ok", 1.0, "fine")),
        Stage("b", "second", lambda env: StageResult("b", "failed", 2.0, "broke", {"table": format_train_table(rows)})),
        Stage("c", "raises", lambda env: 1 / 0),
    ]
    monkeypatch.setattr(check, "STAGES", stages)
    monkeypatch.setattr(check, "no_cuda_message", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    path = tmp_path / "out" / "gpu-check.json"
    assert check.main(["--json", str(path), "--stages", "a", "b", "c"]) == 1  # a stage failed
    out = capsys.readouterr().out
    assert "bf16 peak 989.0 TFLOP/s" in out and "broke" in out and "10.0%" in out
    payload = json.loads(path.read_text())
    assert payload["ok"] is False and payload["complete"] is True and payload["device"]["name"] == "NVIDIA H200"
    assert [s["name"] for s in payload["stages"]] == ["a", "b", "c"] and payload["stages"][1]["summary"] == "broke"
    assert payload["stages"][2]["summary"] == "ZeroDivisionError: division by zero"


def test_summary_table_lines() -> None:
    table = format_summary([StageResult("cuda-tests", "ok", 12.34, "40 passed"), StageResult("v", "skipped", 0, "x")])
    lines = table.splitlines()
    assert lines[0].split() == ["stage", "status", "seconds", "summary"]
    assert lines[2].split() == ["cuda-tests", "ok", "12.3", "40", "passed"]


def test_flop_arithmetic() -> None:
    # the closed form equals the pairs the BD3 predicate allows
    for seq_len, block in ((32, 4), (64, 16), (48, 1)):
        rows = reference_layout(seq_len, block).rows
        assert bd3_attention_pairs(seq_len, block) == allowed_pairs(rows, block_size=block)
    # Qwen3-0.6B: 28 layers of 1024*(2*2048 + 2*1024) + 3*1024*3072 weights = 440M matmul parameters
    assert layer_matmul_params(QWEN3_0_6B) * QWEN3_0_6B.num_layers == 28 * (1024 * 6144 + 3 * 1024 * 3072)
    tiny = DecoderConfig(vocab_size=10, hidden_size=4, intermediate_size=8, num_layers=2, num_heads=2,
                         num_kv_heads=1, head_dim=2)
    dense = 6 * (4 * (2 * 4 + 2 * 2) + 3 * 4 * 8) * 2 * 16  # 6 * params * layers * 2L rows
    head = 6 * 10 * 4 * 8
    attention = 12 * 2 * 2 * (8 * 2 + 64) * 2  # 12 d heads pairs layers
    assert bd3_step_flops(tiny, seq_len=8, block_size=2) == dense + head + attention
    assert bd3_step_flops(tiny, seq_len=8, block_size=2, samples=3) == 3 * (dense + head + attention)
    with pytest.raises(ValueError, match="multiple of block_size"):
        bd3_attention_pairs(10, 4)
    assert gpu_bf16_peak_tflops("NVIDIA H200") == 989.0
    assert gpu_bf16_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert gpu_bf16_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert gpu_bf16_peak_tflops("Some Future GPU") is None
    assert model_flop_utilisation(989e12, step_time_s=2.0, peak_tflops=989.0) == pytest.approx(0.5)
    assert model_flop_utilisation(1, step_time_s=1.0, peak_tflops=None) is None


def test_a_gpus_peak_is_its_own_part_s() -> None:
    """MFU divides by the part's dense bf16 peak: a name that merely contains another part's (the L40
    holds "L4", the NVL cards "H100"/"H200", the A10G "A10") got that part's peak (the L40's MFU came
    out 1.5x too high, an H100 NVL's 16% too low); an unknown part reports none."""
    peaks = {"NVIDIA L40": 181.0, "NVIDIA L40S": 362.0, "NVIDIA L4": 121.0, "NVIDIA H100 NVL": 835.0,
             "NVIDIA H200 NVL": 835.0, "NVIDIA H800": 989.0, "NVIDIA H800 PCIe": 756.0, "NVIDIA A800-SXM4-80GB": 312.0,
             "NVIDIA H100 80GB HBM3": 989.0, "NVIDIA GH200 480GB": 989.0, "NVIDIA A10": 125.0, "NVIDIA A10G": None}
    assert {name: gpu_bf16_peak_tflops(name) for name in peaks} == peaks
    assert model_flop_utilisation(1, step_time_s=0.0, peak_tflops=989.0) is None  # no step time, no rate


def test_training_table_dry_run_on_cpu_at_tiny_sizes() -> None:
    tiny = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8)
    cfg = TableConfig(seq_lens=(64, 32), block_size=4, model=tiny, activation_checkpointing="full",
                      dflash_seq_len=64, dflash_anchors=4, dflash_draft_layers=1, warmup=1, repeats=1,
                      peak_tflops=1.0, compiled_seq_lens=(32,), long_step_s=600.0)  # a slow step must not end a row
    seen: list[TableRow] = []
    rows = run_train_table(cfg, torch.device("cpu"), progress=seen.append)
    assert rows == seen and [(r.kind, r.seq_len) for r in rows] == [
        ("bd3", 32), ("bd3", 64), ("bd3 compiled", 32), ("dflash a=4", 64)]
    # the compiled row trains the same model on the same data: the same (second) step's loss to round-off
    assert rows[2].loss == pytest.approx(rows[0].loss, rel=1e-3) and rows[2].loss != rows[1].loss
    for row in rows:
        assert row.status == "ok (1 timed)" and row.checkpointing == "full"
        assert row.step_time_s > 0 and row.tokens_per_s == pytest.approx(row.seq_len / row.step_time_s)
        assert 0 < row.mfu < 1 and row.loss > 0
    text = format_train_table(rows)
    assert len(text.splitlines()) == 6 and "dflash a=4" in text and "bd3 compiled" in text


def test_a_profiled_row_runs_one_more_step_under_the_profiler_and_prints_it() -> None:
    """The first H200 table's MFU was 14-20% with nothing to say where the rest of a step went: a row at
    one of ``profile_seq_lens`` now carries a profile of one more step, in the JSON and under its line."""
    tiny = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=8)
    cfg = TableConfig(seq_lens=(32, 64), block_size=4, model=tiny, activation_checkpointing="none",
                      dflash_seq_len=None, warmup=0, repeats=1, peak_tflops=1.0, profile_seq_lens=(64,), profile_top=3)
    short, profiled = run_train_table(cfg, torch.device("cpu"))
    assert short.profile is None and profiled.profile is not None
    profile = profiled.profile
    assert len(profile.top) == 3 and profile.launches > 100  # aten ops of a whole training step on the CPU
    assert 0 < profile.attention_ms < profile.busy_ms and profile.syncs == 0
    saved = json.loads(json.dumps(rows_as_dicts([profiled])))[0]["profile"]
    assert saved["launches"] == profile.launches and len(saved["top"]) == 3
    lines = format_train_table([short, profiled]).splitlines()
    assert len(lines) == 5 and lines[3].lstrip().startswith("bd3 ")
    assert lines[4].startswith(f"      {profile.launches} launches; busy ") and "; top: " in lines[4]


def test_long_steps_end_a_row_after_one_timed_step() -> None:
    from csbp.gpu.train_table import _measure

    calls: list[int] = []

    def step(index: int) -> float:
        calls.append(index)
        time.sleep(0.02)
        return 1.0

    cfg = TableConfig(warmup=1, repeats=3, long_step_s=0.01)
    measured = _measure(step, cfg, torch.device("cpu"))
    assert calls == [0] and measured.steps == 1 and measured.step_time_s >= 0.02 and measured.loss == 1.0
    assert _measure(step, TableConfig(warmup=1, repeats=2, long_step_s=10.0), torch.device("cpu")).steps == 2
    # a compiled row's first step compiles: never timed, and never the long step that ends the row
    calls.clear()
    measured = _measure(step, TableConfig(warmup=0, repeats=3, long_step_s=0.01, compile="layers"), torch.device("cpu"))
    assert calls == [0, 1] and measured.steps == 1


def test_training_table_rows_keep_every_timed_step_and_print_their_spread() -> None:
    """The table printed the median step of ``repeats`` with no spread (the benchmarks' ``±``) and
    gpu-check.json kept no repeat: a step time's noise could not be told from a difference."""
    tiny = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=8)
    cfg = TableConfig(seq_lens=(32,), block_size=4, model=tiny, activation_checkpointing="none",
                      dflash_seq_len=None, warmup=0, repeats=3, peak_tflops=1.0)
    (row,) = run_train_table(cfg, torch.device("cpu"))
    assert row.status == "ok (3 timed)" and len(row.step_times_s) == 3
    assert row.step_time_s == sorted(row.step_times_s)[1]
    assert json.loads(json.dumps(rows_as_dicts([row])))[0]["step_times_s"] == list(row.step_times_s)
    fixed = dataclasses.replace(row, step_time_s=1.0, step_times_s=(0.9, 1.0, 1.1))
    header, _, line = format_train_table([fixed]).splitlines()
    assert "±" in header and " ±10% " in line
    one = dataclasses.replace(row, step_times_s=(1.0,))
    assert format_train_table([one]).splitlines()[2].split()[4] == "-"  # one timed step: no spread


def test_training_table_skips_rows_beyond_the_budget() -> None:
    tiny = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=8)
    cfg = TableConfig(seq_lens=(32, 4096), block_size=4, model=tiny, activation_checkpointing="none",
                      dflash_seq_len=None, warmup=0, repeats=1, budget_s=0.0)
    rows = run_train_table(cfg, torch.device("cpu"))
    assert [r.status.split(":")[0] for r in rows] == ["skipped", "skipped"]
    assert "s left of the budget" in rows[0].status
    assert "-" in format_train_table(rows).splitlines()[2]
    broken = TableConfig(seq_lens=(30,), block_size=4, model=tiny, dflash_seq_len=None, warmup=0, repeats=1)
    (row,) = run_train_table(broken, torch.device("cpu"))  # 30 tokens are not whole blocks of 4
    assert row.status.startswith("error: ValueError: ") and row.step_time_s is None


def test_doctor_reports_nccl_bf16_and_flex_attention() -> None:
    rows = {(section, item): value for section, item, value in collect_environment()}
    assert ("nccl", "version") in rows and ("bf16", "cuda") in rows
    assert rows[("bf16", "cpu-autocast")] == "yes"
    assert rows[("flexattention", "module")].startswith(("yes", "no"))
    if not torch.cuda.is_available():
        assert rows[("nccl", "version")].startswith("not available")
        assert rows[("flexattention", "compiled")].startswith("no")
        assert rows[("compile", "train.compile")] == "layers can compile on cpu"  # this machine has g++


def test_train_table_stage_passes_the_options_and_the_remaining_budget(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from csbp.gpu import train_table

    seen: dict[str, object] = {}

    def fake_table(cfg: TableConfig, device: torch.device, *, progress) -> list[TableRow]:  # noqa: ANN001
        seen.update(cfg=cfg, device=device)
        rows = [TableRow("bd3", 8192, "ok (2 timed)", "full", 1.0, 8192.0, 1.0, 0.1, 1, 1.0),
                TableRow("bd3", 16384, "out of memory", "-")]
        for row in rows:
            progress(row)
        return rows

    monkeypatch.setattr(train_table, "run_train_table", fake_table)
    args = check.build_parser().parse_args(["--train-seq-lens", "8192", "16384", "--dflash-seq-len", "0"])
    env = CheckEnv(gpus=1, device_name="x", peak_tflops=989.0, repo=tmp_path, args=args,
                   deadline=time.perf_counter() + 100.0)
    result = check._train_table(env)
    cfg = seen["cfg"]
    assert isinstance(cfg, TableConfig) and cfg.seq_lens == (8192, 16384) and cfg.dflash_seq_len is None
    assert cfg.activation_checkpointing == "full" and cfg.peak_tflops == 989.0
    assert 80.0 < cfg.budget_s <= 100.0 - check.TRAIN_TABLE_RESERVE_S
    assert (result.status, result.summary) == ("failed", "1 of 2 rows measured (flex backend)")  # OOM fails it
    assert (cfg.backend, cfg.diagonal, cfg.clean) == ("auto", "auto", "generic")
    assert result.details["attention"] == {"backend": "flex", "diagonal": "flex", "clean": "generic"}  # auto on CUDA
    # the decomposed rows' noisy blocks: auto is flex on CUDA, folded into the cuDNN pieces' Flex residual
    assert result.details["decomposed_attention"] == {"diagonal": "flex", "clean": "pieces-cudnn"}
    assert "out of memory" in capsys.readouterr().out
    late = CheckEnv(gpus=1, device_name="x", peak_tflops=None, repo=tmp_path, args=args, deadline=time.perf_counter())
    assert check._train_table(late).status == "skipped"


def test_training_table_runs_on_the_configured_backend_and_diagonal(monkeypatch: pytest.MonkeyPatch) -> None:
    from csbp.gpu import train_table

    tiny = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=8)
    seen: list[tuple[str, str, str]] = []
    for name in ("build_rank_plan", "build_dflash_rank_plan"):
        real = getattr(train_table, name)

        def spy(*args, _real=real, **kwargs):  # noqa: ANN002, ANN003, ANN202
            seen.append((kwargs["backend"], kwargs["diagonal"], kwargs.get("clean", "-")))
            return _real(*args, **kwargs)

        monkeypatch.setattr(train_table, name, spy)
    cfg = TableConfig(seq_lens=(32,), block_size=4, model=tiny, activation_checkpointing="none", backend="tiles",
                      diagonal="sdpa", clean="pieces", decomposed_seq_lens=(32,), decomposed_diagonal="matmul",
                      decomposed_clean="generic", dflash_seq_len=32, dflash_anchors=2, dflash_draft_layers=1, warmup=0, repeats=1)
    rows = run_train_table(cfg, torch.device("cpu"))
    assert [(row.kind, row.status) for row in rows] == [
        ("bd3", "ok (1 timed)"), ("bd3 decomposed", "ok (1 timed)"), ("dflash a=2", "ok (1 timed)")
    ]
    # the clean kernel is BD3's (the drafter has no clean stream); the decomposed row takes its own kernels
    assert seen == [("tiles", "sdpa", "pieces"), ("tiles", "matmul", "generic"), ("tiles", "sdpa", "-")]
    with pytest.raises(ValueError, match="backend=flex cannot train on cpu"):
        run_train_table(dataclasses.replace(cfg, backend="flex"), torch.device("cpu"))
    with pytest.raises(ValueError, match="diagonal=flex needs attention.backend flex"):
        run_train_table(dataclasses.replace(cfg, backend="auto", diagonal="flex"), torch.device("cpu"))
    with pytest.raises(ValueError, match="decomposed diagonal=flex needs attention.backend flex"):
        run_train_table(dataclasses.replace(cfg, decomposed_diagonal="flex"), torch.device("cpu"))


def test_a_decomposed_row_is_predicted_from_the_plain_row_of_its_length(monkeypatch: pytest.MonkeyPatch) -> None:
    """``bd3 decomposed`` rows come after the BD3 rows and are skipped, never started, when the plain row
    of the same length says they cannot end inside the budget."""
    from csbp.gpu import train_table

    tiny = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=8)
    built: list[tuple[str, int]] = []

    def fake_row(kind: str, seq_len: int, build, device):  # noqa: ANN001, ANN202
        built.append((kind, seq_len))
        step = {32: 1.0, 64: 40.0}[seq_len]  # the plain 64-token row: one step of 40 s
        return train_table.TableRow(kind=kind, seq_len=seq_len, status="ok (1 timed)", checkpointing="none",
                                    step_time_s=step)

    monkeypatch.setattr(train_table, "_run_row", fake_row)
    clock = iter(float(t) for t in range(1000))
    monkeypatch.setattr(train_table.time, "perf_counter", lambda: next(clock))
    cfg = TableConfig(seq_lens=(32, 64), block_size=4, model=tiny, activation_checkpointing="none", backend="tiles",
                      decomposed_seq_lens=(32, 64), decomposed_diagonal="sdpa", dflash_seq_len=None, warmup=0,
                      repeats=1, budget_s=30.0)
    rows = run_train_table(cfg, torch.device("cpu"))
    assert built == [("bd3", 32), ("bd3", 64), ("bd3 decomposed", 32)]
    assert rows[-1].kind == "bd3 decomposed" and rows[-1].status.startswith("skipped: predicted 40 s")


def test_a_compiled_row_is_predicted_with_its_compilation(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``bd3 compiled`` row's prediction adds COMPILE_ALLOWANCE_S to the plain row's (which compiled none of
    the layers): predicted from the plain row alone it started with a few seconds left and overran the budget."""
    from csbp.gpu import train_table

    tiny = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=8)
    built: list[tuple[str, int]] = []

    def fake_row(kind: str, seq_len: int, build, device):  # noqa: ANN001, ANN202
        built.append((kind, seq_len))
        return train_table.TableRow(kind=kind, seq_len=seq_len, status="ok (1 timed)", checkpointing="none",
                                    step_time_s=1.0)

    monkeypatch.setattr(train_table, "_run_row", fake_row)
    clock = iter(float(t) for t in range(1000))
    monkeypatch.setattr(train_table.time, "perf_counter", lambda: next(clock))
    budget = train_table.COMPILE_ALLOWANCE_S  # the plain row's 1 s step plus the allowance exceeds what is left
    cfg = TableConfig(seq_lens=(32,), block_size=4, model=tiny, activation_checkpointing="none", backend="tiles",
                      compiled_seq_lens=(32,), dflash_seq_len=None, warmup=0, repeats=1, budget_s=budget)
    rows = run_train_table(cfg, torch.device("cpu"))
    assert built == [("bd3", 32)]
    assert rows[-1].kind == "bd3 compiled" and rows[-1].status.startswith(f"skipped: predicted {budget + 1:.0f} s")


def test_a_compiled_rows_compiling_step_is_not_its_timed_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The table measured a ``bd3 compiled`` row with the plain rows' config (``compile: none``): a first
    step that compiled for longer than ``long_step_s`` (a cold compile cache, a loaded machine) was timed
    and ended the row, which then reported the compilation as its step and the first step's loss."""
    from csbp.gpu import train_table

    def fake_step_fn(cfg: TableConfig, seq_len: int, device: torch.device):  # noqa: ANN202
        def step(index: int) -> float:
            time.sleep(0.02)  # every step is "long"
            return float(index)

        return step, "none"

    monkeypatch.setattr(train_table, "bd3_step_fn", fake_step_fn)
    cfg = TableConfig(seq_lens=(32,), block_size=4, activation_checkpointing="none", backend="tiles",
                      compiled_seq_lens=(32,), dflash_seq_len=None, warmup=1, repeats=1, long_step_s=0.01)
    plain, compiled = run_train_table(cfg, torch.device("cpu"))
    assert (plain.kind, plain.loss, len(plain.step_times_s)) == ("bd3", 0.0, 1)  # step 0 was long: it ends the row
    assert (compiled.kind, compiled.loss, len(compiled.step_times_s)) == ("bd3 compiled", 1.0, 1)


def test_row_prediction_keeps_one_time_costs_and_scales_the_steps() -> None:
    from csbp.gpu.train_table import predict_row_seconds

    cfg = TableConfig(warmup=1, repeats=2, long_step_s=20.0)
    # 8K: 40 s in all, 0.5 s steps (so ~39 s of model build and compilation) -> 16K: 39 + 3 * 2 s
    assert predict_row_seconds(8192, 40.0, 0.5, 16384, cfg) == pytest.approx(39.0 + 3 * 2.0)
    assert predict_row_seconds(8192, 40.0, 6.0, 16384, cfg) == pytest.approx(28.0 + 24.0)  # a long step ends the row
    assert predict_row_seconds(8192, 10.0, None, 16384, cfg) == pytest.approx(40.0)  # nothing measured: all scales
