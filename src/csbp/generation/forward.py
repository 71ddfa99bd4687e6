"""The two ways block-diffusion sampling runs the model: with the clean-prefix KV cache, or by
recomputing the whole ``[noisy block ; clean prefix]`` layout every step (the reference).

Both take the sliding ``window`` the model was trained with (``topology.window``; None: full
attention) and apply the windowed BD3 mask. Both run ``S`` sequences at once (the samples of one
prompt, :func:`csbp.generation.sampler.generate_batch`): they share the prompt and the block grid,
so every call runs the same positions for all of them. Both expose the same calls:

* ``prefill(ids [1, P], samples=S)``: the prompt's whole blocks become the clean prefix of each of
  the ``S`` sequences (``P % B == 0``); the prompt is run once, not ``S`` times;
* ``denoise(block_ids [S, B], start)``: final hidden states of the noisy blocks at positions
  ``start .. start+B-1`` (bidirectional inside the block, seeing the whole clean prefix), plus the
  clean hidden states of position ``start - 1``, or None at ``start == 0``;
* ``clean_row_before(start)``: those clean hidden states ``[S, D]`` of position ``start - 1`` alone
  (what a token-shift model predicts the first token of the block at ``start`` from; it sees only
  the clean prefix, so it is the same at every denoising step of that block);
* ``keep(indices)``: drop every sequence but these (in this order), e.g. the samples that ended;
* ``commit(block_ids [S, B], start)``: the finished blocks join the clean prefixes.

``rows_processed`` counts the rows of *one* sequence (a call over ``S`` sequences of ``N`` rows adds
``N``): each sample's share, the same as when it is drawn alone.

:class:`CachedBlockForward` runs only the current rows: ``prefill``/``commit`` run the rows once
as clean blocks (block-causal over the cache) and append their K/V to the cache; ``denoise`` runs
the ``B`` noisy rows against the cache; ``clean_row_before`` returns the last row of the latest
prefill or commit, without a forward. The prefix is never recomputed. :class:`RecomputeBlockForward`
keeps the clean tokens and rebuilds the full BD3 inference layout (``csbp.attention.layouts.bd3_rows``
with a dense mask from ``csbp.attention.rows.allow_matrix``) at every step; it is the oracle the cache
must equal.

Shape legend: ``S`` sequences, ``P`` prompt tokens, ``B`` block size, ``C`` clean prefix length,
``D`` hidden size.
"""

from __future__ import annotations

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

    rows_processed: int

    def prefill(self, ids_1P: Tensor, samples: int = 1) -> None: ...

    def denoise(self, block_ids_SB: Tensor, start: int) -> tuple[Tensor, Tensor | None]: ...

    def clean_row_before(self, start: int) -> Tensor: ...

    def keep(self, indices: list[int]) -> None: ...

    def commit(self, block_ids_SB: Tensor, start: int) -> None: ...


def _check_ids(ids: Tensor, name: str, sequences: int | None = None) -> None:
    """``ids`` must be ``[S, N]`` int64, with ``S == sequences`` when given (1 for a prompt)."""
    rows = 1 if sequences is None else sequences
    if ids.dim() != 2 or ids.shape[0] != rows or ids.dtype != torch.long:
        raise ValueError(f"{name} must be a [{rows}, N] int64 tensor, got {ids.dtype} {tuple(ids.shape)}")


def _check_samples(samples: int) -> None:
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples must be a positive integer, got {samples!r}")


def _check_keep(indices: list[int], sequences: int) -> None:
    if not indices or any(not 0 <= i < sequences for i in indices) or len(set(indices)) != len(indices):
        raise ValueError(f"keep needs distinct sequence indices in [0, {sequences}), got {indices}")


