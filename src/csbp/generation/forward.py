"""The two ways block-diffusion sampling runs the model: with the clean-prefix KV cache, or by
recomputing the whole ``[noisy block ; clean prefix]`` layout every step (the reference).

Both take the sliding ``window`` the model was trained with (``topology.window``; None: full
attention) and apply the windowed BD3 mask. Both expose the same three calls, used by :func:`csbp.generation.sampler.generate`:

* ``prefill(ids [1, P])``: the prompt's whole blocks become the clean prefix (``P % B == 0``);
* ``denoise(block_ids [1, B], start)``: final hidden states of the noisy block at positions
  ``start .. start+B-1`` (bidirectional inside the block, seeing the whole clean prefix), plus the
  clean hidden state of position ``start - 1``, or None at ``start == 0``;
* ``clean_row_before(start)``: that clean hidden state of position ``start - 1`` alone (what a
  token-shift model predicts the first token of the block at ``start`` from; it sees only the clean
  prefix, so it is the same at every denoising step of that block);
* ``commit(block_ids [1, B], start)``: the finished block joins the clean prefix.

:class:`CachedBlockForward` runs only the current rows: ``prefill``/``commit`` run the rows once
as clean blocks (block-causal over the cache) and append their K/V to the cache; ``denoise`` runs
the ``B`` noisy rows against the cache; ``clean_row_before`` returns the last row of the latest
prefill or commit, without a forward. The prefix is never recomputed. :class:`RecomputeBlockForward`
keeps the clean tokens and rebuilds the full BD3 inference layout (``csbp.attention.layouts.bd3_rows``
with a dense mask from ``csbp.attention.rows.allow_matrix``) at every step; it is the oracle the cache
must equal.

Shape legend: ``P`` prompt tokens, ``B`` block size, ``C`` clean prefix length, ``D`` hidden size.
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

    def prefill(self, ids_1P: Tensor) -> None: ...

    def denoise(self, block_ids_1B: Tensor, start: int) -> tuple[Tensor, Tensor | None]: ...

    def clean_row_before(self, start: int) -> Tensor: ...

    def commit(self, block_ids_1B: Tensor, start: int) -> None: ...


def _check_ids(ids: Tensor, name: str) -> None:
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.dtype != torch.long:
        raise ValueError(f"{name} must be a [1, N] int64 tensor, got {ids.dtype} {tuple(ids.shape)}")


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
        self._last_clean_hidden_1D: Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def _run(self, ids_1N: Tensor, start: int, *, append: bool) -> Tensor:
        if start != self.cache.length:
            raise RuntimeError(f"rows start at position {start} but the cache holds {self.cache.length}")
        positions_N = torch.arange(start, start + ids_1N.shape[1], device=self.device)
        attention = CachedPrefixAttention(
            self.cache,
            positions_N // self.block_size,
            append=append,
            window=self.window,
            positions=positions_N,
            block_size=self.block_size,
        )
        self.rows_processed += ids_1N.shape[1]
        return self.model(ids_1N.to(self.device), positions_N, attention)

    def prefill(self, ids_1P: Tensor) -> None:
        _check_ids(ids_1P, "prefill ids")
        if ids_1P.shape[1] % self.block_size:
            raise ValueError(f"prefill needs whole blocks of {self.block_size}, got {ids_1P.shape[1]} tokens")
        if ids_1P.shape[1] == 0:
            return
        hidden_1PD = self._run(ids_1P, 0, append=True)
        self._last_clean_hidden_1D = hidden_1PD[:, -1]

    def clean_row_before(self, start: int) -> Tensor:
        if start < 1 or start != self.cache.length or self._last_clean_hidden_1D is None:
            raise RuntimeError(f"no clean row before position {start} (the cache holds {self.cache.length})")
        return self._last_clean_hidden_1D

    def denoise(self, block_ids_1B: Tensor, start: int) -> tuple[Tensor, Tensor | None]:
        _check_ids(block_ids_1B, "block ids")
        return self._run(block_ids_1B, start, append=False), self._last_clean_hidden_1D

    def commit(self, block_ids_1B: Tensor, start: int) -> None:
        _check_ids(block_ids_1B, "block ids")
        hidden_1BD = self._run(block_ids_1B, start, append=True)
        self._last_clean_hidden_1D = hidden_1BD[:, -1]


class RecomputeBlockForward:
    """Sampling forward passes that rebuild ``[noisy block ; clean prefix]`` every step (no cache)."""

    def __init__(self, model: Decoder, block_size: int, window: int | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.model = model
        self.block_size = block_size
        self.window = window
        self.rows_processed = 0
        self._clean_ids_1C = torch.zeros(1, 0, dtype=torch.long)

    def prefill(self, ids_1P: Tensor) -> None:
        _check_ids(ids_1P, "prefill ids")
        if ids_1P.shape[1] % self.block_size:
            raise ValueError(f"prefill needs whole blocks of {self.block_size}, got {ids_1P.shape[1]} tokens")
        self._clean_ids_1C = ids_1P.cpu()

    def _run(self, block_ids_1B: Tensor, start: int) -> Tensor:
        """Hidden states of the rows ``[noisy block ; clean prefix]`` (no noisy rows for an empty block)."""
        num_clean, num_noisy = self._clean_ids_1C.shape[1], block_ids_1B.shape[1]
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
        input_ids_1R = torch.cat((block_ids_1B.cpu(), self._clean_ids_1C), dim=1).to(device)
        attention = DenseMaskAttention(allow_matrix(rows, rows).to(device))
        self.rows_processed += input_ids_1R.shape[1]
        return self.model(input_ids_1R, rows.pos.to(device), attention)

    def clean_row_before(self, start: int) -> Tensor:
        if start < 1:
            raise RuntimeError(f"no clean row before position {start}")
        return self._run(torch.zeros(1, 0, dtype=torch.long), start)[:, -1]

    def denoise(self, block_ids_1B: Tensor, start: int) -> tuple[Tensor, Tensor | None]:
        _check_ids(block_ids_1B, "block ids")
        num_noisy = block_ids_1B.shape[1]
        hidden_1RD = self._run(block_ids_1B, start)
        return hidden_1RD[:, :num_noisy], hidden_1RD[:, -1] if start > 0 else None

    def commit(self, block_ids_1B: Tensor, start: int) -> None:
        _check_ids(block_ids_1B, "block ids")
        if start != self._clean_ids_1C.shape[1]:
            raise RuntimeError(
                f"block starts at {start} but the clean prefix has {self._clean_ids_1C.shape[1]}"
            )
        self._clean_ids_1C = torch.cat((self._clean_ids_1C, block_ids_1B.cpu()), dim=1)
