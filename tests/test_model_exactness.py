"""The core claim (csbp.md §18 item 7): every layout gives the single-process loss and gradients.

A 2-layer decoder (hidden 32, 4 query / 2 KV heads, RoPE, q/k-norm, SwiGLU) runs one BD3
forward/backward in float64 on 2, 4 and 8 gloo processes; rank 0's global loss and averaged
gradients must equal one process to 1e-9 relative (per parameter: max abs diff / max abs value).
"""

from __future__ import annotations

import pytest

from csbp.engine.verify import VerifyCase, verify
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
