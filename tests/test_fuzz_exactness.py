"""The randomised exactness sweep (csbp.engine.fuzz) stays alive, and the bugs it found stay fixed.

* a handful of seeded random cases (``csbp verify --random``'s draws) equal one process;
* invalid run configs drawn at random are refused with one line naming the field, before anything
  starts;
* regressions: a sliding window on a single-stream objective (mdlm, ar) or on dflash was accepted and
  silently ignored in training (the mdlm sampler then applied it); ``window=1`` with ``block_size=1``
  (every query sees one key, so q/k gradients are mathematically zero) was reported as a failure of
  order 1 by the per-parameter relative error (seed 1048 hit it with all 1-token documents); a batch
  supervising nothing divided by a zero reference loss; DFlash's ``lambda`` LK loss took its
  acceptance over one data-parallel replica's samples instead of the whole batch.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace

import pytest
import torch

from csbp.dflash.config import DFlashObjectiveConfig
from csbp.dflash.verify import DFlashVerifyCase
from csbp.engine.block_diffusion import build_rank_plan
from csbp.engine.context import single_process_context
from csbp.engine.fuzz import describe, draw_case, run_cases
from csbp.engine.verify import (
    GRADIENT_FLOOR,
    VerifyCase,
    compare,
    corrupted_batches,
    gradient_error,
    reference,
)
from csbp.topology import Topology
from fuzz_invalid import INVALID_KINDS, check_fails_closed, draw_invalid


def test_draws_are_reproducible_and_cover_the_knobs() -> None:
    cases = [draw_case(seed) for seed in range(300)]
    assert [describe(c) for c in cases[:20]] == [describe(draw_case(seed)) for seed in range(20)]
    described = [describe(c) for c in cases]
    assert {d["objective"].split("+")[0] for d in described} == {"bd3", "fast_dllm_v2", "mdlm", "dflash"}
    assert {d["layout"] for d in described} == {"data", "cp", "bp", "csbp"}
    assert {d["transport"] for d in described} == {"collective", "streaming", "halo"}
    engine = [c for c in cases if isinstance(c, VerifyCase)]
    assert {c.schedule for c in engine} == {"dual_end", "contiguous", "balanced"}
    assert any(c.fsdp for c in engine)
    assert {c.activation_checkpointing for c in engine} == {"none", "full", "selective"}
    assert any(c.nelbo for c in engine) and any(c.micro_batches == 3 for c in engine)
    assert all(c.topology.world_size <= 4 and c.topology.world_size > 1 for c in cases)
    rows = [row for c in cases if c.doc_ids is not None for row in c.doc_ids]
    lengths = [d for c in described if c["documents"] for row in c["documents"] for d in row.split(",")]
    assert "1" in lengths and any(d.startswith("p") for d in lengths)  # 1-token documents, padding
    assert any(len(set(row)) == 1 for row in rows)  # one document spanning every shard
    assert any(min(i for i in row if i >= 0) > 0 for row in rows)  # ids not starting at 0
    windows = [(c.window, c.block_size) for c in engine if c.window is not None]
    assert any(w < b for w, b in windows) and any(w == b for w, b in windows) and any(w > b for w, b in windows)
    json.dumps(described)  # the --log lines


def test_draws_on_eight_processes_reach_every_world_size_in_float32_too() -> None:
    """``--nproc 8``: 5-8 rank layouts (non-power-of-two rings as well) with tiny shapes, and a float32
    share; draws of ``--nproc <= 4`` keep the layouts they had (the dtype is drawn last)."""
    cases = [draw_case(seed, 8) for seed in range(400)]
    assert {c.topology.world_size for c in cases} == set(range(2, 9))
    topologies = {describe(c)["topology"] for c in cases}
    assert {"dp1xcp3xbp6", "dp1xcp4xbp8", "dp1xcp2xbp6", "dp2xcp2xbp2", "dp1xcp5xbp5", "dp2xcp3xbp3"} <= topologies
    wide = [c for c in cases if c.topology.world_size > 4]
    assert all(c.seq_len <= 64 for c in wide)
    assert all(c.samples <= 2 and c.micro_batches <= 2 for c in wide if isinstance(c, VerifyCase))
    float32 = [c for c in cases if c.dtype == "float32"]
    assert 0.1 < len(float32) / len(cases) < 0.3 and any(isinstance(c, DFlashVerifyCase) for c in float32)
    with pytest.raises(ValueError, match="--nproc 9: --random draws layouts on 2 to 8 processes"):
        draw_case(0, 9)


def test_invalid_configs_fail_closed_with_one_line() -> None:
    kinds = {check_fails_closed(seed)[0] for seed in range(150)}
    assert kinds == set(INVALID_KINDS)


@pytest.mark.parametrize("objective", ["mdlm", "ar"])
def test_window_on_a_single_stream_objective_is_refused(objective: str) -> None:
    """Was: accepted, the engine's single-stream plan dropped the window (full attention in training)."""
    seed = next(s for s in range(500) if draw_invalid(s)[0] == "window_without_windowed_mask"
                and draw_invalid(s)[1]["objective.name"] == objective)
    kind, message = check_fails_closed(seed)
    assert "has no effect on " + objective in message
    with pytest.raises(ValueError, match="single-stream objectives"):
        build_rank_plan(single_process_context(), 16, 16, uses_clean_stream=False, window=4)


