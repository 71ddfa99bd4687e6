"""Context-sharded online target pass for DFlash training under CP/CSBP (csbp.md §14).

Each CP ring member embeds and runs the frozen target (under ``no_grad``) only on its own zigzag
context rows ``context_positions(L, cp, cp_rank)`` at their true positions (RoPE), instead of the
full sequence on every rank (``capture_target_features``, the replicated pass). Per layer the
ring's K/V shards are all-gathered once (forward only: the target is frozen) through the counted
``Comm`` (category ``dflash.target``), and the local queries attend to the gathered keys with the
existing local attention plan (``LocalAttentionFn`` with separate key rows, GQA without repeating
K/V). The mask is the interval form of ``csbp.attention.rows``: a query row at position ``p`` is a
clean row with context ``[doc_start(p), p + 1)`` and the keys are the ring's clean rows, which is
exactly the document-causal attention of the replicated pass (plain causal with one document).

The KL teacher (``with_last_hidden``) is the final-normed last hidden state, returned like the
features as the rank's own rows ``[S, M, H]``; the step then sends each ring member only the rows
its supervised draft rows read (``csbp.dflash.teacher_rows``, category ``dflash.teacher``) instead
of all-gathering every shard.

Bytes received (and sent) per rank and sample: ``(cp − 1)·(L/cp)·2·Hkv·d`` per target layer run (K
and V; every layer with ``loss='kl'``, else up to the deepest fused layer). The features come back
as the rank's rows only (``TargetFeatures.positions``), ``[S, L/cp, K·H]``.

Shape legend: ``S`` samples, ``L`` sequence length, ``M`` this rank's context rows, ``H`` hidden
size, ``K`` fused layers, ``Hkv`` KV heads, ``d`` head dim.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from csbp.attention.rows import Rows
from csbp.attention.transports.local import LocalAttentionFn
from csbp.dflash.anchors import segment_starts
from csbp.dflash.features import TargetFeatures, check_capture_args, run_target_layers
from csbp.dflash.layouts import context_positions, context_rows, ring_context_positions
from csbp.models.decoder import Decoder
from csbp.parallel.comm import Comm

TARGET_CATEGORY = "dflash.target"
TARGET_CAPTURES = ("sharded", "replicated")


def causal_query_rows(positions_M: Tensor, doc_starts_L: Tensor) -> Rows:
    """Clean query rows at ``positions_M`` that see the clean keys in ``[doc_start(p), p + 1)``."""
    n = positions_M.shape[0]
    zeros = torch.zeros(n, dtype=torch.long)
    ones = torch.ones(n, dtype=torch.bool)
    positions_M = positions_M.long()
    return Rows(positions_M, ones, zeros, doc_starts_L[positions_M].long(), positions_M + 1, ones)


class RingGatherAttention:
    """The decoder's ``AttentionFn`` for the sharded target pass: all-gather the ring's K/V (one
    collective per layer, K and V stacked), then local attention of this rank's queries over them."""

    def __init__(self, query_rows: Rows, key_rows: Rows, comm: Comm, *, backend: str = "tiles") -> None:
        self.local = LocalAttentionFn(query_rows, num_noisy=0, key_rows=key_rows, backend=backend)
        self.comm = comm

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, layer_index: int = 0) -> Tensor:
        # [1, Hkv, M, d] x2 -> [M, 2, Hkv, d]: gathered along rows in ring order
        kv_M2Hd = torch.stack((k[0], v[0])).permute(2, 0, 1, 3).contiguous()
        gathered, _ = self.comm.all_gather(kv_M2Hd, category=TARGET_CATEGORY)
        kv_2HNd = gathered.permute(1, 2, 0, 3)
        return self.local(q, kv_2HNd[0][None], kv_2HNd[1][None], layer_index)


@torch.no_grad()
def capture_sharded_target_features(
    target: Decoder,
    input_ids_SL: Tensor,
    layer_ids: Sequence[int],
    *,
    comm: Comm,
    cp: int,
    cp_rank: int,
    doc_ids_SL: Tensor | None = None,
    with_last_hidden: bool = False,
    backend: str = "tiles",
) -> TargetFeatures:
    """This rank's rows of ``capture_target_features`` computed by the ring (module docstring):
    ``features [S, M, K·H]`` and ``last_hidden [S, M, H]`` (or None) at ``positions =
    context_positions(L, cp, cp_rank)``. Every ring member must call it together."""
    layer_ids = check_capture_args(target, input_ids_SL, layer_ids)
    seq_len = input_ids_SL.shape[1]
    if comm.size != cp or comm.rank != cp_rank:
        raise ValueError(
            f"sharded target capture: the ring comm has size {comm.size} rank {comm.rank} but the layout has "
            f"cp={cp} cp_rank={cp_rank}; pass the plan's ring_comm"
        )
    device = target.embed_tokens.weight.device
    mine_M = context_positions(seq_len, cp, cp_rank)
    ring_N = ring_context_positions(seq_len, cp)
    keys = context_rows(ring_N)
    rotary = target.rotary(mine_M.to(device))
    stop = target_layers_run(target.config.num_layers, layer_ids, with_last_hidden=with_last_hidden)
    features, last = [], []
    for sample in range(input_ids_SL.shape[0]):
        if doc_ids_SL is None:
            starts_L = torch.zeros(seq_len, dtype=torch.long)
        else:
            starts_L = segment_starts(doc_ids_SL[sample].cpu())
        attention = RingGatherAttention(causal_query_rows(mine_M, starts_L), keys, comm, backend=backend)
        h_1MD = target.embed(input_ids_SL[sample, mine_M.to(input_ids_SL.device)][None].to(device))
        fused_1MF, h_1MD = run_target_layers(target, h_1MD, rotary, attention, layer_ids, stop)
        features.append(fused_1MF)
        if with_last_hidden:
            last.append(target.norm(h_1MD))
    return TargetFeatures(
        torch.cat(features), torch.cat(last) if with_last_hidden else None, layer_ids, positions=mine_M
    )


def sharded_target_bytes(target: Decoder, seq_len: int, cp: int, *, num_layers: int, element_size: int) -> int:
    """Bytes one rank receives in one sample's sharded pass over ``num_layers`` target layers."""
    cfg = target.config
    rows = (cp - 1) * (seq_len // cp)
    return num_layers * rows * 2 * cfg.num_kv_heads * cfg.head_dim * element_size


def target_layers_run(num_layers: int, layer_ids: tuple[int, ...], *, with_last_hidden: bool) -> int:
    """How many target layers a capture runs: all with the KL teacher, else up to the deepest fused one."""
    return num_layers if with_last_hidden else max(layer_ids) + 1
