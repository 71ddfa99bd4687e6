"""Deterministic, resumable, data-parallel-aware batches from a packed artifact split.

Semantics (the whole state is *global*, independent of the data-parallel layout):

* Epoch ``e`` visits the split's rows in one order: a ``torch.randperm`` drawn from a
  ``torch.Generator`` seeded by ``(seed, e)`` (or ``0 .. N-1`` with ``shuffle=False``).
* Each step consumes one *global batch* of ``G = batch_size * dp_size`` consecutive entries of
  that order; data-parallel rank ``r`` takes entries ``[r*S, (r+1)*S)`` of it (``S =
  batch_size``). Ranks therefore get disjoint rows, and every rank of one model-parallel group
  (same ``dp_rank``, any cp/bp/tp coordinate) gets the *same* batch: the loader is indexed by
  ``dp_rank`` only.
* ``drop_last=True``: an epoch has ``N // G`` steps, the remainder is skipped (a different
  ``N mod G`` rows each epoch, since each epoch has its own order); a batch never wraps around, also
  after a resume with another ``G`` whose cursor is not a multiple of it. ``drop_last=False``:
  ``ceil(N / G)`` steps, the last global batch wraps around to the start of the same order.
* The state is ``(epoch, cursor, seed)``, ``cursor`` = global samples consumed in the current
  epoch, with the split's name, row count and fingerprint to check it against. Resuming with the
  same ``dp_size`` replays exactly the batches an uninterrupted run would have produced. Resuming
  with another ``dp_size`` (or batch size) continues deterministically from the same global
  cursor: the next global batch is the next ``G'`` entries of the epoch order, re-sharded over the
  new ranks. A state from a different split (its name, row count or
  content fingerprint; both splits of an artifact share the artifact's fingerprint) or seed is
  rejected.

Batches are dicts of tensors: ``input_ids [S, L]`` int64, ``loss_mask [S, L]`` bool, ``doc_ids
[S, L]`` int64 (document ordinal, -1 on padding) and ``row_ids [S]`` int64 (row index in the
split, useful to check sharding and to un-permute results).

Usage::

    loader = PackedLoader(artifact.split("train"), batch_size=4, seed=0, dp_rank=r, dp_size=dp)
    batch = next(loader)                       # the loader is an endless iterator over epochs
    state = loader.state_dict()                # save with the checkpoint
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch
from torch import Tensor

from csbp.data.artifact import ArtifactSplit


def epoch_generator_seed(seed: int, epoch: int) -> int:
    """A 63-bit generator seed mixing ``seed`` and ``epoch`` (no collisions between nearby pairs)."""
    digest = hashlib.sha256(f"csbp-loader:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class PackedLoader:
    """Endless iterator of data-parallel shards of global batches (see the module docstring)."""

    def __init__(
        self,
        split: ArtifactSplit,
        *,
        batch_size: int,
        seed: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        drop_last: bool = True,
        shuffle: bool = True,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size is {batch_size}; use at least 1")
        if dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ValueError(
                f"dp_rank {dp_rank} / dp_size {dp_size}: need dp_size >= 1 and 0 <= dp_rank < dp_size"
            )
        if split.num_rows == 0:
            raise ValueError(f"split {split.name!r} has no rows; prepare more data or use another split")
        if drop_last and split.num_rows < batch_size * dp_size:
            raise ValueError(
                f"split {split.name!r} has {split.num_rows} rows, fewer than one global batch "
                f"(batch_size {batch_size} x dp_size {dp_size}); lower batch_size or pass drop_last=False"
            )
        self.split = split
        self.batch_size = batch_size
        self.seed = seed
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.drop_last = drop_last
        self.shuffle = shuffle
        self.epoch = 0
        self.cursor = 0
        self._order_cache: tuple[int, np.ndarray] | None = None

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.dp_size

    @property
    def steps_per_epoch(self) -> int:
        num_rows, global_batch = self.split.num_rows, self.global_batch_size
        return num_rows // global_batch if self.drop_last else -(-num_rows // global_batch)

    def _epoch_exhausted(self) -> bool:
        """Whether the current epoch has no global batch left. With ``drop_last`` that is when fewer
        than ``G`` entries of the order remain: after a resume with another global batch the cursor
        need not be a multiple of ``G``, and wrapping around would repeat rows of this epoch."""
        if self.drop_last:
            return self.cursor + self.global_batch_size > self.split.num_rows
        return self.cursor >= self.split.num_rows

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Row indices in visiting order for ``epoch`` (int64 [N])."""
        if self._order_cache is not None and self._order_cache[0] == epoch:
            return self._order_cache[1]
        num_rows = self.split.num_rows
        if self.shuffle:
            generator = torch.Generator().manual_seed(epoch_generator_seed(self.seed, epoch))
            order = torch.randperm(num_rows, generator=generator).numpy()
        else:
            order = np.arange(num_rows, dtype=np.int64)
        self._order_cache = (epoch, order)
        return order

    def __iter__(self) -> PackedLoader:
        return self

    def __next__(self) -> dict[str, Tensor]:
        if self._epoch_exhausted():
            self.epoch += 1
            self.cursor = 0
        order = self.epoch_order(self.epoch)
        first = self.cursor + self.dp_rank * self.batch_size
        positions = np.arange(first, first + self.batch_size) % self.split.num_rows
        row_ids = order[positions]
        self.cursor += self.global_batch_size
        return self._gather(row_ids)

    def _gather(self, row_ids: np.ndarray) -> dict[str, Tensor]:
        tokens = np.asarray(self.split.tokens[row_ids], dtype=np.int64)  # [S, L]
        loss_mask = np.asarray(self.split.loss_mask[row_ids]) != 0  # [S, L]
        doc_ids = np.asarray(self.split.doc_ids[row_ids], dtype=np.int64)  # [S, L]
        return {
            "input_ids": torch.from_numpy(tokens),
            "loss_mask": torch.from_numpy(loss_mask),
            "doc_ids": torch.from_numpy(doc_ids),
            "row_ids": torch.from_numpy(row_ids.astype(np.int64)),
        }

    def state_dict(self) -> dict[str, Any]:
        """Global position: resume from it with any ``dp_size`` (see the module docstring)."""
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "split": self.split.name,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_rows": self.split.num_rows,
            "fingerprint": self.split.fingerprint,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; ``ValueError`` (one line naming the field) if it belongs to another
        split, other data or another seed. A state without ``split`` (written before it was
        recorded, by the trainer, which saves only its train loader) is a train position."""
        split = state.get("split", "train")
        if split != self.split.name:
            raise ValueError(
                f"loader state field 'split' is {split!r}, this loader reads {self.split.name!r} (fix: load "
                f"a state saved by a loader of the {self.split.name!r} split, or start that loader afresh)"
            )
        for key, mine in (
            ("seed", self.seed),
            ("shuffle", self.shuffle),
            ("num_rows", self.split.num_rows),
            ("fingerprint", self.split.fingerprint),
        ):
            if state.get(key) != mine:
                raise ValueError(
                    f"loader state has {key}={state.get(key)!r} but this loader has {mine!r}; "
                    "resume with the same data artifact and loader seed"
                )
        epoch, cursor = int(state["epoch"]), int(state["cursor"])
        if epoch < 0 or cursor < 0:
            raise ValueError(f"loader state epoch={epoch} cursor={cursor}: both must be >= 0")
        self.epoch, self.cursor = epoch, cursor
