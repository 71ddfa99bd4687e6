"""The ``dflash`` objective (objectives.md §5.6, §6, §12 tests 6-8, 10-11 single-process): slot
weights, label alignment, the step against the dense oracle for every loss option, D-PACE
goldens, the selector sanity identities, chunked KL, and global-denominator partition invariance.
Float64; loss/gradient tolerance 1e-9 relative."""

from __future__ import annotations

import math

import pytest
import torch

from csbp.dflash.chunked_kl import chunked_forward_kl
from csbp.dflash.config import DFlashObjectiveConfig
from csbp.dflash.dflash2 import CandidateSelector, dpace_weights, selector_loss_scale
from csbp.dflash.features import capture_target_features
from csbp.dflash.layouts import AnchorPacket, DFlashLayout, context_rows, owned_packet
from csbp.dflash.loss import block_targets, rank_dflash_loss, slot_decay, supervised_slot_counts
from csbp.dflash.rank_plan import build_dflash_rank_plan
from csbp.dflash.reference import reference_dflash_loss
from csbp.dflash.step import DFlashStep, forward_packet, sample_batch_anchors
from csbp.dflash.verify import DFlashVerifyCase, build_models, make_batch
from csbp.engine.context import single_process_context


def _identity(values: torch.Tensor) -> torch.Tensor:
    return values


def test_slot_decay_values() -> None:
    torch.testing.assert_close(
        slot_decay(torch.arange(1, 4), 7.0, torch.float64),
        torch.tensor([1.0, 0.8669, 0.7515], dtype=torch.float64),
        rtol=0,
        atol=1e-4,
    )
    expected = [1, 0.7788, 0.6065, 0.4724, 0.3679, 0.2865, 0.2231]
    torch.testing.assert_close(
        slot_decay(torch.arange(1, 8), 4.0, torch.float64),
        torch.tensor(expected, dtype=torch.float64),
        rtol=0,
        atol=1e-4,
    )
    assert abs(float(slot_decay(torch.tensor([15]), 7.0, torch.float64)[0]) - math.exp(-2)) < 1e-15
    assert torch.equal(slot_decay(torch.arange(4), None, torch.float64), torch.ones(4, dtype=torch.float64))


def test_slot_weights_follow_the_formula_of_section_5_6() -> None:
    """``ω[n, j] = keep_n · [a_n + j < S] · [j >= 1] · λ[a_n + j] · exp(−(j−1)/γ)`` and ``y = x[a + j]``,
    written out by hand for one case that hits every factor (objectives.md §12 item 7)."""
    tokens = torch.arange(20, 30)  # S = 10
    loss_mask = torch.ones(10, dtype=torch.bool)
    loss_mask[6] = False  # λ = 0 at position 6
    packet = AnchorPacket(
        torch.arange(4),
        torch.tensor([0, 5, 8, 2]),  # anchor 8: slots 2-3 fall past the end; anchor 2: a dead block
        torch.zeros(4, dtype=torch.long),
        torch.tensor([True, True, True, False]),
    )
    targets = block_targets(tokens, loss_mask, torch.zeros(10, dtype=torch.long), packet, 4, sample=0)
    expected_valid = [
        [False, True, True, True],  # a = 0: slot 0 (the anchor) is never a target
        [False, False, True, True],  # a = 5: position 6 unsupervised
        [False, True, False, False],  # a = 8: positions 10, 11 do not exist
        [False, False, False, False],  # dead
    ]
    assert targets.valid.view(4, 4).tolist() == expected_valid
    labels = targets.labels.view(4, 4)
    for n, anchor in enumerate([0, 5, 8]):
        for j in range(4):
            if expected_valid[n][j]:
                assert int(labels[n, j]) == int(tokens[anchor + j])  # same-position labels
    weights = slot_decay(targets.slot, 7.0, torch.float64) * targets.valid
    expected = torch.tensor(
        [[0, 1, math.exp(-1 / 7), math.exp(-2 / 7)], [0, 0, math.exp(-1 / 7), math.exp(-2 / 7)], [0, 1, 0, 0], [0] * 4],
        dtype=torch.float64,
    )
    torch.testing.assert_close(weights.view(4, 4), expected, rtol=0, atol=1e-15)
    assert supervised_slot_counts([targets], 1).tolist() == [6]  # the Turbo-dLLM per-sample count


