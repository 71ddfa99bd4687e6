"""Validation under data parallelism equals one process scoring every replica's rows.

``StepRunner.evaluate`` on ``dp = 2`` gloo ranks (each replica its own validation rows and noise)
must give the ``val_loss`` and unclipped NELBO of one process that reads both replicas' rows in one
micro-batch and corrupts replica ``d``'s half with replica ``d``'s generator: the cross-entropy sums
and the denominators are both summed over the replicas. A mutation audit found the denominators'
sum unguarded (each replica dividing the global sum by its own count doubles ``val_loss`` at
``dp = 2``); float64, tolerance 1e-12 relative.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from csbp.data.artifact import open_artifact
from csbp.engine.block_diffusion import build_rank_plan
from csbp.engine.context import build_parallel_context, single_process_context
from csbp.engine.verify import tiny_model_config
from csbp.models.decoder import Decoder
from csbp.objectives import build_objective
from csbp.objectives.base import corruption_generator
from csbp.parallel.launch import run_local
from csbp.topology import Topology
from csbp.training.step import StepRunner
from test_training_run import make_artifact

SEQ_LEN, BLOCK, ROWS, BATCHES, SEED = 32, 4, 2, 2, 5


def _runner(artifact: Path, topology: Topology) -> StepRunner:
    data = open_artifact(artifact)
    ctx = single_process_context() if topology.world_size == 1 else build_parallel_context(topology)
    model = Decoder(replace(tiny_model_config(), vocab_size=data.vocab_size), dtype=torch.float64, seed=0)
    objective = build_objective("bd3", mask_token_id=data.mask_token_id, block_size=BLOCK)
    return StepRunner(
        model, objective, build_rank_plan(ctx, SEQ_LEN, BLOCK), ctx,
        device=torch.device("cpu"), precision="fp64", seed=SEED, ce_chunk_rows=64,
    )


def _replica_worker(rank: int, world: int, artifact: str) -> tuple[float, float]:
    runner = _runner(Path(artifact), Topology(dp=2))
    result = runner.evaluate(open_artifact(artifact).split("val"), micro_batch_size=ROWS, num_batches=BATCHES)
    return result.loss, result.metrics["nelbo"]


def _one_process_over_both_replicas(artifact: Path) -> tuple[float, float]:
    """Micro-batches of ``2 * ROWS`` rows (both replicas' shards, consecutive), half ``d`` corrupted
    with replica ``d``'s generator; the two halves' corrupted rows concatenated."""
    runner = _runner(artifact, Topology())

    def both_replicas(batch, step, micro_step, objective=None):  # type: ignore[no-untyped-def]
        halves = [
            (objective or runner.objective).corrupt(
                {name: value[d * ROWS : (d + 1) * ROWS] for name, value in batch.items()},
                corruption_generator(SEED, step, d, micro_step=micro_step),
            )
            for d in range(2)
        ]
        fields = {name: torch.cat([getattr(half, name) for half in halves])
                  for name in ("noisy_ids", "clean_ids", "labels", "weights", "doc_ids", "noise_levels")}
        return replace(halves[0], **fields, loss_normaliser=sum(half.loss_normaliser for half in halves))

    runner._corrupt_on_host = both_replicas  # type: ignore[method-assign]
    result = runner.evaluate(open_artifact(artifact).split("val"), micro_batch_size=2 * ROWS, num_batches=BATCHES)
    return result.loss, result.metrics["nelbo"]


@pytest.mark.multiprocess
def test_dp2_validation_equals_one_process_over_both_replicas_rows(tmp_path: Path) -> None:
    artifact = make_artifact(tmp_path / "art", seq_len=SEQ_LEN)
    expected_loss, expected_nelbo = _one_process_over_both_replicas(artifact)
    for loss, nelbo in run_local(_replica_worker, 2, (str(artifact),), timeout_s=120):
        assert loss == pytest.approx(expected_loss, rel=1e-12)
        assert nelbo == pytest.approx(expected_nelbo, rel=1e-12)
