"""Attention masks as pure predicates over logical indices (csbp.md §3, objectives.md §2, §3.2, §5.5).

Every builder here returns a ``mask_mod(b, h, q_idx, kv_idx) -> BoolTensor`` closure over a few
small parameters. The closures use only elementwise torch ops and tensor indexing (no Python
branching on tensor values), so the same function

* evaluates on broadcast index grids (``q_idx [Q, 1]``, ``kv_idx [1, K]``) to give the dense
  oracle mask used by the tests (``builders.dense_mask``), and
* runs inside FlexAttention's ``create_block_mask``, which vmaps it over scalar indices.

``b`` and ``h`` are accepted and ignored: all masks here are the same for every sample and head.
Every predicate is False outside its logical shape (for example the padded tail FlexAttention may
evaluate), so a padded query or key never attends or is attended to.

Layouts:

* ``bd3_mask`` / ``fast_dllm_v2_mask``: the ``[x_t ; x_0]`` sequence of ``2L`` rows, first ``L``
  noisy, last ``L`` clean, both halves using positions ``0 … L-1``.
* ``mdlm_mask`` / ``ar_mask``: one sequence of ``L`` rows.

Packed documents (``doc_ids``) restrict every mask to pairs inside one document (a document is a
maximal run of equal ids); see docs/document-masking.md.
* ``dflash_mask``: queries ``[0, N·B)`` are the anchor blocks, keys ``[0, S + N·B)`` are
  ``[context (S) ; blocks (N·B)]``.
* ``rows_mask``: any query/key row sets in the interval form of ``csbp.attention.rows`` (per-row
  block id, clean-context interval, liveness). This is the predicate the runtime uses: the tiled
  kernels, the FlexAttention backend and the dense reference all evaluate it, and the closed forms
  above are tested to equal it on every layout's rows.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from csbp.attention.rows import Rows

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
"""``mask_mod(b, h, q_idx, kv_idx) -> BoolTensor`` (True = the query may attend to the key)."""


def _check_positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def _check_window(window: int | None) -> None:
    if window is not None and window < 1:
        raise ValueError(f"window must be None (full attention) or >= 1 (it counts the query), got {window}")


def _document_runs(doc_ids: Tensor | None, seq_len: int) -> Tensor | None:
    """Run index of every position (maximal runs of equal ``doc_ids``: a reused id after another
    document is a new document), or None without documents."""
    if doc_ids is None:
        return None
    if doc_ids.dim() != 1 or doc_ids.shape[0] != seq_len:
        raise ValueError(f"doc_ids must have shape ({seq_len},), got {tuple(doc_ids.shape)}")
    if doc_ids.dtype.is_floating_point or doc_ids.dtype == torch.bool:
        raise ValueError(f"doc_ids must be an integer tensor, got {doc_ids.dtype}")
    new_run = torch.ones_like(doc_ids, dtype=torch.long)
    new_run[1:] = (doc_ids[1:] != doc_ids[:-1]).long()
    return torch.cumsum(new_run, 0)


def bd3_mask(
    seq_len: int, block_size: int, window: int | None = None, doc_ids: Tensor | None = None
) -> MaskMod:
    """The BD3-LM training mask over the ``2L`` layout ``[x_t ; x_0]`` (csbp.md §3.1).

    ``allow = M_BD | M_OBC | M_BC`` with

    * ``M_BD``: noisy -> noisy, own block, bidirectional;
    * ``M_OBC``: noisy -> clean, strictly earlier blocks;
    * ``M_BC``: clean -> clean, block-causal (own and earlier blocks).

    With a sliding ``window`` W (counting the query itself, csbp.md §3.3) the clean context shrinks
    to token-unit intervals: a clean query at ``p`` sees clean ``[max(0, p+1-W), p+1)``; a noisy
    query in the block starting at ``s`` sees clean ``[max(0, s-(W-1)), s)``, and still its whole
    own noisy block.

    With ``doc_ids`` (``[L]``, packed documents; docs/document-masking.md) every part also needs
    the query and the key in the same document: a noisy row sees the noisy rows of its block *and*
    document and the clean rows of its document before its block; clean rows are block-causal within
    their document, so a block straddling a document boundary is split by it.
    """
    _check_positive("seq_len", seq_len)
    _check_positive("block_size", block_size)
    _check_window(window)
    if seq_len % block_size != 0:
        raise ValueError(f"seq_len ({seq_len}) must be a multiple of block_size ({block_size})")
    num_rows = 2 * seq_len
    runs = _document_runs(doc_ids, seq_len)

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        in_range = (q_idx < num_rows) & (kv_idx < num_rows)
        q_clean = q_idx >= seq_len
        kv_clean = kv_idx >= seq_len
        q_pos = q_idx % seq_len
        kv_pos = kv_idx % seq_len
        q_block = q_pos // block_size
        kv_block = kv_pos // block_size

        m_bd = ~q_clean & ~kv_clean & (q_block == kv_block)
        m_obc = ~q_clean & kv_clean & (kv_block < q_block)
        m_bc = q_clean & kv_clean & (kv_block <= q_block)
        if window is not None:
            q_block_start = q_block * block_size
            m_obc = m_obc & (kv_pos >= q_block_start - (window - 1))
            m_bc = m_bc & (kv_pos <= q_pos) & (kv_pos >= q_pos + 1 - window)
        allow = (m_bd | m_obc | m_bc) & in_range
        if runs is not None:
            allow = allow & (runs[q_pos.clamp(max=seq_len - 1)] == runs[kv_pos.clamp(max=seq_len - 1)])
        return allow

    return mask_mod


fast_dllm_v2_mask = bd3_mask
"""Fast-dLLM v2 trains with exactly the BD3-LM predicate, ``block_size = bd_size`` (objectives.md §4)."""


def mdlm_mask(seq_len: int, doc_ids: Tensor | None = None) -> MaskMod:
    """MDLM: full bidirectional attention over ``L`` rows, or same-document only (objectives.md §2).

    Args:
        seq_len: number of rows ``L``.
        doc_ids: optional ``[L]`` integer document id per row (packed documents); rows attend only to
            rows of the same document (a maximal run of equal ids). Must live on the device the mask is evaluated on.
    """
    _check_positive("seq_len", seq_len)
    runs = _document_runs(doc_ids, seq_len)

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        in_range = (q_idx < seq_len) & (kv_idx < seq_len)
        if runs is None:
            return in_range
        return (runs[q_idx.clamp(max=seq_len - 1)] == runs[kv_idx.clamp(max=seq_len - 1)]) & in_range

    return mask_mod


def ar_mask(seq_len: int, doc_ids: Tensor | None = None) -> MaskMod:
    """AR: causal attention over ``L`` rows (``kv <= q``), within the query's document when
    ``doc_ids`` (``[L]``, packed documents) is given."""
    _check_positive("seq_len", seq_len)
    runs = _document_runs(doc_ids, seq_len)

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        allow = (kv_idx <= q_idx) & (q_idx < seq_len)
        if runs is None:
            return allow
        return allow & (runs[q_idx.clamp(max=seq_len - 1)] == runs[kv_idx.clamp(max=seq_len - 1)])

    return mask_mod


def dflash_mask(
    context_len: int,
    block_size: int,
    anchors: Tensor,
    keep: Tensor,
    window: int | None = None,
    causal_in_block: bool = False,
    doc_start: Tensor | None = None,
) -> MaskMod:
    """DFlash drafter training mask (objectives.md §5.5), context strictly before the anchor.

    Queries ``q ∈ [0, N·B)`` with ``n(q) = q // B``, ``j(q) = q % B``; keys ``k ∈ [0, S + N·B)`` in
    the layout ``[context (S) ; blocks (N·B)]``, ``n(k) = (k-S) // B``, ``j(k) = (k-S) % B``::

        allow = keep[n(q)] and (
              (k < S and doc_start[n(q)] <= k < a[n(q)]
                     [and k >= a[n(q)] + j(q) - (W-1)     with a window W])
           or (k >= S and n(k) == n(q) [and j(k) <= j(q)  if causal_in_block]) )

    Args:
        context_len: ``S``, the number of context (target-feature) rows.
        block_size: ``B``, draft positions per anchor block.
        anchors: ``[N]`` integer anchor positions ``a_n`` (context coordinates).
        keep: ``[N]`` bool; False marks a dead (padded) block whose rows see nothing.
        window: sliding window ``W`` counting the query itself (SpecForge semantics), or None.
        causal_in_block: make the own-block part lower-triangular (``j(k) <= j(q)``).
        doc_start: ``[N]`` integer start of the anchor's document (packed contexts); default 0.

    All tensors must live on the device the mask is evaluated on.
    """
    _check_positive("context_len", context_len)
    _check_positive("block_size", block_size)
    _check_window(window)
    if anchors.dim() != 1 or anchors.dtype.is_floating_point or anchors.dtype == torch.bool:
        raise ValueError(f"anchors must be a 1-D integer tensor, got {anchors.dtype} {tuple(anchors.shape)}")
    num_blocks = anchors.shape[0]
    if keep.dtype != torch.bool or tuple(keep.shape) != (num_blocks,):
        raise ValueError(
            f"keep must be a bool tensor of shape ({num_blocks},), got {keep.dtype} {tuple(keep.shape)}"
        )
    if doc_start is None:
        doc_start = torch.zeros_like(anchors)
    elif tuple(doc_start.shape) != (num_blocks,) or doc_start.dtype.is_floating_point:
        raise ValueError(
            f"doc_start must be an integer tensor of shape ({num_blocks},), got "
            f"{doc_start.dtype} {tuple(doc_start.shape)}"
        )
    num_queries = num_blocks * block_size
    num_keys = context_len + num_queries

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        in_range = (q_idx < num_queries) & (kv_idx < num_keys)
        q_safe = q_idx.clamp(max=max(num_queries - 1, 0))
        q_block = q_safe // block_size
        q_offset = q_safe % block_size
        anchor = anchors[q_block]
        kv_is_context = kv_idx < context_len
        context = kv_is_context & (kv_idx >= doc_start[q_block]) & (kv_idx < anchor)
        if window is not None:
            context = context & (kv_idx >= anchor + q_offset - (window - 1))
        kv_draft = kv_idx - context_len  # negative for context keys, excluded by ~kv_is_context
        own_block = ~kv_is_context & (kv_draft // block_size == q_block)
        if causal_in_block:
            own_block = own_block & (kv_draft % block_size <= q_offset)
        return keep[q_block] & (context | own_block) & in_range

    return mask_mod


def rows_mask(q_rows: Rows, k_rows: Rows, *, causal_in_block: bool = False) -> MaskMod:
    """The interval predicate over row indices ``q_idx < len(q_rows)``, ``kv_idx < len(k_rows)``::

        allow(q, k) = q.live and k.live and (
              (not q.clean and not k.clean and q.block == k.block
                   and (not causal_in_block or k.pos <= q.pos))        # block-diagonal part
           or (k.clean and q.ctx_start <= k.pos < q.ctx_stop) )       # clean-context part

    Any per-row key interval (block-causal, sliding window, DFlash "before the anchor", document
    starts) is just a ``ctx_start``/``ctx_stop`` value, so every layout flows through unchanged. The
    row tensors are captured (FlexAttention lifts them as buffers) and must live on the device the
    mask is evaluated on; indices outside the row sets are never allowed. It is
    ``rows_predicate(causal_in_block)`` over ``rows_mask_buffers(q_rows, k_rows)``.
    """
    buffers = rows_mask_buffers(q_rows, k_rows)
    predicate = rows_predicate(causal_in_block)

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return predicate(b, h, q_idx, kv_idx, *buffers)

    return mask_mod


def rows_mask_buffers(q_rows: Rows, k_rows: Rows) -> tuple[Tensor, ...]:
    """The row tensors ``rows_predicate`` reads, in its argument order."""
    return (q_rows.live, q_rows.clean, q_rows.block, q_rows.pos, q_rows.ctx_start, q_rows.ctx_stop,
            k_rows.live, k_rows.clean, k_rows.block, k_rows.pos)


@functools.cache
def rows_predicate(causal_in_block: bool) -> Callable[..., Tensor]:
    """``rows_mask``'s predicate with the row tensors as arguments after the indices
    (``rows_mask_buffers``): ``mask_mod(b, h, q_idx, kv_idx, *buffers)``, FlexAttention's form of a
    mask with other buffers. One function per flag (cached), so a graph traced from it can be kept
    and reused for every row set of the same shapes (``csbp.attention.flex_backward``)."""

    def mask_mod(
        b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor,
        q_live: Tensor, q_clean: Tensor, q_block: Tensor, q_pos: Tensor, q_start: Tensor, q_stop: Tensor,
        k_live: Tensor, k_clean: Tensor, k_block: Tensor, k_pos: Tensor,
    ) -> Tensor:
        num_queries, num_keys = q_live.shape[0], k_live.shape[0]
        in_range = (q_idx < num_queries) & (kv_idx < num_keys)
        qi, ki = q_idx.clamp(max=max(num_queries - 1, 0)), kv_idx.clamp(max=max(num_keys - 1, 0))
        key_pos = k_pos[ki]
        diagonal = ~q_clean[qi] & ~k_clean[ki] & (q_block[qi] == k_block[ki])
        if causal_in_block:
            diagonal = diagonal & (key_pos <= q_pos[qi])
        context = k_clean[ki] & (q_start[qi] <= key_pos) & (key_pos < q_stop[qi])
        return (diagonal | context) & q_live[qi] & k_live[ki] & in_range

    return mask_mod
