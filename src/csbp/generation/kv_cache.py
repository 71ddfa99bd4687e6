"""The clean-prefix KV cache of block-diffusion sampling, attached to the decoder from outside.

The decoder never sees a cache: every layer hands its projected, q/k-normed and rotated
``q, k, v`` of the *current rows* to an ``AttentionFn`` together with its ``layer_index``.
:class:`CachedPrefixAttention` is such a callable: it prepends the cached clean K/V of that layer
(every earlier finished block), attends, and, when asked to, appends the current rows' K/V to the
cache. Cached keys are stored already rotated with their absolute positions, so they are never
recomputed.

Mask (the BD3 inference mask restricted to the rows present): every current row sees every cached
row (all of them are clean and lie in earlier blocks) and the current rows of its own or an earlier
block (``block(k) <= block(q)``). For one noisy block that is "the whole clean prefix plus the whole
block, bidirectionally"; for a finished block re-run as clean rows it is the clean block-causal mask
``M_BC``; for a prompt of several clean blocks prefilled at once it is block-causal over them.

With a sliding ``window`` W (a model trained with ``topology.window``) the mask is the windowed
training predicate (``csbp.masks.predicates.bd3_mask``): a noisy row of the block starting at ``s``
sees cached rows ``>= s − (W−1)`` and its whole block; a clean row at ``p`` sees rows
``[p+1−W, p]`` (token-causal inside the window).

Shape legend: ``S`` samples, ``Hq``/``Hkv`` heads, ``N`` current rows, ``C`` cached rows, ``d`` head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

from csbp.models.attention_fns import masked_attention


class PrefixKVCache:
    """Per-layer clean K/V of the finished prefix: ``k, v [S, Hkv, C, d]`` for every layer.

    All layers always hold the same number of rows ``C`` (the prefix length in tokens) once a
    forward pass that appends has run through every layer.
    """

    def __init__(self, num_layers: int) -> None:
        if num_layers < 1:
            raise ValueError(f"PrefixKVCache needs num_layers >= 1, got {num_layers}")
        self.num_layers = num_layers
        self._keys: list[Tensor | None] = [None] * num_layers
        self._values: list[Tensor | None] = [None] * num_layers

    def layer(self, layer_index: int) -> tuple[Tensor, Tensor] | None:
        """Cached ``(k, v)`` of one layer, or None while the cache is empty."""
        k, v = self._keys[layer_index], self._values[layer_index]
        if k is None or v is None:
            return None
        return k, v

    def append(self, layer_index: int, k_SHNd: Tensor, v_SHNd: Tensor) -> None:
        """Add the clean K/V of ``N`` finished rows (in position order) to one layer."""
        cached = self.layer(layer_index)
        k_SHNd, v_SHNd = k_SHNd.detach(), v_SHNd.detach()
        if cached is None:
            self._keys[layer_index], self._values[layer_index] = k_SHNd, v_SHNd
        else:
            self._keys[layer_index] = torch.cat((cached[0], k_SHNd), dim=2)
            self._values[layer_index] = torch.cat((cached[1], v_SHNd), dim=2)

    def expand(self, sequences: int) -> None:
        """Share the cached prefix of one sequence with ``sequences`` (views, no copies: a prompt
        prefilled once for every sample of a batch)."""
        for i in range(self.num_layers):
            cached = self.layer(i)
            if cached is not None:
                if cached[0].shape[0] != 1:
                    raise RuntimeError(f"only a one-sequence cache expands, layer {i} holds {cached[0].shape[0]}")
                self._keys[i] = cached[0].expand(sequences, -1, -1, -1)
                self._values[i] = cached[1].expand(sequences, -1, -1, -1)

    def keep(self, indices: list[int]) -> None:
        """Keep only these sequences (in this order) in every layer."""
        for i in range(self.num_layers):
            cached = self.layer(i)
            if cached is not None:
                index = torch.tensor(indices, dtype=torch.long, device=cached[0].device)
                self._keys[i] = cached[0].index_select(0, index)
                self._values[i] = cached[1].index_select(0, index)

    def layer_length(self, layer_index: int) -> int:
        cached = self.layer(layer_index)
        return 0 if cached is None else int(cached[0].shape[2])

    @property
    def length(self) -> int:
        """Cached prefix length ``C`` in tokens; raises if the layers disagree (a half-run append)."""
        lengths = {self.layer_length(i) for i in range(self.num_layers)}
        if len(lengths) != 1:
            raise RuntimeError(f"KV cache layers hold different lengths {sorted(lengths)}")
        return lengths.pop()


class CachedPrefixAttention:
    """``AttentionFn`` over ``[cached clean prefix ; current rows]``.

    Args:
        cache: the clean-prefix cache (read by every call, appended to when ``append``).
        row_blocks: ``[N]`` block index of each current row; a row sees current rows of blocks
            ``<=`` its own, and every cached row.
        append: store the current rows' K/V in the cache after attending (a finished block being
            committed, or the prompt being prefilled). Denoising steps pass False.
        window: sliding window ``W`` (module docstring), or None for full attention.
        positions: ``[N]`` absolute positions of the current rows (required with a window).
        block_size: the block size (required with a window).
    """

    def __init__(
        self,
        cache: PrefixKVCache,
        row_blocks: Tensor,
        *,
        append: bool,
        window: int | None = None,
        positions: Tensor | None = None,
        block_size: int | None = None,
    ) -> None:
        if row_blocks.dim() != 1 or row_blocks.is_floating_point():
            raise ValueError(
                f"row_blocks must be a 1-D integer tensor, got {row_blocks.dtype} {tuple(row_blocks.shape)}"
            )
        if window is not None and (window < 1 or positions is None or block_size is None):
            raise ValueError("a sliding window needs window >= 1, the rows' positions and the block size")
        self.cache = cache
        self.append = append
        self.current_allow_NN = row_blocks[None, :] <= row_blocks[:, None]
        self.first_visible_N: Tensor | None = None  # lowest key position each row sees (window only)
        if window is not None:
            assert positions is not None and block_size is not None
            if append:  # clean rows: token-causal inside the window
                self.first_visible_N = positions + 1 - window
                self.current_allow_NN = positions[None, :] <= positions[:, None]
            else:  # noisy rows: the window ends at the block start; the whole own block
                self.first_visible_N = row_blocks * block_size - (window - 1)
                self.current_allow_NN = row_blocks[None, :] == row_blocks[:, None]
            self.current_allow_NN = self.current_allow_NN & (positions[None, :] >= self.first_visible_N[:, None])

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, layer_index: int) -> Tensor:
        num_rows = q.shape[2]
        if self.current_allow_NN.shape[0] != num_rows:
            raise ValueError(
                f"CachedPrefixAttention was built for {self.current_allow_NN.shape[0]} rows, got {num_rows}"
            )
        cached = self.cache.layer(layer_index)
        allow = self.current_allow_NN.to(q.device)
        k_all, v_all = k, v
        if cached is not None:
            k_all = torch.cat((cached[0], k), dim=2)  # [S, Hkv, C + N, d]
            v_all = torch.cat((cached[1], v), dim=2)
            sees_cache_NC = torch.ones(num_rows, cached[0].shape[2], dtype=torch.bool, device=q.device)
            if self.first_visible_N is not None:
                cached_C = torch.arange(cached[0].shape[2], device=q.device)
                sees_cache_NC = cached_C[None, :] >= self.first_visible_N.to(q.device)[:, None]
            allow = torch.cat((sees_cache_NC, allow), dim=1)  # [N, C + N]
        out_SHNd = masked_attention(q, k_all, v_all, allow)
        if self.append:
            self.cache.append(layer_index, k, v)
        return out_SHNd
