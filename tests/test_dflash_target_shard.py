"""The context-sharded online target pass (``csbp.dflash.target_shard``) equals the replicated
capture's rows on every CP rank in float64 (cp=2 and cp=4, GQA target, with and without packed
documents and padding, fused features and the last hidden state of the rank's rows), and moves
exactly the bytes its docstring states over the ``dflash.target`` category (the KL teacher rows'
exchange is tested by tests/test_dflash_teacher_rows.py) (the draft layers' ``attention``
bytes are checked by tests/test_dflash_parallel.py, whose whole-step layouts run this pass by
default)."""

from __future__ import annotations

import pytest
import torch

from csbp.dflash.config import DFlashObjectiveConfig
from csbp.dflash.features import capture_target_features
from csbp.dflash.layouts import context_positions
from csbp.dflash.target_shard import TARGET_CATEGORY, capture_sharded_target_features, sharded_target_bytes
from csbp.dflash.verify import TARGET_CONFIG, DFlashVerifyCase, build_models, make_batch
from csbp.engine.context import ParallelContext, build_parallel_context
from csbp.models.decoder import Decoder
from csbp.parallel.comm import Comm
from csbp.parallel.launch import run_local
from csbp.topology import Topology

LAYER_IDS = (0, 2)


def _worker(rank: int, world: int, cp: int) -> list[tuple[float, float, int, int]]:
    ctx = build_parallel_context(Topology(cp=cp))
    target, _ = build_models(DFlashVerifyCase())
    batch = make_batch(2, 32, seed=3)
    ring = ctx.ring_comm()
    assert ring is not None
    results = []
    for doc_ids in (None, batch.doc_ids):  # one document; two packed documents and padding
        ctx.counter.reset()
        results.append(_compare(ctx, ring, target, batch.input_ids, doc_ids, cp))
    return results


def _compare(
    ctx: ParallelContext, ring: Comm, target: Decoder, input_ids: torch.Tensor, doc_ids: torch.Tensor | None, cp: int
) -> tuple[float, float, int, int]:
    sharded = capture_sharded_target_features(
        target, input_ids, LAYER_IDS, comm=ring, cp=cp, cp_rank=ring.rank, doc_ids_SL=doc_ids,
        with_last_hidden=True,
    )
    full = capture_target_features(target, input_ids, LAYER_IDS, doc_ids_SL=doc_ids, with_last_hidden=True)
    mine = context_positions(32, cp, ring.rank)
    assert sharded.positions is not None and torch.equal(sharded.positions, mine)
    assert sharded.last_hidden is not None and full.last_hidden is not None
    feature_err = float((sharded.features - full.features[:, mine]).abs().max())
    last_err = float((sharded.last_hidden - full.last_hidden[:, mine]).abs().max())
    expected = 2 * sharded_target_bytes(target, 32, cp, num_layers=TARGET_CONFIG.num_layers, element_size=8)
    return feature_err, last_err, ctx.counter.bytes(TARGET_CATEGORY), expected


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("cp", [2, 4])
def test_sharded_capture_equals_replicated_rows(cp: int) -> None:
    assert TARGET_CONFIG.num_kv_heads < TARGET_CONFIG.num_heads  # GQA
    for rank_results in run_local(_worker, cp, (cp,), timeout_s=120):
        for feature_err, last_err, moved, expected in rank_results:
            assert feature_err <= 1e-12 and last_err <= 1e-12, (feature_err, last_err)
            assert moved == expected


def test_target_capture_is_validated() -> None:
    with pytest.raises(ValueError, match="target_capture"):
        DFlashObjectiveConfig(target_capture="everywhere")  # type: ignore[arg-type]
