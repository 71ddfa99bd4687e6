"""``csbp bench kernels`` on CPU: records, table, --json/--png, aten op counts and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from csbp.bench.kernels import build_forms, count_aten_ops, run_kernel_bench
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
