"""Model FLOPs of the corrupted micro-batches a training step runs: the ``tflops_per_device`` and ``mfu``
columns of ``metrics.jsonl`` (``csbp.training.step_loop``).

The accounting is the device check's (``csbp.gpu.flops``), so a training run's MFU and the check's
training table read the same way: model FLOPs, not hardware FLOPs (activation checkpointing's recompute
and BP-only's replicated clean prefix are not counted, so both lower MFU for the same step time), per
corrupted row of ``L`` tokens:

* dense matmuls: ``6 · P_layers`` per processed row, ``2L`` rows for the two-stream objectives (bd3,
  fast_dllm_v2: ``[x_t ; x_0]``; Fast-dLLM v2's two complementary views are two corrupted rows), ``L``
  for the single-stream ones (mdlm, ar);
* LM head: ``6 · V · D`` per row a loss may score (``L``; csbp runs the head only on the rows it
  scores, so this is an upper bound by the unscored share, as in the check);
* attention: ``12 · d · H_q`` per allowed (query, key) pair and layer, the pairs counted on the
  single-device mask of the run: BD3's (``csbp.attention.counts.position_pairs``, with
  ``topology.window``), bidirectional (mdlm) or causal (ar), each clipped to the row's packed documents
  under ``data.document_mask``.

Every rank of a replica corrupts the same micro-batches, so each counts its replica's FLOPs on the host
from the batch before it moves to the device; the step sums them over the data-parallel replicas in
the reduction it already makes for the loss's denominator (no extra collective, no host sync).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from csbp.attention.counts import position_pairs
from csbp.attention.documents import Documents
from csbp.gpu.flops import attention_training_flops, layer_matmul_params
from csbp.models.config import DecoderConfig
from csbp.objectives.base import CorruptedBatch


def row_pairs(
    seq_len: int, *, block_size: int, two_stream: bool, causal: bool, window: int | None,
    documents: Documents | None,
) -> int:
    """Allowed (query, key) pairs of one corrupted row on one device (one layer, one head)."""
    if documents is None:
        return _pairs_without_documents(seq_len, block_size, two_stream, causal, window)
    if two_stream:
        positions = np.arange(seq_len, dtype=np.int64)
        bounds = (documents.start.numpy(), documents.stop.numpy())
        noisy, clean = position_pairs(positions, positions, block_size=block_size, window=window, documents=bounds)
        return noisy + clean
    first = documents.start.numpy()  # one bidirectional (mdlm) or causal (ar) block per document
    if causal:
        return int((np.arange(seq_len) + 1 - first).sum())
    return int((documents.stop.numpy() - first).sum())


@lru_cache(maxsize=16)
def _pairs_without_documents(seq_len: int, block_size: int, two_stream: bool, causal: bool, window: int | None) -> int:
    if two_stream:
        positions = np.arange(seq_len, dtype=np.int64)
        noisy, clean = position_pairs(positions, positions, block_size=block_size, window=window)
        return noisy + clean
    return seq_len * (seq_len + 1) // 2 if causal else seq_len * seq_len


def corrupted_flops(
    batch: CorruptedBatch, config: DecoderConfig, *, causal: bool, window: int | None, document_mask: bool
) -> int:
    """Model FLOPs of training one corrupted micro-batch (forward and backward; module docstring)."""
    rows, seq_len = batch.noisy_ids.shape
    two_stream = batch.uses_clean_stream
    processed = (2 if two_stream else 1) * seq_len
    per_row = 6 * layer_matmul_params(config) * config.num_layers * processed
    per_row += 6 * config.vocab_size * config.hidden_size * seq_len
    pairs = 0
    for row in range(rows):
        documents = Documents.from_doc_ids(batch.doc_ids[row]) if document_mask else None
        pairs += row_pairs(
            seq_len, block_size=batch.block_size, two_stream=two_stream, causal=causal, window=window,
            documents=documents,
        )
    attention = attention_training_flops(pairs * config.num_layers, num_heads=config.num_heads, head_dim=config.head_dim)
    return rows * per_row + attention
