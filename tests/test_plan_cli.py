"""``csbp plan`` and ``topology: auto``: tables, JSON, fail-closed errors (``csbp plan calibrate`` is
in ``test_plan_calibrate.py``, which shares ``run`` from here)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from csbp.cli.main import USER_ERROR_EXIT_CODE, main
from csbp.plan.auto import resolve_auto_topology, wants_auto
from csbp.plan.hardware import hardware
from csbp.recipes import load_run_config


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plan_prints_a_ranked_table_oom_apart_and_why(tmp_path: Path, capsys) -> None:
    out_json = tmp_path / "plan.json"
    code, out, err = run(
        capsys,
        "plan",
        "--model",
        "nemotron-3b",
        "--seq-len",
        "64K",
        "--gpus",
        "16",
        "--gpu",
        "h200",
        "--top",
        "3",
        "--json",
        str(out_json),
    )
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0].startswith("csbp plan: NemotronDiffusion-3B") and "16xH200" in lines[0]
    assert "  1 dp" in out and "out of memory:" in out and "largest term" in out
    assert [line for line in lines if line.startswith("why: ")]
    payload = json.loads(out_json.read_text())
    assert payload["feasible"][0]["tokens_per_s"] >= payload["feasible"][1]["tokens_per_s"]
    assert all(not p["fits"] and p["reason"] for p in payload["infeasible"])
    assert payload["calibration"]["source"].startswith("fitted on the fit:true points")


def test_plan_evaluates_given_topologies(capsys) -> None:
    code, out, _ = run(
        capsys,
        "plan",
        "--model",
        "nemotron-14b",
        "--seq-len",
        "256K",
        "--gpus",
        "16",
        "--gpu",
        "h200",
        "--topology",
        "dp2/cp8",
        "dp2/cp8/bp8",
        "--checkpointing",
        "full",
        "--placement",
        "striped",
        "--sharding",
        "zero2",
    )
    assert code == 0
    table = [line for line in out.splitlines() if line[:3].strip().isdigit()]
    assert len(table) == 4 and {line.split()[1] for line in table} == {"dp2/cp8", "dp2/cp8/bp8"}


def test_plan_with_documents_adds_cp_aware_and_halo_rows(tmp_path: Path, capsys) -> None:
    out_json = tmp_path / "plan.json"
    argv = ["plan", "--model", "nemotron-3b", "--seq-len", "64K", "--gpus", "8", "--gpu", "h200",
            "--topology", "dp1/cp8", "dp1/cp8/bp8", "--checkpointing", "full", "--json", str(out_json)]
    code, out, _ = run(capsys, *argv, "--doc-length", "2048")
    assert code == 0 and "packed documents of mean length 2,048 (document mask)" in out.splitlines()[0]
    feasible = json.loads(out_json.read_text())["feasible"]
    rows = {(r["layout"], r["transport"]): r for r in feasible if r["schedule"] == "dual_end"}
    assert set(rows) == {("dp1/cp8", t) for t in ("collective", "streaming", "halo")} | {
        ("dp1/cp8/bp8", t) for t in ("collective", "streaming")
    }
    balanced = {(r["layout"], r["transport"]) for r in feasible if r["schedule"] == "balanced"}
    assert balanced == {("dp1/cp8/bp8", t) for t in ("collective", "streaming")}  # the BP layouts only
    assert rows["dp1/cp8", "halo"]["exchange"] == rows["dp1/cp8/bp8", "collective"]["exchange"] == "halo"
    assert rows["dp1/cp8", "collective"]["exchange"] == "all rows"
    assert rows["dp1/cp8", "halo"]["kv_bytes_per_gpu"] < rows["dp1/cp8", "collective"]["kv_bytes_per_gpu"]
    code, _, _ = run(capsys, *argv)
    plain = {(r["layout"], r["transport"]) for r in json.loads(out_json.read_text())["feasible"]}
    assert ("dp1/cp8", "halo") not in plain and ("dp1/cp8/bp8", "collective") in plain


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "nemotron-14b", "--gpus", "16"], "needs --seq-len"),
        (["--model", "nemotron-14b", "--seq-len", "4K"], "needs --model and --gpus"),
        (["--model", "nemotron-3b", "--seq-len", "4K", "--gpus", "4", "--set", "a.b=1"], "run configs only"),
        (["--model", "nope", "--seq-len", "4K", "--gpus", "4"], "--model 'nope' is no preset (nemotron-3b, "),
        (["--model", "nemotron-3bb", "--seq-len", "4K", "--gpus", "4"], "(fix: did you mean nemotron-3b?)"),
        # a missing file said which kinds of --model there are, not that the file is missing
        (["--model", "run.yaml", "--gpus", "4"], "--model run.yaml: no such file or directory (fix: check the path"),
        (["--model", "configs/run", "--gpus", "4"], "--model configs/run: no such file or directory"),
        (
            ["--model", "nemotron-3b", "--seq-len", "4K", "--gpus", "4", "--topology", "dp2/cp4"],
            "uses 8 devices",
        ),
        (
            ["--model", "nemotron-3b", "--seq-len", "4K", "--gpus", "4", "--topology", "cp4/bp2"],
            "multiple of cp",
        ),
        (
            ["--model", "nemotron-3b", "--seq-len", "4K", "--gpus", "4", "--objective", "dflash"],
            "drop --objective",
        ),
        (["--model", "nemotron-3b", "--seq-len", "4K", "--gpus", "4", "--doc-length", "0"], "--doc-length must be >= 1"),
        (
            ["--model", "nemotron-3b", "--seq-len", "4096", "--gpus", "8", "--gpus-per-node", "3"],
            "--gpus 8 is not a multiple of --gpus-per-node 3: a job on more than one node fills whole nodes "
            "(fix: --gpus 6 or 9, or --gpus-per-node 2 or another divisor of 8)",
        ),
        (
            ["--model", "nemotron-3b", "--seq-len", "4096", "--gpus", "12"],
            "--gpus 12 is not a multiple of the h100 preset's 8 per node",
        ),
        (
            ["--model", "nemotron-3b", "--seq-len", "4097", "--gpus", "8"],
            "--seq-len 4097: no layout of 8 devices accepts it, not even data parallel: seq_len=4097 is not a multiple "
            "of block_size=32 (fix: --seq-len 4096 or 4128, or --block-size 17 or 241)",
        ),
        (
            ["--model", "nemotron-3b", "--seq-len", "4096", "--gpus", "8", "--objective", "mdlm", "--global-batch", "3"],
            "--global-batch 3 is not a multiple of dp x micro-batch of any layout csbp accepts here (dp 8; "
            "micro-batches 1, 2, 4) (fix: --global-batch 8, a multiple of 8)",
        ),
        (
            ["--model", "dflash2-qwen3.8", "--seq-len", "4097", "--gpus", "8"],
            "seq_len=4097 must be a multiple of 2*cp = 2 (the drafter's zigzag chunks) (fix: --seq-len 4096 or 4098)",
        ),
        (
            ["--model", "nemotron-3b", "--seq-len", "4160", "--gpus", "8", "--topology", "dp1/cp8"],
            "--topology dp1/cp8: seq_len=4160 must be a multiple of cp*block_size",
        ),
        (
            ["--model", "nemotron-3b", "--seq-len", "32", "--gpus", "8"],
            "--seq-len 32: no layout of 8 devices accepts it, not even data parallel: block_size=32 must be below "
            "seq_len=32 for bd3 (one block per sequence is mdlm's) (fix: --seq-len 64 or more, or --block-size below 32)",
        ),
        (
            ["--model", "dflash2-qwen3.8", "--seq-len", "8", "--gpus", "8"],
            "block_size=8 must be below seq_len=8 for dflash",
        ),
        (
            ["--model", "nemotron-3b", "--seq-len", "4096", "--gpus", "8", "--topology", "dp1/cp4"],
            "--topology dp1/cp4 uses 4 devices, not --gpus 8 (fix: --gpus 4, or --topology dp2/cp4)",
        ),
        (  # it said "Topology(cp=3, bp=4) is not a valid fused CSBP layout", naming neither flag nor notation
            ["--model", "nemotron-3b", "--seq-len", "4096", "--gpus", "12", "--gpus-per-node", "12", "--topology",
             "dp1/cp3/bp4"],
            "--topology 'dp1/cp3/bp4': bp4 is not a multiple of cp3, which a fused CSBP layout needs (fix: e.g. "
            "dp1/cp3/bp6)",
        ),
        (
            ["--model", "nemotron-3b", "--seq-len", "4096", "--gpus", "8", "--topology", "dp2/cp4", "--global-batch", "3"],
            "--global-batch 3 is not a multiple of dp x micro-batch = 2 of --topology dp2/cp4 (fix: --global-batch 4, "
            "a multiple of 2)",
        ),
        (  # the search looped over every number up to --gpus: no end
            ["--model", "nemotron-3b", "--seq-len", "4096", "--gpus", str(10**12)],
            "argument --gpus: 1000000000000 is too large (at most 2147483647: torch.distributed and NCCL number ranks "
            "with a C int)",
        ),
        (  # it priced mdlm with the window, a run csbp train refuses (topology.window on a single-stream objective)
            ["--model", "nemotron-3b", "--seq-len", "4096", "--gpus", "8", "--objective", "mdlm", "--window", "512"],
            "--window 512: mdlm trains full attention (csbp train refuses topology.window for it) (fix: drop --window, "
            "or plan --objective bd3 or fast_dllm_v2)",
        ),
        (  # numpy's ArrayMemoryError traceback (7.28 TiB for one array of 10**12 rows)
            ["--model", "nemotron-3b", "--seq-len", str(2**50), "--gpus", "8"],
            f"--seq-len {2**50}: csbp plan counts every row's allowed pairs, and planning {2**50} rows of block size 32",
        ),
    ],
)
def test_plan_user_errors_are_one_line(capsys, argv, message) -> None:
    code, out, err = run(capsys, "plan", *argv)
    assert code == USER_ERROR_EXIT_CODE and message in err and len(err.strip().splitlines()) == 1
    assert out == ""  # no (empty) table


@pytest.mark.parametrize(
    ("extra", "per_token"),
    [((), 48 + 576 / 32), (("--doc-length", "64"), 48 + 96 + 576 / 32), (("--block-size", "1"), 48 + 576)],
)
def test_plan_refuses_a_seq_len_whose_planning_cannot_fit_memory(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, extra: tuple[str, ...], per_token: float
) -> None:
    """The bound counted the two prefix sums only (16 bytes per token), but planning peaked at about 80
    (more with documents, about 560 at --block-size 1): between 300M and 1.6G tokens it ran a 24 GiB
    machine out of memory. Here a 1 GiB machine: 2**25 tokens passed the old bound and planned."""
    from csbp.cli import plan_cmd

    monkeypatch.setattr("csbp.plan.hardware.machine_ram_gib", lambda: 1.0)
    monkeypatch.setattr(plan_cmd, "candidate_layouts", lambda *args, **kwargs: pytest.fail("planned"))
    code, out, err = run(capsys, "plan", "--model", "nemotron-3b", "--seq-len", str(2**25), "--gpus", "8", *extra)
    assert (code, out) == (USER_ERROR_EXIT_CODE, "") and len(err.splitlines()) == 1
    assert f"takes about {per_token:.0f} bytes per token" in err
    assert f"(fix: --seq-len {int(2**30 // per_token)} or less)" in err
    fits = int(2**30 // per_token)
    plan_cmd.check_planner_memory(fits, plan_cmd.resolve_workload("nemotron-3b")[0].with_options(
        block_size=int(extra[1]) if extra[:1] == ("--block-size",) else None,
        doc_length=int(extra[1]) if extra[:1] == ("--doc-length",) else None))  # the fix passes


def test_the_search_looks_at_no_ring_larger_than_the_sequence_allows() -> None:
    """``--gpus 10**12`` listed its divisors by a loop over every number up to it; the search now
    stops at the largest ring a sample can be split over, and more devices add replicas."""
    from csbp.plan.search import candidate_layouts, divisors
    from csbp.plan.workload import preset_workload

    assert divisors(10**12, at_most=10) == [1, 2, 4, 5, 8, 10] and divisors(2**31 - 1) == [1, 2**31 - 1]
    assert all(divisors(n, at_most=m) == [d for d in range(1, m + 1) if n % d == 0] for n in range(1, 99) for m in (1, 7, 99))
    layouts = candidate_layouts(preset_workload("nemotron-3b"), 2**30, 4096)
    assert max(max(lay.cp, lay.bp) for lay in layouts) <= 4096 and min(lay.dp for lay in layouts) >= 2**30 // 4096


def test_a_single_stream_objective_has_no_block_rule(capsys) -> None:
    """mdlm is one block per sequence: a row shorter than the preset's 32-token blocks is planned."""
    code, out, err = run(capsys, "plan", "--model", "nemotron-3b", "--objective", "mdlm", "--seq-len", "16", "--gpus", "8")
    assert (code, err) == (0, "") and "  1 dp8 " in out


