"""The training path's LM-head loss (``rank_loss``) reuses the forward's logits in the backward when
it runs one loss per backward (a ``RankPlan``), and recomputes them per sample with a
``DocumentPlanner`` (whose per-sample losses all run before the one backward); either way the loss
and every gradient are those of the recomputing loss, bit for bit."""

from __future__ import annotations

import pytest
import torch

from csbp.engine import block_diffusion
from csbp.engine.block_diffusion import DocumentPlanner, build_rank_plan, rank_loss
from csbp.engine.context import single_process_context
from csbp.engine.verify import tiny_model_config
from csbp.models.decoder import Decoder
from csbp.objectives import Bd3Objective, chunked_ce

SEQ_LEN, BLOCK, SAMPLES = 12, 4, 3


def _batch(vocab: int):
    clean = torch.randint(0, vocab - 1, (SAMPLES, SEQ_LEN), generator=torch.Generator().manual_seed(2))
    doc_ids = torch.tensor([0] * 5 + [1] * 7).repeat(SAMPLES, 1)
    objective = Bd3Objective(mask_token_id=vocab - 1, block_size=BLOCK)
    return objective.corrupt({"input_ids": clean, "doc_ids": doc_ids}, torch.Generator().manual_seed(3))


def _loss_and_grads(model: Decoder, corrupted, plan) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss, ce_sum = rank_loss(model, corrupted, plan, global_denominator=corrupted.denominator(), world_size=1)
    loss.backward()
    return [loss.detach(), ce_sum] + [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("documents", [False, True], ids=["rank_plan", "document_planner"])
def test_rank_loss_reuses_the_head_logits_only_for_one_loss_per_backward(monkeypatch, documents) -> None:
    config = tiny_model_config()
    model = Decoder(config, dtype=torch.float32, seed=0)
    corrupted = _batch(config.vocab_size)
    ctx = single_process_context()
    plan = (
        DocumentPlanner(ctx, SEQ_LEN, BLOCK) if documents else build_rank_plan(ctx, SEQ_LEN, BLOCK)
    )
    calls: list[int] = []
    original = chunked_ce._chunk_logits
    monkeypatch.setattr(
        chunked_ce, "_chunk_logits", lambda h, w, dtype: calls.append(h.shape[0]) or original(h, w, dtype)
    )
    got = _loss_and_grads(model, corrupted, plan)
    losses = SAMPLES if documents else 1
    assert len(calls) == (2 * losses if documents else 1)  # forward (+ the recompute per sample)

    original_plan_loss = block_diffusion._plan_loss
    monkeypatch.setattr(  # the recomputing loss as reference
        block_diffusion, "_plan_loss", lambda *args, **kwargs: original_plan_loss(*args, keep_logits=False)
    )
    calls.clear()
    want = _loss_and_grads(model, corrupted, plan)
    assert len(calls) == 2 * losses
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