def test_check_case_refuses_a_window_on_mdlm_as_the_config_does() -> None:
    """Was: accepted by ``check_case`` (the train config refuses it), refused only once the reference
    planned the case."""
    from csbp.engine.verify import check_case

    with pytest.raises(ValueError, match="window=3 has no effect on mdlm"):
        check_case(VerifyCase(Topology(), 8, 2, window=3, objective="mdlm"))


def test_window_on_dflash_is_refused() -> None:
    from test_config import dflash_changes, error_lines, with_changes

    (line,) = error_lines(with_changes(dflash_changes() | {"topology.window": 8}))
    assert line.startswith("config.yaml: topology.window: window=8 has no effect on dflash")
    assert "objective.dflash.sliding_window" in line


def test_micro_batches_split_the_global_rows_in_order() -> None:
    """Micro-batch ``k`` holds rows ``[k*dp*samples, (k+1)*dp*samples)`` of the case's documents and
    supervision (padding never supervised); each is corrupted by its own micro-step generator."""
    docs = ((0,) * 5 + (1,) * 11, (3,) * 16, (0,) + (1,) * 15, (2,) * 12 + (-1,) * 4)
    case = VerifyCase(Topology(), 16, 4, samples=2, micro_batches=2, doc_ids=docs, supervision=(0.5, 0.0, 1.0, 0.8))
    one = replace(case, samples=4, micro_batches=1)
    accumulated, whole = corrupted_batches(case), corrupted_batches(one)
    assert torch.equal(torch.cat([c.doc_ids for c in accumulated]), whole[0].doc_ids)
    assert torch.equal(torch.cat([c.clean_ids for c in accumulated]), whole[0].clean_ids)
    labelled = [(c.labels >= 0).sum(dim=1).tolist() for c in accumulated]
    assert labelled[0][1] == 0 and labelled[1][1] <= 12  # no supervision; padding unsupervised


SWEEP_SEEDS = (0, 12, 17, 49)
"""Seeded cases the suite runs, all on 4 processes so they share one launch: DFlash BP-only with
documents, CSBP x dp2 with documents and accumulation, CP-only x dp2 with FSDP (fast_dllm_v2),
BP-only with documents and activation checkpointing (see test_sweep_seeds_span_the_layouts)."""


def test_sweep_seeds_span_the_layouts() -> None:
    cases = [draw_case(seed, 4) for seed in SWEEP_SEEDS]
    described = [describe(c) for c in cases]
    assert {c.topology.world_size for c in cases} == {4}
    assert {d["layout"] for d in described} == {"cp", "bp", "csbp"}
    assert any(d["objective"] == "dflash" for d in described)
    assert all(d["documents"] for d in described)
    assert any(d.get("fsdp") for d in described) and any(d.get("ac") not in (None, "none") for d in described)


ONE_KEY = VerifyCase(Topology(dp=2), 8, 1, window=1, objective="fast_dllm_v2", samples=2)
"""Every query sees exactly one key (found by seed 10010: dp4, L=5, B=1, window=1)."""


