"""Validation and the noise-window search on several ranks equal one process.

``StepRunner.evaluate`` (``val_loss`` and the unclipped NELBO) and ``search_clip_window`` (every
candidate window's summed loss variance and the window chosen, ``objective.clip_search_widths``) on 2
gloo ranks must give what one process gives:

* ``dp = 2``: each replica scores its own validation rows with its own noise; the one process reads
  both replicas' rows in one micro-batch and corrupts replica ``d``'s half with replica ``d``'s
  generator. Cross-entropy sums, denominators and the variance's ``(Σx, Σx², n)`` are all summed over
  the replicas (a mutation audit found the denominators' sum unguarded: each replica dividing the
  global sum by its own count doubles ``val_loss`` at ``dp = 2``).
* CSBP ``cp = 2, bp = 2``: each rank owns whole noisy blocks; the blocks' losses are summed over the
  replica's ranks before their variance is taken. Also with packed documents (each sample its own plan).
* CSBP with ``objective.resample`` on a clipped window (:mod:`csbp.objectives.window_resample`): the
  redraws consume the generator, and every rank of a replica must still draw the same corruption.
* BP-only with the clean prefix replicated on every rank (``replicate_clean_prefix``), and CP-only
  under a sliding window with the streaming transport: every noisy row is still scored on exactly one
  rank (a replicated clean row is never scored), so the replica's sums count each block once.

Float64; tolerance 1e-12 relative (only the summation order differs).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from csbp.data.artifact import open_artifact
from csbp.engine.block_diffusion import DocumentPlanner, build_rank_plan
from csbp.engine.context import build_parallel_context, single_process_context
from csbp.engine.verify import tiny_model_config
from csbp.models.decoder import Decoder
from csbp.objectives import build_objective
from csbp.objectives.base import corruption_generator
from csbp.parallel.launch import run_local
from csbp.topology import Topology
from csbp.training.clip_search import clip_candidates, search_clip_window
from csbp.training.step import StepRunner
from test_training_run import make_artifact

SEQ_LEN, BLOCK, ROWS, BATCHES, SEED = 32, 4, 2, 2, 5
CANDIDATES = clip_candidates([0.5, 0.9], 0.25, (1e-3, 1.0))
LAYOUTS = {
    "dp2": {"dp": 2}, "csbp-cp2bp2": {"cp": 2, "bp": 2}, "csbp-cp2bp2-docs": {"cp": 2, "bp": 2, "docs": True},
    "csbp-cp2bp2-resample": {"cp": 2, "bp": 2, "resample": (0.3, 0.8)},
    "bp2-replicated-prefix": {"bp": 2, "replicate_clean_prefix": True},
    "cp2-window-streaming": {"cp": 2, "window": 8, "transport": "streaming"},
}
PLAN_OPTIONS = ("docs", "window", "transport", "resample")  # not topology fields: how the plan and noise are built


def _runner(artifact: Path, layout: dict) -> StepRunner:
    data = open_artifact(artifact)
    topology = Topology(**{name: value for name, value in layout.items() if name not in PLAN_OPTIONS})
    ctx = single_process_context() if topology.world_size == 1 else build_parallel_context(topology)
    model = Decoder(replace(tiny_model_config(), vocab_size=data.vocab_size), dtype=torch.float64, seed=0)
    resample = {"resample": True, "t_min": layout["resample"][0], "t_max": layout["resample"][1]} if "resample" in layout else {}
    objective = build_objective("bd3", mask_token_id=data.mask_token_id, block_size=BLOCK, **resample)
    # packed documents: every sample its own plan (rank_block_losses runs them one by one)
    options = {name: layout[name] for name in ("window", "transport") if name in layout}
    plan = (DocumentPlanner(ctx, SEQ_LEN, BLOCK, **options) if layout.get("docs")
            else build_rank_plan(ctx, SEQ_LEN, BLOCK, **options))
    return StepRunner(
        model, objective, plan, ctx, device=torch.device("cpu"), precision="fp64", seed=SEED, ce_chunk_rows=64,
    )


def _scores(runner: StepRunner, artifact: Path, rows: int) -> tuple[float, float, tuple, dict]:
    split = open_artifact(artifact).split("val")
    result = runner.evaluate(split, micro_batch_size=rows, num_batches=BATCHES)
    search = search_clip_window(runner, split, micro_batch_size=rows, num_batches=BATCHES, candidates=CANDIDATES)
    return result.loss, result.metrics["nelbo"], search.window, search.variances


def _layout_worker(rank: int, world: int, artifact: str, layout: dict) -> tuple[float, float, tuple, dict]:
    return _scores(_runner(Path(artifact), layout), Path(artifact), ROWS)


def _one_process(artifact: Path, layout: dict) -> tuple[float, float, tuple, dict]:
    """Micro-batches of ``dp * ROWS`` rows (every replica's shard, consecutive), shard ``d`` corrupted
    with replica ``d``'s generator and the shards' corrupted rows concatenated; the layout's window."""
    dp = layout.get("dp", 1)
    runner = _runner(artifact, {name: layout[name] for name in ("docs", "window", "resample") if name in layout})

    def every_replica(batch, step, micro_step, objective=None):  # type: ignore[no-untyped-def]
        shards = [
            (objective or runner.objective).corrupt(
                {name: value[d * ROWS : (d + 1) * ROWS] for name, value in batch.items()},
                corruption_generator(SEED, step, d, micro_step=micro_step),
            )
            for d in range(dp)
        ]
        fields = {name: torch.cat([getattr(shard, name) for shard in shards])
                  for name in ("noisy_ids", "clean_ids", "labels", "weights", "doc_ids", "noise_levels")}
        return replace(shards[0], **fields, loss_normaliser=sum(shard.loss_normaliser for shard in shards))

    runner._corrupt_on_host = every_replica  # type: ignore[method-assign]
    return _scores(runner, artifact, dp * ROWS)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_artifact(tmp_path_factory.mktemp("data") / "art", seq_len=SEQ_LEN)


@pytest.mark.multiprocess
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_validation_and_the_window_search_equal_one_process(artifact: Path, name: str) -> None:
    layout = LAYOUTS[name]
    loss, nelbo, window, variances = _one_process(artifact, layout)
    assert len(set(variances.values())) == len(CANDIDATES)  # distinct: the choice is not a tie
    for got in run_local(_layout_worker, 2, (str(artifact), layout), timeout_s=120):
        assert got[0] == pytest.approx(loss, rel=1e-12)
        assert got[1] == pytest.approx(nelbo, rel=1e-12)
        assert got[2] == window
        assert got[3].keys() == variances.keys()
        assert all(got[3][w] == pytest.approx(v, rel=1e-12) for w, v in variances.items())
