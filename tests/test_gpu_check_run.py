"""The device check as a run: the CPU dry run of every stage, the report kept current while it runs,
the watchdog at the end of the budget, command stages cut short (with their workers), pytest and
kernel-row parsing, the dependency preflight and the Makefile's device-machine branch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from csbp.gpu import check, preflight
from csbp.gpu.check import StageResult, pytest_counts, summarize_kernel_rows
from csbp.gpu.report import CheckReport, expire, start_watchdog
from csbp.gpu.stage import CheckEnv, Stage, command_stage

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_dry_run_walks_every_stage_on_the_cpu_and_writes_the_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(REPO)
    path = tmp_path / "out" / "gpu-check.json"
    assert check.main(["--dry-run-cpu", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    payload = json.loads(path.read_text())
    assert payload["ok"] is True and payload["complete"] is True and payload["device"]["dry_run"] is True
    stages = {stage["name"]: stage for stage in payload["stages"]}
    assert list(stages) == [stage.name for stage in check.STAGES]
    assert {stage["status"] for stage in stages.values()} == {"ok"}, {n: s["summary"] for n, s in stages.items()}
    # the DFlash draft attention's backward runs on the CPU where the direct flex backward exists
    from csbp.attention.flex_backward import direct_backward_support

    expected = {"passed": 4} if direct_backward_support()[0] else {"passed": 3, "skipped": 1}
    assert stages["cuda-tests"]["details"]["counts"] == expected
    assert payload["device"]["flex_backward"] == ("direct" if direct_backward_support()[0] else "recompute")
    for name in ("verify", "verify-dflash"):
        command = stages[name]["details"]["command"]
        assert command[command.index("--device") + 1] == "cpu" and command[command.index("--nproc") + 1] == "2"
    rows = stages["kernels"]["details"]["rows"]
    assert rows == json.loads((tmp_path / "out" / "gpu-kernels.json").read_text())
    assert {row["form"] for row in rows} == {"dense", "mixed", "decomposed", "diagonal"}
    assert stages["kernels"]["summary"].startswith(f"{len(rows)} rows, best ")
    table = stages["train-table"]["details"]["rows"]
    assert [(row["kind"], row["status"]) for row in table] == [("bd3", "ok (1 timed)")] * 2 + [
        ("bd3 decomposed", "ok (1 timed)"), ("bd3 compiled", "ok (1 timed)"), ("bd3 selective", "ok (1 timed)"),
        ("dflash a=4", "ok (1 timed)")
    ]
    assert [row["checkpointing"] for row in table if row["kind"] == "bd3 selective"] == ["selective"]
    assert stages["train-table"]["summary"] == "6 of 6 rows measured (tiles backend)"
    # the kernels resolved on the device: auto is matmul on the dry run's tiles at B = 4 (flex on CUDA)
    assert stages["train-table"]["details"]["decomposed_attention"] == {"diagonal": "matmul", "clean": "pieces"}
    assert "CPU dry run" in out and "dflash a=4" in out


def test_the_report_is_on_disk_from_the_start_and_after_every_stage(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "gpu-check.json"
    seen: list[dict] = []

    def first(env: CheckEnv) -> StageResult:
        assert env.seconds_left() > check.DEFAULT_BUDGET_S - 60  # counted from this call, not from the import
        seen.append(json.loads(path.read_text()))  # the device and this stage, running
        env.progress(rows=[{"seq_len": 8}])
        seen.append(json.loads(path.read_text()))
        return StageResult("first", "ok", 0.1, "fine")

    def second(env: CheckEnv) -> StageResult:
        seen.append(json.loads(path.read_text()))
        raise RuntimeError("boom")

    monkeypatch.setattr(check, "STAGES", [Stage("first", "", first), Stage("second", "", second)])
    monkeypatch.setattr(check, "STARTED", time.perf_counter() - 10 * check.DEFAULT_BUDGET_S)  # a long test session
    assert check.main(["--dry-run-cpu", "--json", str(path)]) == 1
    assert [s["status"] for s in seen[0]["stages"]] == ["running"] and seen[0]["complete"] is False
    assert seen[1]["stages"][0]["details"] == {"rows": [{"seq_len": 8}]}
    assert [(s["name"], s["status"]) for s in seen[2]["stages"]] == [("first", "ok"), ("second", "running")]
    final = json.loads(path.read_text())
    assert final["complete"] is True and final["ok"] is False
    assert final["stages"][1]["summary"] == "RuntimeError: boom"


def test_the_watchdog_cuts_the_running_stage_keeps_its_progress_and_exits(tmp_path: Path) -> None:
    report = CheckReport(tmp_path / "gpu-check.json", {"name": "x"}, budget_s=1.0)
    report.finish(StageResult("done", "ok", 1.0, "fine"))
    report.begin("train-table")
    report.progress(rows=[{"seq_len": 8192, "status": "ok (2 timed)"}])
    exits: list[int] = []
    expire(report, "cut at the end of the 1 s budget", exit=exits.append)
    assert exits == [1]
    payload = json.loads(report.path.read_text())
    assert payload["complete"] is False and payload["ok"] is False
    cut = payload["stages"][1]
    assert (cut["name"], cut["status"], cut["summary"]) == ("train-table", "failed", "cut at the end of the 1 s budget")
    assert cut["details"]["rows"] == [{"seq_len": 8192, "status": "ok (2 timed)"}]
    fired: list[int] = []
    timer = start_watchdog(0.05, CheckReport(tmp_path / "b.json", {}, budget_s=0.0), exit=fired.append)
    timer.join(5)
    assert fired == [1] and timer.daemon
    between = json.loads((tmp_path / "b.json").read_text())
    # cut before any stage ran (the process exits 1): the report said "ok": true
    assert between["complete"] is False and between["ok"] is False and between["cut"].startswith("cut at the end")
    assert payload["cut"] == "cut at the end of the 1 s budget"


def test_a_command_stage_cut_at_its_limit_kills_its_workers_and_keeps_the_output(tmp_path: Path) -> None:
    code = (
        "import subprocess, sys, time\n"
        "worker = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print('worker', worker.pid)\n"
        "time.sleep(60)\n"
    )
    stage = command_stage("slow", "", lambda env: [sys.executable, "-c", code], timeout_s=3)
    env = CheckEnv(gpus=1, device_name="x", peak_tflops=None, repo=tmp_path, args=None,  # type: ignore[arg-type]
                   deadline=time.perf_counter() + 60, out_dir=tmp_path)
    import threading

    finished: list[StageResult] = []
    runner = threading.Thread(target=lambda: finished.append(stage.run(env)))
    runner.start()
    log, seen_live = tmp_path / "gpu-slow.log", False
    while runner.is_alive() and not seen_live:  # the log fills while the stage still runs
        seen_live = log.exists() and log.read_text().startswith("worker ")
        time.sleep(0.05)
    runner.join()
    assert seen_live  # read while the stage was still running (it runs 3 s)
    result = finished[0]
    assert (result.status, result.summary) == ("failed", "timed out after 3 s")
    worker = int(str(result.details["output_tail"]).split()[-1])
    assert (tmp_path / "gpu-slow.log").read_text() == f"worker {worker}\n" and result.details["log"] == str(
        tmp_path / "gpu-slow.log"
    )  # the whole output, beside the report
    time.sleep(0.2)
    status = Path(f"/proc/{worker}/status")
    assert not status.exists() or "zombie" in status.read_text()  # killed with its process group


def test_pytest_outcomes_are_counted_and_a_cut_run_says_how_far_it_got(tmp_path: Path) -> None:
    output = (
        "tests/test_cuda.py::test_a[bf16] PASSED                                  [ 10%]\n"
        "tests/test_cuda.py::test_b SKIPPED (needs 2 GPUs)                          [ 20%]\n"
        "tests/test_flex_cuda.py::test_c[backward-fp32-reference] FAILED            [ 30%]\n"
        "tests/test_flex_cuda.py::test_d ERROR                                      [ 40%]\n"
        "tests/test_flex_cuda.py::test_e PASSED                                     [ 50%]\n"
    )
    counts, failed = pytest_counts(output)
    assert counts == {"passed": 2, "skipped": 1, "failed": 1, "error": 1}
    assert failed == ["tests/test_flex_cuda.py::test_c[backward-fp32-reference]", "tests/test_flex_cuda.py::test_d"]
    env = CheckEnv(gpus=1, device_name="x", peak_tflops=None, repo=tmp_path, args=None,  # type: ignore[arg-type]
                   deadline=time.perf_counter() + 60, out_dir=tmp_path)
    cut = StageResult("cuda-tests", "failed", 200.0, "timed out after 200 s", {"returncode": -9})
    summary = check._cuda_tests_report(env, cut, output).summary
    assert summary == "timed out after 200 s; 2 passed, 1 skipped, 1 failed, 1 error before the limit"
    done = StageResult("cuda-tests", "ok", 20.0, "=== 2 passed in 20s ===", {"returncode": 0})
    assert check._cuda_tests_report(env, done, output).summary == "=== 2 passed in 20s ==="


def test_kernel_rows_summary_and_a_stage_cut_short_keeps_its_rows(tmp_path: Path) -> None:
    nan = float("nan")
    rows = [
        {"form": "dense", "vs_dense": 1.0, "decomposed_speedup": nan},
        {"form": "mixed", "vs_dense": nan, "decomposed_speedup": nan},
        {"form": "mixed", "vs_dense": 0.61, "decomposed_speedup": nan},
        {"form": "decomposed", "vs_dense": 0.74, "decomposed_speedup": 1.21},
        {"form": "decomposed", "vs_dense": 0.5, "decomposed_speedup": 0.82},
    ]
    assert summarize_kernel_rows(rows) == "5 rows, best 0.74x dense SDPA's rate, decomposed/mixed 0.82-1.21x"
    assert summarize_kernel_rows([]) == "0 rows"
    compiled = [{"form": "mixed-ag", "vs_dense": 0.8, "first_call_s": 12.5, "compiled_graphs": 2},
                {"form": "mixed", "vs_dense": 0.6, "first_call_s": 31.0, "compiled_graphs": 3}]
    assert summarize_kernel_rows(compiled) == (
        "2 rows, best 0.80x dense SDPA's rate, 5 graphs compiled, slowest first call 31.0 s"
    )
    in_range = [{**r, "seq_len": 65536, "block_size": 128, "backend": "flex", "time_s": t, "diagonal": "sdpa",
                 "clean": "pieces"} for r, t in zip(rows[1:4], (nan, 1.2, 1.0), strict=True)]
    assert summarize_kernel_rows(in_range) == (  # rows in the kernel targets' range: their worst values too
        "3 rows, best 0.74x dense SDPA's rate, decomposed/mixed 1.21-1.21x; targets at L = 65536: worst mixed 0.61x "
        "and decomposed 0.74x dense's rate (>= 0.60x); decomposed/mixed worst 1.20x (>= 1.0x), at B=128 1.20x (>= 1.2x); "
        "verdict: met (up to L = 65536: 131072 not reached)"
    )
    # the CUDA check's summary always carries the verdict, also when no shape in the range was measured
    assert summarize_kernel_rows(rows, targets=True).endswith("; targets: no shape measured at L = 16384-131072")
    (tmp_path / "gpu-kernels.json").write_text(json.dumps(rows))
    env = CheckEnv(gpus=1, device_name="x", peak_tflops=None, repo=tmp_path, args=None,  # type: ignore[arg-type]
                   deadline=time.perf_counter() + 60, out_dir=tmp_path)
    cut = check._kernels_report(env, StageResult("kernels", "failed", 120.0, "timed out after 120 s"), "")
    assert cut.summary.startswith("timed out after 120 s; 5 rows, best 0.74x") and len(cut.details["rows"]) == 5
    assert cut.summary.endswith("targets: no shape measured at L = 16384-131072 before that")  # CUDA profile


def test_preflight_names_missing_dependencies_before_anything_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {dep.split(">")[0].split("=")[0].split("<")[0].strip() for dep in declared}
    assert names == set(preflight.RUNTIME_MODULES)  # the preflight checks what pyproject declares
    (torch_floor,) = [dep for dep in declared if dep.startswith("torch>=")]
    assert torch_floor.split(">=")[1].split()[0] == ".".join(map(str, preflight.OLDEST_TORCH))
    assert preflight.missing_packages() == []
    real = preflight.importlib.util.find_spec
    monkeypatch.setattr(preflight.importlib.util, "find_spec", lambda name: None if name == "pydantic" else real(name))
    assert check.main(["--dry-run-cpu", "--json", str(tmp_path / "gpu-check.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gpu-check: error: missing Python package(s) pydantic;") and "make gpu-wheels" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "gpu-check.json").exists()


def test_preflight_refuses_a_torch_older_than_pyprojects_floor(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """The flex backend calls FlexAttention's AuxRequest (newer than torch 2.8): an older device image
    failed inside the stages."""
    assert preflight.torch_too_old("2.11.0+cu130") is None and preflight.torch_too_old("2.13.0+cpu") is None
    assert preflight.torch_too_old("3.0.0") is None and preflight.torch_too_old("nightly") is None
    assert preflight.torch_too_old("2.8.0+cu128").startswith("gpu-check: error: torch 2.8.0+cu128 is older than 2.11")
    assert preflight.torch_too_old() is None  # the installed one
    monkeypatch.setattr(preflight.importlib.metadata, "version", lambda name: "2.6.0" if name == "torch" else "9")
    assert check.main(["--dry-run-cpu", "--json", str(tmp_path / "gpu-check.json")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("gpu-check: error: torch 2.6.0 is older than 2.11") and not (tmp_path / "gpu-check.json").exists()


def _wheel(directory: Path) -> Path:
    """A minimal pure-Python wheel (module ``csbp_probe``), as ``make gpu-wheels`` would leave one."""
    path = directory / "csbp_probe-1.0-py3-none-any.whl"
    files = {
        "csbp_probe.py": "VALUE = 7\n",
        "csbp_probe-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: csbp_probe\nVersion: 1.0\n",
        "csbp_probe-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
        record = "".join(f"{name},,\n" for name in files) + "csbp_probe-1.0.dist-info/RECORD,,\n"
        archive.writestr("csbp_probe-1.0.dist-info/RECORD", record)
    return path


@pytest.mark.slow
def test_make_gpu_check_without_a_venv_runs_the_image_python_from_src_with_the_carried_wheels(tmp_path: Path) -> None:
    """The device machine's branch of ``make gpu-check``: no .venv, wheels unpacked to GPU_SITE."""
    wheels = tmp_path / "whl"
    wheels.mkdir()
    _wheel(wheels)
    site = tmp_path / "site"
    # csbp itself must come from the src/ that make puts first; the caller's other PYTHONPATH entries stay,
    # since they may be where this interpreter's dependencies are (the image's python3 with the wheels
    # unpacked beside it, as on a device machine).
    others = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != REPO / "src"]
    done = subprocess.run(
        ["make", "--no-print-directory", "gpu-check", f"VENV={tmp_path / 'no-venv'}", f"GPU_PYTHON={sys.executable}",
         f"GPU_WHEEL_DIR={wheels}", f"GPU_SITE={site}", "GPU_CHECK_ARGS=--list"],
        cwd=REPO, capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": os.pathsep.join(others)},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (site / "csbp_probe.py").exists()
    assert f"PYTHONPATH={REPO / 'src'}:{site} {sys.executable} -m csbp.gpu.check" in done.stdout
    assert "train-table" in done.stdout  # --list ran from src/


def test_a_check_past_its_budget_ends_with_the_report_on_disk(tmp_path: Path) -> None:
    """The watchdog's real exit: an in-process stage that would run for a minute is cut at the budget."""
    path = tmp_path / "gpu-check.json"
    script = (
        "import sys, time\n"
        "from csbp.gpu import check\n"
        "check.WATCHDOG_GRACE_S = 0.5\n"
        "def stuck(env):\n"
        "    env.progress(rows=[{'seq_len': 8192}])\n"
        "    time.sleep(60)\n"
        "check.STAGES[:] = [check.Stage('train-table', 'stuck', stuck)]\n"
        # the flex backward's probe (a compile, seconds on a loaded machine) once, before the 2 s budget starts:
        # it once took the whole budget there, and the watchdog fired before the stage began
        "check.resolve_flex_backward('auto')\n"
        f"sys.exit(check.main(['--dry-run-cpu', '--budget-s', '2', '--json', {str(path)!r}]))\n"
    )
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and time.perf_counter() - start < 30, done.stdout + done.stderr
    assert "cut at the end of the 2 s budget" in done.stdout
    payload = json.loads(path.read_text())
    assert payload["complete"] is False and payload["ok"] is False
    (stage,) = payload["stages"]
    assert (stage["status"], stage["details"]) == ("failed", {"rows": [{"seq_len": 8192}]})
