"""The CUDA half of the device check (``make gpu-check`` runs ``pytest -m cuda``); every test is
skipped without a CUDA device.

* kernels and local attention on CUDA against the CPU float64 dense reference: float64 at 1e-10,
  float32 at 1e-5 (TF32 off, torch's default), bf16 inputs within 2e-2 relative (bf16 rounds the
  inputs to 8 bits; measured ~0.7e-2), and bit-identical with and without bf16 autocast;
* plans built once on the CPU serve CUDA calls with every tensor on the GPU;
* ``csbp train`` of every objective (bd3 in fp32 and bf16, fast_dllm_v2, mdlm, ar, dflash) on one GPU
  inside an NCCL process group of world size 1, validating every step (``val_nelbo`` too): any CPU
  tensor handed to a collective fails there, as it would with more GPUs;
* a DFlash drafter step on CUDA equals the CPU float64 reference;
* activation checkpointing (full and selective) on CUDA gives the plain step's loss and gradients (float64).

``CSBP_CUDA_TESTS_DEVICE=cpu`` runs the same bodies on the CPU with gloo (a dry run of the test code
on machines without a GPU; not part of the suite).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from csbp.attention.rows import allow_matrix
from csbp.attention.transports.local import LocalAttentionFn
from csbp.devices import iter_tensors, tensors_to
from csbp.engine.block_diffusion import build_rank_plan, rank_loss
from csbp.engine.context import build_parallel_context, single_process_context
from csbp.engine.verify import VerifyCase, corrupted_batch, reference, tiny_model_config
from csbp.models.decoder import Decoder
from csbp.parallel.launch import run_local
from csbp.topology import Topology
from csbp.training.activation_checkpointing import checkpoint_layers
from test_kernel import bd3_rows, random_qkv, reference_grads

DEVICE = os.environ.get("CSBP_CUDA_TESTS_DEVICE", "cuda")
pytestmark = pytest.mark.cuda
CASE = VerifyCase(Topology())


def _device() -> torch.device:
    return torch.device("cuda", 0) if DEVICE == "cuda" else torch.device("cpu")


def _rel(value: torch.Tensor, ref: torch.Tensor) -> float:
    value, ref = value.detach().cpu().double(), ref.detach().cpu().double()
    return float((value - ref).abs().max() / ref.abs().max())


def _local_case():  # noqa: ANN202
    noisy = [4, 5, 6, 7, 12, 13, 14, 15]
    rows = bd3_rows(noisy, list(range(16)), 4)
    return LocalAttentionFn(rows, num_noisy=len(noisy), tile_rows=4), allow_matrix(rows, rows)


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float64, 1e-10), (torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_local_attention_on_cuda_matches_the_cpu_float64_reference(dtype: torch.dtype, tolerance: float) -> None:
    attn, allow = _local_case()
    q, k, v = random_qkv(24, 24, seed=1)
    dout = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    out_ref, _, grads_ref = reference_grads(q, k, v, allow, 1 / math.sqrt(q.shape[-1]), dout)
    leaves = [t.to(_device(), dtype).requires_grad_(True) for t in (q, k, v)]
    out = attn(*leaves, 0)
    (out.double() * dout.to(_device())).sum().backward()
    assert out.device == _device() and out.dtype == dtype
    assert _rel(out, out_ref) <= tolerance
    for leaf, grad_ref in zip(leaves, grads_ref):
        assert _rel(leaf.grad, grad_ref) <= tolerance
    assert all(t.device == _device() for t in iter_tensors(attn._plans.get(_device())))


def test_bf16_autocast_does_not_change_attention_on_cuda() -> None:
    attn, _ = _local_case()
    q, k, v = (t.to(_device(), torch.bfloat16) for t in random_qkv(24, 24, seed=3))
    results = []
    for enabled in (False, True):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        with torch.autocast(_device().type, dtype=torch.bfloat16, enabled=enabled):
            out = attn(*leaves, 0)
        out.float().square().sum().backward()
        results.append([out.detach()] + [leaf.grad for leaf in leaves])
    for plain, autocast in zip(*results):
        assert torch.equal(plain, autocast)


def _rank_steps(rank: int, world: int, modes: tuple[str, ...]) -> dict[str, tuple[float, dict[str, torch.Tensor]]]:
    """One float64 BD3 step of the verify model per checkpointing mode, in an NCCL world of one
    (gloo for the CPU dry run)."""
    ctx = build_parallel_context(Topology())
    assert ctx.is_distributed and ctx.device == _device()
    if ctx.device.type == "cuda":  # a group of one still refuses what NCCL would refuse
        with pytest.raises(ValueError, match="a tensor on cpu was given to a collective"):
            ctx.world_comm("loss").all_reduce(torch.zeros(1))
    results = {}
    for mode in modes:
        model = Decoder(tiny_model_config(), dtype=torch.float64, seed=0, device=ctx.device)
        checkpoint_layers(model.layers, mode)
        batch = tensors_to(corrupted_batch(CASE), ctx.device)
        plan = build_rank_plan(ctx, CASE.seq_len, CASE.block_size)
        loss, ce_sum = rank_loss(model, batch, plan, global_denominator=batch.denominator(), world_size=1)
        loss.backward()
        total = ctx.world_comm("loss").all_reduce(ce_sum.reshape(1).clone())  # NCCL rejects CPU tensors
        grads = {name: p.grad.cpu() for name, p in model.named_parameters()}
        results[mode] = (float(total[0]) / batch.denominator(), grads)
    return results


def test_bd3_step_in_an_nccl_world_of_one_matches_the_cpu_reference_with_and_without_checkpointing() -> None:
    (results,) = run_local(_rank_steps, 1, (("none", "full", "selective"),), device=DEVICE)
    loss_ref, grads_ref = reference(CASE)
    loss, grads = results["none"]
    assert loss == pytest.approx(loss_ref, rel=1e-9)
    for name, ref in grads_ref.items():
        assert _rel(grads[name], ref) <= 1e-9, name
    loss_ckpt, grads_ckpt = results["full"]
    assert loss_ckpt == loss  # the recompute repeats the same computation: bit-identical
    for name, grad in grads.items():
        assert torch.equal(grads_ckpt[name], grad), name
    # selective replays the attention's results; on CUDA its attention runs through the explicit-backward
    # Function (Flex's own autograd cannot be replayed), so its gradients are the reference's to round-off
    loss_selective, grads_selective = results["selective"]
    assert loss_selective == pytest.approx(loss_ref, rel=1e-9)
    for name, ref in grads_ref.items():
        assert _rel(grads_selective[name], ref) <= 1e-9, name


def _train_on_one_gpu(rank: int, world: int, runs: dict[str, object], root: Path) -> dict[str, list[float]]:
    from csbp.training import train

    return {name: list(train(cfg, run_dir=root / name, max_steps=2).losses) for name, cfg in runs.items()}


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_training_run import make_artifact

    return make_artifact(tmp_path_factory.mktemp("data") / "art")


def test_csbp_train_every_objective_on_one_gpu_with_nccl(artifact: Path, tmp_path: Path) -> None:
    """Two steps (grad_accum 2, validation every step) of every objective in one NCCL process."""
    from csbp.data.artifact import open_artifact
    from test_training_dflash import dflash_config, export_target
    from test_training_run import tiny_config

    common = {"train.eval_every": 1, "train.save_every": 0}
    changes = {
        "bd3": {},
        "bd3-bf16": {"train.precision": "bf16"},
        # the weight average (swapped on the GPU for validation and the export) and the resampled noise
        "bd3-ema-resample": {"train.precision": "bf16", "optim.ema_decay": 0.9, "objective.t_min": 0.3,
                             "objective.t_max": 0.8, "objective.resample": True},
        "fast_dllm_v2": {"objective.name": "fast_dllm_v2", "objective.loss_weight": "unit"},
        "mdlm": {"objective.name": "mdlm", "objective.block_size": None},
        "ar": {"objective.name": "ar", "objective.block_size": None, "objective.loss_weight": "unit"},
    }
    runs = {name: tiny_config(artifact, **common, **change) for name, change in changes.items()}
    target = export_target(tmp_path / "target", open_artifact(artifact).vocab_size, tokenizer_dir=artifact)
    runs["dflash"] = dflash_config(artifact, target, **common)
    (losses,) = run_local(_train_on_one_gpu, 1, (runs, tmp_path), device=DEVICE, timeout_s=600)
    assert sorted(losses) == sorted(runs)
    for name, values in losses.items():
        assert len(values) == 2 and all(math.isfinite(v) and v > 0 for v in values), name
    from csbp.training.metrics import read_metrics

    for name in ("bd3", "bd3-bf16", "bd3-ema-resample", "fast_dllm_v2", "mdlm"):  # validation's unclipped NELBO, computed on the GPU
        validated = [r for r in read_metrics(tmp_path / name / "metrics.jsonl") if "val_loss" in r]
        assert validated and all(math.isfinite(r["val_nelbo"]) for r in validated), name
    assert (tmp_path / "bd3-ema-resample" / "final" / "model.safetensors").is_file()


def test_dflash_drafter_step_on_cuda_matches_the_cpu_float64_reference() -> None:
    from csbp.dflash.rank_plan import build_dflash_rank_plan
    from csbp.dflash.step import DFlashStep
    from csbp.dflash.verify import DFlashVerifyCase, anchor_generator, build_models, make_batch, reference

    case = DFlashVerifyCase()
    loss_ref, grads_ref = reference(case)
    ctx = single_process_context(_device())
    _, drafter = build_models(case, device=ctx.device)
    step = DFlashStep(drafter, case.objective, build_dflash_rank_plan(ctx, case.objective))
    out = step(make_batch(case.samples, case.seq_len, seed=case.seed), anchor_generator(case, 0))
    out.loss.backward()
    assert out.loss_value == pytest.approx(loss_ref, rel=1e-9)
    for name, param in drafter.named_parameters():
        assert _rel(param.grad, grads_ref[name]) <= 1e-9, name


def _gpus() -> int:
    if DEVICE != "cuda":
        return 2  # the CPU dry run has as many "devices" as it likes
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(_gpus() < 2, reason="the ring transports need 2 GPUs (one NCCL rank each)")
@pytest.mark.parametrize(
    ("topology", "transport", "window"),
    [(Topology(cp=2), "collective", None), (Topology(cp=2, bp=2), "collective", None),
     (Topology(cp=2, bp=2), "streaming", None), (Topology(cp=2, bp=2), "collective", 6)],
    ids=["cp-only", "csbp-collective", "csbp-streaming", "csbp-window"],
)
def test_ring_transports_on_two_gpus_match_the_cpu_reference(topology: Topology, transport: str, window) -> None:  # noqa: ANN001
    from csbp.engine.verify import verify

    result = verify(VerifyCase(topology, transport=transport, window=window, device=DEVICE))  # type: ignore[arg-type]
    assert result.ok, (result.loss_rel_err, result.grad_rel_err, result.worst_param)
