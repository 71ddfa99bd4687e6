"""Chunked LM-head cross-entropy against a direct full-logits implementation.

Float64 values and gradients agree to 1e-10; the chunk loop is observed through the module's one
``[·, V]`` producer to prove that no call builds more than ``chunk_rows`` rows of logits.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from csbp.objectives import chunked_ce
from csbp.objectives.chunked_ce import IGNORE_INDEX, chunked_weighted_ce, token_accuracy

ROWS, DIM, VOCAB = 37, 8, 23


def _inputs(dtype: torch.dtype = torch.float64, seed: int = 0, exclude: int | None = 5):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(ROWS, DIM, generator=generator, dtype=torch.float64).to(dtype)
    weight = torch.randn(VOCAB, DIM, generator=generator, dtype=torch.float64).to(dtype)
    labels = torch.randint(0, VOCAB, (ROWS,), generator=generator)
    if exclude is not None:
        labels[labels == exclude] = (exclude + 1) % VOCAB
    labels[torch.rand(ROWS, generator=generator) < 0.3] = IGNORE_INDEX
    weights = torch.rand(ROWS, generator=generator, dtype=torch.float64) * 3
    weights[::6] = 0.0
    return hidden.requires_grad_(), weight.requires_grad_(), labels, weights


def _direct(hidden, weight, labels, weights, exclude, softcap):
    logits = hidden.double() @ weight.double().t()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    if exclude is not None:
        logits = logits.masked_fill(torch.arange(VOCAB) == exclude, float("-inf"))
    ce = F.cross_entropy(logits, labels, reduction="none", ignore_index=IGNORE_INDEX)
    return (weights.double() * ce).sum()


@pytest.mark.parametrize("chunk_rows", [1, 5, 64])
@pytest.mark.parametrize("exclude", [None, 5])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_matches_direct_float64_values_and_gradients(chunk_rows, exclude, softcap) -> None:
    hidden, weight, labels, weights = _inputs(exclude=exclude)
    got = chunked_weighted_ce(
        hidden, weight, labels, weights, chunk_rows=chunk_rows, exclude_token=exclude, logit_softcap=softcap
    )
    assert got.dtype == torch.float64
    got_dh, got_dw = torch.autograd.grad(got, (hidden, weight))
    want = _direct(hidden, weight, labels, weights, exclude, softcap)
    want_dh, want_dw = torch.autograd.grad(want, (hidden, weight))
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-10)
    assert torch.allclose(got_dh, want_dh, rtol=1e-10, atol=1e-10)
    assert torch.allclose(got_dw, want_dw, rtol=1e-10, atol=1e-10)
    if exclude is not None:
        assert float(got_dw[exclude].abs().max()) == 0.0


def test_gradcheck_with_softcap_and_exclusion() -> None:
    hidden, weight, labels, weights = _inputs(exclude=2)
    hidden = hidden.detach()[:9, :3].contiguous().requires_grad_()  # small: gradcheck is O(numel^2)
    weight = weight.detach()[:, :3].contiguous().requires_grad_()
    labels, weights = labels[:9], weights[:9]

    def loss(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return chunked_weighted_ce(h, w, labels, weights, chunk_rows=4, exclude_token=2, logit_softcap=2.0)

    assert torch.autograd.gradcheck(loss, (hidden, weight))


def test_scales_with_upstream_gradient() -> None:
    hidden, weight, labels, weights = _inputs()
    loss = chunked_weighted_ce(hidden, weight, labels, weights, chunk_rows=7, exclude_token=5)
    (grad_once,) = torch.autograd.grad(loss, hidden)
    loss = chunked_weighted_ce(hidden, weight, labels, weights, chunk_rows=7, exclude_token=5)
    (grad_scaled,) = torch.autograd.grad(2.5 * loss, hidden)
    assert torch.allclose(grad_scaled, 2.5 * grad_once, rtol=1e-12, atol=1e-14)


def test_chunk_loop_never_builds_full_logits(monkeypatch) -> None:
    hidden, weight, labels, weights = _inputs()
    kept = int(((labels != IGNORE_INDEX) & (weights != 0)).sum())
    chunk_rows = 4
    seen_rows: list[int] = []
    original = chunked_ce._chunk_logits

    def recording(hidden_CD, weight_VD, accum_dtype):
        seen_rows.append(hidden_CD.shape[0])
        return original(hidden_CD, weight_VD, accum_dtype)

    monkeypatch.setattr(chunked_ce, "_chunk_logits", recording)
    loss = chunked_weighted_ce(hidden, weight, labels, weights, chunk_rows=chunk_rows, exclude_token=5)
    forward_calls = list(seen_rows)
    loss.backward()
    backward_calls = seen_rows[len(forward_calls) :]
    expected_chunks = math.ceil(kept / chunk_rows)
    assert kept < ROWS  # dropped rows exist, so this also checks they never reach the head
    assert len(forward_calls) == expected_chunks and len(backward_calls) == expected_chunks
    assert sum(forward_calls) == kept and sum(backward_calls) == kept
    assert max(forward_calls + backward_calls) <= chunk_rows


def test_no_kept_rows_gives_zero_with_zero_gradients() -> None:
    hidden, weight, _, weights = _inputs()
    labels = torch.full((ROWS,), IGNORE_INDEX)
    loss = chunked_weighted_ce(hidden, weight, labels, weights)
    assert float(loss.detach()) == 0.0
    dh, dw = torch.autograd.grad(loss, (hidden, weight))
    assert float(dh.abs().max()) == 0.0 and float(dw.abs().max()) == 0.0


def test_float32_computes_in_float32_and_matches_float64() -> None:
    hidden64, weight64, labels, weights = _inputs()
    hidden = hidden64.detach().float().requires_grad_()
    weight = weight64.detach().float().requires_grad_()
    got = chunked_weighted_ce(hidden, weight, labels, weights.float(), chunk_rows=8, exclude_token=5)
    assert got.dtype == torch.float32
    got.backward()
    want = _direct(hidden64, weight64, labels, weights, 5, None)
    want_dh, want_dw = torch.autograd.grad(want, (hidden64, weight64))
    assert abs(float(got.detach()) - float(want.detach())) <= 1e-5 * abs(float(want.detach()))
    assert hidden.grad.dtype == torch.float32 and weight.grad.dtype == torch.float32
    assert torch.allclose(hidden.grad.double(), want_dh, rtol=1e-4, atol=1e-5)
    assert torch.allclose(weight.grad.double(), want_dw, rtol=1e-4, atol=1e-5)


def test_bfloat16_inputs_give_float32_loss_and_native_gradients() -> None:
    hidden64, weight64, labels, weights = _inputs()
    hidden = hidden64.detach().bfloat16().requires_grad_()
    weight = weight64.detach().bfloat16().requires_grad_()
    got = chunked_weighted_ce(hidden, weight, labels, weights, chunk_rows=8, exclude_token=5)
    assert got.dtype == torch.float32
    got.backward()
    assert hidden.grad.dtype == torch.bfloat16 and weight.grad.dtype == torch.bfloat16
    want = _direct(hidden.detach(), weight.detach(), labels, weights, 5, None)  # same rounded inputs
    # bf16 logits carry ~2^-8 relative error.
    assert abs(float(got.detach()) - float(want)) <= 2e-2 * abs(float(want))


def test_token_accuracy_matches_direct_argmax_and_respects_exclusion() -> None:
    hidden, weight, labels, _ = _inputs(seed=3)
    weight = weight.detach().clone()
    logits = hidden.detach() @ weight.t()
    labels = torch.where(labels == IGNORE_INDEX, labels, logits.argmax(1))
    labels[1] = IGNORE_INDEX
    flip = labels != IGNORE_INDEX
    flip_rows = flip.nonzero().squeeze(1)[:4]
    labels[flip_rows] = (labels[flip_rows] + 1) % VOCAB  # four wrong predictions
    correct, total = token_accuracy(hidden, weight, labels, chunk_rows=3)
    assert int(total) == int((labels != IGNORE_INDEX).sum())
    assert int(correct) == int(total) - 4
    # Make token 7 the argmax everywhere: excluding it restores the original predictions.
    boosted = weight.clone()
    boosted[7] = 1e3 * hidden.detach().mean(0)
    assert float(((hidden.detach() @ boosted.t()).argmax(1) == 7).double().mean()) > 0.5
    correct_excluded, _ = token_accuracy(hidden, boosted, labels, chunk_rows=3, exclude_token=7)
    want = ((logits.masked_fill(torch.arange(VOCAB) == 7, float("-inf")).argmax(1) == labels) & flip).sum()
    assert int(correct_excluded) == int(want)


def test_shape_and_chunk_validation() -> None:
    hidden, weight, labels, weights = _inputs()
    with pytest.raises(ValueError, match="lm_head_weight"):
        chunked_weighted_ce(hidden, weight[:, :3], labels, weights)
    with pytest.raises(ValueError, match="labels"):
        chunked_weighted_ce(hidden, weight, labels[:-1], weights)
    with pytest.raises(ValueError, match="chunk_rows"):
        chunked_weighted_ce(hidden, weight, labels, weights, chunk_rows=0)


@pytest.mark.parametrize("exclude", [None, 5])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_keep_logits_skips_the_recompute_of_a_single_chunk_bit_for_bit(monkeypatch, exclude, softcap) -> None:
    hidden, weight, labels, weights = _inputs(dtype=torch.float32, exclude=exclude)
    calls: list[int] = []
    original = chunked_ce._chunk_logits

    def recording(hidden_CD, weight_VD, accum_dtype):
        calls.append(hidden_CD.shape[0])
        return original(hidden_CD, weight_VD, accum_dtype)

    monkeypatch.setattr(chunked_ce, "_chunk_logits", recording)
    results = {}
    for keep in (False, True):
        calls.clear()
        loss = chunked_weighted_ce(
            hidden, weight, labels, weights, chunk_rows=64, exclude_token=exclude, logit_softcap=softcap,
            keep_logits=keep,
        )
        results[keep] = (loss, *torch.autograd.grad(loss, (hidden, weight)))
        assert len(calls) == (1 if keep else 2)  # the backward reuses the forward's logits
    for recomputed, kept in zip(results[False], results[True], strict=True):
        assert torch.equal(recomputed, kept)


def test_keep_logits_still_recomputes_several_chunks_and_a_retained_graph(monkeypatch) -> None:
    hidden, weight, labels, weights = _inputs()
    kept = int(((labels != IGNORE_INDEX) & (weights != 0)).sum())
    calls: list[int] = []
    original = chunked_ce._chunk_logits
    monkeypatch.setattr(
        chunked_ce, "_chunk_logits", lambda h, w, dtype: calls.append(h.shape[0]) or original(h, w, dtype)
    )
    loss = chunked_weighted_ce(hidden, weight, labels, weights, chunk_rows=7, exclude_token=5, keep_logits=True)
    loss.backward()
    assert len(calls) == 2 * math.ceil(kept / 7) and max(calls) <= 7  # no [R, V] logits held across chunks
    calls.clear()
    loss = chunked_weighted_ce(hidden, weight, labels, weights, chunk_rows=64, exclude_token=5, keep_logits=True)
    first = torch.autograd.grad(loss, (hidden, weight), retain_graph=True)
    second = torch.autograd.grad(loss, (hidden, weight))  # the held logits went with the first backward
    assert calls == [kept, kept]
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
