"""``csbp bench kernels`` on CPU: records, table, --json/--png, aten op counts and one-line errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from csbp.bench.kernel_profile import count_aten_ops
from csbp.bench.kernels import build_forms, run_kernel_bench
from csbp.cli.main import main


def test_kernel_bench_command_writes_table_json_and_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "kernels.json"
    code = main(["bench", "kernels", "--seq-lens", "64", "--block-sizes", "8", "32", "--repeats", "1",
                 "--warmup", "0", "--num-heads", "2", "--num-kv-heads", "1", "--head-dim", "16", "--json", str(out),
                 "--diagonals", "matmul", "sdpa"])
    assert code == 0
    records = json.loads(out.read_text())
    assert out.with_suffix(".png").stat().st_size > 0
    assert {(r["block_size"], r["backend"], r["form"], r["diagonal"], r["clean"]) for r in records} == {
        (b, backend, form, diagonal, clean) for b in (8, 32) for backend, form, diagonal, clean in
        (("sdpa", "dense", "-", "-"), ("tiles", "mixed", "-", "-"), ("tiles", "diagonal", "matmul", "-"),
         ("tiles", "diagonal", "sdpa", "-"))
        + tuple(("tiles", "decomposed", d, c) for d in ("matmul", "sdpa") for c in ("pieces", "generic"))
    }
    for r in records:
        assert r["time_s"] > 0 and r["tflops"] > 0
        if r["backend"] == "tiles":
            assert r["useful_pairs"] < 128 * 128 and r["aten_ops"] > 0 and r["mask_build_s"] > 0
        if r["form"] == "diagonal":
            assert r["useful_pairs"] == 64 * r["block_size"]
        if r["backend"] == "tiles":  # timed first call; tiles compile nothing
            assert r["first_call_s"] > 0 and r["compiled_graphs"] == 0
    decomposed = [r for r in records if r["form"] == "decomposed"]
    mixed = {r["block_size"]: r["time_s"] for r in records if r["form"] == "mixed"}
    assert all(r["decomposed_speedup"] == pytest.approx(mixed[r["block_size"]] / r["time_s"]) for r in decomposed)
    assert "decomp x" in capsys.readouterr().out


def test_mixed_and_decomposed_forms_compute_the_same_attention() -> None:
    from csbp.attention.layouts import reference_layout
    from csbp.attention.transports.local import local_attention_forward

    rows = reference_layout(32, 4).rows
    forms = build_forms(rows, 32, 4, "tiles")
    q, k, v = (torch.randn(1, 2, 64, 8, dtype=torch.float64) for _ in range(3))
    (out_m, lse_m), (out_d, lse_d) = (local_attention_forward(q, k, v, forms[f]) for f in ("mixed", "decomposed"))
    torch.testing.assert_close(out_m, out_d)
    torch.testing.assert_close(lse_m, lse_d)
    assert count_aten_ops(lambda: local_attention_forward(q, k, v, forms["decomposed"])) > 0


def test_kernel_bench_fails_closed(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "kernels", "--backends", "flex"]) == 2
    assert "--backends flex needs --device cuda" in capsys.readouterr().err
    assert main(["bench", "kernels", "--diagonals", "flex"]) == 2
    assert "diagonal=flex needs attention.backend=flex" in capsys.readouterr().err
    assert main(["bench", "kernels", "--diagonals", "dense"]) == 2
    assert "--diagonals must be one of" in capsys.readouterr().err
    assert main(["bench", "kernels", "--clean-kernels", "pieces-cudnn"]) == 2
    assert "--clean-kernels pieces-cudnn needs --device cuda" in capsys.readouterr().err
    assert main(["bench", "kernels", "--seq-lens", "100", "--block-sizes", "16"]) == 2
    out, err = capsys.readouterr()  # no header before the one error line
    assert out == "" and err == "csbp: error: --seq-lens 100 must be a multiple of every --block-sizes value (16)\n"
    with pytest.raises(ValueError, match="multiple of every --block-sizes"):
        run_kernel_bench([100], [16], ["tiles"])


def test_primary_first_orders_the_primary_rows_of_every_length_first() -> None:
    from csbp.bench.kernels import KernelJob, kernel_jobs

    def diagonals(backend: str, block: int) -> list[str]:
        return ["sdpa", "flex"] if backend == "flex" else ["sdpa"]

    args = ([16384, 65536], [16, 128], ["flex"], diagonals, ["pieces", "generic"])
    by_length = kernel_jobs(*args)
    primary = kernel_jobs(*args, primary_first=1)
    assert sorted(map(repr, by_length)) == sorted(map(repr, primary))  # the same rows, only reordered
    assert [j.seq_len for j in by_length] == sorted(j.seq_len for j in by_length)
    head = primary[:12]  # per length and block: mixed, mixed-ag and the primary decomposed form
    assert {(j.form, j.diagonal, j.clean) for j in head} == {
        ("mixed", "-", "-"), ("mixed-ag", "-", "-"), ("decomposed", "sdpa", "pieces")
    }
    assert [j.seq_len for j in head] == [16384] * 6 + [65536] * 6
    assert KernelJob(65536, 128, "flex", "diagonal", "flex") == primary[-1]
    assert all(j.form in ("decomposed", "diagonal") for j in primary[12:])
    two = kernel_jobs(*args, primary_first=2)  # the first two decomposed variants, clean-major
    assert {(j.form, j.diagonal, j.clean) for j in two[:16] if j.form == "decomposed"} == {
        ("decomposed", "sdpa", "pieces"), ("decomposed", "flex", "pieces")
    }
    assert sorted(map(repr, two)) == sorted(map(repr, by_length)) and len(two) == len(by_length)
    with pytest.raises(ValueError, match="--primary-first must be >= 0"):
        run_kernel_bench([32], [4], ["tiles"], primary_first=-1)


def test_primary_first_measures_the_same_rows_and_speedups(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "k.json"
    assert main(["bench", "kernels", "--seq-lens", "32", "64", "--block-sizes", "8", "--repeats", "1", "--warmup",
                 "0", "--num-heads", "2", "--num-kv-heads", "1", "--head-dim", "8", "--diagonals", "sdpa", "matmul",
                 "--no-op-count", "--primary-first", "--json", str(out)]) == 0
    records = json.loads(out.read_text())
    forms = [(r["seq_len"], r["form"], r["diagonal"], r["clean"]) for r in records]
    assert forms[:6] == [(32, "dense", "-", "-"), (32, "mixed", "-", "-"), (32, "decomposed", "sdpa", "generic"),
                         (64, "dense", "-", "-"), (64, "mixed", "-", "-"), (64, "decomposed", "sdpa", "generic")]
    assert len(forms) == len(set(forms)) == 2 * (2 + 4 + 2)  # dense and mixed once per length, no row twice
    mixed = {r["seq_len"]: r["time_s"] for r in records if r["form"] == "mixed"}
    for r in records:  # the second pass's decomposed rows still compare with their length's mixed form
        if r["form"] == "decomposed":
            assert r["decomposed_speedup"] == pytest.approx(mixed[r["seq_len"]] / r["time_s"])
    printed = capsys.readouterr().out
    assert "L=32 B=8 tiles: fastest mixed (mixed)" in printed and "L=64 B=8 tiles:" in printed


def test_verdicts_and_targets_from_json_rows() -> None:
    from csbp.bench.kernel_summary import format_verdicts, shape_verdicts, target_line

    def row(seq_len: int, block: int, form: str, time_s: float, vs_dense: float, diagonal: str = "-",
            clean: str = "-") -> dict[str, object]:
        return {"seq_len": seq_len, "block_size": block, "backend": "flex", "form": form, "time_s": time_s,
                "vs_dense": vs_dense, "diagonal": diagonal, "clean": clean}

    rows = [
        {"seq_len": 16384, "block_size": 16, "backend": "sdpa", "form": "dense", "time_s": 1.0, "vs_dense": 1.0},
        row(16384, 16, "mixed", 2.0, 0.5), row(16384, 16, "mixed-ag", 1.6, 0.62),
        row(16384, 16, "decomposed", 1.5, 0.66, "sdpa", "pieces"),
        row(16384, 16, "decomposed", float("nan"), float("nan"), "flex", "generic"),  # a failed variant
        row(16384, 128, "mixed-ag", 1.5, 0.66), row(16384, 128, "decomposed", 1.0, 0.99, "flex", "pieces"),
        row(2048, 128, "mixed", 1.0, 0.1), row(2048, 128, "decomposed", 10.0, 0.01, "sdpa", "generic"),
    ]
    verdicts = shape_verdicts(rows)
    assert [(v.seq_len, v.block_size) for v in verdicts] == [(16384, 16), (16384, 128), (2048, 128)]
    first = verdicts[0]
    assert (first.mixed_form, first.decomposed_kernels) == ("mixed-ag", "sdpa diagonal, pieces clean")
    assert first.speedup == pytest.approx(1.6 / 1.5)
    assert "L=16384 B=128 flex: fastest mixed (mixed-ag) 0.66x dense's rate; fastest decomposed (flex diagonal, " \
        "pieces clean) 0.99x dense's rate = 1.50x the mixed form's speed" in format_verdicts(verdicts)
    line = target_line(rows)  # 2048 is outside the targets' range: its 0.1x does not count
    assert line == ("targets at L = 16384: worst mixed 0.62x and decomposed 0.66x dense's rate (>= 0.60x); "
                    "decomposed/mixed worst 1.07x (>= 1.0x), at B=128 1.50x (>= 1.2x); "
                    "verdict: met (up to L = 16384: 131072 not reached)")
    assert target_line(rows[-2:]) == "targets: no shape measured at L = 16384-131072"


def test_the_target_line_ends_with_a_verdict_naming_what_missed_or_was_not_measured() -> None:
    """The kernels stage's summary is #8's verdict: a value under its target is named, a target without
    a measured row is not counted as met, and the range's upper end is required for a plain "met"."""
    from csbp.bench.kernel_summary import target_line

    def row(seq_len: int, block: int, form: str, time_s: float, vs_dense: float) -> dict[str, object]:
        return {"seq_len": seq_len, "block_size": block, "backend": "flex", "form": form, "time_s": time_s,
                "vs_dense": vs_dense, "diagonal": "sdpa", "clean": "pieces"}

    full_range = [row(n, b, form, t, r) for n in (16384, 131072) for b in (16, 128)
                  for form, t, r in (("mixed-ag", 1.3, 0.7), ("decomposed", 1.0, 0.9))]
    assert target_line(full_range).endswith("at B=128 1.30x (>= 1.2x); verdict: met")
    slow = [*full_range[:-1], row(131072, 128, "decomposed", 1.2, 0.55)]  # 1.08x at B=128, 0.55x dense
    assert target_line(slow).endswith("verdict: missed (decomposed rate, B=128)")
    no_large_block = [r for r in full_range if r["block_size"] == 16]
    assert target_line(no_large_block).endswith("at B=128 not measured (>= 1.2x); verdict: not measured (B=128)")
    only_mixed = [r for r in full_range if r["form"] == "mixed-ag" and r["seq_len"] == 16384]
    assert target_line(only_mixed).endswith(
        "verdict: not measured (decomposed rate, decomposed/mixed, B=128) (up to L = 16384: 131072 not reached)"
    )


