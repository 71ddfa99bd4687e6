"""The BD3 training rows against their inference meaning (objectives.md §12 items 2 and 3).

The rows are produced by the engine's own single-process training path (``build_rank_plan`` +
``rank_inputs``, the tiles backend the loss runs on), for the two-stream objectives (BD3-LM and
Fast-dLLM v2 share the layout and the mask).

* **Oracle** (item 2): the logits of noisy block ``b`` in the ``2L`` forward equal a separate forward
  over ``[x_0[:bB] ; x_t block b]`` whose mask is written here from the definition (clean prefix
  block-causal, the noisy block bidirectional and seeing the whole clean prefix), with positions
  ``0 .. bB+B-1``. Every block, including ``b = 0`` (no prefix).
* **Isolation** (item 3): perturbing ``x_t`` leaves every clean row unchanged; perturbing ``x_0`` in
  blocks ``>= b`` leaves noisy block ``b`` unchanged, while perturbing block ``b - 1`` changes it (so
  the check can fail).
* **MDLM = BD3 with one block** (§2, §3.1): same corruption, and the engine's single-stream MDLM loss
  and gradient equal the two-stream BD3 ones at ``B = L``.

Tiny §12 decoder (hidden 32, 4/2 heads, head dim 8, vocabulary 64, ``[M] = 63``), random weights.
Float64 at 1e-12, and float32 at the tolerance objectives.md §12 states (1e-5).
"""

from __future__ import annotations

import pytest
import torch

from csbp.engine.block_diffusion import build_rank_plan, rank_inputs, rank_loss
from csbp.engine.context import single_process_context
from csbp.engine.verify import tiny_model_config
from csbp.models.attention_fns import DenseMaskAttention
from csbp.models.decoder import Decoder
from csbp.objectives import Bd3Objective, CorruptedBatch, FastDllmV2Objective, MdlmObjective

MASK = 63
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}


def _model(dtype: torch.dtype) -> Decoder:
    model = Decoder(tiny_model_config(), dtype=dtype, seed=0)
    model.init_weights(torch.Generator().manual_seed(1), std=0.3)  # clear differences between rows
    return model.eval()


def _corrupted(objective_name: str, seq_len: int, block_size: int) -> CorruptedBatch:
    clean = torch.randint(0, MASK, (1, seq_len), generator=torch.Generator().manual_seed(2))
    if objective_name == "bd3":
        objective = Bd3Objective(mask_token_id=MASK, block_size=block_size)
    else:
        objective = FastDllmV2Objective(mask_token_id=MASK, block_size=block_size)
    corrupted = objective.corrupt({"input_ids": clean}, torch.Generator().manual_seed(3))
    assert bool((corrupted.noisy_ids == MASK).any()), "the draw must mask something"
    return corrupted


def _training_rows(model: Decoder, noisy_1L: torch.Tensor, clean_1L: torch.Tensor, block_size: int):
    """``(noisy logits [L, V], clean hidden [L, D])`` by position, from the engine's training path."""
    seq_len = noisy_1L.shape[1]
    plan = build_rank_plan(single_process_context(), seq_len, block_size)
    batch = CorruptedBatch(
        noisy_ids=noisy_1L,
        clean_ids=clean_1L,
        labels=torch.full_like(noisy_1L, -100),
        weights=torch.zeros(noisy_1L.shape),
        doc_ids=torch.zeros_like(noisy_1L),
        noise_levels=None,
        uses_clean_stream=True,
        block_size=block_size,
        exclude_token=MASK,
        loss_normaliser=1.0,
    )
    input_ids, positions = rank_inputs(batch, plan)
    with torch.no_grad():
        hidden_RD = model(input_ids, positions, plan.attention)[0]
    noisy_LD = torch.empty(seq_len, hidden_RD.shape[-1], dtype=hidden_RD.dtype)
    clean_LD = torch.empty_like(noisy_LD)
    noisy_LD[plan.noisy_positions] = hidden_RD[: plan.num_noisy]
    clean_LD[plan.clean_positions] = hidden_RD[plan.num_noisy :]
    assert sorted(plan.noisy_positions.tolist()) == sorted(plan.clean_positions.tolist()) == list(range(seq_len))
    with torch.no_grad():
        return model.logits(noisy_LD), clean_LD