def test_a_mathematically_zero_gradient_is_measured_against_the_model_scale() -> None:
    _, grads = reference(ONE_KEY)
    largest = max(float(g.abs().max()) for g in grads.values())
    q = "layers.0.self_attn.q_proj.weight"
    assert float(grads[q].abs().max()) < 1e-12 * largest  # round-off only
    noisy = {name: g.clone() for name, g in grads.items()}
    noisy[q] = noisy[q] + 1e-17 * torch.randn(noisy[q].shape, dtype=torch.float64)
    name, err = gradient_error(noisy, grads)
    assert err < 1e-12, (name, err)  # was ~1: max|g - g_ref| / max|g_ref| with a round-off scale
    small = "layers.0.post_attention_layernorm.weight"  # a genuinely small gradient is still checked
    assert float(grads[small].abs().max()) < 10 * GRADIENT_FLOOR * largest
    wrong = {**grads, small: grads[small] * 1.01}
    assert gradient_error(wrong, grads)[0] == small and gradient_error(wrong, grads)[1] > 1e-5


def test_a_batch_supervising_nothing_compares_without_dividing_by_zero() -> None:
    """Was: ZeroDivisionError in the loss's relative error (seed 1064 drew no supervised token)."""
    case = VerifyCase(Topology(dp=2), 6, 3, samples=1, supervision=(0.0, 0.0))
    loss, grads = reference(case)
    assert loss == 0.0 and all(float(g.abs().max()) == 0.0 for g in grads.values())
    result = compare(case, [(loss, grads, 0), (loss, None, 0)], loss, grads)
    assert result.ok and result.loss_rel_err == 0.0 and result.grad_rel_err == 0.0


LAMBDA_DP = DFlashVerifyCase(
    Topology(dp=2, cp=2), objective=DFlashObjectiveConfig(max_anchors=4, gamma=4.0, lk_loss_type="lambda"), seq_len=16,
)
"""DFlash's ``lambda`` LK loss under data parallelism (found by seed 50018): each replica computed the
acceptance of its own samples, one process that of the whole batch (loss off by 1.8e-5 relative)."""


VACUOUS_SEEDS = (40, 238, 279, 312, 700049)
"""Draws whose whole batch scored no token (low supervision on short rows; ~1 engine draw in 35), so
loss and every gradient were 0 on both sides and the case passed whatever the layouts computed."""


def test_engine_draws_score_some_token() -> None:
    drawn = [draw_case(seed) for seed in (*VACUOUS_SEEDS, *range(300))]
    cases = [c for c in drawn if isinstance(c, VerifyCase)]
    assert [c.seed for c in cases[: len(VACUOUS_SEEDS)]] == list(VACUOUS_SEEDS)
    silent = [c.seed for c in cases if not any(bool((b.labels >= 0).any()) for b in corrupted_batches(c, c.topology.dp))]
    assert not set(silent) & set(VACUOUS_SEEDS) and len(silent) <= 2, silent
    loss, grads = reference(draw_case(VACUOUS_SEEDS[-1]))
    assert loss > 0 and max(float(g.abs().max()) for g in grads.values()) > 0


ANCHORLESS_SEEDS = (2490, 700167)
"""DFlash draws whose batch had a row without a valid anchor (1-token documents, padding and the random
supervision): the reference refused them, so ``csbp verify --random`` reported an ERROR for a draw that
training refuses before its first step (``validate_anchor_coverage``); now redrawn valid."""


def test_dflash_draws_give_every_row_an_anchor() -> None:
    from csbp.dflash.anchors import valid_anchor_mask
    from csbp.dflash.verify import make_batch

    cases = [c for c in (draw_case(seed) for seed in (*ANCHORLESS_SEEDS, *range(400)))
             if isinstance(c, DFlashVerifyCase)]
    assert [c.seed for c in cases[:2]] == list(ANCHORLESS_SEEDS) and len(cases) > 60
    for c in cases:
        batch = make_batch(c.samples * c.topology.dp, c.seq_len, seed=c.seed, doc_ids=c.doc_ids)
        assert bool(valid_anchor_mask(batch.loss_mask, batch.doc_ids).any(dim=-1).all()), describe(c)


def test_an_anchorless_dflash_draw_is_redrawn_valid() -> None:
    from csbp.dflash.verify import anchorless_rows
    from csbp.engine.fuzz import _with_anchors

    ones = DFlashVerifyCase(Topology(cp=2), seq_len=12, samples=2, doc_ids=(tuple(range(12)),) * 2)
    assert anchorless_rows(ones) == [0, 1]  # 1-token documents: no anchor at all
    fixed = _with_anchors(random.Random(0), ones, 4)
    assert not anchorless_rows(fixed) and fixed.seq_len % 4 == 0
    sparse = DFlashVerifyCase(Topology(), seq_len=12, samples=1, seed=2937, doc_ids=((0,) * 12,))
    assert anchorless_rows(sparse) == [0]  # its supervision holds no two consecutive tokens: no documents help
    longer = _with_anchors(random.Random(0), sparse, 2)
    assert not anchorless_rows(longer) and longer.seq_len != 12 and longer.seq_len % 2 == 0


