"""``csbp verify`` end to end: table rows, exit codes, and fail-closed arguments."""

from __future__ import annotations

import pytest

from csbp.cli.main import main


@pytest.mark.multiprocess
def test_verify_one_csbp_layout(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--nproc", "2", "--cp", "2", "--bp", "2", "--transport", "streaming"]) == 0
    out = capsys.readouterr().out
    assert "csbp     dp1xcp2xbp2  streaming" in out
    assert out.strip().endswith("the 1 layout equals one process within tolerance")


@pytest.mark.multiprocess
def test_verify_dflash_layout(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--nproc", "2", "--cp", "2", "--bp", "2", "--objective", "dflash", "--diagonal", "sdpa"]) == 0
    out = capsys.readouterr().out
    assert "csbp     dp1xcp2xbp2" in out and "ok" in out


@pytest.mark.multiprocess
def test_verify_with_the_sdpa_diagonal_against_the_matmul_reference(capsys: pytest.CaptureFixture[str]) -> None:
    """``--diagonal sdpa`` reaches every rank's local partial (the reference runs the matmul diagonal)."""
    argv = ["--nproc", "2", "--cp", "2", "--bp", "2", "--seq-len", "64", "--block-size", "16", "--diagonal", "sdpa"]
    assert main(["verify", *argv]) == 0
    assert capsys.readouterr().out.strip().endswith("the 1 layout equals one process within tolerance")


@pytest.mark.multiprocess
def test_verify_with_flash_pieces_against_the_generic_reference(capsys: pytest.CaptureFixture[str]) -> None:
    """``--clean pieces`` reaches every rank's local and remote clean-context partials (the reference
    runs one generic partial); cp=2 x bp=2 at L = 64 has runs of >= 16 rows, the CPU's minimum piece."""
    argv = ["--nproc", "2", "--cp", "2", "--bp", "2", "--seq-len", "64", "--block-size", "4", "--clean", "pieces"]
    assert main(["verify", *argv]) == 0
    assert capsys.readouterr().out.strip().endswith("the 1 layout equals one process within tolerance")


@pytest.mark.multiprocess
def test_verify_runs_the_flex_backend_on_cpu_exactly(capsys: pytest.CaptureFixture[str]) -> None:
    """``--backend flex`` on the CPU: FlexAttention's dense forward and its backward operator (the
    direct backward, traced by dynamo) through the whole model, packed documents, against the tiles'
    one-process reference in float64."""
    from csbp.attention.flex_backward import direct_backward_support

    argv = ["verify", "--nproc", "2", "--cp", "2", "--bp", "2", "--backend", "flex", "--doc-length", "6"]
    if not direct_backward_support()[0]:
        assert main(argv) == 2
        assert "--backend=flex on cpu needs FlexAttention's direct backward" in capsys.readouterr().err
        return
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "backend=flex" in out.splitlines()[0] and "csbp     dp1xcp2xbp2  halo" in out
    assert out.strip().endswith("the 1 layout equals one process within tolerance")


@pytest.mark.multiprocess
def test_random_cases_run_on_the_named_backend(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--random N --backend flex``: the same drawn cases (the seed names the case), run on flex."""
    import json

    from csbp.attention.flex_backward import direct_backward_support

    if not direct_backward_support()[0]:
        pytest.skip("this torch cannot trace the direct flex backward")
    log = tmp_path / "cases.jsonl"
    assert main(["verify", "--random", "2", "--seed", "4", "--backend", "flex", "--log", str(log)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith("backend flex")
    case_lines = [line for line in out.splitlines() if line.startswith("seed ")]
    assert len(case_lines) == 2 and all(line.endswith("  ok") for line in case_lines)  # no trailing space after ok
    cases = [json.loads(line)["case"] for line in log.read_text().splitlines()]
    assert [c["backend"] for c in cases] == ["flex", "flex"] and cases[0]["topology"] == "dp1xcp2xbp2"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nproc", "2", "--diagonal", "flex"], "--diagonal=flex needs attention.backend flex"),
        (["--nproc", "2", "--diagonal", "flex", "--backend", "tiles"], "--diagonal=flex needs"),
        (["--nproc", "2", "--objective", "dflash", "--diagonal", "flex"], "--diagonal=flex needs"),
        (["--random", "2", "--diagonal", "sdpa"], "--random draws the attention kernels itself: drop --diagonal"),
        (["--random", "2", "--clean", "pieces"], "--random draws the attention kernels itself: drop --clean"),
        (["--nproc", "2", "--objective", "dflash", "--backend", "tiles", "--diagonal", "flex"], "--diagonal=flex needs"),
        (["--nproc", "4", "--cp", "3", "--bp", "4"], "--cp 3 --bp 4: not a fused CSBP layout: --bp must be a multiple of --cp"),
        (["--nproc", "2", "--cp", "2", "--bp", "2", "--seq-len", "30"], "--seq-len 30 is not a multiple of --block-size 4 (fix: --seq-len 16 or 32)"),
        (["--nproc", "4", "--bp", "4", "--seq-len", "12"], "bp"),
        # one block covering the whole row: the train config refuses it (objective.block_size), so does verify
        (["--nproc", "1", "--seq-len", "8", "--block-size", "8"], "--block-size 8 must be below --seq-len 8 for bd3"),
        (["--nproc", "2", "--cp", "2", "--bp", "2", "--objective", "dflash", "--seq-len", "30"], "2*cp=4"),
        (["--nproc", "2", "--objective", "dflash", "--dtype", "float32"], "drop --dtype"),
        # found by the random CLI sweep: a Topology.dp=0 message, and flags dflash silently ignored
        (["--nproc", "2", "--cp", "4"], "--nproc 2 is not a multiple of max(--cp, --bp) = 4 (fix: --nproc 4, or set --dp)"),
        (["--nproc", "2", "--objective", "dflash", "--block-size", "8"], "drop --block-size"),
        (["--nproc", "2", "--objective", "dflash", "--schedule", "contiguous"], "drop --schedule"),
        # one-token documents leave a drafter no anchor: refused up front, not after the table's header
        (["--nproc", "2", "--objective", "dflash", "--doc-length", "1"], "--doc-length 1 packs only one-token"),
        (["--random", "2", "--cp", "2"], "--random draws the layout"),
        (["--random", "2", "--dtype", "float32"], "--random draws the layout, objective, dtype"),
        (["--random", "2", "--nproc", "9"], "--nproc 9: --random draws layouts on 2 to 8 processes"),
        (["--random", "2", "--nproc", "1"], "--nproc 1: --random draws layouts on 2 to 8 processes"),
        (["--nproc", "2", "--log", "cases.jsonl"], "--log records --random cases"),
        # a ring transport on a layout without a CP ring: was verified with the flag ignored (train refuses it)
        (["--nproc", "2", "--bp", "2", "--transport", "streaming"], "--transport streaming needs a CP ring"),
        (["--nproc", "2", "--dp", "2", "--transport", "streaming"], "--transport streaming needs a CP ring"),
        (["--nproc", "2", "--cp", "1", "--bp", "2", "--objective", "dflash", "--transport", "streaming"],
         "--transport streaming needs a CP ring"),
        (["--nproc", "1", "--transport", "streaming"], "no layout of --nproc 1 has cp > 1"),
        (["--nproc", "2", "--bp", "2", "--transport", "halo"], "--transport halo needs a CP ring"),
        (["--nproc", "1", "--transport", "halo"], "--transport halo needs a CP ring, and no layout of --nproc 1"),
        # a DFlash batch with a sample holding no anchor: was the table's header, then the engine's error
        (["--nproc", "4", "--cp", "2", "--bp", "4", "--objective", "dflash", "--seq-len", "4"],
         "--seq-len 4 --seed 0: sample 1 of the DFlash batch of 2 samples has no valid anchor"),
        (["--nproc", "2", "--objective", "dflash", "--seq-len", "8", "--doc-length", "2"], "use a longer --seq-len, a longer --doc-length"),
    ],
)
def test_verify_rejects_bad_input_before_launching(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["verify", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("csbp: error: ") and message in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("flag", ["--nproc", "--dp", "--cp", "--bp", "--window", "--doc-length"])
def test_verify_rejects_non_positive_sizes_in_one_argparse_line(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", flag, "0"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"csbp verify: error: argument {flag}: 0 must be >= 1")
    assert len(err.strip().splitlines()) == 1


def _record_dflash_cases(monkeypatch: pytest.MonkeyPatch) -> list:
    """Replace ``verify_dflash`` by a stub that records each case and passes; returns the record."""
    import csbp.dflash.verify as dflash_verify

    seen = []

    def fake_verify(case: dflash_verify.DFlashVerifyCase) -> dflash_verify.DFlashVerifyResult:
        seen.append(case)
        return dflash_verify.DFlashVerifyResult(case, 1.0, 1.0, 0.0, 0.0, "-", [0])

    monkeypatch.setattr(dflash_verify, "verify_dflash", fake_verify)
    return seen


@pytest.mark.parametrize(("argv", "backend", "diagonal"), [
    ([], "tiles", "auto"),  # auto is tiles on the CPU
    (["--backend", "tiles", "--diagonal", "sdpa_fold"], "tiles", "sdpa_fold"),
])
def test_verify_dflash_passes_backend_and_diagonal_to_every_case(
    argv: list[str], backend: str, diagonal: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen = _record_dflash_cases(monkeypatch)
    assert main(["verify", "--nproc", "2", "--objective", "dflash", *argv]) == 0
    assert len(seen) == 4 and all((c.backend, c.diagonal) == (backend, diagonal) for c in seen)  # every layout
    assert f"backend={backend}" in capsys.readouterr().out.splitlines()[0]


def test_verify_dflash_with_documents_adds_cp_aware(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--doc-length`` reaches every case, and CP-only also runs with the context exchange (``halo``)."""
    seen = _record_dflash_cases(monkeypatch)
    assert main(["verify", "--nproc", "2", "--objective", "dflash", "--doc-length", "6"]) == 0
    assert all(c.doc_length == 6 for c in seen) and len(seen) == 5
    cp_only = [c.transport for c in seen if c.topology.layout == "cp"]
    assert cp_only == ["collective", "halo"]
    out = capsys.readouterr().out
    assert "doc_length=6" in out.splitlines()[0] and "cp-aware dp1xcp2xbp1  exchange" in out


def test_verify_dflash_window_slides_the_first_drafter_layer(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--window W`` gives every case a sliding first layer; CSBP then exchanges (its one-document
    samples' window rows), plain CP-only keeps the all-gather."""
    seen = _record_dflash_cases(monkeypatch)
    assert main(["verify", "--nproc", "2", "--objective", "dflash", "--window", "6"]) == 0
    assert len(seen) == 4 and all(c.drafter_options == {
        "layer_types": ("sliding_attention", "full_attention"), "sliding_window": 6} for c in seen)
    out = capsys.readouterr().out
    assert "window=6" in out.splitlines()[0]
    assert "csbp     dp1xcp2xbp2  exchange" in out and "cp-only  dp1xcp2xbp1  all-gather" in out


def test_dflash_verify_worker_builds_its_plan_on_the_case_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layouts' draft attention runs on ``case.backend`` (one process, the worker itself)."""
    import csbp.dflash.verify as dflash_verify
    from csbp.dflash.rank_plan import build_dflash_rank_plan

    plans = []

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        plans.append(build_dflash_rank_plan(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(dflash_verify, "build_dflash_rank_plan", spy)
    from csbp.attention.flex_backward import flex_backward_mode

    case = dflash_verify.DFlashVerifyCase(backend="flex", diagonal="flex", samples=1)
    # recompute: FlexAttention's autograd refuses the CPU, so the worker stops in the first backward
    with pytest.raises(NotImplementedError, match="FlexAttention"), flex_backward_mode("recompute"):
        dflash_verify._worker(0, 1, case)
    assert (plans[0].backend, plans[0].diagonal) == ("flex", "flex")


def _stub_verify(monkeypatch: pytest.MonkeyPatch, rel_err: float = 0.0) -> None:
    """Replace the layout verification by a stub returning ``rel_err`` for loss and gradients."""
    import csbp.cli.verify_cmd as verify_cmd
    from csbp.engine.verify import VerifyResult

    def fake_verify(case):  # noqa: ANN001, ANN202
        return VerifyResult(case, 1.0, 1.0, rel_err, rel_err, "w", 1e-9)

    monkeypatch.setattr(verify_cmd, "verify", fake_verify)


def test_the_table_widens_its_detail_column_to_fit_every_row(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``halo balanced`` (13 characters) pushed its row's numbers one column right of the header's."""
    _stub_verify(monkeypatch)
    argv = ["verify", "--nproc", "4", "--seq-len", "128", "--doc-length", "24", "--schedule", "balanced"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    header, rows = lines[1], [line for line in lines[3:-1] if line.strip()]
    assert any(" halo balanced " in row for row in rows)
    end = header.index("loss rel err") + len("loss rel err")
    assert all(row.index("0.00e+00") + len("0.00e+00") == end for row in rows), "\n".join([header, *rows])
    assert lines[-1] == f"all {len(rows)} layouts equal one process within tolerance"


@pytest.mark.parametrize(
    ("nproc", "rel_err", "last"),
    [
        ("1", 0.0, "the 1 layout equals one process within tolerance"),
        ("1", 1.0, "1 of 1 layout exceeds the tolerance"),
        ("2", 1.0, "4 of 4 layouts exceed the tolerance"),
    ],
)
def test_the_verdict_agrees_with_its_count(
    nproc: str, rel_err: float, last: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _stub_verify(monkeypatch, rel_err)
    assert main(["verify", "--nproc", nproc]) == (1 if rel_err else 0)
    assert capsys.readouterr().out.splitlines()[-1] == last


def test_every_layout_table_streams_only_where_there_is_a_ring(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--transport streaming`` over every layout of 4 processes: the ring layouts stream, the layouts
    without a CP ring run as ``collective`` (their local attention), and every case passes ``check_case``
    (which, like the train config, refuses a streaming transport with ``cp == 1``)."""
    import csbp.cli.verify_cmd as verify_cmd
    from csbp.engine.verify import VerifyCase, VerifyResult, check_case

    seen: list[VerifyCase] = []

    def record(case: VerifyCase) -> VerifyResult:
        check_case(case)
        seen.append(case)
        return VerifyResult(case, 1.0, 1.0, 0.0, 0.0, "w", 1e-9)

    monkeypatch.setattr(verify_cmd, "verify", record)
    for transport in ("streaming", "halo"):  # halo, the same: a cp = 1 layout has no ring to exchange over
        seen.clear()
        assert main(["verify", "--nproc", "4", "--transport", transport]) == 0
        assert {(c.topology.cp > 1, c.transport) for c in seen} == {(True, transport), (False, "collective")}


def test_check_case_refuses_a_streaming_transport_without_a_ring() -> None:
    from csbp.engine.verify import VerifyCase, check_case
    from csbp.topology import Topology

    bp_only = Topology(bp=2, replicate_clean_prefix=True)
    with pytest.raises(ValueError, match=r"transport='streaming' needs a CP ring \(cp > 1\), got cp=1 \(bp layout\)"):
        check_case(VerifyCase(topology=bp_only, transport="streaming"))
    with pytest.raises(ValueError, match=r"transport='halo' needs a CP ring \(cp > 1\), got cp=1 \(bp layout\)"):
        check_case(VerifyCase(topology=bp_only, transport="halo"))