def test_profile_top_records_each_rows_launches_and_costliest_kernels(capsys: pytest.CaptureFixture[str]) -> None:
    """``--profile-top N`` profiles each row's step once more at ``--profile-seq-lens``: its launches
    (aten ops on CPU) and the N costliest kernels land in the record and under the printed row."""
    code = main(["bench", "kernels", "--seq-lens", "32", "64", "--block-sizes", "8", "--repeats", "1", "--warmup",
                 "0", "--num-heads", "2", "--num-kv-heads", "1", "--head-dim", "16", "--diagonals", "sdpa",
                 "--clean-kernels", "generic", "--profile-top", "2", "--profile-seq-lens", "64"])
    assert code == 0
    printed = capsys.readouterr().out
    records = run_kernel_bench([32, 64], [8], ["tiles"], num_heads=2, num_kv_heads=1, head_dim=16, warmup=0,
                               repeats=1, diagonals=("sdpa",), clean_kernels=("generic",), profile_top=2,
                               profile_seq_lens=(64,))
    for r in records:
        if r.seq_len == 64 and r.backend == "tiles":
            assert r.launches > 0 and len(r.top_kernels) == 2
            assert all(name.startswith("aten::") and ms >= 0 and calls >= 1 for name, ms, calls in r.top_kernels)
            assert r.busy_ms > 0 and r.wall_ms >= r.issue_ms > 0 and r.syncs == 0  # the CPU: nothing to wait for
            assert 0 < r.attention_ms < r.busy_ms  # ATen's flash kernel or matmuls, and passes around them
        else:  # not profiled: the dense baseline and the other length
            assert (r.launches, r.top_kernels, r.syncs) == (0, (), 0) and math.isnan(r.busy_ms)
    assert printed.count(" ms wall (host issued it in ") == 3  # mixed, decomposed and diagonal rows at L = 64
    assert printed.count(" syncs); attention/matmul kernels ") == 3
    with pytest.raises(ValueError, match="--profile-top must be >= 0"):
        run_kernel_bench([32], [8], ["tiles"], profile_top=-1)


