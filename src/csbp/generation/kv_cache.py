"""The clean-prefix KV cache of block-diffusion sampling, attached to the decoder from outside.

The decoder never sees a cache: every layer hands its projected, q/k-normed and rotated
``q, k, v`` of the *current rows* to an ``AttentionFn`` together with its ``layer_index``.
:class:`CachedPrefixAttention` is such a callable: it prepends the cached clean K/V of that layer
(every earlier finished block), attends, and, when asked to, appends the current rows' K/V to the
cache. Cached keys are stored already rotated with their absolute positions, so they are never
recomputed.

Mask (the BD3 inference mask restricted to the rows present): every current row sees every filled
cache slot of its sequence (all of them are clean and lie in earlier blocks) and the current rows of its own or an earlier
block (``block(k) <= block(q)``). For one noisy block that is "the whole clean prefix plus the whole
block, bidirectionally"; for a finished block re-run as clean rows it is the clean block-causal mask
``M_BC``; for a prompt of several clean blocks prefilled at once it is block-causal over them.

With a sliding ``window`` W (a model trained with ``topology.window``) the mask is the windowed
training predicate (``csbp.masks.predicates.bd3_mask``): a noisy row of the block starting at ``s``
sees cached rows ``>= s − (W−1)`` and its whole block; a clean row at ``p`` sees rows
``[p+1−W, p]`` (token-causal inside the window).

Several sequences (the samples of a batch, each with its own prompt) share one cache of ``C`` slots
per layer: each slot holds the K/V of one position of one sequence, and ``slot_positions [S, C]``
says which (-1: an empty slot, where a sequence with a shorter prefix is padded). Attention never
depends on the slots' order, only on their positions, so every sequence appends its rows to the
same new slots whatever its prefix length, and the mask is built per sequence ``[S, N, C + N]``.

Shape legend: ``S`` sequences, ``Hq``/``Hkv`` heads, ``N`` current rows, ``C`` cache slots, ``d`` head dim.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from csbp.models.attention_fns import masked_attention

EMPTY_SLOT = -1


class PrefixKVCache:
    """Per-layer clean K/V ``k, v [S, Hkv, C, d]`` of the finished prefixes, and the position each
    slot holds, ``slot_positions [S, C]`` (:data:`EMPTY_SLOT` where a sequence has none).

    All layers hold the same ``C`` slots once a forward pass that appends has run through every
    layer and its positions were recorded (:meth:`record_positions`).
    """

    def __init__(self, num_layers: int, sequences: int = 1, device: torch.device | str = "cpu") -> None:
        if num_layers < 1:
            raise ValueError(f"PrefixKVCache needs num_layers >= 1, got {num_layers}")
        self.num_layers = num_layers
        self._keys: list[Tensor | None] = [None] * num_layers
        self._values: list[Tensor | None] = [None] * num_layers
        self.slot_positions = torch.full((sequences, 0), EMPTY_SLOT, dtype=torch.long, device=device)

    def layer(self, layer_index: int) -> tuple[Tensor, Tensor] | None:
        """Cached ``(k, v)`` of one layer, or None while the cache is empty."""
        k, v = self._keys[layer_index], self._values[layer_index]
        if k is None or v is None:
            return None
        return k, v

    def append(self, layer_index: int, k_SHNd: Tensor, v_SHNd: Tensor) -> None:
        """Add the clean K/V of ``N`` finished rows per sequence to one layer (new slots)."""
        cached = self.layer(layer_index)
        k_SHNd, v_SHNd = k_SHNd.detach(), v_SHNd.detach()
        if cached is None:
            self._keys[layer_index], self._values[layer_index] = k_SHNd, v_SHNd
        else:
            self._keys[layer_index] = torch.cat((cached[0], k_SHNd), dim=2)
            self._values[layer_index] = torch.cat((cached[1], v_SHNd), dim=2)

    def record_positions(self, positions_SN: Tensor) -> None:
        """The positions of the slots the last appending forward added (one row per sequence)."""
        positions_SN = positions_SN.to(self.slot_positions.device).expand(self.sequences, -1)
        self.slot_positions = torch.cat((self.slot_positions, positions_SN), dim=1)

    @property
    def sequences(self) -> int:
        return int(self.slot_positions.shape[0])

    def layer_length(self, layer_index: int) -> int:
        cached = self.layer(layer_index)
        return 0 if cached is None else int(cached[0].shape[2])

    @property
    def length(self) -> int:
        """Slots ``C``; raises if the layers or the positions disagree (a half-run append)."""
        lengths = {self.layer_length(i) for i in range(self.num_layers)} | {int(self.slot_positions.shape[1])}
        if len(lengths) != 1:
            raise RuntimeError(f"KV cache layers hold different lengths {sorted(lengths)}")
        return lengths.pop()

    def keep(self, indices: Sequence[int]) -> None:
        """Keep only these sequences (in this order) in every layer."""
        index = torch.tensor(list(indices), dtype=torch.long, device=self.slot_positions.device)
        self.slot_positions = self.slot_positions.index_select(0, index)
        for i in range(self.num_layers):
            cached = self.layer(i)
            if cached is not None:
                self._keys[i] = cached[0].index_select(0, index.to(cached[0].device))
                self._values[i] = cached[1].index_select(0, index.to(cached[1].device))

    @classmethod
    def gather(cls, caches: Sequence[PrefixKVCache], sources: Sequence[int]) -> PrefixKVCache:
        """A cache whose sequence ``i`` is the (only) sequence of ``caches[sources[i]]``: one-sequence
        caches of different lengths, empty slots padding the shorter ones at the end."""
        if not caches or any(c.sequences != 1 or c.num_layers != caches[0].num_layers for c in caches):
            raise ValueError("gather takes one-sequence caches with the same number of layers")
        longest = max(c.length for c in caches)
        device = caches[0].slot_positions.device
        index = torch.tensor(list(sources), dtype=torch.long, device=device)
        out = cls(caches[0].num_layers, len(sources), device)
        padded = [
            torch.nn.functional.pad(c.slot_positions, (0, longest - c.length), value=EMPTY_SLOT) for c in caches
        ]
        out.slot_positions = torch.cat(padded).index_select(0, index)
        if longest == 0:
            return out
        for i in range(out.num_layers):
            template = next(c.layer(i) for c in caches if c.layer(i) is not None)[0]
            per_cache = []
            for c in caches:
                cached = c.layer(i)
                kv = (torch.zeros_like(template[:, :, :0]),) * 2 if cached is None else cached
                pad = (0, 0, 0, longest - kv[0].shape[2])
                per_cache.append(tuple(torch.nn.functional.pad(t, pad) for t in kv))
            out._keys[i] = torch.cat([kv[0] for kv in per_cache]).index_select(0, index.to(template.device))
            out._values[i] = torch.cat([kv[1] for kv in per_cache]).index_select(0, index.to(template.device))
        return out


class CachedPrefixAttention:
    """``AttentionFn`` over ``[cached clean prefix ; current rows]``, per sequence.

    Args:
        cache: the clean-prefix cache (read by every call, appended to when ``append``); its slot
            positions are read once, here, before the forward appends anything.
        positions: ``[S, N]`` (or ``[N]``, shared) absolute positions of the current rows; a row sees
            the current rows of its own or an earlier block (token-causal inside the window with a
            window and ``append``) and every filled slot of its sequence (inside the window).
        block_size: the block size ``B`` (block of a position: ``position // B``).
        append: store the current rows' K/V in the cache after attending (a finished block being
            committed, or the prompt being prefilled). Denoising steps pass False.
        window: sliding window ``W`` (module docstring), or None for full attention.
    """

    def __init__(
        self, cache: PrefixKVCache, positions: Tensor, *, block_size: int, append: bool, window: int | None = None
    ) -> None:
        if positions.dim() not in (1, 2) or positions.is_floating_point():
            raise ValueError(f"positions must be an integer tensor [N] or [S, N], got {positions.dtype} {tuple(positions.shape)}")
        if block_size < 1 or (window is not None and window < 1):
            raise ValueError(f"block_size and window must be >= 1, got {block_size} and {window}")
        self.cache = cache
        self.append = append
        slots_SC = cache.slot_positions
        positions_SN = positions.to(slots_SC.device).expand(cache.sequences, -1)  # [N] is shared
        blocks_SN = positions_SN // block_size
        q_pos, k_pos = positions_SN[:, :, None], positions_SN[:, None, :]
        q_block, k_block = blocks_SN[:, :, None], blocks_SN[:, None, :]
        sees_cache_SNC = (slots_SC != EMPTY_SLOT)[:, None, :].expand(-1, positions_SN.shape[1], -1)
        if window is None:
            current_SNN = k_block <= q_block
        else:
            if append:  # clean rows: token-causal inside the window
                first_visible = q_pos + 1 - window
                current_SNN = k_pos <= q_pos
            else:  # noisy rows: the window ends at the block start; the whole own block
                first_visible = q_block * block_size - (window - 1)
                current_SNN = k_block == q_block
            current_SNN = current_SNN & (k_pos >= first_visible)
            sees_cache_SNC = sees_cache_SNC & (slots_SC[:, None, :] >= first_visible)
        self.allow_SNK = torch.cat((sees_cache_SNC, current_SNN), dim=2)  # [S, N, C + N]

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, layer_index: int) -> Tensor:
        if tuple(self.allow_SNK.shape[:2]) != (q.shape[0], q.shape[2]):
            raise ValueError(
                f"CachedPrefixAttention was built for {tuple(self.allow_SNK.shape[:2])} (sequences, rows), "
                f"got {(q.shape[0], q.shape[2])}"
            )
        cached = self.cache.layer(layer_index)
        k_all, v_all = k, v
        if cached is not None:
            k_all = torch.cat((cached[0], k), dim=2)  # [S, Hkv, C + N, d]
            v_all = torch.cat((cached[1], v), dim=2)
        out_SHNd = masked_attention(q, k_all, v_all, self.allow_SNK.to(q.device))
        if self.append:
            self.cache.append(layer_index, k, v)
        return out_SHNd
