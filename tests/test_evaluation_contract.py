"""The NELBO of ``csbp eval`` whatever the trained objective's options, the noise each batch draws,
and the split of batches over data-parallel replicas (``csbp.evaluation``; objectives.md §3.4:
evaluation uses the unclipped ELBO).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from csbp.data.artifact import ArtifactSplit
from csbp.engine.context import single_process_context
from csbp.engine.verify import MASK_TOKEN_ID, VOCAB_SIZE, tiny_model_config
from csbp.evaluation import EVAL_T_MIN, EvalOptions, EvalSettings, evaluate_model, nelbo_objective
from csbp.evaluation.runner import eval_plan, score_split
from csbp.models.decoder import Decoder
from csbp.objectives import Bd3Objective, FastDllmV2Objective, MdlmObjective, corruption_generator


def test_the_nelbo_replaces_every_training_choice_of_the_objective() -> None:
    # trained clipped to [0.3, 0.8], unit weights, stratified noise, S·L denominator: the NELBO
    # still uses t in [EVAL_T_MIN, 1], 1/t weights, the rotated lattice and supervised tokens
    bd3 = nelbo_objective(
        Bd3Objective(mask_token_id=MASK_TOKEN_ID, block_size=4, t_min=0.3, t_max=0.8, noise_scheme="stratified",
                     loss_weight="unit", denominator="all_tokens")
    )
    assert isinstance(bd3, Bd3Objective)
    assert (bd3.t_min, bd3.t_max, bd3.loss_weight, bd3.noise_scheme, bd3.denominator) == (
        EVAL_T_MIN, 1.0, "inv_t", "rotated_lattice", "supervised_tokens"
    )
    mdlm = nelbo_objective(MdlmObjective(mask_token_id=MASK_TOKEN_ID, eps=0.2, loss_weight="unit", denominator="all_tokens"))
    assert isinstance(mdlm, MdlmObjective)
    assert (mdlm.eps, mdlm.loss_weight, mdlm.noise_scheme, mdlm.denominator) == (
        EVAL_T_MIN, "inv_t", "rotated_lattice", "supervised_tokens"
    )


def test_fast_dllm_v2_nelbo_move_chances_stay_inside_a_and_one_minus_a() -> None:
    # p ~ U[a, 1 − a] for view 1 and 1 − p for view 2: both views mask with chance >= a, so no
    # weight exceeds 1/(2a).
    nelbo = nelbo_objective(FastDllmV2Objective(mask_token_id=MASK_TOKEN_ID, block_size=4), t_min=0.3)
    assert nelbo is not None
    ids = torch.randint(0, MASK_TOKEN_ID, (4, 64), generator=torch.Generator().manual_seed(0))
    corrupted = nelbo.corrupt({"input_ids": ids}, corruption_generator(0, 0, 0))
    levels = corrupted.noise_levels
    assert levels is not None and levels.shape == (8, 16)
    assert float(levels.min()) >= 0.3 and float(levels.max()) <= 0.7
    torch.testing.assert_close(levels[4:], 1.0 - levels[:4], rtol=0, atol=0)
    assert float(corrupted.weights.max()) <= 0.5 / 0.3 + 1e-6


def _split(rows: np.ndarray) -> ArtifactSplit:
    count, seq_len = rows.shape
    ones = np.ones((count, seq_len), np.uint8)
    return ArtifactSplit("val", seq_len, rows.astype(np.uint32), ones, np.zeros((count, seq_len), np.int64), "test")


def test_every_batch_draws_its_own_noise() -> None:
    # Draw k of batch n is seeded by (seed, n, k): a row repeated as a second batch is corrupted
    # differently, so the estimate moves; were every batch given batch 0's noise it would not.
    row = np.random.default_rng(0).integers(0, MASK_TOKEN_ID, size=(1, 8))
    model = Decoder(tiny_model_config(), dtype=torch.float64, seed=0)
    settings = EvalSettings(objective="bd3", block_size=4, mask_token_id=MASK_TOKEN_ID)
    options = EvalOptions(samples=2, micro_batch_size=1, left_to_right=False)
    once = evaluate_model(model, _split(row), settings, options, progress=False)
    twice = evaluate_model(model, _split(np.concatenate([row, row])), settings, options, progress=False)
    assert twice.nelbo_tokens == 2 * once.nelbo_tokens
    assert twice.nelbo != pytest.approx(once.nelbo, rel=1e-9)


def test_replicas_score_each_batch_exactly_once() -> None:
    # Batch n belongs to replica n mod R: three replicas' sums add up to one process's.
    rows = np.random.default_rng(1).integers(0, MASK_TOKEN_ID, size=(7, 8))
    split = _split(rows)
    model = Decoder(tiny_model_config(), dtype=torch.float64, seed=0)
    settings = EvalSettings(objective="bd3", block_size=4, mask_token_id=MASK_TOKEN_ID)
    options = EvalOptions(samples=2, micro_batch_size=2)
    plan = eval_plan(settings, 8, single_process_context())
    whole = score_split(model, split, settings, plan, options, progress=False)
    parts = [score_split(model, split, settings, plan, options, replica=r, replicas=3, progress=False) for r in range(3)]
    assert [p.rows for p in parts] == [3, 2, 2]  # batches {0, 3}, {1}, {2}; batch 3 holds one row
    assert sum(p.ltr_tokens for p in parts) == whole.ltr_tokens
    assert sum(p.ltr for p in parts) == pytest.approx(whole.ltr, rel=1e-12)
    for draw in range(2):
        assert sum(p.nelbo[draw] for p in parts) == pytest.approx(whole.nelbo[draw], rel=1e-12)


@pytest.mark.parametrize("objective", ["fast_dllm_v2", "bd3"])
def test_a_scored_mask_token_is_refused_before_any_forward(objective: str) -> None:
    # [M]'s logit is excluded, so a scored [M] has infinite CE: fast_dllm_v2 reported nelbo inf and
    # ltr nll inf, bd3 refused it only at its batch, after forwards, naming a training option.
    rows = np.random.default_rng(2).integers(0, MASK_TOKEN_ID, size=(2, 8))
    rows[1, 5] = MASK_TOKEN_ID
    settings = EvalSettings(objective=objective, block_size=4, mask_token_id=MASK_TOKEN_ID)
    model = Decoder(tiny_model_config(), dtype=torch.float64, seed=0)
    with pytest.raises(ValueError, match=r"--split val: row 1 holds the mask token id 63 at scored position 5; ") as caught:
        evaluate_model(model, _split(rows), settings, EvalOptions(samples=2), progress=False)
    assert "\n" not in str(caught.value) and "fix:" in str(caught.value)
    # an [M] that is never scored only conditions: unsupervised, or (token shift) at position 0
    rows[1, 5] = 1
    rows[0, 0] = MASK_TOKEN_ID
    split = _split(rows)
    if objective == "bd3":
        split.loss_mask[0, 0] = 0
    report = evaluate_model(model, split, settings, EvalOptions(samples=2), progress=False)
    assert np.isfinite(report.nelbo) and report.ltr_nll is not None and np.isfinite(report.ltr_nll)


@pytest.mark.parametrize(("objective", "scored"), [("mdlm", 16), ("bd3", 16), ("fast_dllm_v2", 14)])
def test_only_fast_dllm_v2_scores_with_token_shift(objective: str, scored: int) -> None:
    # same-position labels for MDLM and BD3-LM, token shift for Fast-dLLM v2 (objectives.md §1): under
    # shift position 0 of each row is never a target, so 2 rows of 8 supervised tokens score 14
    rows = np.random.default_rng(3).integers(0, MASK_TOKEN_ID, size=(2, 8))
    settings = EvalSettings(objective=objective, block_size=8 if objective == "mdlm" else 4, mask_token_id=MASK_TOKEN_ID)
    model = Decoder(tiny_model_config(), dtype=torch.float64, seed=0)
    report = evaluate_model(model, _split(rows), settings, EvalOptions(samples=2), progress=False)
    assert (report.ltr_tokens, report.nelbo_tokens) == (scored, scored)


class _CountedReads:
    """A split array that notes how many rows each read returns."""

    def __init__(self, array: np.ndarray, reads: list[int]) -> None:
        self.array, self.reads, self.shape = array, reads, array.shape

    def __getitem__(self, key: object) -> np.ndarray:
        out = self.array[key]
        self.reads.append(len(out))
        return out


@pytest.mark.parametrize("objective", ["fast_dllm_v2", "bd3"])
def test_the_scored_token_scan_reads_a_bounded_number_of_positions(objective: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # the scan read 4096 rows at a time whatever their length: with the tokens it now reads as well,
    # some GiB per chunk for long rows; it reads SCAN_TOKENS positions (at least one row) at a time
    from csbp.evaluation import runner

    monkeypatch.setattr(runner, "SCAN_TOKENS", 16, raising=False)  # two rows of 8
    rows = np.ones((5, 8), dtype=np.uint32)
    rows[3, 6] = MASK_TOKEN_ID
    reads: list[int] = []
    split = ArtifactSplit(
        name="val", seq_len=8, tokens=_CountedReads(rows, reads),  # type: ignore[arg-type]
        loss_mask=_CountedReads(np.ones((5, 8), dtype=np.uint8), reads),  # type: ignore[arg-type]
        doc_ids=_CountedReads(np.zeros((5, 8), dtype=np.int32), reads), fingerprint="test",  # type: ignore[arg-type]
    )
    settings = EvalSettings(objective=objective, block_size=4, mask_token_id=MASK_TOKEN_ID)
    with pytest.raises(ValueError, match=r"--split val: row 3 holds the mask token id 63 at scored position 6; "):
        runner.check_scored_tokens(split, settings, EvalOptions(micro_batch_size=1), vocab_size=VOCAB_SIZE)
    assert reads and max(reads) == 2
    monkeypatch.setattr(runner, "SCAN_TOKENS", 3, raising=False)  # less than a row: one row at a time
    rows[3, 6] = 1
    reads.clear()
    runner.check_scored_tokens(split, settings, EvalOptions(micro_batch_size=1), vocab_size=VOCAB_SIZE)
    assert max(reads) == 1 and sum(reads) == 5 * (3 if objective == "fast_dllm_v2" else 2)
