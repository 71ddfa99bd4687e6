"""Multi-process training on gloo: exact resume with 2 BP-only ranks, resuming onto another
topology, FSDP2 through the ``csbp train`` launcher (torch elastic), and a failing rank.

To keep process start-up (importing torch per process) off the critical path, one pair of gloo
processes runs several trainings in a row (``run_local``); the launcher is exercised by two
``launch_training`` calls (FSDP, failure).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch.distributed as dist

from csbp.data import PackedLoader, open_artifact
from csbp.data.artifact import content_fingerprint
from csbp.data.prepare_manifest import write_manifest
from csbp.gpu.flops import bd3_step_flops
from csbp.parallel.launch import run_local
from csbp.training import TrainingFailed, launch_training, train
from csbp.training.checkpoint_integrity import checkpoint_problem
from csbp.training.metrics import read_metrics
from csbp.training.preflight import check_run
from test_training_run import make_artifact, metric_rows, tiny_config, trajectory

pytestmark = pytest.mark.multiprocess

BP_ONLY = {"topology.bp": 2, "topology.replicate_clean_prefix": True}
CSBP_STREAMING = {"topology.cp": 2, "topology.bp": 2, "topology.transport": "streaming", "data.document_mask": True}
DATA_PARALLEL = {"topology.dp": 2, "train.micro_batch_size": 1, "train.eval_every": 0, "train.save_every": 0}


def _two_rank_runs(rank: int, world: int, artifact: Path, root: Path) -> dict[str, Any] | None:
    """On 2 gloo ranks: BP-only uninterrupted, BP-only to step 2 (kept as a copy), its resume, CSBP
    (streaming ring, packed documents) uninterrupted and resumed at step 3, and a 3-step dp=2 run (the
    FSDP reference)."""
    train(tiny_config(artifact, **BP_ONLY), run_dir=root / "bp_full")
    train(tiny_config(artifact, **CSBP_STREAMING), run_dir=root / "csbp_full")
    train(tiny_config(artifact, **CSBP_STREAMING), run_dir=root / "csbp_half", max_steps=3)
    train(tiny_config(artifact, **CSBP_STREAMING), run_dir=root / "csbp_half", resume=True)
    train(tiny_config(artifact, **BP_ONLY), run_dir=root / "bp_half", max_steps=2)
    if rank == 0:
        shutil.copytree(root / "bp_half", root / "bp_step2")
    dist.barrier()
    resumed = train(tiny_config(artifact, **BP_ONLY), run_dir=root / "bp_half", resume=True)
    data_parallel = train(tiny_config(artifact, **DATA_PARALLEL), run_dir=root / "dp", max_steps=3)
    if rank != 0:
        return None
    return {"resumed_start": resumed.start_step, "dp_losses": data_parallel.losses}


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_artifact(tmp_path_factory.mktemp("data") / "art")


@pytest.fixture(scope="module")
def two_rank_runs(artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    root = tmp_path_factory.mktemp("mp")
    result = run_local(_two_rank_runs, 2, (artifact, root), timeout_s=240)[0]
    return root, result


def test_two_rank_resume_is_bit_identical(two_rank_runs: tuple[Path, dict[str, Any]]) -> None:
    root, result = two_rank_runs
    assert result["resumed_start"] == 2
    full = trajectory(root / "bp_full")
    assert [row[0] for row in full] == [0, 1, 2, 3, 4]  # step 0: the untrained model's validation
    assert trajectory(root / "bp_half") == full  # float32 CPU, 2 processes: exact equality


def test_two_rank_csbp_resume_between_validations_is_bit_identical(two_rank_runs: tuple[Path, dict[str, Any]]) -> None:
    """CSBP over the streaming ring with packed documents, stopped at step 3 (validation runs every 2
    steps): the resumed steps repeat the uninterrupted run bit for bit, and so do the exported weights.
    The stopped invocation's own validation at step 3 is the one extra number."""
    root, _ = two_rank_runs
    full, resumed = trajectory(root / "csbp_full"), trajectory(root / "csbp_half")
    assert [row[0] for row in full] == [0, 1, 2, 3, 4] and full[3][4] is None and resumed[3][4] is not None
    assert resumed[:3] + [resumed[3][:4] + (None,)] + resumed[4:] == full
    weights = "final/model.safetensors"
    assert (root / "csbp_half" / weights).read_bytes() == (root / "csbp_full" / weights).read_bytes()


def test_bp_only_matches_one_process_and_resumes_onto_it(
    two_rank_runs: tuple[Path, dict[str, Any]], artifact: Path, tmp_path: Path
) -> None:
    root, _ = two_rank_runs
    bp_losses = [row[1] for row in trajectory(root / "bp_full") if row[0] > 0]
    single = train(tiny_config(artifact), run_dir=tmp_path / "single")
    assert single.losses == pytest.approx(bp_losses, rel=1e-5)
    # A checkpoint written by 2 BP ranks resumes on one process (another topology).
    resumed = train(tiny_config(artifact), run_dir=root / "bp_step2", resume=True)
    assert resumed.losses == pytest.approx(bp_losses[2:], rel=1e-5)


