"""The NELBO estimator of ``csbp eval`` and ``val_nelbo``: unbiased whatever the trained noise scheme
(each slot's level marginally uniform), and a split with nothing to score refused with one line."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from csbp.data.artifact import ArtifactSplit
from csbp.engine.verify import MASK_TOKEN_ID, VOCAB_SIZE, tiny_model_config
from csbp.evaluation import EVAL_T_MIN, EvalOptions, EvalSettings, evaluate_model, nelbo_objective
from csbp.evaluation.runner import check_scored_tokens
from csbp.models.decoder import Decoder
from csbp.objectives import build_objective, corruption_generator

SEQ_LEN = 16


def _proxy_estimate(objective_name: str, noise_scheme: str, draws: int) -> tuple[float, float, float]:
    """``(mean, stderr, exact)`` of the NELBO estimator for a proxy loss that, like a real model's,
    grows with the masking: a masked token costs ``c_row · (masked fraction of its block)``, with one
    row four times harder than the others. For one block of ``B`` tokens at level ``t``,
    ``E[(1/t) Σ m_i · c · n/B] = c·((1 − t) + B·t)``, so over ``t ~ U[a, 1]`` the exact per-token value
    is ``Σ_s c_s · N · ((1 − a)/2 + B(1 + a)/2) / (S·L)``."""
    block_size = SEQ_LEN if objective_name == "mdlm" else 4
    options: dict[str, object] = {"mask_token_id": MASK_TOKEN_ID, "noise_scheme": noise_scheme}
    if objective_name == "bd3":
        options["block_size"] = block_size
    nelbo = nelbo_objective(build_objective(objective_name, **options))
    assert nelbo is not None
    cost_S1 = torch.tensor([[4.0], [1.0], [1.0], [1.0]], dtype=torch.float64)
    ids = torch.randint(0, MASK_TOKEN_ID, (4, SEQ_LEN), generator=torch.Generator().manual_seed(0))
    values = []
    for draw in range(draws):
        corrupted = nelbo.corrupt({"input_ids": ids}, corruption_generator(0, 0, 0, micro_step=draw))
        masked_SNB = (corrupted.labels != -100).double().view(4, -1, block_size)
        fraction_SL = masked_SNB.mean(-1, keepdim=True).expand_as(masked_SNB).reshape(4, SEQ_LEN)
        values.append(float((corrupted.weights.double() * cost_S1 * fraction_SL).sum()) / corrupted.denominator())
    a, blocks = EVAL_T_MIN, SEQ_LEN // block_size
    exact = float(cost_S1.sum()) * blocks * ((1 - a) / 2 + block_size * (1 + a) / 2) / (4 * SEQ_LEN)
    tensor = torch.tensor(values, dtype=torch.float64)
    return float(tensor.mean()), float(tensor.std()) / math.sqrt(draws), exact


@pytest.mark.parametrize("objective_name", ["mdlm", "bd3"])
@pytest.mark.parametrize("noise_scheme", ["stratified", "rotated_lattice"])
def test_nelbo_is_unbiased_whatever_the_trained_noise_scheme(objective_name: str, noise_scheme: str) -> None:
    # A stratified draw gives slot k = s·N + b a level in [k/K, (k+1)/K) at every draw: the rows and
    # blocks of a fixed, unshuffled eval set kept their strata, so the estimate converged to a number
    # that depends on where each row sits in its batch (here 0.66 instead of 0.93), and the standard
    # error over draws could not see it.
    mean, stderr, exact = _proxy_estimate(objective_name, noise_scheme, draws=1500)
    assert abs(mean - exact) < 4 * stderr, (mean, stderr, exact)


@pytest.mark.parametrize("objective_name", ["mdlm", "bd3"])
def test_every_nelbo_slot_draws_its_level_over_the_whole_range(objective_name: str) -> None:
    options: dict[str, object] = {"mask_token_id": MASK_TOKEN_ID, "noise_scheme": "stratified"}
    if objective_name == "bd3":
        options["block_size"] = 4
    nelbo = nelbo_objective(build_objective(objective_name, **options))
    assert nelbo is not None
    ids = torch.zeros(4, SEQ_LEN, dtype=torch.long)
    levels = torch.stack([
        nelbo.corrupt({"input_ids": ids}, corruption_generator(0, 0, 0, micro_step=draw)).noise_levels  # type: ignore[misc]
        for draw in range(200)
    ])  # [draws, S, N]
    assert float(levels.min()) >= EVAL_T_MIN
    # every (row, block) slot sees low and high levels across the draws (a stratum is 1/K wide)
    assert bool((levels.amin(0) < 0.25).all()) and bool((levels.amax(0) > 0.75).all())


def _split(loss_mask: np.ndarray, doc_ids: np.ndarray | None = None) -> ArtifactSplit:
    rows, seq_len = loss_mask.shape
    return ArtifactSplit(
        name="val",
        seq_len=seq_len,
        tokens=np.ones((rows, seq_len), dtype=np.uint32),
        loss_mask=loss_mask.astype(np.uint8),
        doc_ids=np.zeros((rows, seq_len), dtype=np.int64) if doc_ids is None else doc_ids,
        fingerprint="test",
    )


def test_a_split_with_nothing_to_score_is_refused_before_any_forward() -> None:
    bd3 = EvalSettings(objective="bd3", block_size=4, mask_token_id=MASK_TOKEN_ID)
    unsupervised = _split(np.zeros((3, 8)))
    # evaluate_model reported nelbo 0.0000 and ppl bound 1.00 (0 / max(0, 1)): a perfect model, silently
    model = Decoder(tiny_model_config(), dtype=torch.float32, seed=0)
    with pytest.raises(ValueError, match="hold no supervised token"):
        evaluate_model(model, unsupervised, bd3, EvalOptions(samples=1, left_to_right=False), progress=False)
    with pytest.raises(ValueError, match=r"--split val: the 3 rows scored hold no supervised token") as caught:
        check_scored_tokens(unsupervised, bd3, EvalOptions(micro_batch_size=2), vocab_size=VOCAB_SIZE)
    assert "\n" not in str(caught.value) and "fix:" in str(caught.value)
    # fast_dllm_v2 never scores position 0 nor a document start: one supervised token there is nothing
    fast = EvalSettings(objective="fast_dllm_v2", block_size=4, mask_token_id=MASK_TOKEN_ID)
    mask = np.zeros((2, 8))
    mask[0, 0] = mask[1, 4] = 1
    doc_ids = np.array([[0] * 8, [0] * 4 + [1] * 4])
    with pytest.raises(ValueError, match="hold no supervised token"):
        check_scored_tokens(_split(mask, doc_ids), fast, EvalOptions(), vocab_size=VOCAB_SIZE)
    check_scored_tokens(_split(mask, doc_ids), bd3, EvalOptions(), vocab_size=VOCAB_SIZE)  # bd3 scores both
    # --max-batches caps the rows looked at, as it caps the rows scored
    late = np.zeros((4, 8))
    late[3, 2] = 1
    check_scored_tokens(_split(late), bd3, EvalOptions(micro_batch_size=2), vocab_size=VOCAB_SIZE)
    with pytest.raises(ValueError, match="the 2 rows scored"):
        check_scored_tokens(_split(late), bd3, EvalOptions(micro_batch_size=2, max_batches=1), vocab_size=VOCAB_SIZE)
    with pytest.raises(ValueError, match="has no rows"):
        check_scored_tokens(_split(np.zeros((0, 8))), bd3, EvalOptions(), vocab_size=VOCAB_SIZE)


@pytest.mark.parametrize(
    ("objective_name", "label", "t_max"), [("bd3", "t in [0.001, 1]", 1.0), ("fast_dllm_v2", "p in [0.001, 0.999]", 0.999)]
)
def test_the_report_names_the_noise_range_it_used_and_its_units(objective_name: str, label: str, t_max: float) -> None:
    # Fast-dLLM v2's move chance lies in [a, 1 - a]; the report said "t in [0.001, 1]" for it too.
    settings = EvalSettings(objective=objective_name, block_size=4, mask_token_id=MASK_TOKEN_ID)
    ids = np.random.default_rng(0).integers(0, MASK_TOKEN_ID, size=(2, 8)).astype(np.uint32)
    split = ArtifactSplit("val", 8, ids, np.ones((2, 8), np.uint8), np.zeros((2, 8), np.int64), "test")
    model = Decoder(tiny_model_config(), dtype=torch.float64, seed=0)
    report = evaluate_model(model, split, settings, EvalOptions(samples=2, left_to_right=False), progress=False)
    assert label in report.format().splitlines()[1] and "nats/token" in report.format()
    record = report.to_json()
    assert (record["units"], record["t_min"], record["t_max"]) == ("nats/token", EVAL_T_MIN, pytest.approx(t_max))


def test_the_exact_nll_is_per_token_over_the_split_whatever_the_batch_size() -> None:
    """Batches of different token counts (a padded last row) weigh by tokens: a mean of batch means
    would move with ``--micro-batch-size``; the exact LTR NLL must not."""
    rng = np.random.default_rng(1)
    ids = rng.integers(0, MASK_TOKEN_ID, size=(5, 8)).astype(np.uint32)
    loss_mask = np.ones((5, 8), np.uint8)
    loss_mask[4, 3:] = 0  # the padded tail of the split
    loss_mask[1, :6] = 0  # a mostly unsupervised row
    split = ArtifactSplit("val", 8, ids, loss_mask, np.zeros((5, 8), np.int64), "test")
    model = Decoder(tiny_model_config(), dtype=torch.float64, seed=0)
    settings = EvalSettings(objective="bd3", block_size=4, mask_token_id=MASK_TOKEN_ID)
    reports = [
        evaluate_model(model, split, settings, EvalOptions(samples=1, micro_batch_size=size), progress=False)
        for size in (1, 2, 5)
    ]
    assert {r.ltr_tokens for r in reports} == {r.nelbo_tokens for r in reports} == {int(loss_mask.sum())}
    for report in reports[1:]:
        assert report.ltr_nll == pytest.approx(reports[0].ltr_nll, rel=1e-12)


def test_a_token_past_the_embedding_is_refused_where_no_token_is_scored_too() -> None:
    """Under token shift position 0 is never scored, but it is an input of the forward all the same."""
    fast = EvalSettings(objective="fast_dllm_v2", block_size=4, mask_token_id=MASK_TOKEN_ID)
    split = _split(np.ones((2, 8)))
    check_scored_tokens(split, fast, EvalOptions(), vocab_size=VOCAB_SIZE)
    split.tokens[1, 0] = VOCAB_SIZE
    with pytest.raises(ValueError, match=rf"^--split val: row 1 holds token id {VOCAB_SIZE} at position 0, outside the "
                       rf"model vocabulary \[0, {VOCAB_SIZE}\) \(fix: "):
        check_scored_tokens(split, fast, EvalOptions(), vocab_size=VOCAB_SIZE)
    check_scored_tokens(split, fast, EvalOptions(), vocab_size=VOCAB_SIZE + 1)