def test_a_job_within_one_node_needs_no_multiple_of_the_node_size(capsys) -> None:
    code, out, err = run(capsys, "plan", "--model", "nemotron-3b", "--seq-len", "4096", "--gpus", "4")
    assert (code, err) == (0, "") and "4xH100 (8/node)" in out and "  1 dp" in out
    assert hardware("h200", gpus=16, gpus_per_node=4).gpus_per_node == 4


def test_a_cpu_plan_prints_no_node_size(tmp_path: Path, capsys) -> None:
    """Processes of this machine have no node size: the header said "4xCPU (gloo, ...) (1024/node)"."""
    config = tmp_path / "tiny.yaml"
    config.write_text(
        "run: {name: tiny}\n"
        "model: {arch: qwen3, hidden_size: 32, intermediate_size: 64, num_layers: 2, num_heads: 2, num_kv_heads: 1, "
        "head_dim: 16, vocab_size: 64}\n"
        "data: {train: art, seq_len: 64}\nobjective: {name: bd3, block_size: 4}\ntopology: auto\n"
        "optim: {lr: 1.0e-3}\ntrain: {max_steps: 4}\n",
        encoding="utf-8",
    )
    code, out, err = run(capsys, "plan", "--model", str(config), "--seq-len", "256", "--gpus", "4", "--gpu", "cpu")
    header = out.splitlines()[1 if out.startswith("run config") else 0]
    assert (code, err) == (0, "") and "on 4xCPU (gloo, 1 thread/process)" in header and "/node" not in header, out


