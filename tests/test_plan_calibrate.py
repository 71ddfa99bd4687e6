"""``csbp plan calibrate``: fitting the cost model's calibration to benchmark records, reading what
each ``csbp bench`` writes, fail-closed errors (``csbp plan`` itself is in ``test_plan_cli.py``)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from csbp.cli.main import USER_ERROR_EXIT_CODE
from csbp.plan.calibration import Calibration, load_calibration
from csbp.plan.hardware import hardware
from csbp.plan.layout import Layout
from csbp.plan.model import predict
from csbp.plan.workload import LayerGroup, ModelShape, Objective, Workload
from test_plan_cli import run


def _bench_records(path: Path, cal: Calibration, doc_length: int | None = None) -> list[dict]:
    """Records in the `csbp bench train --json` format whose numbers come from ``cal`` (with
    ``doc_length``: over packed documents, plus the cp-aware baseline)."""
    group = LayerGroup(2, 4, 2, 32)
    workload = Workload(
        ModelShape("bench-decoder", 128, 512, 256, (group,)), Objective("bd3", 16, kv_grad_bytes=4), 4
    ).with_options(doc_length=doc_length)
    hw = hardware("cpu", gpus=2)
    records = []
    layouts = (("cp", 2, 1), ("bp", 1, 2), ("csbp", 2, 2)) + ((("cp-aware", 2, 1),) if doc_length else ())
    for seq_len in (512, 1024, 2048):
        for name, cp, bp in layouts:
            transport = "halo" if name == "cp-aware" else "collective"
            layout = Layout(1, cp, bp, transport=transport, checkpointing="none", sharding="ddp")
            pred = predict(workload, layout, seq_len, hw, cal, step_memory_only=True)
            records.append(
                {
                    "objective": "bd3",
                    "layout": name,
                    "cp": cp,
                    "bp": bp,
                    "seq_len": seq_len,
                    "block_size": 16,
                    "nproc": 2,
                    "samples": 1,
                    "step_time_s": pred.step_s,
                    "peak_mem_bytes": int(pred.mem_bytes),
                    "hidden_size": 128,
                    "intermediate_size": 256,
                    "num_layers": 2,
                    "num_heads": 4,
                    "num_kv_heads": 2,
                    "head_dim": 32,
                    "vocab_size": 512,
                    "dtype": "float32",
                    "transport": "collective",
                    **({"doc_length": doc_length} if doc_length else {}),
                }
            )
    path.write_text(json.dumps(records))
    return records


def test_calibrate_recovers_the_machine_it_measured(tmp_path: Path, capsys) -> None:
    truth = replace(
        Calibration(),
        gemm_eff=0.2,
        attn_eff=0.05,
        intra_eff=0.3,
        step_overhead_s=0.02,
        act_factor=1.7,
        mem_fixed_gib=0.01,
        overlap_cp=0.0,
        overlap_csbp=0.0,
    )
    bench = tmp_path / "bench.json"
    _bench_records(bench, truth)
    code, out, err = run(
        capsys, "plan", "calibrate", str(bench), "--out", str(tmp_path / "cal.json"), "--fit-max-len", "1024"
    )
    assert (code, err) == (0, "") and out.count(" held ") == 6
    cal = load_calibration(tmp_path / "cal.json")
    assert "gemm_eff" in cal.fit and str(bench) in cal.source
    for line in out.splitlines():
        if "measured" in line:
            assert abs(float(line.rsplit("(", 1)[1].rstrip("%)"))) <= 3, line


def test_calibrate_predicts_document_records_and_fits_them_alone(tmp_path: Path, capsys) -> None:
    """Document-masked and cp-aware records are read with their documents and transport (the model
    that made them reproduces them); beside one-document records they are held out."""
    truth = replace(Calibration(), gemm_eff=0.2, attn_eff=0.05, intra_eff=0.3, overlap_cp=0.0, overlap_csbp=0.0)
    plain, docs = tmp_path / "plain.json", tmp_path / "docs.json"
    _bench_records(plain, truth)
    _bench_records(docs, truth, doc_length=128)
    code, out, err = run(capsys, "plan", "calibrate", str(plain), str(docs), "--out", str(tmp_path / "cal.json"))
    held = [line for line in out.splitlines() if line.lstrip().startswith("held")]
    assert (code, err) == (0, "") and len(held) == 24 and all("doc=128" in line for line in held)
    assert sum("cp-aware" in line for line in held) == 6
    # and says why (the listing said only "held")
    assert "note: 24 document-masked record(s) held: one-document records exist" in out
    code, out, err = run(capsys, "plan", "calibrate", str(docs), "--out", str(tmp_path / "cal.json"))
    assert (code, err) == (0, "") and " held " not in out
    for line in out.splitlines():
        if "step_s" in line:
            assert abs(float(line.rsplit("(", 1)[1].rstrip("%)"))) <= 3, line


def test_calibrate_fails_closed_on_records_without_the_model_shape(tmp_path: Path, capsys) -> None:
    bench = tmp_path / "old.json"
    bench.write_text(json.dumps([{"objective": "bd3", "layout": "cp", "cp": 2, "bp": 1, "seq_len": 512}]))
    code, _, err = run(capsys, "plan", "calibrate", str(bench), "--out", str(tmp_path / "cal.json"))
    assert (
        code == USER_ERROR_EXIT_CODE and "rerun the benchmark" in err and not (tmp_path / "cal.json").exists()
    )
    code, _, err = run(capsys, "plan", "calibrate", "--out", str(tmp_path / "cal.json"))
    assert code == USER_ERROR_EXIT_CODE and "BENCH.json files or --published" in err


def test_calibrate_refuses_a_fit_max_len_that_selects_nothing_or_is_ignored(tmp_path: Path, capsys) -> None:
    """``--fit-max-len 0`` was accepted (with --published it, and --timing, were silently ignored)."""
    out = tmp_path / "cal.json"
    for flag in (["--fit-max-len", "0"], ["--fit-max-len", "-5"]):
        code, _, err = run(capsys, "plan", "calibrate", "--published", "--out", str(out), *flag)
        assert code == USER_ERROR_EXIT_CODE and f"argument --fit-max-len: {flag[1]} must be >= 1" in err
    for flag in (["--fit-max-len", "512"], ["--timing", "median"]):
        code, _, err = run(capsys, "plan", "calibrate", "--published", "--out", str(out), *flag)
        assert code == USER_ERROR_EXIT_CODE and err == (
            f"csbp: error: {' '.join(flag)}: applies to BENCH.json records, but --published fits on the packaged runs "
            f"(fix: drop {flag[0]}, or pass BENCH.json files instead of --published)\n"
        )
    bench = tmp_path / "bench.json"
    _bench_records(bench, Calibration())
    code, _, err = run(capsys, "plan", "calibrate", str(bench), "--out", str(out), "--fit-max-len", "100")
    assert code == USER_ERROR_EXIT_CODE and err.endswith("(fix: --fit-max-len >= 512, the shortest fitted record's "
                                                         "seq_len, or drop it)\n")
    assert not out.exists()


def test_calibrate_reads_what_each_benchmark_writes(tmp_path: Path) -> None:
    """Every `csbp bench` record type carries the shape `csbp plan calibrate` needs."""
    from dataclasses import asdict

    from csbp.bench.attention import AttentionRecord
    from csbp.bench.dflash_bench import DFlashRecord
    from csbp.bench.train_bench import TrainRecord
    from csbp.plan.fit import bench_observations

    shape = {"num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "head_dim": 32}
    records = [
        TrainRecord(
            "bd3",
            "csbp",
            2,
            2,
            512,
            16,
            2,
            1,
            0.3,
            1700.0,
            1 << 20,
            1 << 20,
            0,
            6.0,
            hidden_size=128,
            intermediate_size=256,
            vocab_size=512,
            **shape,
        ),
        AttentionRecord(
            "cp",
            2,
            1,
            512,
            16,
            2,
            None,
            "collective",
            0.1,
            1 << 20,
            10**8,
            1 << 20,
            1.0,
            hidden_size=128,
            **shape,
        ),
        DFlashRecord(
            "csbp",
            2,
            2,
            1,
            1024,
            16,
            16,
            2,
            1,
            0.2,
            10**8,
            1 << 20,
            1 << 20,
            3.0,
            hidden_size=128,
            intermediate_size=384,
            vocab_size=1024,
            feature_width=128,
            **shape,
        ),
    ]
    path = tmp_path / "bench.json"
    path.write_text(json.dumps([asdict(r) for r in records]))
    observations = bench_observations([path])
    assert [o.metric for o in observations] == ["step_s", "mem_gib"] * 3
    assert observations[-1].workload.objective.is_drafter
    # a compiled step is not what the cost model's eager efficiencies describe: one line, not a skewed fit
    compiled = tmp_path / "compiled.json"
    compiled.write_text(json.dumps([{**asdict(records[0]), "compile": "layers"}]))
    with pytest.raises(ValueError, match=r"compiled.json\[0\]: timed with `--compile layers` .* --compile none\)$"):
        bench_observations([compiled])


def test_calibrate_times_every_benchmark_by_its_fastest_repeat_and_reads_older_files(tmp_path: Path) -> None:
    """``--timing fastest`` (the default) read ``step_time_min_s``, which only ``bench train`` writes: an
    attention or DFlash record was fitted on its median while a train record in the same file was
    fitted on its fastest repeat. Now every record's fastest repeat (``step_times_s``) is read; files
    from before the repeats still read (train's ``step_time_min_s``, else the median)."""
    from csbp.plan.fit import bench_observations

    shape = {"hidden_size": 128, "num_layers": 1, "num_heads": 4, "num_kv_heads": 2, "head_dim": 32, "seq_len": 512,
             "block_size": 16, "nproc": 2, "cp": 2, "bp": 1, "layout": "cp", "peak_mem_bytes": 1 << 20}
    new = {**shape, "step_time_s": 1.0, "step_times_s": [1.5, 0.5, 1.0]}
    old_attention = {**shape, "step_time_s": 1.0}
    old_train = {**old_attention, "objective": "bd3", "vocab_size": 512, "intermediate_size": 256,
                 "step_time_min_s": 0.75}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps([new, old_attention, old_train]))
    steps = [o.value for o in bench_observations([path]) if o.metric == "step_s"]
    assert steps == [0.5, 1.0, 0.75]  # the first was 1.0, its median
    assert [o.value for o in bench_observations([path], fastest=False) if o.metric == "step_s"] == [1.0] * 3