VARIANTS = [
    pytest.param({}, {}, 0.0, id="ce-decay"),
    pytest.param({}, {"gamma": None}, 0.0, id="ce-no-decay"),
    pytest.param({}, {"loss": "kl"}, 0.0, id="kl"),
    pytest.param({}, {"lk_loss_type": "tv"}, 0.0, id="tv"),
    pytest.param({}, {"lk_loss_type": "lambda", "kl_scale": 0.9, "kl_decay": 2.0}, 0.0, id="lambda"),
    pytest.param({}, {"weighting": "dpace"}, 0.0, id="dpace"),
    pytest.param({}, {"weighting": "dpace-cumulative-confidence-only"}, 0.0, id="dpace-cumulative"),
    pytest.param({}, {"weighting": "dpace-continuation-value-only"}, 0.0, id="dpace-continuation"),
    pytest.param(
        {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 4, "selector_top_k": 40},
        {},
        0.5,
        id="dflash2-selector",
    ),
    pytest.param(
        {"selector_rank": 4, "selector_top_k": 40},
        {"selector_stop_gradient": True},
        1.0,
        id="selector-stop-gradient",
    ),
    pytest.param(
        {"layer_types": ("sliding_attention", "full_attention"), "sliding_window": 3},
        {"context": "inclusive", "anchor_sampling": "locality"},
        0.0,
        id="sliding-inclusive-locality",
    ),
]


@pytest.mark.parametrize(("drafter_options", "objective_options", "selector_scale"), VARIANTS)
def test_step_equals_dense_reference(
    drafter_options: dict, objective_options: dict, selector_scale: float
) -> None:
    objective = DFlashObjectiveConfig(**{"max_anchors": 6, "gamma": 7.0, **objective_options})
    case = DFlashVerifyCase(drafter_options=drafter_options, objective=objective, perturb_extras=True)
    target, drafter = build_models(case)
    batch = make_batch(2, 32)
    step = DFlashStep(drafter, objective, build_dflash_rank_plan(single_process_context(), objective))
    out = step(batch, torch.Generator().manual_seed(3), selector_scale=selector_scale)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in drafter.named_parameters()}
    drafter.zero_grad()
    anchors = sample_batch_anchors(batch, objective, 4, torch.Generator().manual_seed(3))
    features = capture_target_features(
        target, batch.input_ids, (0, 2), doc_ids_SL=batch.doc_ids, with_last_hidden=True
    )
    ref = reference_dflash_loss(
        drafter,
        batch.input_ids,
        batch.loss_mask,
        batch.doc_ids,
        anchors,
        features,
        objective,
        selector_scale=selector_scale,
    )
    ref.loss.backward()
    assert abs(float(out.loss.detach()) - float(ref.main + selector_scale * ref.selector)) <= 1e-9 * abs(
        float(ref.main)
    )
    assert abs(out.selector_value - float(ref.selector)) <= 1e-9 * max(abs(float(ref.selector)), 1e-30)
    for name, param in drafter.named_parameters():
        scale = max(float(param.grad.abs().max()), 1e-30)
        assert float((grads[name] - param.grad).abs().max()) <= 1e-9 * scale, name
    m = ref.metrics
    assert out.metrics["token_accuracy"] == m["correct"] / m["supervised"]
    assert out.metrics["tau_mean"] == m["tau_sum"] / m["live_blocks"]
    if drafter.selector is not None:
        assert m["covered"] > 0 and out.metrics["candidate_recall"] == m["covered"] / m["supervised"]


