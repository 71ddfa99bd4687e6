"""The two ways block-diffusion sampling runs the model: with the clean-prefix KV cache, or by
recomputing the whole ``[noisy block ; clean prefix]`` layout every step (the reference).

Both take the sliding ``window`` the model was trained with (``topology.window``; None: full
attention) and apply the windowed BD3 mask. Both run ``S`` sequences at once (the samples of a
batch, :func:`csbp.generation.sampler.generate_batch`), each with its own prompt: every call runs
the same number of rows for each sequence, at that sequence's own positions (``starts[i]`` is where
sequence ``i``'s block starts, a multiple of ``B``). The calls:

* ``prefill(prefixes)``: each sequence's prompt blocks (a token list of whole blocks, maybe empty)
  become its clean prefix; a prefix shared by several sequences (the samples of one prompt) is run
  once;
* ``denoise(block_ids [S, B], starts)``: final hidden states of the noisy blocks (bidirectional
  inside the block, seeing the sequence's whole clean prefix);
* ``clean_row_before(rows)``: the clean hidden states ``[len(rows), D]`` of the position just
  before each listed sequence's current block (what a token-shift model predicts the block's first
  token from; it sees only the clean prefix, so it is the same at every denoising step of the block);
* ``keep(indices)``: drop every sequence but these (in this order), e.g. the samples that ended;
* ``commit(block_ids [S, B], starts)``: the finished blocks join the clean prefixes.

``rows_processed[i]`` counts the rows run for sequence ``i``: as many as when it is drawn alone (a
shared prefix counts for each of its sequences).

:class:`CachedBlockForward` runs only the current rows: ``prefill``/``commit`` run the rows once
as clean blocks (block-causal over the cache) and append their K/V to the cache; ``denoise`` runs
the ``B`` noisy rows against the cache; ``clean_row_before`` returns the last row of the latest
prefill or commit, without a forward. The prefix is never recomputed. :class:`RecomputeBlockForward`
keeps the clean tokens and rebuilds the full BD3 inference layout (``csbp.attention.layouts.bd3_rows``
with a dense mask from ``csbp.attention.rows.allow_matrix``) at every step, one sequence at a time;
it is the oracle the cache must equal.

Shape legend: ``S`` sequences, ``P`` prompt tokens, ``B`` block size, ``C`` cache slots, ``D`` hidden size.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
from torch import Tensor

from csbp.attention.layouts import bd3_rows
from csbp.attention.rows import allow_matrix
from csbp.generation.kv_cache import CachedPrefixAttention, PrefixKVCache
from csbp.models.attention_fns import DenseMaskAttention
from csbp.models.decoder import Decoder


class BlockForward(Protocol):
    """Model calls of the sampling loop (see the module docstring)."""

    rows_processed: list[int]

    def prefill(self, prefixes: Sequence[Sequence[int]]) -> None: ...

    def denoise(self, block_ids_SB: Tensor, starts: Sequence[int]) -> Tensor: ...

    def clean_row_before(self, rows: Sequence[int]) -> Tensor: ...

    def keep(self, indices: Sequence[int]) -> None: ...

    def commit(self, block_ids_SB: Tensor, starts: Sequence[int]) -> None: ...


def _check_block(block_ids: Tensor, starts: Sequence[int], sequences: int, block_size: int) -> None:
    if block_ids.dim() != 2 or block_ids.shape[0] != sequences or block_ids.dtype != torch.long:
        raise ValueError(f"block ids must be a [{sequences}, N] int64 tensor, got {block_ids.dtype} {tuple(block_ids.shape)}")
    if len(starts) != sequences or any(start % block_size for start in starts):
        raise ValueError(f"starts must be {sequences} multiples of the block size {block_size}, got {list(starts)}")


def _check_prefixes(prefixes: Sequence[Sequence[int]], block_size: int) -> None:
    if not prefixes:
        raise ValueError("prefill needs at least one sequence")
    for prefix in prefixes:
        if len(prefix) % block_size:
            raise ValueError(f"prefill needs whole blocks of {block_size}, got {len(prefix)} tokens")


def _check_keep(indices: Sequence[int], sequences: int) -> None:
    if not indices or any(not 0 <= i < sequences for i in indices) or len(set(indices)) != len(indices):
        raise ValueError(f"keep needs distinct sequence indices in [0, {sequences}), got {list(indices)}")


class CachedBlockForward:
    """Sampling forward passes over the clean-prefix KV cache.

    Attributes:
        cache: per-layer clean K/V of every sequence's committed positions.
        rows_processed: rows fed to the model per sequence so far (the cost counter tests read).
    """

    def __init__(self, model: Decoder, block_size: int, window: int | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.model = model
        self.block_size = block_size
        self.window = window
        self.cache = PrefixKVCache(model.config.num_layers, device=self.device)
        self.rows_processed = [0]
        self._last_clean_hidden_SD: Tensor | None = None  # the last row of each sequence's latest prefill/commit
        self._has_clean_row = [False]
        self._prefix_lengths = [0]  # each sequence's filled slots, kept here: reading them off the device syncs

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def _run(self, ids_SN: Tensor, positions_SN: Tensor, *, append: bool) -> Tensor:
        attention = CachedPrefixAttention(
            self.cache, positions_SN, block_size=self.block_size, append=append, window=self.window
        )
        hidden_SND = self.model(ids_SN.to(self.device), positions_SN, attention)
        if append:
            self.cache.record_positions(positions_SN)
        self.rows_processed = [rows + ids_SN.shape[1] for rows in self.rows_processed]
        return hidden_SND

    def _positions(self, starts: Sequence[int], rows: int) -> Tensor:
        for row, (start, held) in enumerate(zip(starts, self._prefix_lengths, strict=True)):
            if start != held:
                raise RuntimeError(f"sequence {row}'s block starts at {start} but its cache holds {held}")
        return torch.tensor(list(starts), device=self.device)[:, None] + torch.arange(rows, device=self.device)

    def prefill(self, prefixes: Sequence[Sequence[int]]) -> None:
        _check_prefixes(prefixes, self.block_size)
        distinct = list(dict.fromkeys(tuple(int(t) for t in prefix) for prefix in prefixes))
        caches, last_rows = [], []
        for prefix in distinct:
            self.cache = PrefixKVCache(self.model.config.num_layers, device=self.device)
            self.rows_processed = [0]
            if prefix:
                ids_1P = torch.tensor([prefix], dtype=torch.long)
                last_rows.append(self._run(ids_1P, torch.arange(len(prefix), device=self.device)[None], append=True)[:, -1])
            else:
                last_rows.append(None)
            caches.append(self.cache)
        sources = [distinct.index(tuple(int(t) for t in prefix)) for prefix in prefixes]
        self.cache = PrefixKVCache.gather(caches, sources)
        self.rows_processed = [len(prefix) for prefix in prefixes]
        self._prefix_lengths = [len(prefix) for prefix in prefixes]
        self._has_clean_row = [last_rows[source] is not None for source in sources]
        known = [row for row in last_rows if row is not None]
        if known:
            zero = torch.zeros_like(known[0])
            self._last_clean_hidden_SD = torch.cat([zero if last_rows[s] is None else last_rows[s] for s in sources])

    def clean_row_before(self, rows: Sequence[int]) -> Tensor:
        if self._last_clean_hidden_SD is None or not all(self._has_clean_row[row] for row in rows):
            raise RuntimeError(f"no clean row before the current block of sequences {list(rows)} (an empty prefix)")
        return self._last_clean_hidden_SD[list(rows)]

    def denoise(self, block_ids_SB: Tensor, starts: Sequence[int]) -> Tensor:
        _check_block(block_ids_SB, starts, self.cache.sequences, self.block_size)
        return self._run(block_ids_SB, self._positions(starts, block_ids_SB.shape[1]), append=False)

    def keep(self, indices: Sequence[int]) -> None:
        _check_keep(indices, self.cache.sequences)
        self.cache.keep(indices)
        self.rows_processed = [self.rows_processed[i] for i in indices]
        self._prefix_lengths = [self._prefix_lengths[i] for i in indices]
        self._has_clean_row = [self._has_clean_row[i] for i in indices]
        if self._last_clean_hidden_SD is not None:
            self._last_clean_hidden_SD = self._last_clean_hidden_SD[list(indices)]

    def commit(self, block_ids_SB: Tensor, starts: Sequence[int]) -> None:
        _check_block(block_ids_SB, starts, self.cache.sequences, self.block_size)
        hidden_SBD = self._run(block_ids_SB, self._positions(starts, block_ids_SB.shape[1]), append=True)
        self._prefix_lengths = [length + block_ids_SB.shape[1] for length in self._prefix_lengths]
        self._last_clean_hidden_SD = hidden_SBD[:, -1]
        self._has_clean_row = [True] * len(self._has_clean_row)


class RecomputeBlockForward:
    """Sampling forward passes that rebuild ``[noisy block ; clean prefix]`` every step (no cache),
    one sequence at a time."""

    def __init__(self, model: Decoder, block_size: int, window: int | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.model = model
        self.block_size = block_size
        self.window = window
        self.rows_processed = [0]
        self._clean_ids: list[Tensor] = [torch.zeros(1, 0, dtype=torch.long)]  # [1, C] per sequence

    def prefill(self, prefixes: Sequence[Sequence[int]]) -> None:
        _check_prefixes(prefixes, self.block_size)
        self._clean_ids = [torch.tensor([list(prefix)], dtype=torch.long).reshape(1, -1) for prefix in prefixes]
        self.rows_processed = [0] * len(prefixes)

    def _run(self, row: int, block_ids_1B: Tensor, start: int) -> Tensor:
        """Hidden states of one sequence's rows ``[noisy block ; clean prefix]`` (no noisy rows for an empty block)."""
        clean_1C = self._clean_ids[row]
        num_clean, num_noisy = clean_1C.shape[1], block_ids_1B.shape[1]
        if start != num_clean:
            raise RuntimeError(f"sequence {row}'s block starts at {start} but its clean prefix has {num_clean} tokens")
        rows = bd3_rows(
            torch.arange(start, start + num_noisy),
            torch.arange(num_clean),
            block_size=self.block_size,
            window=self.window,
        )
        device = self.model.embed_tokens.weight.device
        input_ids_1R = torch.cat((block_ids_1B.cpu(), clean_1C), dim=1).to(device)
        attention = DenseMaskAttention(allow_matrix(rows, rows).to(device))
        self.rows_processed[row] += input_ids_1R.shape[1]
        return self.model(input_ids_1R, rows.pos.to(device), attention)

    def clean_row_before(self, rows: Sequence[int]) -> Tensor:
        empty = torch.zeros(1, 0, dtype=torch.long)
        for row in rows:
            if self._clean_ids[row].shape[1] < 1:
                raise RuntimeError(f"no clean row before the current block of sequence {row} (an empty prefix)")
        return torch.cat([self._run(row, empty, self._clean_ids[row].shape[1])[:, -1] for row in rows])

    def denoise(self, block_ids_SB: Tensor, starts: Sequence[int]) -> Tensor:
        _check_block(block_ids_SB, starts, len(self._clean_ids), self.block_size)
        num_noisy = block_ids_SB.shape[1]
        return torch.cat([
            self._run(row, block_ids_SB[row : row + 1], start)[:, :num_noisy] for row, start in enumerate(starts)
        ])

    def keep(self, indices: Sequence[int]) -> None:
        _check_keep(indices, len(self._clean_ids))
        self._clean_ids = [self._clean_ids[i] for i in indices]
        self.rows_processed = [self.rows_processed[i] for i in indices]

    def commit(self, block_ids_SB: Tensor, starts: Sequence[int]) -> None:
        _check_block(block_ids_SB, starts, len(self._clean_ids), self.block_size)
        for row, start in enumerate(starts):
            if start != self._clean_ids[row].shape[1]:
                raise RuntimeError(
                    f"sequence {row}'s block starts at {start} but its clean prefix has {self._clean_ids[row].shape[1]}"
                )
            self._clean_ids[row] = torch.cat((self._clean_ids[row], block_ids_SB[row : row + 1].cpu()), dim=1)
