"""The core claim (csbp.md §18 item 7): every layout gives the single-process loss and gradients.

A 2-layer decoder (hidden 32, 4 query / 2 KV heads, RoPE, q/k-norm, SwiGLU) runs one BD3
forward/backward in float64 on 2, 4 and 8 gloo processes; rank 0's global loss and averaged
gradients must equal one process to 1e-9 relative (per parameter: max abs diff / max abs value).
"""

from __future__ import annotations

import pytest
import torch

from csbp.attention.layouts import rank_layout
from csbp.engine.block_diffusion import build_rank_plan, rank_loss
from csbp.engine.context import build_parallel_context
from csbp.engine.grads import average_gradients
from csbp.engine.verify import VerifyCase, corrupted_batch, reference, tiny_model_config, verify
from csbp.models.decoder import Decoder
from csbp.parallel.launch import run_local
from csbp.topology import Topology

CASES = [
    pytest.param(VerifyCase(Topology(dp=2)), id="dp2"),
    pytest.param(VerifyCase(Topology(cp=2)), id="cp2"),
    pytest.param(VerifyCase(Topology(cp=4)), id="cp4"),
    pytest.param(VerifyCase(Topology(bp=2, replicate_clean_prefix=True)), id="bp2"),
    pytest.param(VerifyCase(Topology(bp=4, replicate_clean_prefix=True), window=6), id="bp4-window6"),
    pytest.param(VerifyCase(Topology(cp=2, bp=2)), id="csbp-cp2bp2-collective"),
    pytest.param(VerifyCase(Topology(cp=2, bp=2), transport="streaming"), id="csbp-cp2bp2-streaming"),
    pytest.param(VerifyCase(Topology(cp=2, bp=4)), id="csbp-cp2bp4-collective"),
    pytest.param(VerifyCase(Topology(cp=2, bp=4), transport="streaming"), id="csbp-cp2bp4-streaming"),
    pytest.param(VerifyCase(Topology(cp=4, bp=4), seq_len=64, block_size=4), id="csbp-cp4bp4-collective"),
    pytest.param(
        VerifyCase(Topology(cp=4, bp=4), seq_len=64, block_size=4, transport="streaming"),
        id="csbp-cp4bp4-streaming",
    ),
    pytest.param(VerifyCase(Topology(cp=2, bp=2), window=6), id="csbp-cp2bp2-window6"),
    pytest.param(VerifyCase(Topology(cp=2, bp=4), window=5), id="csbp-cp2bp4-window5"),
    pytest.param(VerifyCase(Topology(dp=2, cp=2, bp=2)), id="dp2-csbp-cp2bp2"),
]


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES)
def test_layout_equals_single_process(case: VerifyCase) -> None:
    result = verify(case, timeout_s=240)
    assert result.loss_rel_err <= 1e-9, result
    assert result.grad_rel_err <= 1e-9, result


@pytest.mark.multiprocess
def test_float32_within_tolerance() -> None:
    result = verify(VerifyCase(Topology(cp=2, bp=2), dtype="float32"), timeout_s=240)
    assert result.loss_rel_err <= 1e-4 and result.grad_rel_err <= 1e-4, result


def test_block_size_not_splitting_into_zigzag_chunks_is_rejected() -> None:
    # L=24, B=4, cp=2: 24 % (2*2*4) != 0, so clean zigzag chunks would cut a block.
    with pytest.raises(ValueError, match="seq_len"):
        verify(VerifyCase(Topology(cp=2, bp=2), seq_len=24, block_size=4))


def test_fewer_blocks_than_bp_workers_is_rejected() -> None:
    with pytest.raises(ValueError):
        verify(VerifyCase(Topology(bp=4, replicate_clean_prefix=True), seq_len=12, block_size=4))


def _local_denominator_worker(rank: int, world: int, case: VerifyCase) -> dict[str, torch.Tensor] | None:
    """The engine step, but dividing by the rank's own supervised-token count (the classic bug)."""
    ctx = build_parallel_context(case.topology)
    model = Decoder(tiny_model_config(), dtype=torch.float64, seed=case.seed)
    corrupted = corrupted_batch(case)
    plan = build_rank_plan(ctx, case.seq_len, case.block_size)
    owned = corrupted.labels[:, plan.noisy_positions] != -100
    local_denominator = float(owned.sum()) * ctx.world_size  # what a local mean would use
    loss, _ = rank_loss(model, corrupted, plan, global_denominator=local_denominator, world_size=ctx.world_size)
    loss.backward()
    average_gradients(model.parameters(), ctx.world_comm("gradients"))
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()} if rank == 0 else None


@pytest.mark.multiprocess
def test_rank_local_denominator_is_not_exact() -> None:
    """csbp.md §18 item 8: ranks own different numbers of supervised tokens, so a rank-local
    denominator changes the gradient; the global one (above) does not."""
    case = VerifyCase(Topology(cp=2, bp=2))
    corrupted = corrupted_batch(case)
    counts = []
    for local_rank in range(2):
        layout_positions = rank_layout(case.topology, local_rank, case.seq_len, case.block_size).noisy_positions
        counts.append(int((corrupted.labels[:, layout_positions] != -100).sum()))
    assert counts[0] != counts[1], "the batch must give ranks different supervised counts"
    _, grads_ref = reference(case)
    grads = run_local(_local_denominator_worker, 2, (case,), timeout_s=240)[0]
    worst = max((grads[n] - g).abs().max().item() / g.abs().max().item() for n, g in grads_ref.items())
    assert worst > 1e-3