def test_plan_reads_hf_config_and_run_config(tmp_path: Path, capsys) -> None:
    hf = tmp_path / "model"
    hf.mkdir()
    (hf / "config.json").write_text(
        json.dumps(
            {
                "hidden_size": 256,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "num_hidden_layers": 2,
                "intermediate_size": 512,
                "vocab_size": 1000,
            }
        )
    )
    code, out, _ = run(
        capsys,
        "plan",
        "--model",
        str(hf),
        "--seq-len",
        "1024",
        "--gpus",
        "4",
        "--gpu",
        "cpu",
        "--block-size",
        "16",
        "--top",
        "2",
    )
    assert code == 0 and "block 16" in out
    assert re.search(r"\(\d+\.\d\dM params,", out), out.splitlines()[0]  # not "0.00B params"
    (hf / "config.json").write_text(json.dumps({"hidden_size": 256, "num_local_experts": 8}))
    code, _, err = run(capsys, "plan", "--model", str(hf), "--seq-len", "1024", "--gpus", "4")
    assert code == USER_ERROR_EXIT_CODE and "mixture-of-experts" in err
    code, out, err = run(
        capsys, "plan", "--model", "demo", "--set", "model.vocab_size=512", "--gpus", "4", "--gpu", "cpu"
    )
    assert (code, err) == (0, "") and "at L=64 on 4x" in out  # the demo recipe's data.seq_len
    target = f"objective.dflash.target={hf}"  # a DFlash run config is shaped by its target
    (hf / "config.json").write_text(
        json.dumps(
            {
                "hidden_size": 128,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "num_hidden_layers": 4,
                "intermediate_size": 384,
                "vocab_size": 2048,
            }
        )
    )
    dflash = ("plan", "--model", "dflash-demo", "--set", target, "--set", f"data.train={tmp_path / 'none'}", "--gpus", "4")
    code, out, err = run(capsys, *dflash, "--gpu", "cpu")  # dflash masks documents: data.train's are planned
    assert code == USER_ERROR_EXIT_CODE and "data.document_mask" in err and "not a csbp data artifact" in err
    code, out, err = run(capsys, *dflash, "--gpu", "cpu", "--doc-length", "64")
    assert (code, err) == (0, "") and "DFlash(" in out and "dflash, block 4" in out


