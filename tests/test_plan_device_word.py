"""``csbp plan`` counts devices as devices: ``--gpu cpu`` plans gloo processes on this machine, yet
its errors said "no layout of 2 GPUs accepts it" and its sentence "K/V per GPU per step". Plan
output and errors now say "devices" whatever the preset (the header names the kind: ``2xCPU``)."""

from __future__ import annotations

import pytest

from csbp.cli.main import USER_ERROR_EXIT_CODE, main


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["plan", "--model", "nemotron-3b", *argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--seq-len", "4097", "--gpus", "2", "--gpu", "cpu"],
            "csbp: error: --seq-len 4097: no layout of 2 devices accepts it, not even data parallel: seq_len=4097 "
            "is not a multiple of block_size=32 (fix: --seq-len 4096 or 4128, or --block-size 17 or 241)",
        ),
        (
            ["--seq-len", "4096", "--gpus", "2", "--gpu", "cpu", "--topology", "dp1/cp4"],
            "csbp: error: --topology dp1/cp4 uses 4 devices, not --gpus 2 (fix: --gpus 4)",
        ),
    ],
)
def test_cpu_plan_errors_count_devices(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    code, out, err = _run(capsys, *argv)
    assert (code, out, err.strip()) == (USER_ERROR_EXIT_CODE, "", message)


def test_the_why_sentence_counts_kv_per_device(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, "--seq-len", "64K", "--gpus", "16", "--gpu", "h200")
    why = [line for line in out.splitlines() if line.startswith("why: ")]
    assert (code, err) == (0, "") and len(why) == 1
    assert "of K/V per device per step" in why[0] and "GPU" not in why[0]