def test_the_logged_rate_counts_the_flops_of_every_replica(
    two_rank_runs: tuple[Path, dict[str, Any]], artifact: Path
) -> None:
    """dp=2: each replica counts its own batches and the step sums them over dp in the reduction of the
    loss's denominator; one replica's count alone would log half the rate."""
    root, _ = two_rank_runs
    cfg = tiny_config(artifact, **DATA_PARALLEL)
    config = check_run(cfg, check_device=False).decoder_config
    samples = cfg.topology.dp * cfg.train.micro_batch_size * cfg.train.grad_accum
    expected = bd3_step_flops(config, seq_len=cfg.data.seq_len, block_size=cfg.objective.block_size, samples=samples)
    rows = [r for r in metric_rows(root / "dp") if r.get("loss") is not None]
    assert len(rows) == 3
    for row in rows:
        seconds = samples * cfg.data.seq_len / row["tokens_per_s"]
        assert row["tflops_per_device"] * 1e12 * cfg.world_size * seconds == pytest.approx(expected, rel=1e-9)


def test_tokens_per_s_counts_every_data_parallel_replica(two_rank_runs: tuple[Path, dict[str, Any]]) -> None:
    """A dp=2 step trains dp 2 x micro_batch_size 1 x grad_accum 2 x seq_len 32 = 128 tokens in its
    step time, which lies between two records' ``elapsed_s``: tokens_per_s x that gap is at least 128
    (a mutant counting one replica's 64 tokens passed)."""
    root, _ = two_rank_runs
    rows = read_metrics(root / "dp" / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3]
    elapsed = [0.0] + [row["elapsed_s"] for row in rows]
    for row, before, after in zip(rows, elapsed, elapsed[1:]):
        assert row["tokens_per_s"] * (after - before) >= 128 * (1 - 1e-9)


def test_fsdp_through_the_launcher_matches_plain_data_parallel(
    two_rank_runs: tuple[Path, dict[str, Any]], artifact: Path, tmp_path: Path
) -> None:
    _, result = two_rank_runs
    cfg = tiny_config(artifact, **DATA_PARALLEL, **{"train.fsdp": True})
    summary = launch_training(cfg, run_dir=tmp_path / "fsdp", max_steps=3)
    assert summary is not None and summary.end_step == 3
    assert summary.losses == pytest.approx(result["dp_losses"], rel=1e-5)
    assert (tmp_path / "fsdp" / "final" / "model.safetensors").is_file()
    assert (tmp_path / "fsdp" / "checkpoints" / "latest").read_text().strip() == "step_0000003"


def poison_rank1_row(artifact: Path, target: Path) -> Path:
    """A copy of ``artifact`` whose row read first by dp rank 1 (of 2) holds a supervised mask token,
    which MDLM rejects: rank 1 raises while rank 0 waits in the step's first collective."""
    shutil.copytree(artifact, target)
    opened = open_artifact(target)
    split = opened.split("train")
    row = int(next(PackedLoader(split, batch_size=1, seed=0, dp_rank=1, dp_size=2))["row_ids"][0])
    shape = (split.num_rows, opened.seq_len)
    tokens = np.memmap(target / "train.tokens.bin", dtype="<u4", mode="r+", shape=shape)
    loss_mask = np.memmap(target / "train.loss_mask.bin", dtype="u1", mode="r+", shape=shape)
    tokens[row, 3], loss_mask[row, 3] = opened.mask_token_id, 1
    tokens.flush()
    loss_mask.flush()
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["content_fingerprint"] = content_fingerprint(target)  # vouch for the edit
    write_manifest(target, manifest)
    return target


def test_a_failing_rank_ends_the_launch_with_its_message(artifact: Path, tmp_path: Path) -> None:
    poisoned = poison_rank1_row(artifact, tmp_path / "poisoned")
    cfg = tiny_config(
        poisoned,
        **DATA_PARALLEL,
        **{"objective.name": "mdlm", "objective.block_size": None, "train.grad_accum": 1},
    )
    started = time.monotonic()
    with pytest.raises(TrainingFailed, match=r"training failed on rank 1: ValueError: .*mask token") as info:
        launch_training(cfg, run_dir=tmp_path / "run")
    assert "check_no_mask_token_supervised" in info.value.details  # the failing rank's traceback
    assert time.monotonic() - started < 120, "the surviving rank must be stopped, not left hanging"


def test_a_two_rank_checkpoint_records_the_checksum_of_every_ranks_files(
    two_rank_runs: tuple[Path, dict[str, Any]],
) -> None:
    root, _ = two_rank_runs
    checkpoint = root / "bp_step2" / "checkpoints" / "step_0000002"
    files = json.loads((checkpoint / "trainer_state.json").read_text())["checksums"]["files"]
    assert sorted(files) == sorted(p.name for p in checkpoint.iterdir() if p.name != "trainer_state.json")
    assert {name[:4] for name in files if name.endswith(".distcp")} == {"__0_", "__1_"}
    assert checkpoint_problem(checkpoint) is None