def test_topology_auto_in_config_validate_fails_with_the_fix(capsys) -> None:
    code, _, err = run(capsys, "config", "validate", "demo", "--set", "topology=auto")
    assert code == USER_ERROR_EXIT_CODE and "chosen by the planner" in err and "config validate CONFIG --nproc N" in err


def test_config_validate_with_nproc_validates_the_layout_auto_would_launch(capsys) -> None:
    auto = ["config", "validate", "demo", "--set", "topology=auto", "--set", "model.vocab_size=512"]  # no artifact needed
    code, out, err = run(capsys, *auto, "--nproc", "4")
    assert (code, err) == (0, "") and out.startswith("topology: auto -> dp4, ")
    assert "config ok: demo" in out and "topology   data layout: dp=4 cp=1 bp=1, world size 4" in out
    code, out, err = run(capsys, *auto, "--nproc", "2", "--nnodes", "2")
    assert code == 0 and "for 4 processes" in out and "world size 4" in out
    code, _, err = run(capsys, "config", "validate", "demo", "--nproc", "4")  # nothing to plan: not silently ignored
    assert code == USER_ERROR_EXIT_CODE and err.strip() == (
        "csbp: error: --nproc 4: demo sets its topology, so there is no layout to plan (fix: drop --nproc, or "
        "validate it with --set topology=auto)"
    )