class CachedBlockForward:
    """Sampling forward passes over the clean-prefix KV cache.

    Attributes:
        cache: per-layer clean K/V of every committed position ``0 .. C-1``.
        rows_processed: total rows fed to the model so far (the cost counter tests read).
    """

    def __init__(self, model: Decoder, block_size: int, window: int | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.model = model
        self.block_size = block_size
        self.window = window
        self.cache = PrefixKVCache(model.config.num_layers)
        self.rows_processed = 0
        self.sequences = 1
        self._last_clean_hidden_SD: Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def _run(self, ids_SN: Tensor, start: int, *, append: bool) -> Tensor:
        if start != self.cache.length:
            raise RuntimeError(f"rows start at position {start} but the cache holds {self.cache.length}")
        positions_N = torch.arange(start, start + ids_SN.shape[1], device=self.device)
        attention = CachedPrefixAttention(
            self.cache,
            positions_N // self.block_size,
            append=append,
            window=self.window,
            positions=positions_N,
            block_size=self.block_size,
        )
        self.rows_processed += ids_SN.shape[1]
        return self.model(ids_SN.to(self.device), positions_N, attention)

    def prefill(self, ids_1P: Tensor, samples: int = 1) -> None:
        _check_ids(ids_1P, "prefill ids")
        _check_samples(samples)
        if ids_1P.shape[1] % self.block_size:
            raise ValueError(f"prefill needs whole blocks of {self.block_size}, got {ids_1P.shape[1]} tokens")
        self.sequences = samples
        if ids_1P.shape[1] == 0:
            return
        hidden_1PD = self._run(ids_1P, 0, append=True)
        self.cache.expand(samples)
        self._last_clean_hidden_SD = hidden_1PD[:, -1].expand(samples, -1)

    def clean_row_before(self, start: int) -> Tensor:
        if start < 1 or start != self.cache.length or self._last_clean_hidden_SD is None:
            raise RuntimeError(f"no clean row before position {start} (the cache holds {self.cache.length})")
        return self._last_clean_hidden_SD

    def denoise(self, block_ids_SB: Tensor, start: int) -> tuple[Tensor, Tensor | None]:
        _check_ids(block_ids_SB, "block ids", self.sequences)
        return self._run(block_ids_SB, start, append=False), self._last_clean_hidden_SD

    def keep(self, indices: list[int]) -> None:
        _check_keep(indices, self.sequences)
        self.cache.keep(indices)
        if self._last_clean_hidden_SD is not None:
            self._last_clean_hidden_SD = self._last_clean_hidden_SD[indices]
        self.sequences = len(indices)

    def commit(self, block_ids_SB: Tensor, start: int) -> None:
        _check_ids(block_ids_SB, "block ids", self.sequences)
        hidden_SBD = self._run(block_ids_SB, start, append=True)
        self._last_clean_hidden_SD = hidden_SBD[:, -1]


class RecomputeBlockForward:
    """Sampling forward passes that rebuild ``[noisy block ; clean prefix]`` every step (no cache)."""

    def __init__(self, model: Decoder, block_size: int, window: int | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.model = model
        self.block_size = block_size
        self.window = window
        self.rows_processed = 0
        self._clean_ids_SC = torch.zeros(1, 0, dtype=torch.long)

    @property
    def sequences(self) -> int:
        return int(self._clean_ids_SC.shape[0])

    def prefill(self, ids_1P: Tensor, samples: int = 1) -> None:
        _check_ids(ids_1P, "prefill ids")
        _check_samples(samples)
        if ids_1P.shape[1] % self.block_size:
            raise ValueError(f"prefill needs whole blocks of {self.block_size}, got {ids_1P.shape[1]} tokens")
        self._clean_ids_SC = ids_1P.cpu().expand(samples, -1)

    def _run(self, block_ids_SB: Tensor, start: int) -> Tensor:
        """Hidden states of the rows ``[noisy block ; clean prefix]`` (no noisy rows for an empty block)."""
        num_clean, num_noisy = self._clean_ids_SC.shape[1], block_ids_SB.shape[1]
        if start != num_clean:
            raise RuntimeError(
                f"block starts at position {start} but the clean prefix has {num_clean} tokens"
            )
        rows = bd3_rows(
            torch.arange(start, start + num_noisy),
            torch.arange(num_clean),
            block_size=self.block_size,
            window=self.window,
        )
        device = self.model.embed_tokens.weight.device
        input_ids_SR = torch.cat((block_ids_SB.cpu(), self._clean_ids_SC), dim=1).to(device)
        attention = DenseMaskAttention(allow_matrix(rows, rows).to(device))
        self.rows_processed += input_ids_SR.shape[1]
        return self.model(input_ids_SR, rows.pos.to(device), attention)

    def clean_row_before(self, start: int) -> Tensor:
        if start < 1:
            raise RuntimeError(f"no clean row before position {start}")
        return self._run(torch.zeros(self.sequences, 0, dtype=torch.long), start)[:, -1]

    def denoise(self, block_ids_SB: Tensor, start: int) -> tuple[Tensor, Tensor | None]:
        _check_ids(block_ids_SB, "block ids", self.sequences)
        num_noisy = block_ids_SB.shape[1]
        hidden_SRD = self._run(block_ids_SB, start)
        return hidden_SRD[:, :num_noisy], hidden_SRD[:, -1] if start > 0 else None

    def keep(self, indices: list[int]) -> None:
        _check_keep(indices, self.sequences)
        self._clean_ids_SC = self._clean_ids_SC[indices]

    def commit(self, block_ids_SB: Tensor, start: int) -> None:
        _check_ids(block_ids_SB, "block ids", self.sequences)
        if start != self._clean_ids_SC.shape[1]:
            raise RuntimeError(
                f"block starts at {start} but the clean prefix has {self._clean_ids_SC.shape[1]}"
            )
        self._clean_ids_SC = torch.cat((self._clean_ids_SC, block_ids_SB.cpu()), dim=1)
