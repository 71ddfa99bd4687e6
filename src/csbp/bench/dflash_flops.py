"""FLOPs of one DFlash drafter training step over a rank's anchor packet (``csbp bench dflash``'s
``drafter_flops_per_rank``, ``csbp gpu``'s drafter table).

* per block row of the packet (dead padding rows included, they are computed) and draft layer:
  q/k/v/o projections and the SwiGLU MLP; per scored row (slots ``1 … B−1`` of live anchors inside
  the sequence) the LM head; per context row the rank holds: the fusion ``fc`` and each layer's
  context k/v projections. Forward ``2·m·n`` per matrix; backward doubles trainable matmuls whose
  input needs a gradient (×3 in all), weight-gradient only for ``fc`` (×2), input-gradient only
  for the frozen head (×2);
* attention: ``B·(B + a − doc_start)`` allowed pairs per live anchor ``a`` per layer
  (``csbp.bench.measure.attention_flops``, forward and backward); per sliding layer
  (``DFlashConfig.sliding_window``) the context pairs of ``layouts.block_query_rows`` and the
  block's own pairs (``B·(B+1)/2`` when causal in the block).

Shape legend: ``B`` block size, ``a`` anchor position.
"""

from __future__ import annotations

from csbp.bench.measure import attention_flops
from csbp.dflash.config import DFlashConfig
from csbp.dflash.layouts import AnchorPacket, block_query_rows
from csbp.gpu.flops import attention_training_flops


def drafter_step_flops(
    config: DFlashConfig, packet: AnchorPacket, num_context_rows: int, seq_len: int, *, model_flops: bool = False
) -> int:
    """Drafter matmul and attention FLOPs of one training step over ``packet`` (module docstring).
    ``model_flops``: attention at MFU's ``12·d`` per pair (``csbp.gpu.flops``: the backward's score
    recomputation is not model work), as the device check's BD3 rows count it, instead of the ``14·d``
    a flash kernel runs (the per-rank work ``csbp bench dflash`` compares across layouts)."""
    hidden, block = config.hidden_size, config.block_size
    q_width, kv_width = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    block_row = 2 * hidden * (2 * q_width + 2 * kv_width) + 6 * hidden * config.intermediate_size
    context_row = 2 * hidden * 2 * kv_width
    live = packet.anchors[packet.keep]
    scored = int((seq_len - 1 - live).clamp(min=0, max=block - 1).sum())
    matmul = 3 * config.num_layers * (len(packet) * block * block_row + num_context_rows * context_row)
    matmul += (
        2 * num_context_rows * 2 * config.feature_width * hidden + 2 * scored * 2 * hidden * config.vocab_size
    )
    full_pairs = int((block * (block + live - packet.doc_start[packet.keep])).sum())
    sliding = sum(kind == "sliding_attention" for kind in config.layer_types or ())
    pairs = full_pairs * (config.num_layers - sliding)
    if sliding:
        rows = block_query_rows(packet, block, context="strict", window=config.sliding_window)
        context_pairs = int(((rows.ctx_stop - rows.ctx_start).clamp(min=0) * rows.live).sum())
        in_block = block * (block + 1) // 2 if config.sliding_window_causal else block * block
        pairs += (context_pairs + in_block * len(live)) * sliding
    if model_flops:
        return matmul + attention_training_flops(pairs, num_heads=config.num_heads, head_dim=config.head_dim)
    return matmul + attention_flops(pairs, num_heads=config.num_heads, head_dim=config.head_dim)