@pytest.mark.multiprocess
@pytest.mark.slow
def test_seeded_random_cases_equal_one_process() -> None:
    """The suite's randomized sweep: SWEEP_SEEDS and the regressions share one 4-rank launch."""
    drawn = [(seed, draw_case(seed, 4)) for seed in (*SWEEP_SEEDS, ANCHORLESS_SEEDS[1])]
    drawn += [(-1, replace(ONE_KEY, topology=Topology(dp=4))), (-2, LAMBDA_DP)]
    results = run_cases(drawn)
    assert [r.seed for r in results] == [seed for seed, _ in drawn]
    assert all(r.status == "ok" for r in results), [r for r in results if r.status != "ok"]


WIDE_SEEDS = (100221, 100118, 100005)
"""Seeded cases of ``--nproc 8`` draws, all on 6 processes so they share one launch: CSBP ``cp=3 x bp=6``
(rings of three, streaming, documents), ``dp3 x cp2 x bp2`` (streaming, window 5, documents,
checkpointing) and a float32 ``fast_dllm_v2`` on ``dp2 x cp3 x bp3`` (documents, accumulation)."""


def test_wide_seeds_span_the_layouts() -> None:
    described = [describe(draw_case(seed, 8)) for seed in WIDE_SEEDS]
    assert [d["topology"] for d in described] == ["dp1xcp3xbp6", "dp3xcp2xbp2", "dp2xcp3xbp3"]
    assert [d["dtype"] for d in described] == ["float64", "float64", "float32"]
    assert all(d["documents"] for d in described)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_seeded_cases_on_six_processes_equal_one_process() -> None:
    """WIDE_SEEDS in one 6-rank launch (float32 within its tolerance, TOLERANCES)."""
    results = run_cases([(seed, draw_case(seed, 8)) for seed in WIDE_SEEDS])
    assert [r.seed for r in results] == list(WIDE_SEEDS)
    assert all(r.status == "ok" for r in results), [r for r in results if r.status != "ok"]


def _verify_argv(rng: random.Random) -> list[str]:
    """Random ``csbp verify`` flags, most combinations invalid."""
    argv = ["verify"]
    for flag, values in (
        ("--nproc", [1, 2, 3, 4, 6, 8]), ("--dp", [None, None, 1, 2, 3]), ("--cp", [None, 1, 2, 3, 4]),
        ("--bp", [None, 1, 2, 3, 4, 6, 8]), ("--seq-len", [None, 4, 8, 12, 16, 24, 30, 32, 48]),
        ("--block-size", [None, 1, 2, 3, 4, 5, 8, 16]), ("--window", [None, None, 1, 4, 40]),
        ("--doc-length", [None, None, 1, 6]), ("--transport", [None, "streaming", "halo"]),
        ("--schedule", [None, "contiguous", "balanced"]), ("--objective", [None, None, "dflash"]),
        ("--dtype", [None, None, "float32"]), ("--diagonal", [None, None, "sdpa", "flex"]),
        ("--backend", [None, None, "flex", "tiles"]),
    ):
        value = rng.choice(values)
        if value is not None:
            argv += [flag, str(value)]
    return argv


def test_random_verify_flags_run_a_valid_case_or_fail_closed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found the ``Topology.dp must be a positive integer, got 0`` line and dflash's ignored flags."""
    import csbp.cli.verify_cmd as verify_cmd
    import csbp.dflash.verify as dflash_verify
    from csbp.cli.main import main
    from csbp.engine.verify import check_case

    launched: list[object] = []

    class Launched(Exception):
        pass

    def stub(case: object, **_: object) -> None:
        launched.append(case)
        raise Launched

    monkeypatch.setattr(verify_cmd, "verify", stub)
    monkeypatch.setattr(dflash_verify, "verify_dflash", stub)
    refused = 0
    for seed in range(150):
        argv = _verify_argv(random.Random(seed))
        try:
            code = main(argv)
        except Launched:
            case = launched[-1]
            nproc = int(argv[argv.index("--nproc") + 1])
            assert case.topology.world_size == nproc, argv  # type: ignore[attr-defined]
            if isinstance(case, VerifyCase):
                check_case(case)
            else:
                assert "--block-size" not in argv or argv[argv.index("--block-size") + 1] == "4", argv
            continue
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and "Traceback" not in err[0], (argv, err)
        refused += 1
    assert refused > 100 and len(launched) >= 3