def test_profiled_kernels_split_into_attention_and_the_passes_around_it() -> None:
    """The 16K profile's question is how much of a step is attention kernels and how much the merges,
    casts and copies around them: names of the CUDA kernels the forms launch, sorted."""
    from csbp.bench.kernel_profile import StepProfile, format_profile, is_attention_kernel

    attention = [
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_kernel0_0",
        "void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t>>",
        "flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel", "fmha_cutlassF_bf16_aligned_64x64_rf_sm80",
        "triton_tem_fused_flex_attention_0", "triton_tem_fused_flex_attention_backward_1",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "aten::bmm",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
    ]
    passes = [
        "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::func_wrapper_t>>",
        "triton_poi_fused__to_copy_lerp_0", "triton_per_fused_mul_sum_0", "Memcpy DtoD (Device -> Device)",
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>", "aten::copy_",
    ]
    assert all(is_attention_kernel(name) for name in attention)
    assert not any(is_attention_kernel(name) for name in passes)
    line = format_profile(StepProfile(40, (("flash_fwd_kernel", 3.0, 2),), busy_ms=5.0, wall_ms=6.0, issue_ms=1.0,
                                      attention_ms=3.5))
    assert "busy 5.00 of 6.00 ms wall (host issued it in 1.00 ms, 0 syncs); attention/matmul kernels 3.50 ms, " \
        "the rest 1.50 ms; top: flash_fwd_kernel 3.00 ms x2" in line


def test_a_profiled_step_leaves_out_kinetos_notices_and_keeps_the_rest(capfd: pytest.CaptureFixture[str]) -> None:
    """torch's profiler library writes ``USDT: ... profiler_start`` / ``profiler_stop`` to file descriptor 2
    at every profiled step (torch 2.13), between the benchmark's rows: they are dropped, and what the
    step itself writes to stderr is kept."""
    import os

    from csbp.bench.kernel_profile import profile_step

    def step() -> None:
        os.write(2, b"the step's own line\n")
        torch.ones(8).sum()

    profile_step(step, torch.device("cpu"), top=1)
    err = capfd.readouterr().err
    assert "USDT:" not in err and "STAGE:" not in err
    assert err.count("the step's own line\n") == 3  # the sync count, the timed and the profiled run
