"""Qwen3/Qwen2/Llama/Mistral-family decoder whose attention is supplied from outside.

The model holds the parameters and the row-local math only (embedding, RMSNorm, q/k/v/o
projections, optional per-head q/k norm, RoPE from explicit positions, SwiGLU MLP, LM head). The
attention itself, i.e. the softmax over keys with whatever mask, layout or distributed transport
applies, is a callable passed to ``forward``; the model contains no mask logic and no collectives.
The same weights therefore run under the dense single-process callables of
``csbp.models.attention_fns`` and under every parallel transport of the engine.

Module names follow Hugging Face (``embed_tokens``, ``layers.{i}.self_attn.q_proj``, ...), so a HF
state dict maps onto ``Decoder.state_dict()`` by stripping the ``model.`` prefix.

Shape legend: ``S`` samples sharing one row layout, ``N`` query rows, ``M`` extra key/value rows,
``D`` hidden size, ``Hq``/``Hkv`` query/key-value heads, ``d`` head dim, ``V`` vocabulary.

Usage::

    model = Decoder(config, dtype=torch.float32, seed=0)
    hidden_SND = model(input_ids_SN, positions_N, CausalAttention())
    logits_SNV = model.logits(hidden_SND)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from csbp.models.config import DecoderConfig
from csbp.models.rope import RotaryTables, rotary_tables


class AttentionFn(Protocol):
    """The attention computation a caller supplies to the decoder.

    ``q [S, Hq, N, d]`` and ``k, v [S, Hkv, Nk, d]`` arrive already projected, q/k-normed and
    rotated; ``Nk == N`` for a plain decoder and ``Nk == M + N`` when a layer was given extra
    key/value rows (the extra rows come first). The callable returns softmax attention with scale
    ``1 / sqrt(d)`` under its own mask, ``[S, Hq, N, d]``, in the dtype of ``q``; query head ``h``
    uses KV head ``h // (Hq // Hkv)``. ``layer_index`` lets stateful transports keep per-layer
    state (e.g. saved statistics or communication buffers).
    """

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, layer_index: int) -> Tensor: ...


def attention_inputs(*tensors: Tensor) -> tuple[Tensor, ...]:
    """``q, k, v`` (and any extra K/V) in one dtype, the one the attention kernel computes from.

    Under ``torch.autocast`` that is the autocast dtype, as torch's own SDPA casts its inputs: the
    q/k norms' float32 weights promote q and k to float32 while v stays bf16, and FlexAttention's
    backward refuses mixed dtypes (a bf16 step on CUDA failed there before this). Outside autocast,
    the widest of the given dtypes. The kernels still accumulate in float32 (csbp.attention.merge).
    """
    device_type = tensors[0].device.type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
    else:
        dtype = tensors[0].dtype
        for tensor in tensors[1:]:
            dtype = torch.promote_types(dtype, tensor.dtype)
    return tuple(t if t.dtype == dtype else t.to(dtype) for t in tensors)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, computed in float32 (float64 for float64
    inputs) and scaled by a learned weight after casting back, as in HF Qwen3/Llama."""

    def __init__(
        self,
        width: int,
        eps: float,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width, dtype=dtype, device=device))

    def forward(self, x: Tensor) -> Tensor:
        compute_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        x_compute = x.to(compute_dtype)
        x_compute = x_compute * torch.rsqrt(x_compute.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x_compute.to(x.dtype)


class MLP(nn.Module):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))``."""

    def __init__(
        self,
        config: DecoderConfig,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        width, inner = config.hidden_size, config.intermediate_size
        factory = {"dtype": dtype, "device": device, "bias": config.mlp_bias}
        self.gate_proj = nn.Linear(width, inner, **factory)
        self.up_proj = nn.Linear(width, inner, **factory)
        self.down_proj = nn.Linear(inner, width, **factory)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """The projections around attention: q/k/v in, optional per-head q/k RMSNorm (before RoPE),
    RoPE, the supplied ``AttentionFn``, and the output projection.

    ``project_query`` and ``project_key_value`` are public so that a drafter can compute context
    K/V with this layer's own ``k_proj``/``k_norm``/``v_proj`` (DFlash "KV injection").
    """

    def __init__(
        self,
        config: DecoderConfig,
        layer_index: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        )
        factory = {"dtype": dtype, "device": device}
        q_width, kv_width = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv_bias = config.has_qkv_bias
        self.q_proj = nn.Linear(config.hidden_size, q_width, bias=qkv_bias, **factory)
        self.k_proj = nn.Linear(config.hidden_size, kv_width, bias=qkv_bias, **factory)
        self.v_proj = nn.Linear(config.hidden_size, kv_width, bias=qkv_bias, **factory)
        self.o_proj = nn.Linear(q_width, config.hidden_size, bias=config.attention_bias, **factory)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype, device=device)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype=dtype, device=device)

    def project_query(self, x_SND: Tensor, rotary: RotaryTables) -> Tensor:
        """``[S, N, D] -> q [S, Hq, N, d]`` (normed and rotated)."""
        q_SNHd = self.q_proj(x_SND).unflatten(-1, (self.num_heads, self.head_dim))
        if self.q_norm is not None:
            q_SNHd = self.q_norm(q_SNHd)
        return rotary.apply(q_SNHd.transpose(1, 2))

    def project_key_value(self, x_SND: Tensor, rotary: RotaryTables) -> tuple[Tensor, Tensor]:
        """``[S, N, D] -> k, v [S, Hkv, N, d]`` (k normed and rotated; v neither)."""
        k_SNHd = self.k_proj(x_SND).unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.k_norm is not None:
            k_SNHd = self.k_norm(k_SNHd)
        v_SNHd = self.v_proj(x_SND).unflatten(-1, (self.num_kv_heads, self.head_dim))
        return rotary.apply(k_SNHd.transpose(1, 2)), v_SNHd.transpose(1, 2)

    def forward(
        self,
        x_SND: Tensor,
        rotary: RotaryTables,
        attention: AttentionFn,
        *,
        kv_extra: Tensor | None = None,
        kv_extra_rotary: RotaryTables | None = None,
    ) -> Tensor:
        """Attention block output ``[S, N, D]`` for the (already input-normed) rows ``x``.

        ``kv_extra [S, M, D]`` are additional key/value input rows (e.g. DFlash context features,
        already normed by the caller). They are projected with this layer's own k/v projections,
        k-norm and ``kv_extra_rotary`` and placed *before* the rows' own keys, so the attention
        callable sees ``Nk = M + N`` keys.
        """
        q_SHNd = self.project_query(x_SND, rotary)
        k_SHNd, v_SHNd = self.project_key_value(x_SND, rotary)
        if kv_extra is not None:
            if kv_extra_rotary is None:
                raise ValueError("kv_extra needs kv_extra_rotary: pass the RoPE tables of the extra rows")
            if kv_extra.dim() != 3 or kv_extra.shape[0] != x_SND.shape[0]:
                raise ValueError(
                    f"kv_extra must be [S, M, D] with S={x_SND.shape[0]}, got {tuple(kv_extra.shape)}"
                )
            k_extra_SHMd, v_extra_SHMd = self.project_key_value(kv_extra, kv_extra_rotary)
            k_SHNd = torch.cat((k_extra_SHMd, k_SHNd), dim=2)
            v_SHNd = torch.cat((v_extra_SHMd, v_SHNd), dim=2)
        q_SHNd, k_SHNd, v_SHNd = attention_inputs(q_SHNd, k_SHNd, v_SHNd)
        out_SHNd = attention(q_SHNd, k_SHNd, v_SHNd, self.layer_index)
        expected = tuple(q_SHNd.shape)
        if tuple(out_SHNd.shape) != expected:
            raise ValueError(
                f"attention callable returned shape {tuple(out_SHNd.shape)} at layer {self.layer_index}, "
                f"expected {expected}"
            )
        return self.o_proj(out_SHNd.transpose(1, 2).flatten(-2).to(x_SND.dtype))


class DecoderLayer(nn.Module):
    """Pre-norm layer: ``h + attn(norm(h))``, then ``h + mlp(norm(h))``."""

    def __init__(
        self,
        config: DecoderConfig,
        layer_index: int,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.self_attn = Attention(config, layer_index, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device
        )
        self.mlp = MLP(config, dtype=dtype, device=device)

    def forward(
        self,
        h_SND: Tensor,
        rotary: RotaryTables,
        attention: AttentionFn,
        *,
        kv_extra: Tensor | None = None,
        kv_extra_rotary: RotaryTables | None = None,
    ) -> Tensor:
        """See ``Attention.forward`` for ``kv_extra``: it is *not* passed through
        ``input_layernorm`` (a DFlash context is normed once, outside the layers)."""
        h_SND = h_SND + self.self_attn(
            self.input_layernorm(h_SND), rotary, attention, kv_extra=kv_extra, kv_extra_rotary=kv_extra_rotary
        )
        return h_SND + self.mlp(self.post_attention_layernorm(h_SND))


class Decoder(nn.Module):
    """Token embedding, ``num_layers`` decoder layers, final RMSNorm, LM head (tied or not).

    ``forward`` returns the final-normed hidden states; ``logits`` applies the LM head separately,
    so objectives can compute a chunked cross-entropy without materialising ``[S, N, V]``.

    Construction draws every weight matrix (and bias) from ``normal(0, 0.02)`` with a CPU
    generator seeded by ``seed`` (identical across devices and dtypes); norm weights start at 1.
    On the ``meta`` device nothing is initialised (used by the checkpoint loader).
    """

    def __init__(
        self,
        config: DecoderConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if dtype not in (torch.float64, torch.float32, torch.bfloat16):
            raise ValueError(f"Decoder dtype must be float64, float32 or bfloat16, got {dtype}")
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, dtype=dtype, device=device) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.lm_head: nn.Linear | None = None
        if not config.tie_embeddings:
            self.lm_head = nn.Linear(
                config.hidden_size, config.vocab_size, bias=False, dtype=dtype, device=device
            )
        if self.embed_tokens.weight.device.type != "meta":
            generator = torch.Generator(device="cpu")
            generator.manual_seed(seed)
            self.init_weights(generator)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator, *, std: float = 0.02) -> None:
        """Re-draw all weights deterministically: matrices and biases ``normal(0, std)`` (no zero
        initialisation anywhere), norm weights 1. Draws on the CPU in float32, in parameter order."""
        params = dict(self.named_parameters())
        for name, value in self.initial_weights(generator, std=std):
            params[name].copy_(value)

    def initial_weights(self, generator: torch.Generator, *, std: float = 0.02) -> Iterator[tuple[str, Tensor]]:
        """``(name, full float32 CPU tensor)`` of every parameter as ``init_weights`` draws it, one at a
        time (a model built on the ``meta`` device and sharded is filled from these)."""
        norm_weights = {id(m.weight) for m in self.modules() if isinstance(m, RMSNorm)}
        for name, param in self.named_parameters():
            if id(param) in norm_weights:
                yield name, torch.ones(param.shape, dtype=torch.float32)
            else:
                yield name, torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=generator)

    @property
    def lm_head_weight(self) -> Tensor:
        """``[V, D]`` output projection (the embedding matrix when tied)."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def embed(self, input_ids: Tensor) -> Tensor:
        """``[S, N]`` token ids -> ``[S, N, D]`` embeddings."""
        return self.embed_tokens(input_ids)

    def rotary(self, positions: Tensor) -> RotaryTables:
        """RoPE tables of this model for ``positions [N]`` or ``[S, N]``."""
        return rotary_tables(
            positions,
            head_dim=self.config.head_dim,
            theta=self.config.rope_theta,
            model_dtype=self.embed_tokens.weight.dtype,
            scaling=self.config.rope_scaling,
        )

    def forward(
        self,
        input_ids: Tensor | None,
        positions: Tensor,
        attention: AttentionFn,
        *,
        input_embeds: Tensor | None = None,
    ) -> Tensor:
        """Final-normed hidden states ``[S, N, D]``.

        Args:
            input_ids: ``[S, N]`` token ids, or None when ``input_embeds`` is given.
            positions: explicit RoPE positions, ``[N]`` (shared by all samples) or ``[S, N]``.
            attention: the ``AttentionFn`` used by every layer.
            input_embeds: ``[S, N, D]`` embeddings to use instead of ``embed(input_ids)``.
        """
        h_SND = self._embed_inputs(input_ids, input_embeds)
        rotary = self._rotary_for(positions, h_SND)
        for layer in self.layers:
            h_SND = layer(h_SND, rotary, attention)
        return self.norm(h_SND)

    def layer_outputs(
        self,
        input_ids: Tensor,
        positions: Tensor,
        attention: AttentionFn,
        layer_ids: Sequence[int],
    ) -> Tensor:
        """Residual-stream outputs of the listed layers, concatenated: ``[S, N, len(layer_ids) * D]``.

        Layer ``i``'s output is HF's ``hidden_states[i + 1]`` (before the final norm; HF applies the
        final norm to its last entry only). Layers after ``max(layer_ids)`` are not run. The
        whole-batch reference that DFlash's per-sample capture
        (``csbp.dflash.features.capture_target_features``) is tested against.
        """
        if not layer_ids:
            raise ValueError("layer_ids must name at least one layer")
        for i in layer_ids:
            if not 0 <= i < self.config.num_layers:
                raise ValueError(f"layer id {i} is outside [0, {self.config.num_layers})")
        h_SND = self._embed_inputs(input_ids, None)
        rotary = self._rotary_for(positions, h_SND)
        captured: dict[int, Tensor] = {}
        for layer in self.layers[: max(layer_ids) + 1]:
            h_SND = layer(h_SND, rotary, attention)
            captured[layer.layer_index] = h_SND
        return torch.cat([captured[i] for i in layer_ids], dim=-1)

    def logits(self, hidden_SND: Tensor) -> Tensor:
        """LM head: ``[..., D] -> [..., V]``."""
        return F.linear(hidden_SND, self.lm_head_weight)

    def _embed_inputs(self, input_ids: Tensor | None, input_embeds: Tensor | None) -> Tensor:
        if (input_ids is None) == (input_embeds is None):
            raise ValueError("pass exactly one of input_ids and input_embeds")
        if input_embeds is not None:
            if input_embeds.dim() != 3 or input_embeds.shape[-1] != self.config.hidden_size:
                raise ValueError(
                    f"input_embeds must be [S, N, {self.config.hidden_size}], got {tuple(input_embeds.shape)}"
                )
            return input_embeds
        assert input_ids is not None
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [S, N], got shape {tuple(input_ids.shape)}")
        return self.embed(input_ids)

    def _rotary_for(self, positions: Tensor, h_SND: Tensor) -> RotaryTables:
        num_samples, num_rows = h_SND.shape[0], h_SND.shape[1]
        if positions.shape not in ((num_rows,), (num_samples, num_rows)):
            raise ValueError(
                f"positions must be [{num_rows}] or [{num_samples}, {num_rows}], got {tuple(positions.shape)}"
            )
        return self.rotary(positions.to(h_SND.device))