def test_calibrate_says_when_no_fitted_record_informs_the_drafter_factor() -> None:
    """Every drafter record of a calibration was held (document-masked beside one-document decoder
    records): drafter_eff silently kept its prior."""
    from types import SimpleNamespace

    from csbp.cli.plan_calibrate_cmd import _held_notes

    def obs(drafter: bool, doc_length: int | None) -> SimpleNamespace:
        objective = SimpleNamespace(is_drafter=drafter)
        return SimpleNamespace(workload=SimpleNamespace(objective=objective, doc_length=doc_length))

    decoder, drafter = obs(False, None), obs(True, 256)
    notes = _held_notes([decoder, drafter], [decoder], one_document=True, limit=None)
    assert notes[0].startswith("note: 1 document-masked record(s) held")
    assert notes[-1] == "note: drafter_eff keeps its prior: no drafter record was fitted"
    assert _held_notes([decoder], [decoder], one_document=True, limit=None) == []


def test_calibrate_leaves_out_the_compiled_records_of_a_compile_sweep(tmp_path: Path, capsys) -> None:
    """``bench train --compile none layers`` writes eager and compiled records in one file: calibrate fits the
    eager ones and says what it left out (it refused the whole file); a file of compiled records only is one line."""
    sweep = Path(__file__).resolve().parents[1] / "docs" / "bench" / "train_compile.json"
    records = json.loads(sweep.read_text())
    assert {r["compile"] for r in records} == {"none", "layers"}
    code, out, err = run(capsys, "plan", "calibrate", str(sweep), "--out", str(tmp_path / "cal.json"))
    assert (code, err) == (0, "") and (tmp_path / "cal.json").is_file()
    assert out.startswith("note: left out 4 compiled record(s) (bench train --compile layers, first ")
    assert sum(" fit " in f" {line}" for line in out.splitlines()) == 8  # the 4 eager records, step and memory
    only = tmp_path / "compiled.json"
    only.write_text(json.dumps([r for r in records if r["compile"] == "layers"]))
    code, _, err = run(capsys, "plan", "calibrate", str(only), "--out", str(tmp_path / "cal2.json"))
    assert code == USER_ERROR_EXIT_CODE and "and no eager one" in err and "--compile none" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "cal2.json").exists()