def _inference_logits(model: Decoder, clean_1L: torch.Tensor, noisy_1L: torch.Tensor, block: int, size: int):
    """Noisy block ``block``'s logits from one forward over ``[x_0[:bB] ; x_t block b]``."""
    prefix = block * size
    ids = torch.cat((clean_1L[:, :prefix], noisy_1L[:, prefix : prefix + size]), dim=1)
    n = prefix + size
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    clean_q, clean_k = q < prefix, k < prefix
    block_causal = clean_q & clean_k & (k // size <= q // size)
    noisy_sees = ~clean_q & (clean_k | (k >= prefix))  # the whole clean prefix and its own block
    with torch.no_grad():
        hidden = model(ids, torch.arange(n), DenseMaskAttention(block_causal | noisy_sees))[0]
        return model.logits(hidden[prefix:])


@pytest.mark.parametrize("objective_name", ["bd3", "fast_dllm_v2"])
@pytest.mark.parametrize(("seq_len", "block_size"), [(8, 2), (12, 4)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_noisy_block_logits_equal_a_separate_inference_forward(
    objective_name: str, seq_len: int, block_size: int, dtype: torch.dtype
) -> None:
    model = _model(dtype)
    corrupted = _corrupted(objective_name, seq_len, block_size)
    for view in range(corrupted.num_rows):  # Fast-dLLM v2: both complementary views
        noisy, clean = corrupted.noisy_ids[view : view + 1], corrupted.clean_ids[view : view + 1]
        logits_LV, _ = _training_rows(model, noisy, clean, block_size)
        for block in range(seq_len // block_size):
            expected = _inference_logits(model, clean, noisy, block, block_size)
            span = slice(block * block_size, (block + 1) * block_size)
            torch.testing.assert_close(logits_LV[span], expected, rtol=0, atol=TOLERANCE[dtype])


@pytest.mark.parametrize(("seq_len", "block_size"), [(8, 2), (12, 4)])
def test_clean_rows_ignore_the_noisy_stream_and_noisy_blocks_ignore_later_clean_blocks(
    seq_len: int, block_size: int
) -> None:
    model = _model(torch.float64)
    corrupted = _corrupted("bd3", seq_len, block_size)
    noisy, clean = corrupted.noisy_ids, corrupted.clean_ids
    logits_LV, clean_LD = _training_rows(model, noisy, clean, block_size)

    other_noisy = (noisy + 1 + torch.arange(seq_len)) % MASK  # every x_t token changes, [M] included
    moved_logits_LV, moved_clean_LD = _training_rows(model, other_noisy, clean, block_size)
    assert torch.equal(moved_clean_LD, clean_LD)  # the clean half never sees the noisy half
    assert float((moved_logits_LV - logits_LV).abs().max()) > 1e-3  # (the noisy rows do)

    for block in range(seq_len // block_size):
        span = slice(block * block_size, (block + 1) * block_size)
        later = clean.clone()
        later[:, block * block_size :] = (later[:, block * block_size :] + 5) % MASK
        later_logits_LV, _ = _training_rows(model, noisy, later, block_size)
        assert torch.equal(later_logits_LV[span], logits_LV[span]), f"block {block} saw x_0 blocks >= {block}"
        if block > 0:  # the clean block just before is visible: perturbing it must show
            earlier = clean.clone()
            earlier[:, span.start - block_size : span.start] += 1
            earlier_logits_LV, _ = _training_rows(model, noisy, earlier % MASK, block_size)
            assert float((earlier_logits_LV[span] - logits_LV[span]).abs().max()) > 1e-3


@pytest.mark.parametrize("scheme", ["stratified", "rotated_lattice"])
def test_mdlm_is_bd3_with_one_block(scheme: str) -> None:
    """objectives.md §2/§3.1: MDLM is the ``B = L`` case of BD3-LM. The same draws give the same
    corruption (levels, masks, labels, ``1/t`` weights, denominator), and the engine's single-stream
    MDLM forward gives the loss and gradient of the ``[x_t ; x_0]`` BD3 forward with one block (its
    noisy block sees no earlier clean block), float64 at 1e-12. Padding (loss_mask False) included."""
    num_samples, seq_len = 3, 12
    clean = torch.randint(0, MASK, (num_samples, seq_len), generator=torch.Generator().manual_seed(5))
    loss_mask = torch.ones(num_samples, seq_len, dtype=torch.bool)
    loss_mask[1, 9:] = False
    batch = {"input_ids": clean, "loss_mask": loss_mask}
    mdlm = MdlmObjective(mask_token_id=MASK, eps=0.05, noise_scheme=scheme).corrupt(
        batch, torch.Generator().manual_seed(7)
    )
    bd3 = Bd3Objective(mask_token_id=MASK, block_size=seq_len, t_min=0.05, noise_scheme=scheme).corrupt(
        batch, torch.Generator().manual_seed(7)
    )
    for name in ("noisy_ids", "clean_ids", "labels", "weights", "doc_ids", "noise_levels"):
        assert torch.equal(getattr(mdlm, name), getattr(bd3, name)), name
    assert mdlm.denominator() == bd3.denominator() == float(loss_mask.sum())
    assert mdlm.block_size == bd3.block_size == seq_len and not mdlm.uses_clean_stream and bd3.uses_clean_stream
    assert mdlm.num_labelled() > 0

    model = _model(torch.float64)
    results = []
    for corrupted in (mdlm, bd3):
        plan = build_rank_plan(
            single_process_context(), seq_len, seq_len, uses_clean_stream=corrupted.uses_clean_stream
        )
        model.zero_grad()
        loss, _ = rank_loss(model, corrupted, plan, global_denominator=corrupted.denominator(), world_size=1)
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        results.append((loss.detach(), grads))
    (mdlm_loss, mdlm_grads), (bd3_loss, bd3_grads) = results
    assert float(mdlm_loss) > 0.1
    torch.testing.assert_close(bd3_loss, mdlm_loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(bd3_grads, mdlm_grads, rtol=0, atol=1e-12 * float(mdlm_grads.abs().max()))
