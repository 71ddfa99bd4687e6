"""Row metadata in interval form: the one description of "who may attend to whom" that every
attention kernel and transport in csbp consumes (csbp.md §3.2).

Every rank holds some subset of the logical rows of a sequence (noisy and clean rows of the
``[x_t ; x_0]`` layout, DFlash anchor blocks and context rows, ...). Instead of materialising a
mask, each row carries a few integers:

* query side: ``clean``, ``block``, ``ctx_start``/``ctx_stop`` (the half-open range of *clean
  positions* in token units the row may see) and ``live`` (a dead row sees nothing);
* key side: ``clean``, ``block``, ``pos`` (the clean coordinate) and ``live`` (padding rows are
  invisible).

The predicate is::

    allow(q, k) = q.live and k.live and (
          (not q.clean and not k.clean and q.block == k.block
               and (not causal_in_block or k.pos <= q.pos))          # block-diagonal part
       or (k.clean and q.ctx_start <= k.pos < q.ctx_stop) )         # clean-context part

``pos`` is also the RoPE position of the row. Because intervals are in token units, sliding
windows, block-causal and encoder-causal clean streams, packed-document starts and DFlash
"strictly before the anchor" contexts are all just different ``ctx_start``/``ctx_stop`` values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from csbp.masks import dense_mask, rows_mask


@dataclass(frozen=True)
class Rows:
    """Metadata of a set of rows, all 1-D tensors of equal length ``n`` (int64 / bool, CPU or same
    device as the activations).

    Attributes:
        pos: token position (RoPE position; for clean keys also the clean coordinate).
        clean: True for rows of the clean stream (``x_0`` / target context), False for noisy or
            draft-block rows.
        block: block-diagonal group id of a noisy row (BD3: ``pos // B``; DFlash: anchor index).
            For clean rows it is ``pos // B`` (informational; the predicate does not use it).
        ctx_start: first clean position this row may attend to (query side).
        ctx_stop: one past the last clean position this row may attend to (query side).
        live: False for padding rows (keys) and dead rows (queries, e.g. padded DFlash anchors).
    """

    pos: Tensor
    clean: Tensor
    block: Tensor
    ctx_start: Tensor
    ctx_stop: Tensor
    live: Tensor

    def __post_init__(self) -> None:
        n = self.pos.shape[0]
        for name in ("clean", "block", "ctx_start", "ctx_stop", "live"):
            t = getattr(self, name)
            if t.dim() != 1 or t.shape[0] != n:
                raise ValueError(f"Rows.{name} has shape {tuple(t.shape)}, expected ({n},)")

    def __len__(self) -> int:
        return int(self.pos.shape[0])

    def select(self, index: Tensor | slice) -> Rows:
        """Rows at ``index`` (a slice, a bool mask or an int64 index tensor)."""
        return Rows(*(getattr(self, f)[index] for f in _FIELDS))

    def to(self, device: torch.device | str) -> Rows:
        return Rows(*(getattr(self, f).to(device) for f in _FIELDS))

    @staticmethod
    def cat(parts: list[Rows]) -> Rows:
        """Concatenate row sets in order."""
        return Rows(*(torch.cat([getattr(p, f) for p in parts]) for f in _FIELDS))

    def padded(self, num_rows: int) -> Rows:
        """These rows followed by dead rows (``live = False``: invisible keys, queries that see
        nothing) up to ``num_rows`` rows."""
        missing = num_rows - len(self)
        if missing < 0:
            raise ValueError(f"cannot pad {len(self)} rows to {num_rows}")
        if missing == 0:
            return self
        zeros = torch.zeros(missing, dtype=torch.long, device=self.pos.device)
        ones = torch.ones(missing, dtype=torch.bool, device=self.pos.device)
        return Rows.cat([self, Rows(zeros, ones, zeros, zeros, zeros, ~ones)])

    @staticmethod
    def empty(device: torch.device | str = "cpu") -> Rows:
        z = torch.zeros(0, dtype=torch.long, device=device)
        b = torch.zeros(0, dtype=torch.bool, device=device)
        return Rows(z, b, z, z, z, b)


_FIELDS = ("pos", "clean", "block", "ctx_start", "ctx_stop", "live")


def allow_matrix(q: Rows, k: Rows, *, causal_in_block: bool = False) -> Tensor:
    """Dense ``[len(q), len(k)]`` boolean mask of the interval predicate (reference and tests): the
    one definition, ``csbp.masks.rows_mask``, evaluated at every pair."""
    return dense_mask(rows_mask(q, k, causal_in_block=causal_in_block), len(q), len(k), device=q.pos.device)
