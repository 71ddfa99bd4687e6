"""The DFlash / DFlash2 drafter: a few Qwen3-style layers whose attention reads context K/V injected
from fused target features (objectives.md §5.2, §6).

::

    C = hidden_norm(fc(F))                                  # F [M, K·H] target features; per context row
    per layer (block rows h, positions pos_blk; context positions pos_ctx):
        u = input_layernorm(h)                              # [DFlash2: u = conv(u, κ_in)]
        q = RoPE(q_norm(W_q u), pos_blk)
        k = RoPE(k_norm(W_k [C ; u]), [pos_ctx ; pos_blk])  # the layer's OWN W_k, k_norm
        v = W_v [C ; u]                                     # the layer's OWN W_v
        h = h + W_o Attention(q, k, v)                      # [DFlash2: conv(·, κ_out)]
        h = h + MLP(post_attention_layernorm(h))            # [DFlash2: conv around the MLP too]
    hidden = norm(h)

The token embedding and LM head are the **target's**, frozen and held by reference (not registered
as parameters, not saved); ``attach_target`` sets them. The attention is supplied from outside
(``csbp.dflash.attention``), so the same weights run under the dense references, the inference
path and the sharded training transport.

Inference keeps a ``DraftContextCache`` of context K/V per layer: each round appends the K/V of the
newly verified positions and ``crop`` drops positions that were rejected (objectives.md §7).

Shape legend: ``S`` samples, ``N`` block rows (whole blocks), ``M`` context rows, ``F`` feature
width ``K·H``, ``D`` hidden, ``Hq``/``Hkv`` heads, ``d`` head dim, ``V`` vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from csbp.dflash.attention import DraftAttentionFn
from csbp.dflash.config import DFlashConfig, validate_drafter_target
from csbp.dflash.dflash2 import CandidateSelector, DynamicBlockConv, block_conv
from csbp.models.decoder import MLP, Attention, Decoder, RMSNorm, attention_inputs
from csbp.models.rope import RotaryTables, rotary_tables


@dataclass
class DraftContextCache:
    """Context K/V of every draft layer for inference: ``keys[i], values[i] [S, Hkv, M, d]`` and the
    cached positions ``[M]``."""

    keys: list[Tensor] = field(default_factory=list)
    values: list[Tensor] = field(default_factory=list)
    positions: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))

    def __len__(self) -> int:
        return int(self.positions.shape[0])

    def crop(self, length: int) -> None:
        """Keep the first ``length`` cached context rows."""
        if not 0 <= length <= len(self):
            raise ValueError(f"crop length must be in [0, {len(self)}], got {length}")
        self.keys = [k[:, :, :length] for k in self.keys]
        self.values = [v[:, :, :length] for v in self.values]
        self.positions = self.positions[:length]


class DFlashLayer(nn.Module):
    """One draft layer (HF Qwen3 module names; optional DFlash2 convolutions)."""

    def __init__(
        self, config: DFlashConfig, layer_index: int, *, dtype: torch.dtype, device: torch.device | str | None
    ) -> None:
        super().__init__()
        decoder_config = config.decoder_config()
        self.layer_index = layer_index
        self.block_size = config.block_size
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.self_attn = Attention(decoder_config, layer_index, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device
        )
        self.mlp = MLP(decoder_config, dtype=dtype, device=device)
        self.attn_conv: DynamicBlockConv | None = None
        self.mlp_conv: DynamicBlockConv | None = None
        if config.conv_kernel_size > 0:
            options = {"kernel_size": config.conv_kernel_size, "group_size": config.conv_group_size}
            self.attn_conv = DynamicBlockConv(config.hidden_size, **options, dtype=dtype, device=device)
            self.mlp_conv = DynamicBlockConv(config.hidden_size, **options, dtype=dtype, device=device)

    def context_key_value(self, context_SMD: Tensor, rotary: RotaryTables) -> tuple[Tensor, Tensor]:
        """Context K/V ``[S, Hkv, M, d]`` from the fused, normed context with this layer's own k/v."""
        return self.self_attn.project_key_value(context_SMD, rotary)

    def forward(
        self,
        h_SND: Tensor,
        rotary: RotaryTables,
        k_ctx: Tensor,
        v_ctx: Tensor,
        attention: DraftAttentionFn,
    ) -> Tensor:
        u_SND = self.input_layernorm(h_SND)
        h_SND = h_SND + self._wrapped(
            self.attn_conv, u_SND, lambda x: self._attend(x, rotary, k_ctx, v_ctx, attention)
        )
        u_SND = self.post_attention_layernorm(h_SND)
        return h_SND + self._wrapped(self.mlp_conv, u_SND, self.mlp)

    def _attend(
        self, x_SND: Tensor, rotary: RotaryTables, k_ctx: Tensor, v_ctx: Tensor, attention: DraftAttentionFn
    ) -> Tensor:
        attn = self.self_attn
        q_SHNd = attn.project_query(x_SND, rotary)
        k_SHNd, v_SHNd = attn.project_key_value(x_SND, rotary)
        q_SHNd, k_ctx, v_ctx, k_SHNd, v_SHNd = attention_inputs(q_SHNd, k_ctx, v_ctx, k_SHNd, v_SHNd)
        out_SHNd = attention(q_SHNd, k_ctx, v_ctx, k_SHNd, v_SHNd, self.layer_index)
        return attn.o_proj(out_SHNd.transpose(1, 2).flatten(-2).to(x_SND.dtype))

    def _wrapped(
        self, conv: DynamicBlockConv | None, u_SND: Tensor, sublayer: Callable[[Tensor], Tensor]
    ) -> Tensor:
        if conv is None:
            return sublayer(u_SND)
        kappa_in, kappa_out = conv.kernels(u_SND)
        inner = sublayer(block_conv(u_SND, kappa_in, self.block_size))
        return block_conv(inner, kappa_out, self.block_size)


