"""Self-denoising objectives against direct single-process formulas (objectives.md §2-§4, §12).

Every formula is re-derived here from scratch: the noise draws are replayed from the same seed in
the documented order, and losses are computed token by token from full float64 logits.
"""

from __future__ import annotations

import math

import pytest
import torch

from csbp.objectives import (
    IGNORE_INDEX,
    ArObjective,
    Bd3Objective,
    CorruptedBatch,
    FastDllmV2Objective,
    MdlmObjective,
    Objective,
    build_objective,
    corruption_generator,
    fast_dllm_v2_views,
    objective_loss,
)

VOCAB, MASK, DIM = 64, 63, 6


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _clean_batch(num_samples: int, seq_len: int, seed: int = 0, prompt: int = 0, pad: int = 0) -> dict:
    generator = _generator(1000 + seed)
    input_ids = torch.randint(0, MASK, (num_samples, seq_len), generator=generator)
    loss_mask = torch.ones(num_samples, seq_len, dtype=torch.bool)
    loss_mask[:, :prompt] = False
    if pad:
        loss_mask[:, seq_len - pad :] = False
    return {"input_ids": input_ids, "loss_mask": loss_mask}


def _head(rows: int, seq_len: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = _generator(2000 + seed)
    hidden = torch.randn(rows, seq_len, DIM, generator=generator, dtype=torch.float64)
    weight = torch.randn(VOCAB, DIM, generator=generator, dtype=torch.float64)
    return hidden, weight


def _ce(hidden_D: torch.Tensor, weight: torch.Tensor, label: int, exclude: int | None) -> float:
    logits = weight @ hidden_D
    if exclude is not None:
        logits = torch.cat([logits[:exclude], logits[exclude + 1 :]])
        label = label - (label > exclude)
    return float(torch.logsumexp(logits, 0) - logits[label])


def _objectives() -> list[Objective]:
    return [
        Bd3Objective(mask_token_id=MASK, block_size=4),
        FastDllmV2Objective(mask_token_id=MASK, block_size=4),
        MdlmObjective(mask_token_id=MASK),
        ArObjective(),
    ]


def _assert_same(first: CorruptedBatch, second: CorruptedBatch) -> None:
    for name in ("noisy_ids", "clean_ids", "labels", "weights", "doc_ids"):
        assert torch.equal(getattr(first, name), getattr(second, name)), name
    assert first.denominator() == second.denominator()


# ---------------------------------------------------------------------------- generator, determinism


def test_corruption_generator_depends_on_seed_step_dp_rank_only() -> None:
    def draw(*args: int, **kwargs: int) -> torch.Tensor:
        return torch.rand(4, generator=corruption_generator(*args, **kwargs), dtype=torch.float64)

    reference = draw(7, 3, 1)
    assert torch.equal(reference, draw(7, 3, 1))
    variants = [draw(8, 3, 1), draw(7, 4, 1), draw(7, 3, 0), draw(7, 3, 1, micro_step=1), draw(3, 7, 1)]
    for other in variants:
        assert not torch.equal(reference, other)
    with pytest.raises(ValueError, match="dp_rank"):
        corruption_generator(0, 0, -1)


@pytest.mark.parametrize("objective", _objectives(), ids=lambda o: o.name)
def test_same_generator_seed_gives_identical_corruption(objective: Objective) -> None:
    batch = _clean_batch(3, 8, prompt=1)
    first = objective.corrupt(batch, corruption_generator(5, 2, 0))
    _assert_same(first, objective.corrupt(batch, corruption_generator(5, 2, 0)))
    other = objective.corrupt(batch, corruption_generator(5, 3, 0))
    if objective.name != "ar":
        assert not torch.equal(first.noisy_ids, other.noisy_ids)


@pytest.mark.parametrize("objective", _objectives(), ids=lambda o: o.name)
def test_objectives_satisfy_the_protocol_and_registry(objective: Objective) -> None:
    assert isinstance(objective, Objective)
    options = {
        field: getattr(objective, field)
        for field in ("mask_token_id", "block_size")
        if hasattr(objective, field)
    }
    assert type(build_objective(objective.name, **options)) is type(objective)


# ------------------------------------------------------------------------------------------- BD3


def _bd3_replay(batch: dict, seed: int, block_size: int, t_min: float, t_max: float, scheme: str):
    """Direct replay of the BD3 draws: K = S·N levels (slot k = s·N + b), then one U per token."""
    input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]
    num_samples, seq_len = input_ids.shape
    num_slots = num_samples * (seq_len // block_size)
    generator = _generator(seed)
    if scheme == "rotated_lattice":
        offset = float(torch.rand(1, generator=generator, dtype=torch.float64))
        tau = [(offset + k / num_slots) % 1.0 for k in range(num_slots)]
    else:
        jitter = torch.rand(num_slots, generator=generator, dtype=torch.float64).tolist()
        order = torch.randperm(num_slots, generator=generator).tolist()  # strata dealt in random order
        tau = [(order[k] + jitter[order[k]]) / num_slots for k in range(num_slots)]
    levels = [t_min + (t_max - t_min) * value for value in tau]
    uniforms = torch.rand(num_samples, seq_len, generator=generator, dtype=torch.float64)
    blocks = seq_len // block_size
    masked = [
        [
            bool(loss_mask[s, i]) and float(uniforms[s, i]) <= levels[s * blocks + i // block_size]
            for i in range(seq_len)
        ]
        for s in range(num_samples)
    ]
    return levels, masked


@pytest.mark.parametrize("scheme", ["rotated_lattice", "stratified"])
@pytest.mark.parametrize("loss_weight", ["inv_t", "unit"])
@pytest.mark.parametrize("denominator", ["supervised_tokens", "all_tokens"])
def test_bd3_matches_direct_formula(scheme: str, loss_weight: str, denominator: str) -> None:
    num_samples, seq_len, block_size, seed = 3, 12, 4, 17
    batch = _clean_batch(num_samples, seq_len, prompt=2, pad=1)
    objective = Bd3Objective(
        mask_token_id=MASK,
        block_size=block_size,
        noise_scheme=scheme,
        loss_weight=loss_weight,
        denominator=denominator,
    )
    corrupted = objective.corrupt(batch, _generator(seed))
    levels, masked = _bd3_replay(batch, seed, block_size, 1e-3, 1.0, scheme)
    assert (
        corrupted.uses_clean_stream and corrupted.block_size == block_size and corrupted.exclude_token == MASK
    )
    assert torch.equal(corrupted.clean_ids, batch["input_ids"])
    hidden, weight = _head(num_samples, seq_len)
    total, blocks = 0.0, seq_len // block_size
    for s in range(num_samples):
        for b in range(blocks):
            assert corrupted.noise_levels[s, b].item() == pytest.approx(levels[s * blocks + b], abs=1e-15)
        for i in range(seq_len):
            x0 = int(batch["input_ids"][s, i])
            t = levels[s * blocks + i // block_size]
            assert int(corrupted.noisy_ids[s, i]) == (MASK if masked[s][i] else x0)
            assert int(corrupted.labels[s, i]) == (x0 if masked[s][i] else IGNORE_INDEX)
            want_weight = (1.0 / t if loss_weight == "inv_t" else 1.0) if masked[s][i] else 0.0
            assert float(corrupted.weights[s, i]) == pytest.approx(want_weight, rel=1e-7)
            if masked[s][i]:
                total += want_weight * _ce(hidden[s, i], weight, x0, MASK)
    normaliser = (
        float(batch["loss_mask"].sum()) if denominator == "supervised_tokens" else num_samples * seq_len
    )
    assert corrupted.denominator() == normaliser
    got = objective_loss(hidden, weight, corrupted, chunk_rows=5)
    # Stored weights are float32, so the float64 loss carries their 6e-8 relative rounding.
    assert float(got) == pytest.approx(total / normaliser, rel=1e-6)


def test_bd3_mask_token_logit_is_excluded() -> None:
    batch = _clean_batch(2, 8)
    corrupted = Bd3Objective(mask_token_id=MASK, block_size=2).corrupt(batch, _generator(4))
    assert corrupted.num_labelled() > 0
    hidden, weight = _head(2, 8)
    weight.requires_grad_()
    loss = objective_loss(hidden, weight, corrupted)
    (grad_weight,) = torch.autograd.grad(loss, weight)
    changed = weight.detach().clone()
    changed[MASK] = 50.0 * torch.randn(DIM, generator=_generator(9), dtype=torch.float64)
    assert float(objective_loss(hidden, changed, corrupted)) == float(loss.detach())
    assert float(grad_weight[MASK].abs().max()) == 0.0


def test_bd3_noise_levels_are_per_block_and_clipped() -> None:
    num_samples, seq_len, block_size = 4, 16, 4
    objective = Bd3Objective(mask_token_id=MASK, block_size=block_size, t_min=0.3, t_max=0.6)
    corrupted = objective.corrupt(_clean_batch(num_samples, seq_len), _generator(2))
    levels = corrupted.noise_levels
    assert levels.shape == (num_samples, seq_len // block_size)
    assert float(levels.min()) >= 0.3 and float(levels.max()) < 0.6
    spacing = torch.diff(torch.sort(levels.flatten()).values)
    assert torch.allclose(spacing, torch.full_like(spacing, 0.3 / levels.numel()), rtol=0, atol=1e-12)
    weights = corrupted.weights
    assert float(weights.max()) <= 1.0 / 0.3 + 1e-6
    per_token = levels.repeat_interleave(block_size, dim=1)
    masked = corrupted.labels != IGNORE_INDEX
    assert torch.allclose(weights[masked].double(), 1.0 / per_token[masked], rtol=1e-7)


@pytest.mark.parametrize(
    "objective",
    [Bd3Objective(mask_token_id=MASK, block_size=4), MdlmObjective(mask_token_id=MASK)],
    ids=["bd3", "mdlm"],
)
def test_inverse_probability_identity_and_uniform_predictor(objective: Objective) -> None:
    # objectives.md §12 item 7: E[m/t] = 1, so a uniform predictor over V' = V-1 classes scores
    # log V' per maskable token. 16384 tokens; the standard error of mean(m/t) is about 0.02.
    batch = _clean_batch(128, 128, seed=3)
    corrupted = objective.corrupt(batch, _generator(21))
    ratio = float(corrupted.weights.double().sum()) / corrupted.denominator()
    assert ratio == pytest.approx(1.0, abs=0.1)
    hidden = torch.zeros(128, 128, 2, dtype=torch.float64)
    weight = torch.randn(VOCAB, 2, generator=_generator(0), dtype=torch.float64)
    loss = float(objective_loss(hidden, weight, corrupted, chunk_rows=4096))
    assert loss == pytest.approx(ratio * math.log(VOCAB - 1), rel=1e-12)
    assert loss == pytest.approx(math.log(VOCAB - 1), rel=0.1)


# ------------------------------------------------------------------------------------ Fast-dLLM v2


def test_fast_dllm_v2_supervision_map_of_the_reference_example() -> None:
    # objectives.md §4: L = 8, bd = 4, prompt 0-1, m1 = {2, 3}, m2 = {4, 5, 6, 7}.
    input_ids = torch.arange(10, 18).view(1, 8)
    eligible = torch.tensor([[False, False, True, True, True, True, True, True]])
    bernoulli = torch.tensor([[True, False, True, True, False, False, False, False]])
    corrupted = fast_dllm_v2_views(
        input_ids, eligible, torch.zeros_like(input_ids), bernoulli, mask_token_id=MASK, block_size=4
    )
    assert corrupted.num_rows == 2 and corrupted.exclude_token is None and corrupted.uses_clean_stream
    noisy_view1 = [10, 11, MASK, MASK, 14, 15, 16, 17]
    noisy_view2 = [10, 11, 12, 13, MASK, MASK, MASK, MASK]
    assert corrupted.noisy_ids.tolist() == [noisy_view1, noisy_view2]
    assert torch.equal(corrupted.clean_ids, torch.cat([input_ids, input_ids]))
    scored = {
        (view, row, int(corrupted.labels[view, row]))
        for view in range(2)
        for row in range(8)
        if int(corrupted.labels[view, row]) != IGNORE_INDEX
    }
    # (logit row -> label position): view 1 (1->2), (2->3); view 2 (3->4), (4->5), (5->6), (6->7).
    assert scored == {(0, 1, 12), (0, 2, 13), (1, 3, 14), (1, 4, 15), (1, 5, 16), (1, 6, 17)}
    assert corrupted.weights.sum() == 6 and corrupted.denominator() == 6.0


def _fdv2_replay(batch: dict, seed: int, block_size: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Direct replay: t ~ U(0,1) per (sample, block), p = (1-eps)t + eps, m_i = [U_i < p]."""
    num_samples, seq_len = batch["input_ids"].shape
    generator = _generator(seed)
    levels = torch.rand(num_samples * (seq_len // block_size), generator=generator, dtype=torch.float64)
    move_chance = ((1 - eps) * levels + eps).view(num_samples, -1)
    uniforms = torch.rand(num_samples, seq_len, generator=generator, dtype=torch.float64)
    bernoulli = torch.zeros(num_samples, seq_len, dtype=torch.bool)
    for s in range(num_samples):
        for i in range(seq_len):
            bernoulli[s, i] = float(uniforms[s, i]) < float(move_chance[s, i // block_size])
    return move_chance, bernoulli


@pytest.mark.parametrize("prompt", [0, 3])
def test_fast_dllm_v2_matches_direct_formula(prompt: int) -> None:
    num_samples, seq_len, block_size, seed = 2, 12, 4, 8
    batch = _clean_batch(num_samples, seq_len, prompt=prompt)
    corrupted = FastDllmV2Objective(mask_token_id=MASK, block_size=block_size).corrupt(
        batch, _generator(seed)
    )
    move_chance, bernoulli = _fdv2_replay(batch, seed, block_size, 1e-3)
    assert torch.allclose(corrupted.noise_levels, torch.cat([move_chance, 1 - move_chance]), rtol=0, atol=0)
    assert float(move_chance.min()) >= 1e-3
    hidden, weight = _head(2 * num_samples, seq_len)
    total, count = 0.0, 0
    for view in range(2):
        for s in range(num_samples):
            row = view * num_samples + s
            for i in range(seq_len):
                eligible = bool(batch["loss_mask"][s, i])
                masked = eligible and (bool(bernoulli[s, i]) if view == 0 else not bool(bernoulli[s, i]))
                x0 = int(batch["input_ids"][s, i])
                assert int(corrupted.noisy_ids[row, i]) == (MASK if masked else x0)
                if masked and i >= 1:  # logit of row i-1 predicts token i; mask logit kept
                    total += _ce(hidden[row, i - 1], weight, x0, None)
                    count += 1
    assert corrupted.denominator() == count
    got = objective_loss(hidden, weight, corrupted, chunk_rows=7)
    assert float(got) == pytest.approx(total / count, rel=1e-10)


def test_fast_dllm_v2_views_partition_the_eligible_tokens() -> None:
    num_samples, seq_len = 5, 16
    objective = FastDllmV2Objective(mask_token_id=MASK, block_size=4)
    for prompt, pad in ((0, 0), (5, 2)):
        batch = _clean_batch(num_samples, seq_len, seed=prompt, prompt=prompt, pad=pad)
        corrupted = objective.corrupt(batch, _generator(prompt))
        masked = corrupted.noisy_ids == MASK
        view1, view2 = masked[:num_samples], masked[num_samples:]
        assert not bool((view1 & view2).any())
        assert torch.equal(view1 | view2, batch["loss_mask"])  # m1 + m2 = eligible, exactly
        active = corrupted.num_labelled()
        valid = int(batch["loss_mask"][:, 1:].sum())  # shifted targets: position 0 never scored
        assert active == valid == corrupted.denominator()
        if prompt == 0:
            assert active == num_samples * (seq_len - 1)
        assert torch.equal(corrupted.weights, (corrupted.labels != IGNORE_INDEX).float())
        assert bool((corrupted.labels[:, -1] == IGNORE_INDEX).all())


def test_fast_dllm_v2_drops_targets_across_packed_documents() -> None:
    input_ids = torch.arange(20, 28).view(1, 8)
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    batch = {"input_ids": input_ids, "doc_ids": doc_ids}
    corrupted = FastDllmV2Objective(mask_token_id=MASK, block_size=4).corrupt(batch, _generator(0))
    # Row 2 (document 0) never predicts token 3 (first token of document 1).
    assert bool((corrupted.labels[:, 2] == IGNORE_INDEX).all())
    assert corrupted.num_labelled() == 6 and corrupted.doc_ids.shape == (2, 8)


# ------------------------------------------------------------------------------------------ MDLM


def test_mdlm_matches_direct_formula() -> None:
    num_samples, seq_len, seed, eps = 4, 10, 13, 1e-3
    batch = _clean_batch(num_samples, seq_len, pad=2)
    corrupted = MdlmObjective(mask_token_id=MASK).corrupt(batch, _generator(seed))
    assert (
        not corrupted.uses_clean_stream
        and corrupted.block_size == seq_len
        and corrupted.exclude_token == MASK
    )
    generator = _generator(seed)
    jitter = torch.rand(num_samples, generator=generator, dtype=torch.float64)
    order = torch.randperm(num_samples, generator=generator).tolist()
    levels = [eps + (1 - eps) * (j + float(jitter[j])) / num_samples for j in order]
    uniforms = torch.rand(num_samples, seq_len, generator=generator, dtype=torch.float64)
    hidden, weight = _head(num_samples, seq_len)
    total = 0.0
    for s in range(num_samples):
        assert float(corrupted.noise_levels[s, 0]) == pytest.approx(levels[s], abs=1e-15)
        for i in range(seq_len):
            masked = bool(batch["loss_mask"][s, i]) and float(uniforms[s, i]) <= levels[s]
            x0 = int(batch["input_ids"][s, i])
            assert int(corrupted.labels[s, i]) == (x0 if masked else IGNORE_INDEX)
            if masked:
                total += _ce(hidden[s, i], weight, x0, MASK) / levels[s]
    non_pad = int(batch["loss_mask"].sum())
    assert corrupted.denominator() == non_pad
    assert float(objective_loss(hidden, weight, corrupted)) == pytest.approx(total / non_pad, rel=1e-6)


def test_mdlm_levels_are_stratified_across_the_batch() -> None:
    corrupted = MdlmObjective(mask_token_id=MASK, eps=0.1).corrupt(_clean_batch(16, 4), _generator(1))
    tau = (corrupted.noise_levels[:, 0] - 0.1) / 0.9
    assert sorted(torch.floor(tau * 16).long().tolist()) == list(range(16))  # one per stratum


# -------------------------------------------------------------------------------------------- AR


def test_ar_matches_direct_next_token_loss() -> None:
    batch = _clean_batch(2, 9, prompt=3)
    batch["doc_ids"] = torch.tensor([[0] * 9, [0, 0, 0, 0, 0, 1, 1, 1, 1]])
    corrupted = ArObjective().corrupt(batch, _generator(0))
    assert torch.equal(corrupted.noisy_ids, batch["input_ids"])
    assert not corrupted.uses_clean_stream and corrupted.block_size == 1 and corrupted.noise_levels is None
    hidden, weight = _head(2, 9)
    total, count = 0.0, 0
    for s in range(2):
        for i in range(8):
            target_ok = bool(batch["loss_mask"][s, i + 1]) and int(batch["doc_ids"][s, i]) == int(
                batch["doc_ids"][s, i + 1]
            )
            if target_ok:
                total += _ce(hidden[s, i], weight, int(batch["input_ids"][s, i + 1]), None)
                count += 1
    assert count == 6 + 5 and corrupted.denominator() == count
    assert float(objective_loss(hidden, weight, corrupted)) == pytest.approx(total / count, rel=1e-10)
    unsupervised = ArObjective().corrupt({"input_ids": batch["input_ids"]}, _generator(0))
    assert unsupervised.denominator() == 2 * 8


# ------------------------------------------------------------------------------------ validation


def test_user_errors_raise_value_errors() -> None:
    with pytest.raises(ValueError, match="block_size"):
        Bd3Objective(mask_token_id=MASK, block_size=3).corrupt(_clean_batch(1, 8), _generator(0))
    with pytest.raises(ValueError, match="block_size"):
        FastDllmV2Objective(mask_token_id=MASK, block_size=5).corrupt(_clean_batch(1, 8), _generator(0))
    batch = _clean_batch(1, 8)
    batch["input_ids"][0, 3] = MASK
    with pytest.raises(ValueError, match="mask token"):
        Bd3Objective(mask_token_id=MASK, block_size=4).corrupt(batch, _generator(0))
    with pytest.raises(ValueError, match="t_min"):
        Bd3Objective(mask_token_id=MASK, block_size=4, t_min=0.0)
    with pytest.raises(ValueError, match="denominator"):
        MdlmObjective(mask_token_id=MASK, denominator="tokens")
    with pytest.raises(ValueError, match="loss_mask"):
        MdlmObjective(mask_token_id=MASK).corrupt(
            {"input_ids": torch.zeros(2, 4, dtype=torch.long), "loss_mask": torch.ones(2, 4)}, _generator(0)
        )
    with pytest.raises(ValueError, match="input_ids"):
        ArObjective().corrupt({"input_ids": torch.zeros(4, dtype=torch.long)}, _generator(0))
    with pytest.raises(ValueError, match="objective"):
        build_objective("dflash")
    with pytest.raises(ValueError, match="invalid options"):
        build_objective("bd3", mask_token_id=MASK, block=4)
    corrupted = ArObjective().corrupt(_clean_batch(1, 8), _generator(0))
    with pytest.raises(ValueError, match="hidden_noisy_rows"):
        objective_loss(torch.zeros(2, 8, DIM), torch.zeros(VOCAB, DIM), corrupted)


@pytest.mark.parametrize("chance", [0.9, 0.1])
def test_fast_dllm_v2_views_mask_at_the_move_chance_they_weight_by(chance: float) -> None:
    """The Bernoulli masks are drawn against the move chance ``low + (high - low)·t`` the views record (and
    the NELBO weights by), not against the raw level ``t``: drawn against ``t``, ``eps`` and the NELBO's
    ``[a, 1 - a]`` range were ignored when masking, and no test saw it."""
    from csbp.objectives.fast_dllm_v2 import draw_views

    ids = torch.randint(0, 100, (4, 1024), generator=torch.Generator().manual_seed(1))
    views = draw_views({"input_ids": ids, "loss_mask": torch.ones_like(ids, dtype=torch.bool)},
                       torch.Generator().manual_seed(0), mask_token_id=100, block_size=32, low=chance, high=chance)
    first, second = (float((views.noisy_ids[rows] == 100).double().mean()) for rows in (slice(0, 4), slice(4, 8)))
    assert abs(first - chance) < 0.02 and abs(second - (1 - chance)) < 0.02  # 4096 draws: sd 0.005
    assert torch.equal(views.noise_levels, torch.tensor([[chance] * 32] * 4 + [[1 - chance] * 32] * 4, dtype=torch.float64))