def _run_config(cp: int, bp: int, dp: int, seq_len: int, block: int, window: int | None, transport: str,
                schedule: str, objective: str, documents: bool) -> dict:
    data: dict = {
        "run": {"name": "fuzz", "seed": 0},
        "model": {"arch": "qwen3", "hidden_size": 32, "intermediate_size": 64, "num_layers": 2, "num_heads": 4,
                  "num_kv_heads": 2, "head_dim": 8, "vocab_size": 64},
        "data": {"train": "artifacts/fuzz", "seq_len": seq_len, "document_mask": documents},
        "objective": {"name": objective, "mask_token_id": 63},
        "optim": {"lr": 1e-3, "warmup_steps": 0},
        "train": {"max_steps": 2, "micro_batch_size": 1},
        "topology": {"dp": dp, "cp": cp, "bp": bp, "replicate_clean_prefix": cp == 1 and bp > 1,
                     "transport": transport, "schedule": schedule},
    }
    if objective != "mdlm":
        data["objective"]["block_size"] = block
    if window is not None:
        data["topology"]["window"] = window
    return data


def test_check_case_accepts_exactly_what_the_train_config_accepts() -> None:
    """``csbp verify`` must not verify a layout training refuses, nor refuse one training runs: random
    degrees, sizes, windows, transports, schedules and objectives, most invalid (found: a streaming
    transport with ``cp == 1`` and a window on mdlm were accepted by ``check_case`` only)."""
    from csbp.config.loading import config_from_dict
    from csbp.engine.verify import check_case

    outcomes = set()
    for seed in range(400):
        rng = random.Random(seed)
        cp, bp, dp = rng.choice([1, 2, 3, 4]), rng.choice([1, 2, 3, 4, 6, 8]), rng.choice([1, 2])
        seq_len, block = rng.choice([4, 6, 8, 12, 16, 18, 24, 30, 32, 48]), rng.choice([1, 2, 3, 4, 5, 8, 16])
        window = rng.choice([None, None, 1, 3, 100])
        transport = rng.choice(["collective", "streaming", "halo"])
        schedule = rng.choice(["dual_end", "contiguous", "balanced"])
        objective, documents = rng.choice(["bd3", "bd3", "fast_dllm_v2", "mdlm"]), rng.random() < 0.5
        args = (cp, bp, dp, seq_len, block, window, transport, schedule, objective, documents)
        try:
            config_from_dict(_run_config(*args), source="c.yaml")
            config_ok = True
        except ValueError:
            config_ok = False
        try:
            topology = Topology(dp=dp, cp=cp, bp=bp, replicate_clean_prefix=cp == 1 and bp > 1)
            check_case(VerifyCase(topology, seq_len, block, window=window, transport=transport,  # type: ignore[arg-type]
                                  schedule=schedule, objective=objective, doc_length=4 if documents else None))  # type: ignore[arg-type]
            verify_ok = True
        except ValueError:
            verify_ok = False
        assert config_ok == verify_ok, (args, config_ok, verify_ok)
        outcomes.add(config_ok)
    assert outcomes == {True, False}


def test_a_non_finite_gradient_is_an_infinite_error() -> None:
    """A NaN gradient measured as no error at all (``NaN >= worst`` is false), so every layout's exactness
    test passed with NaN gradients; an inf one was an inf error only by luck of the comparison."""
    grads = {"a": torch.ones(3, dtype=torch.float64), "b": torch.ones(2, dtype=torch.float64)}
    for bad in (math.nan, math.inf):
        for name in grads:
            broken = {**grads, name: torch.tensor([1.0, bad, 1.0][: grads[name].numel()], dtype=torch.float64)}
            assert gradient_error(broken, grads) == (name, math.inf)
    nan_reference = {**grads, "b": torch.full((2,), math.nan, dtype=torch.float64)}
    assert gradient_error(grads, nan_reference)[1] == math.inf