class DFlashDrafter(nn.Module):
    """Drafter parameters (``fc``, ``hidden_norm``, ``layers``, ``norm``; DFlash2: convolutions inside
    the layers and ``selector``) plus a by-reference handle on the frozen target.

    Construction draws every matrix from ``normal(0, 0.02)`` with a CPU generator seeded by ``seed``
    in parameter order (DFlash2 convolutions start at identity and ``selector.cand_embed`` at 0, so
    a fresh DFlash2 drafter computes exactly what the DFlash drafter with the same seed computes).
    """

    def __init__(
        self,
        config: DFlashConfig,
        *,
        target: Decoder | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.config = config
        self.fc = nn.Linear(config.feature_width, config.hidden_size, bias=False, dtype=dtype, device=device)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.layers = nn.ModuleList(
            DFlashLayer(config, i, dtype=dtype, device=device) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.selector: CandidateSelector | None = None
        if config.selector_rank > 0:
            self.selector = CandidateSelector(
                config.vocab_size,
                config.hidden_size,
                rank=config.selector_rank,
                top_k=config.selector_top_k,
                dtype=dtype,
                device=device,
            )
        self._target: Decoder | None = None
        if self.fc.weight.device.type != "meta":
            self.init_weights(seed)
        if target is not None:
            self.attach_target(target)

    @torch.no_grad()
    def init_weights(self, seed: int, *, std: float = 0.02) -> None:
        """Deterministic initialisation (see the class docstring)."""
        generator = torch.Generator(device="cpu").manual_seed(seed)
        extras = [m for m in self.modules() if isinstance(m, (DynamicBlockConv, CandidateSelector))]
        extra_params = {id(p) for m in extras for p in m.parameters()}
        norms = {id(m.weight) for m in self.modules() if isinstance(m, RMSNorm)}
        for param in self.parameters():
            if id(param) in extra_params:
                continue
            if id(param) in norms:
                param.fill_(1.0)
            else:
                param.copy_(
                    torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=generator)
                )
        extra_generator = torch.Generator(device="cpu").manual_seed(seed + 1)
        for module in extras:
            if isinstance(module, CandidateSelector):
                module.reset_parameters(extra_generator, std=std)
            else:
                module.reset_parameters()

    # ---- the frozen target (held by reference) --------------------------------------------------

    def attach_target(self, target: Decoder) -> None:
        """Share ``target``'s embedding and LM head (frozen: ``requires_grad_(False)`` on the target)."""
        validate_drafter_target(self.config, target.config)
        target.requires_grad_(False)
        object.__setattr__(self, "_target", target)  # not a submodule: never trained, moved or saved

    @property
    def target(self) -> Decoder:
        if self._target is None:
            raise ValueError("the drafter has no target: call attach_target(target) first")
        return self._target

    @property
    def lm_head_weight(self) -> Tensor:
        """``[V, D]`` the target's (frozen) LM head."""
        return self.target.lm_head_weight

    def embed(self, input_ids: Tensor) -> Tensor:
        """Block token ids ``[S, N]`` -> embeddings ``[S, N, D]`` with the target's embedding."""
        return self.target.embed(input_ids)

    def block_input_ids(self, anchor_tokens: Tensor, keep: Tensor | None = None) -> Tensor:
        """``[..., n] -> [..., n·B]``: ``[x_a, M, …, M]`` per block (``[M] × B`` for dead blocks)."""
        block_size, mask = self.config.block_size, self.config.mask_token_id
        ids = torch.full(
            (*anchor_tokens.shape, block_size), mask, dtype=torch.long, device=anchor_tokens.device
        )
        first = anchor_tokens if keep is None else torch.where(keep, anchor_tokens, mask)
        ids[..., 0] = first
        return ids.flatten(-2)

    # ---- forward -------------------------------------------------------------------------------

    def rotary(self, positions: Tensor) -> RotaryTables:
        return rotary_tables(
            positions,
            head_dim=self.config.head_dim,
            theta=self.config.rope_theta,
            model_dtype=self.fc.weight.dtype,
            scaling=self.config.rope_scaling,
        )

    def fuse_context(self, features_SMF: Tensor) -> Tensor:
        """``C = hidden_norm(fc(F))`` ``[S, M, D]``."""
        if features_SMF.shape[-1] != self.config.feature_width:
            raise ValueError(
                f"context features have width {features_SMF.shape[-1]}, the drafter fuses "
                f"{len(self.config.target_layer_ids or ())} target layers of {self.config.hidden_size} "
                f"= {self.config.feature_width}"
            )
        return self.hidden_norm(self.fc(features_SMF.to(self.fc.weight.dtype)))

    def forward(
        self,
        block_embeds_SND: Tensor,
        block_positions_N: Tensor,
        context_features_SMF: Tensor,
        context_positions_M: Tensor,
        attention: DraftAttentionFn,
        *,
        live_rows_N: Tensor | None = None,
        cache: DraftContextCache | None = None,
    ) -> Tensor:
        """Final-normed hidden states ``[S, N, D]`` of the block rows.

        ``live_rows_N`` zeroes the rows of dead anchors (finite zeros). With ``cache`` the new
        context rows are appended to it and the attention sees every cached context row.
        """
        if block_embeds_SND.shape[1] % self.config.block_size != 0:
            raise ValueError(
                f"block rows ({block_embeds_SND.shape[1]}) must be whole blocks of "
                f"block_size={self.config.block_size}"
            )
        context_SMD = self.fuse_context(context_features_SMF)
        rotary_blk = self.rotary(block_positions_N.to(block_embeds_SND.device))
        rotary_ctx = self.rotary(context_positions_M.to(block_embeds_SND.device))
        h_SND = block_embeds_SND.to(self.fc.weight.dtype)
        for layer in self.layers:
            k_ctx, v_ctx = layer.context_key_value(context_SMD, rotary_ctx)
            if cache is not None:
                k_ctx, v_ctx = self._extend_cache(cache, layer.layer_index, k_ctx, v_ctx)
            h_SND = layer(h_SND, rotary_blk, k_ctx, v_ctx, attention)
        if cache is not None:
            cache.positions = torch.cat([cache.positions, context_positions_M.cpu().long()])
        hidden_SND = self.norm(h_SND)
        if live_rows_N is not None:
            hidden_SND = torch.where(live_rows_N.to(hidden_SND.device)[:, None], hidden_SND, 0.0)
        return hidden_SND

    @staticmethod
    def _extend_cache(
        cache: DraftContextCache, index: int, k_ctx: Tensor, v_ctx: Tensor
    ) -> tuple[Tensor, Tensor]:
        if index == len(cache.keys):
            cache.keys.append(k_ctx)
            cache.values.append(v_ctx)
        else:
            cache.keys[index] = torch.cat([cache.keys[index], k_ctx], dim=2)
            cache.values[index] = torch.cat([cache.values[index], v_ctx], dim=2)
        return cache.keys[index], cache.values[index]

    def logits(self, hidden: Tensor) -> Tensor:
        """The target's LM head on draft hidden states ``[..., D] -> [..., V]``."""
        return hidden @ self.lm_head_weight.t()