def test_topology_auto_resolves_to_a_valid_layout_for_nproc(capsys) -> None:
    overrides = ["topology=auto", "model.vocab_size=512"]
    assert wants_auto("demo", overrides) and not wants_auto("demo", ["model.vocab_size=512"])
    resolved = resolve_auto_topology("demo", overrides, nproc=4)
    out = capsys.readouterr().out
    assert out.startswith("topology: auto -> ") and "predicted" in out and "GiB per process" in out
    assert "; overlap: no K/V ring; " in out  # data parallel: nothing to hide
    resolve_auto_topology("demo", [*overrides, "data.seq_len=65536", "train.micro_batch_size=1"], nproc=4)
    out = capsys.readouterr().out  # a ring: the share csbp plan's overlap: line spells out
    # streaming's prediction hides only behind its ring attention: it named overlap_csbp's 0% too, which it never used
    assert "-> dp2/cp2/bp2 streaming" in out and "; overlap: streaming hides K/V traffic up to 80% of its ring attention " \
        "(overlap_stream); " in out and "overlap_csbp" not in out
    cfg = load_run_config("demo", resolved)
    assert cfg.world_size == 4
    with pytest.raises(ValueError, match="--nproc N"):
        resolve_auto_topology("demo", overrides, nproc=None)


def test_topology_auto_in_the_config_file(tmp_path: Path, capsys) -> None:
    import yaml

    from csbp.recipes import copy_recipe

    path = copy_recipe("demo", tmp_path)
    data = yaml.safe_load(path.read_text())
    data["topology"] = "auto"
    path.write_text(yaml.safe_dump(data))
    assert wants_auto(str(path), [])
    resolved = resolve_auto_topology(str(path), ["model.vocab_size=512"], nproc=2)
    assert "topology: auto -> " in capsys.readouterr().out
    assert load_run_config(str(path), resolved).world_size == 2


def test_plan_prices_selective_checkpointing_between_full_and_none(tmp_path: Path, capsys) -> None:
    """``--checkpointing selective`` (``train.activation_checkpointing: selective``): less memory than none
    and a shorter step than full, which recomputes the attention and re-sends its K/V."""
    out_json = tmp_path / "plan.json"
    argv = ["plan", "--model", "nemotron-3b", "--seq-len", "64K", "--gpus", "8", "--gpu", "h200",
            "--topology", "dp1/cp8/bp8", "--json", str(out_json)]
    rows = {}
    for mode in ("none", "full", "selective"):
        code, out, _ = run(capsys, *argv, "--checkpointing", mode)
        assert code == 0, out
        report = json.loads(out_json.read_text())
        (row,) = [r for r in report["feasible"] + report["infeasible"] if r["transport"] == "collective"]
        rows[mode] = row
    assert rows["selective"]["activation_checkpointing"] == "selective" and " sel " in out
    assert rows["full"]["mem_gib"] < rows["selective"]["mem_gib"] < rows["none"]["mem_gib"]
    assert rows["none"]["step_s"] < rows["selective"]["step_s"] < rows["full"]["step_s"]
    assert rows["selective"]["kv_bytes_per_gpu"] == rows["none"]["kv_bytes_per_gpu"] < rows["full"]["kv_bytes_per_gpu"]