class _HeadRows(torch.overrides.TorchFunctionMode):
    """Records the row count of every 2-D matmul whose output is ``[rows, V]`` (the LM head)."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        self.vocab_size, self.rows = vocab_size, []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        out = func(*args, **(kwargs or {}))
        matmuls = (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.einsum)
        if func in matmuls and isinstance(out, torch.Tensor) and out.dim() == 2:
            if out.shape[-1] == self.vocab_size:
                self.rows.append(int(out.shape[0]))
        return out


@pytest.mark.parametrize(
    ("drafter_options", "objective_options"),
    [
        pytest.param({}, {}, id="ce"),
        pytest.param({}, {"loss": "kl"}, id="kl"),
        pytest.param({}, {"lk_loss_type": "lambda", "weighting": "dpace"}, id="lambda-dpace"),
        pytest.param({"selector_rank": 4, "selector_top_k": 8}, {}, id="selector"),
    ],
)
def test_the_step_never_builds_more_than_a_chunk_of_head_logits(
    drafter_options: dict, objective_options: dict
) -> None:
    """objectives.md §9 pitfall 11: ``[N·B, V]`` logits are never materialised, forward or backward."""
    chunk = 5
    objective = DFlashObjectiveConfig(max_anchors=6, gamma=7.0, ce_chunk_rows=chunk, **objective_options)
    target, drafter = build_models(DFlashVerifyCase(drafter_options=drafter_options, objective=objective))
    batch = make_batch(2, 32)
    features = capture_target_features(target, batch.input_ids, (0, 2), with_last_hidden=True)
    step = DFlashStep(drafter, objective, build_dflash_rank_plan(single_process_context(), objective))
    recorder = _HeadRows(drafter.lm_head_weight.shape[0])
    with recorder:
        out = step(batch, torch.Generator().manual_seed(3), features=features, selector_scale=0.5)
        out.loss.backward()
    assert recorder.rows and max(recorder.rows) <= chunk, recorder.rows
    assert sum(recorder.rows) > 4 * chunk  # the head did see many more rows than one chunk


def _onehot_problem(shift: int) -> tuple[torch.Tensor, torch.Tensor, object]:
    """Identity head (V = D = 16); draft hidden = 50·onehot(x[a + j + shift]); a perfect teacher whose
    last hidden state at position p is 50·onehot(x[p + 1]) (its next-token prediction)."""
    length, block = 16, 4
    tokens = torch.randint(0, 16, (length,), generator=torch.Generator().manual_seed(0))
    packet = AnchorPacket(
        torch.arange(3),
        torch.tensor([1, 5, 9]),
        torch.zeros(3, dtype=torch.long),
        torch.ones(3, dtype=torch.bool),
    )
    teacher_LD = 50.0 * torch.nn.functional.one_hot(
        tokens[(torch.arange(length) + 1).clamp(max=length - 1)], 16
    )
    targets = block_targets(
        tokens,
        torch.ones(length, dtype=torch.bool),
        torch.zeros(length, dtype=torch.long),
        packet,
        block,
        sample=0,
        last_hidden_LD=teacher_LD.double(),
    )
    position = (packet.anchors.repeat_interleave(block) + torch.arange(block).repeat(3) + shift).clamp(
        max=length - 1
    )
    hidden = 50.0 * torch.nn.functional.one_hot(tokens[position], 16).double()
    return hidden.requires_grad_(), torch.eye(16, dtype=torch.float64), targets


@pytest.mark.parametrize("loss", ["ce", "kl"])
def test_label_alignment(loss: str) -> None:
    objective = DFlashObjectiveConfig(gamma=7.0, loss=loss)
    for shift, aligned in ((0, True), (1, False)):
        hidden, head, targets = _onehot_problem(shift)
        out = rank_dflash_loss(
            hidden,
            head,
            targets,
            objective,
            block_size=4,
            sample_counts=supervised_slot_counts([targets], 1),
            reduce=_identity,
        )
        tau = out.metrics["tau_sum"] / out.metrics["live_blocks"]
        if aligned:
            assert abs(float(out.loss.detach())) < 1e-15 and tau == 4
            assert out.metrics["correct"] == out.metrics["supervised"] == 9
        else:
            assert float(out.loss.detach()) > 10 and tau < 2


@pytest.mark.parametrize(
    ("alpha", "cases"),
    [
        (0.5, {"dpace": [0.0, 1.95, 1.2, 0.45], "dpace-cumulative-confidence-only": [0.0, 0.75, 0.75, 0.45],
               "dpace-continuation-value-only": [0.0, 2.6, 1.6, 1.0]}),
        # alpha and 1 - alpha coincide at 0.5; at 0.25: s = [-, 0.25 + 0.75*0.5, 0.25 + 0.75*1.0, 0.25 + 0.75*0.2]
        # = [1, 0.625, 1, 0.4] (slot 0 invalid), P = [1, 0.625, 0.625, 0.25], u = [-, 1.5, 0.875, 0.25], u / P
        (0.25, {"dpace": [0.0, 1.5, 0.875, 0.25], "dpace-cumulative-confidence-only": [0.0, 0.625, 0.625, 0.25],
                "dpace-continuation-value-only": [0.0, 2.4, 1.4, 1.0]}),
    ],
)
def test_dpace_weights_golden(alpha: float, cases: dict[str, list[float]]) -> None:
    prob = torch.tensor([[0.3, 0.5, 1.0, 0.2]], dtype=torch.float64)
    valid = torch.tensor([[False, True, True, True]])
    for kind, expected in cases.items():
        got = dpace_weights(prob, valid, alpha=alpha, kind=kind)
        torch.testing.assert_close(got, torch.tensor([expected], dtype=torch.float64), rtol=0, atol=1e-12)


def test_selector_sanity_with_zero_codebook() -> None:
    generator = torch.Generator().manual_seed(0)
    selector = CandidateSelector(64, 32, rank=4, top_k=8).double()
    selector.reset_parameters(generator)
    head = torch.randn(64, 32, generator=generator, dtype=torch.float64)
    hidden = torch.randn(4, 32, generator=generator, dtype=torch.float64)
    drafted = selector.greedy_decode(hidden, head, anchor_token=5)
    assert torch.equal(drafted, (hidden[1:] @ head.t()).argmax(-1))  # Bk = 0: the unary top-1 path
    unary = hidden @ head.t()
    candidates = unary.topk(8, dim=-1).indices
    scores = selector.pair_scores(hidden, unary.gather(1, candidates), torch.tensor([1, 2, 3, 4]), candidates)
    restricted = torch.log_softmax(unary.gather(1, candidates), dim=-1)
    torch.testing.assert_close(
        torch.log_softmax(scores, -1), restricted, rtol=0, atol=1e-14
    )  # CE_K = unary CE


def test_chunked_forward_kl_matches_dense_autograd() -> None:
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(7, 8, generator=generator, dtype=torch.float64)
    head = torch.randn(20, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    weights = torch.rand(7, generator=generator, dtype=torch.float64)
    value = chunked_forward_kl(hidden, teacher, head, weights, chunk_rows=3)
    grads = torch.autograd.grad(2.5 * value, (hidden, head))  # scaled: the backward must apply its grad_output
    log_t = torch.log_softmax(teacher @ head.detach().t(), -1)  # the teacher is a constant
    log_d = torch.log_softmax(hidden @ head.t(), -1)
    dense = (weights * (log_t.exp() * (log_t - log_d)).sum(-1)).sum()
    dense_grads = torch.autograd.grad(2.5 * dense, (hidden, head))
    torch.testing.assert_close(value, dense, rtol=1e-12, atol=0)
    torch.testing.assert_close(grads[0], dense_grads[0], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grads[1], dense_grads[1], rtol=1e-12, atol=1e-14)


def test_global_denominators_make_partitions_sum_exactly() -> None:
    objective = DFlashObjectiveConfig(max_anchors=8, gamma=7.0)
    target, drafter = build_models(DFlashVerifyCase(objective=objective))
    batch = make_batch(1, 32)
    anchors = sample_batch_anchors(batch, objective, 4, torch.Generator().manual_seed(1))[0]
    features = capture_target_features(target, batch.input_ids, (0, 2)).features
    positions = torch.arange(32)
    doc_start = torch.zeros_like(anchors)

    def share(layout: DFlashLayout, counts: torch.Tensor | None) -> torch.Tensor:
        packet = owned_packet(anchors, doc_start, layout, context="strict", min_bucket=1)
        hidden = forward_packet(
            drafter, batch.input_ids[0], packet, features, positions, context_rows(positions)
        )[0]
        targets = block_targets(batch.input_ids[0], batch.loss_mask[0], batch.doc_ids[0], packet, 4, sample=0)
        local = supervised_slot_counts([targets], 1) if counts is None else counts
        return rank_dflash_loss(
            hidden,
            drafter.lm_head_weight,
            targets,
            objective,
            block_size=4,
            sample_counts=local,
            reduce=_identity,
        ).loss.detach()

    whole_packet = owned_packet(
        anchors, doc_start, DFlashLayout(1, 0, 1, 0, 1.0), context="strict", min_bucket=1
    )
    counts = supervised_slot_counts(
        [block_targets(batch.input_ids[0], batch.loss_mask[0], batch.doc_ids[0], whole_packet, 4, sample=0)],
        1,
    )
    whole = share(DFlashLayout(1, 0, 1, 0, 1.0), counts)
    halves = [DFlashLayout(1, 0, 2, r, 2.0) for r in range(2)]
    global_sum = sum(share(layout, counts) for layout in halves)
    local_sum = sum(share(layout, None) for layout in halves)
    assert abs(float(global_sum) - float(whole)) <= 1e-12 * float(whole)
    assert abs(float(local_sum) - float(whole)) > 1e-3 * float(whole)  # rank-local denominators are wrong


def test_selector_schedule_and_objective_validation() -> None:
    assert selector_loss_scale(0.05, alpha=1.0, warmup_ratio=0.1, ramp_ratio=0.2) == 0.0
    assert selector_loss_scale(0.2, alpha=1.0, warmup_ratio=0.1, ramp_ratio=0.2) == pytest.approx(0.5)
    assert selector_loss_scale(0.9, alpha=0.1, warmup_ratio=0.1, ramp_ratio=0.2) == 0.1
    for options, match in (
        ({"loss": "kl", "lk_loss_type": "tv"}, "lk_loss_type"),
        ({"weighting": "focal"}, "weighting"),
        ({"kl_scale": 1.5}, "kl_scale"),
        ({"gamma": 0.0}, "gamma"),
    ):
        with pytest.raises(ValueError, match=match):
            DFlashObjectiveConfig(**options)


def test_kl_without_last_hidden_is_rejected() -> None:
    objective = DFlashObjectiveConfig(max_anchors=4, loss="kl")
    target, drafter = build_models(DFlashVerifyCase(objective=objective))
    batch = make_batch(1, 16)
    step = DFlashStep(drafter, objective, build_dflash_rank_plan(single_process_context(), objective))
    features = capture_target_features(target, batch.input_ids, (0, 2))
    with pytest.raises(ValueError, match="last hidden"):
        step(batch, torch.Generator().manual_seed(0), features=features)


def test_tau_runs_through_slots_the_loss_mask_leaves_out() -> None:
    """tau counts the anchor plus the slots a drafter would have accepted in a row; a slot the loss mask
    leaves out (a prompt token inside the block, on chat data) is not scored and does not break the run.
    Treating it as a miss (tau under-reported on chat data) passed every test."""
    from types import SimpleNamespace

    from csbp.dflash.loss import _metrics

    valid = torch.tensor([True, True, False, True, True, True, True, True])  # blocks of 4: a hole at slot 2
    targets = SimpleNamespace(valid=valid, live=torch.ones(8, dtype=torch.bool))
    scored = torch.nonzero(valid).flatten()
    correct = torch.tensor([True, True, True, True, True, False, True])  # block 2 misses its slot 2
    metrics = _metrics(targets, scored, correct, torch.zeros(7, dtype=torch.bool), 4)  # type: ignore[arg-type]
    assert metrics["tau_sum"].item() == (1 + 2) + (1 + 1)  # slots 1 and 3 of the first; slot 1 of the second
    assert (metrics["supervised"].item(), metrics["correct"].item(), metrics["live_blocks"].item()) == (7, 6, 2)


def test_block_targets_cat_keeps_teachers_on_all_parts_and_refuses_them_on_some() -> None:
    from csbp.dflash.loss import BlockTargets

    def part(rows: int, teacher: bool) -> BlockTargets:
        ints = torch.arange(rows)
        return BlockTargets(ints, ints > 0, ints, ints, ints, ints >= 0,
                            teacher=torch.full((rows, 3), float(rows)) if teacher else None)

    both = BlockTargets.cat([part(2, True), part(3, True)])
    assert both.teacher is not None and both.teacher[:, 0].tolist() == [2.0, 2.0, 3.0, 3.0, 3.0]
    assert both.labels.tolist() == [0, 1, 0, 1, 2]
    assert BlockTargets.cat([part(2, False), part(3, False)]).teacher is None
    # a KL over only some rows' teachers was a different loss, silently: now refused
    with pytest.raises(ValueError, match=r"1 of 2 parts carry a teacher; give every part one or none"):
        BlockTargets.cat([part(2, True), part(3, False)])
