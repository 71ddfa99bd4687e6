"""The decoder hands its attention callable q, k and v in one dtype.

Under bf16 autocast the q/k norms' float32 weights promote q and k to float32 while v stays bf16;
FlexAttention's compiled backward refuses such mixed inputs, and a bf16 training step on the GPU
failed on its first backward (``make gpu-check``, 2026-12-04). The rule (``attention_inputs``): the
autocast dtype under autocast, as torch's SDPA casts its own inputs; the widest dtype otherwise.
"""

from __future__ import annotations

import pytest
import torch

from csbp.models.attention_fns import CausalAttention
from csbp.models.config import DecoderConfig
from csbp.models.decoder import Decoder, attention_inputs


def _recording_attention(seen: list[tuple[torch.dtype, ...]]):  # noqa: ANN202
    causal = CausalAttention()

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_index: int = 0) -> torch.Tensor:
        seen.append((q.dtype, k.dtype, v.dtype))
        return causal(q, k, v, layer_index)

    return attention


@pytest.mark.parametrize("autocast", [False, True])
def test_a_qk_normed_decoder_hands_attention_one_dtype(autocast: bool) -> None:
    config = DecoderConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2,
                           num_kv_heads=1, head_dim=8, qk_norm=True)
    model = Decoder(config, dtype=torch.float32, seed=0)
    ids = torch.randint(0, 32, (1, 6), generator=torch.Generator().manual_seed(0))
    seen: list[tuple[torch.dtype, ...]] = []
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        model(ids, torch.arange(6), _recording_attention(seen))
    want = torch.bfloat16 if autocast else torch.float32
    assert seen == [(want, want, want)] * config.num_layers


def test_attention_inputs_outside_autocast_promote_to_the_widest() -> None:
    q, k, v = torch.zeros(1, dtype=torch.float32), torch.zeros(1, dtype=torch.bfloat16), torch.zeros(1)
    assert [t.dtype for t in attention_inputs(q, k, v.double())] == [torch.float64] * 3
    assert [t.dtype for t in attention_inputs(q, k, v)] == [torch.float32] * 3
    same = attention_inputs(q, q)
    assert same[0] is q  # no copy when nothing changes
