"""The target model with a per-layer K/V cache, for speculative decoding (objectives.md §7).

``csbp.models.decoder.Decoder`` never holds state: every layer hands its projected, q/k-normed and
rotated ``q, k, v`` of the *current rows* to an ``AttentionFn`` together with its ``layer_index``.
:class:`CachedCausalAttention` is such a callable. It prepends the cached K/V of that layer, attends
causally (new row ``i`` sees every cached row and new rows ``0 … i``) and appends the new rows'
K/V. Cached keys are stored already rotated at their absolute positions, so nothing is recomputed.
:meth:`TargetKVCache.crop` rolls the cache back to a committed length (rejected drafts).

:class:`CachedTarget` runs the target on the next rows of one sequence (positions continue after
the cached ones) and returns, per row, the greedy next token, the logits and the fused features of the
drafter's ``target_layer_ids`` (``csbp.dflash.features`` convention: layer ``i``'s residual output,
before the final norm), counting its forward passes.

Shape legend: ``S`` samples (1 here), ``Hq``/``Hkv`` heads, ``N`` new rows, ``C`` cached rows,
``d`` head dim, ``D`` hidden, ``F`` fused feature width ``K·D``, ``V`` vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from csbp.models.attention_fns import masked_attention
from csbp.models.decoder import Decoder


class TargetKVCache:
    """Per-layer K/V of the positions ``0 … length−1``: ``k, v [S, Hkv, C, d]`` per layer."""

    def __init__(self, num_layers: int) -> None:
        if num_layers < 1:
            raise ValueError(f"TargetKVCache needs num_layers >= 1, got {num_layers}")
        self.keys: list[Tensor | None] = [None] * num_layers
        self.values: list[Tensor | None] = [None] * num_layers

    def layer_length(self, layer_index: int) -> int:
        k = self.keys[layer_index]
        return 0 if k is None else int(k.shape[2])

    @property
    def length(self) -> int:
        """Cached positions; raises if the layers disagree (a forward pass stopped half-way)."""
        lengths = {self.layer_length(i) for i in range(len(self.keys))}
        if len(lengths) != 1:
            raise RuntimeError(f"target KV cache layers hold different lengths {sorted(lengths)}")
        return lengths.pop()

    def append(self, layer_index: int, k_SHNd: Tensor, v_SHNd: Tensor) -> tuple[Tensor, Tensor]:
        """Add ``N`` rows to one layer; return that layer's whole ``(k, v)``."""
        cached_k, cached_v = self.keys[layer_index], self.values[layer_index]
        if cached_k is None or cached_v is None:
            new_k, new_v = k_SHNd, v_SHNd
        else:
            new_k, new_v = torch.cat((cached_k, k_SHNd), dim=2), torch.cat((cached_v, v_SHNd), dim=2)
        self.keys[layer_index], self.values[layer_index] = new_k, new_v
        return new_k, new_v

    def crop(self, length: int) -> None:
        """Keep the first ``length`` positions of every layer."""
        if not 0 <= length <= self.length:
            raise ValueError(f"crop length must be in [0, {self.length}], got {length}")
        self.keys = [None if k is None else k[:, :, :length] for k in self.keys]
        self.values = [None if v is None else v[:, :, :length] for v in self.values]


class CachedCausalAttention:
    """``AttentionFn`` over ``[cached rows ; new rows]``, causal, appending the new rows' K/V."""

    def __init__(self, cache: TargetKVCache) -> None:
        self.cache = cache

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, layer_index: int) -> Tensor:
        num_cached = self.cache.layer_length(layer_index)
        k_all, v_all = self.cache.append(layer_index, k, v)
        num_new = q.shape[2]
        allow_NK = torch.ones(num_new, num_cached + num_new, dtype=torch.bool, device=q.device)
        allow_NK[:, num_cached:] = torch.ones(num_new, num_new, dtype=torch.bool, device=q.device).tril()
        return masked_attention(q, k_all, v_all, allow_NK)


@dataclass(frozen=True)
class TargetPass:
    """One cached target forward: ``next_tokens [N]`` (greedy argmax of each row's logits),
    ``features [N, F]`` (None when no layers are captured) and the rows' ``logits [N, V]`` (what
    speculative *sampling* tempers into the target's distributions)."""

    next_tokens: Tensor
    features: Tensor | None
    logits: Tensor


class CachedTarget:
    """The frozen target continuing one sequence through a :class:`TargetKVCache`.

    Attributes:
        forward_passes: target forwards run so far (the cost that speculative decoding cuts).
    """

    def __init__(self, target: Decoder, layer_ids: Sequence[int] = ()) -> None:
        self.target = target
        self.layer_ids = tuple(int(i) for i in layer_ids)
        bad = [i for i in self.layer_ids if not 0 <= i < target.config.num_layers]
        if bad:
            raise ValueError(
                f"target_layer_ids {bad} are outside the target's layers [0, {target.config.num_layers})"
            )
        self.cache = TargetKVCache(target.config.num_layers)
        self.forward_passes = 0

    @property
    def length(self) -> int:
        return self.cache.length

    def crop(self, length: int) -> None:
        self.cache.crop(length)

    @torch.no_grad()
    def forward(self, tokens_N: Tensor) -> TargetPass:
        """Run rows ``tokens_N`` at positions ``length … length+N−1``; they join the cache."""
        target = self.target
        device = target.embed_tokens.weight.device
        start = self.length
        positions_N = torch.arange(start, start + tokens_N.shape[0], device=device)
        rotary = target.rotary(positions_N)
        attention = CachedCausalAttention(self.cache)
        h_1ND = target.embed(tokens_N.to(device).view(1, -1))
        captured: dict[int, Tensor] = {}
        for layer in target.layers:
            h_1ND = layer(h_1ND, rotary, attention)
            if layer.layer_index in self.layer_ids:
                captured[layer.layer_index] = h_1ND
        logits_NV = target.logits(target.norm(h_1ND))[0]
        self.forward_passes += 1
        features = torch.cat([captured[i] for i in self.layer_ids], dim=-1)[0] if self.layer_ids else None
        return TargetPass(logits_NV.argmax(dim=-1), features, logits_NV)
