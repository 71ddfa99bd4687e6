"""FSDP2 from the meta device, sharded DCP checkpoints and resharding on resume (4 gloo ranks).

``dp=2 x bp=2`` with ``train.fsdp`` shards over dp on a 2-D mesh (HSDP: the two BP ranks of a sample
replicate). The model reaches ``fully_shard`` on the ``meta`` device (``model.init_from`` too: each
rank then holds exactly its shards of the HF checkpoint's tensors); the checkpoint holds one piece
per dp shard of every parameter and optimizer moment (nothing gathered); the run (with activation
checkpointing on too) matches plain data parallelism, and its checkpoint resumes both without FSDP
and with FSDP on another topology (CSBP ``cp=2, bp=2``), continuing the plain run's losses.
"""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

import csbp.training.trainer as trainer_module
from csbp.data import open_artifact
from csbp.engine.context import build_parallel_context
from csbp.engine.verify import tiny_model_config
from csbp.models.decoder import Decoder
from csbp.models.hf_io import export_hf_checkpoint
from csbp.parallel.launch import run_local
from csbp.training import train
from csbp.training.model_factory import build_model, decoder_config_for_run
from csbp.training.parallelize import apply_fsdp
from test_training_run import make_artifact, tiny_config

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

DP2_BP2 = {
    "topology.dp": 2,
    "topology.bp": 2,
    "topology.replicate_clean_prefix": True,
    "train.micro_batch_size": 1,
    "train.eval_every": 0,
    "train.save_every": 0,
}
CSBP = {"topology.replicate_clean_prefix": False, "topology.cp": 2}
SHARDED = {"train.fsdp": True, "train.activation_checkpointing": "full"}


def _runs(rank: int, world: int, artifact: Path, root: Path) -> dict[str, Any] | None:
    devices_at_sharding: list[set[str]] = []
    original = trainer_module.apply_fsdp

    def recording(model: Any, ctx: Any, device: Any) -> None:
        devices_at_sharding.append({p.device.type for p in model.parameters()})
        original(model, ctx, device)

    trainer_module.apply_fsdp = recording  # type: ignore[assignment]
    plain = train(tiny_config(artifact, **DP2_BP2), run_dir=root / "plain", max_steps=3)
    sharded = train(tiny_config(artifact, **DP2_BP2, **SHARDED), run_dir=root / "sharded", max_steps=2)
    if rank == 0:
        shutil.copytree(root / "sharded", root / "sharded_copy")
    dist.barrier()
    unsharded_resume = train(tiny_config(artifact, **DP2_BP2), run_dir=root / "sharded", resume=True, max_steps=3)
    other_topology = train(
        tiny_config(artifact, **{**DP2_BP2, **SHARDED, **CSBP}), run_dir=root / "sharded_copy", resume=True, max_steps=3
    )
    init_from_exact = _init_from_fills_the_shards(rank, artifact, root)
    if rank != 0:
        return None
    return {
        "init_from_exact": init_from_exact,
        "devices": devices_at_sharding,
        "plain": plain.losses,
        "sharded": sharded.losses,
        "unsharded_resume": unsharded_resume.losses,
        "other_topology": other_topology.losses,
    }


def _init_from_fills_the_shards(rank: int, artifact: Path, root: Path) -> bool:
    """``model.init_from`` under FSDP: every rank holds only its shard, and the shards are the
    checkpoint's tensors exactly."""
    vocab = open_artifact(artifact).vocab_size
    source = Decoder(replace(tiny_model_config(), vocab_size=vocab), dtype=torch.float32, seed=11)
    if rank == 0:
        export_hf_checkpoint(source, source.config, root / "hf")
    dist.barrier()
    shape_free = {f"model.{k}": None for k in ("hidden_size", "intermediate_size", "num_layers", "num_heads")}
    shape_free.update({"model.num_kv_heads": None, "model.head_dim": None, "model.init_from": str(root / "hf")})
    cfg = tiny_config(artifact, **{**DP2_BP2, **SHARDED, **shape_free})
    ctx = build_parallel_context(cfg.topology.to_topology())
    cpu = torch.device("cpu")
    model = build_model(
        cfg, decoder_config_for_run(cfg, open_artifact(artifact)), device=cpu, shard=lambda m: apply_fsdp(m, ctx, cpu)
    )
    exact = True
    for (name, param), expected in zip(model.named_parameters(), source.parameters(), strict=True):
        assert isinstance(param, DTensor), name
        exact &= param.to_local().numel() < expected.numel() or expected.shape[0] < 2
        exact &= torch.equal(param.full_tensor(), expected)
    return bool(exact)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    artifact = make_artifact(tmp_path_factory.mktemp("data") / "art")
    root = tmp_path_factory.mktemp("sharded")
    return root, run_local(_runs, 4, (artifact, root), timeout_s=400)[0]


def test_fsdp_shards_a_model_still_on_the_meta_device(runs: tuple[Path, dict[str, Any]]) -> None:
    _, result = runs
    assert result["devices"] == [{"meta"}, {"meta"}]  # the two FSDP trainings, before materialising


def test_init_from_loads_each_ranks_shards_exactly(runs: tuple[Path, dict[str, Any]]) -> None:
    _, result = runs
    assert result["init_from_exact"]


def test_hsdp_with_activation_checkpointing_matches_plain_data_parallel(runs: tuple[Path, dict[str, Any]]) -> None:
    _, result = runs
    assert result["sharded"] == pytest.approx(result["plain"][:2], rel=1e-5)


def test_checkpoint_holds_one_piece_per_dp_shard(runs: tuple[Path, dict[str, Any]]) -> None:
    root, _ = runs
    metadata = dcp.FileSystemReader(str(root / "sharded_copy" / "checkpoints" / "step_0000002")).read_metadata()
    for key in ("model.layers.0.mlp.up_proj.weight", "optim.state.layers.0.mlp.up_proj.weight.exp_avg"):
        entry = metadata.state_dict_metadata[key]
        assert list(entry.size) == [64, 32], key
        pieces = sorted((list(c.offsets), list(c.sizes)) for c in entry.chunks)
        assert pieces == [([0, 0], [32, 32]), ([32, 0], [32, 32])], key
    ranks_written = {item.relative_path for item in metadata.storage_data.values()}
    assert len(ranks_written) >= 2  # every dp shard wrote its own file


def test_sharded_checkpoint_resumes_without_fsdp_and_on_another_topology(
    runs: tuple[Path, dict[str, Any]],
) -> None:
    _, result = runs
    assert result["unsharded_resume"] == pytest.approx(result["plain"][2:], rel=1e-5)
    assert result["other_topology"] == pytest.approx(result["plain"][2:], rel=1e-5)
