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
  under ``data.document_mask``. The pairs are summed per document and per block segment
  (:func:`pairs_of_documents`), not per position: about 5 ms for a 1M-token row of 2K-token documents
  where the per-position bounds took 100-250 ms, before every micro-batch's forward on every rank.

Every rank of a replica corrupts the same micro-batches, so each counts its replica's FLOPs on the host
from the batch before it moves to the device; the step sums them over the data-parallel replicas in
the reduction it already makes for the loss's denominator (no extra collective, no host sync).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from torch import Tensor

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
    starts = np.flatnonzero(documents.start.numpy() == np.arange(seq_len)).astype(np.int64)
    return pairs_of_documents(seq_len, starts, block_size=block_size, two_stream=two_stream, causal=causal, window=window)


def document_starts(doc_ids: Tensor) -> np.ndarray:
    """int64 first positions of the documents of one packed row ``doc_ids [L]`` (maximal runs of equal
    ids, padding's ``-1`` run included, as ``Documents.from_doc_ids``)."""
    ids = doc_ids.detach().cpu().numpy()
    return np.concatenate(([0], np.flatnonzero(ids[1:] != ids[:-1]) + 1)).astype(np.int64)


def pairs_of_documents(
    seq_len: int, starts: np.ndarray, *, block_size: int, two_stream: bool, causal: bool, window: int | None
) -> int:
    """:func:`row_pairs` of a row whose documents start at ``starts`` (sorted, from 0), summed per
    document and per *segment* (a block cut by document starts: its rows share their bounds), so one
    row costs ``O(L / B + documents)`` array work rather than ``O(L)`` per-position bounds (the count
    runs on every rank before every micro-batch).

    BD3 (``csbp.attention.counts.position_pairs`` with documents): a noisy row of a segment ``[lo, hi)``
    in block ``[a, a + B)`` and document ``[s, e)`` sees the clean ``[max(s, a - (W - 1)), a)`` and its
    segment; a clean row sees ``[s, hi)`` (block-causal), with a window ``min(W, p + 1 - s)`` keys
    (causal), ``T(e - s)`` per document with ``T(n) = Σ_{k<=n} min(W, k)``. Single stream: ``n²``
    (bidirectional) or ``n(n + 1)/2`` (causal) per document of ``n`` tokens."""
    lengths = np.diff(np.append(starts, seq_len))
    if not two_stream:
        return int((lengths * (lengths + 1) // 2).sum() if causal else (lengths * lengths).sum())
    is_cut = np.zeros(seq_len, dtype=bool)  # block starts and document starts, without sorting
    is_cut[::block_size] = True
    is_cut[starts] = True
    cuts = np.flatnonzero(is_cut)
    segment = np.diff(np.append(cuts, seq_len))
    doc_start = starts[np.searchsorted(starts, cuts, side="right") - 1]
    block_start = cuts // block_size * block_size
    lower = doc_start if window is None else np.maximum(doc_start, block_start - (window - 1))
    noisy = int((segment * ((block_start - lower).clip(min=0) + segment)).sum())
    if window is None:
        return noisy + int((segment * (cuts + segment - doc_start)).sum())
    inside = np.minimum(lengths, window)  # T(n) = inside·(inside + 1)/2 + (n - inside)·W
    return noisy + int((inside * (inside + 1) // 2 + (lengths - inside) * window).sum())


@lru_cache(maxsize=16)
def _pairs_without_documents(seq_len: int, block_size: int, two_stream: bool, causal: bool, window: int | None) -> int:
    return pairs_of_documents(
        seq_len, np.zeros(1, dtype=np.int64), block_size=block_size, two_stream=two_stream, causal=causal, window=window
    )


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
        if document_mask:
            pairs += pairs_of_documents(
                seq_len, document_starts(batch.doc_ids[row]), block_size=batch.block_size, two_stream=two_stream,
                causal=causal, window=window,
            )
        else:
            pairs += _pairs_without_documents(seq_len, batch.block_size, two_stream, causal, window)
    attention = attention_training_flops(pairs * config.num_layers, num_heads=config.num_heads, head_dim=config.head_dim)
    return rows * per_row + attention
