"""Activation checkpointing (``train.activation_checkpointing: full | selective``) is exact and saves memory.

* On 2 gloo ranks (CSBP ``cp=2, bp=2``, collective transport) a checkpointed float64 step gives the
  plain step's loss and every local gradient bit for bit, for the decoder and for a DFlash drafter;
  under ``full`` the recompute repeats exactly the forward's attention collectives, counted under
  ``recompute.attention`` while ``attention`` is unchanged; under ``selective`` it replays the
  attention's results and repeats none.
* In one process the peak resident-memory growth of a step drops (the drop is printed).
* The config key reaches the trainer: a checkpointed run logs the plain run's losses and validation
  losses bit for bit (float32, one process).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from csbp.bench.measure import PeakMemory, fixed_mmap_threshold
from csbp.dflash.rank_plan import build_dflash_rank_plan
from csbp.dflash.step import DFlashStep
from csbp.dflash.verify import DFlashVerifyCase, anchor_generator, build_models, make_batch
from csbp.engine.block_diffusion import build_rank_plan, rank_loss
from csbp.engine.context import build_parallel_context, single_process_context
from csbp.engine.verify import VerifyCase, corrupted_batch, tiny_model_config
from csbp.models.config import DecoderConfig
from csbp.models.decoder import Decoder
from csbp.objectives import build_objective, corruption_generator
from csbp.parallel.launch import run_local
from csbp.topology import Topology
from csbp.training import train
from csbp.training.activation_checkpointing import checkpoint_layers
from test_training_run import make_artifact, tiny_config


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def _decoder_step(model: Decoder, ctx, plan, corrupted) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    ctx.counter.reset()
    loss, _ = rank_loss(model, corrupted, plan, global_denominator=corrupted.denominator(), world_size=ctx.world_size)
    forward_bytes = ctx.counter.bytes("attention")
    loss.backward()
    return loss.detach(), _grads(model), forward_bytes


def _exactness_worker(rank: int, world: int) -> dict[str, object]:
    case = VerifyCase(Topology(cp=2, bp=2))
    ctx = build_parallel_context(case.topology)
    plan = build_rank_plan(ctx, case.seq_len, case.block_size)
    corrupted = corrupted_batch(case)
    plain = Decoder(tiny_model_config(num_layers=3), dtype=torch.float64, seed=0)
    loss_plain, grads_plain, forward_bytes = _decoder_step(plain, ctx, plan, corrupted)
    plain_traffic = ctx.counter.snapshot()
    modes: dict[str, dict[str, object]] = {}
    for mode in ("full", "selective"):
        checkpointed = Decoder(tiny_model_config(num_layers=3), dtype=torch.float64, seed=0)
        assert checkpoint_layers(checkpointed.layers, mode, ctx.counter) == 3  # type: ignore[arg-type]
        loss_ckpt, grads_ckpt, _ = _decoder_step(checkpointed, ctx, plan, corrupted)
        modes[mode] = {
            "decoder_loss_equal": torch.equal(loss_plain, loss_ckpt),
            "decoder_grads_equal": _same(grads_plain, grads_ckpt) and len(grads_plain) > 0,
            "ckpt_traffic": ctx.counter.snapshot(),
        }

    dcase = DFlashVerifyCase(Topology(cp=2, bp=2))
    batch = make_batch(dcase.samples, dcase.seq_len, seed=dcase.seed)
    drafter_results = {}
    for mode in ("none", "full", "selective"):
        _, drafter = build_models(dcase)
        checkpoint_layers(drafter.layers, mode, ctx.counter)  # type: ignore[arg-type]
        ctx.counter.reset()
        step = DFlashStep(drafter, dcase.objective, build_dflash_rank_plan(ctx, dcase.objective))
        out = step(batch, anchor_generator(dcase, 0), selector_scale=0.0)
        out.loss.backward()
        drafter_results[mode] = (out.loss.detach(), _grads(drafter), ctx.counter.snapshot())
    dloss_plain, dgrads_plain, dtraffic_plain = drafter_results["none"]
    for mode in ("full", "selective"):
        dloss_ckpt, dgrads_ckpt, dtraffic_ckpt = drafter_results[mode]
        modes[mode].update({
            "drafter_loss_equal": torch.equal(dloss_plain, dloss_ckpt),
            "drafter_grads_equal": _same(dgrads_plain, dgrads_ckpt) and len(dgrads_plain) > 0,
            "drafter_ckpt_traffic": dtraffic_ckpt,
        })
    return {"forward_bytes": forward_bytes, "plain_traffic": plain_traffic, "drafter_plain_traffic": dtraffic_plain,
            "modes": modes}


@pytest.mark.multiprocess
def test_checkpointed_steps_are_bit_identical_and_count_the_recompute() -> None:
    """``full`` repeats the forward's attention collectives in the recompute; ``selective`` replays the
    attention's results and repeats none. Both give the plain step's loss and gradients bit for bit."""
    for rank, result in enumerate(run_local(_exactness_worker, 2, timeout_s=240)):
        plain, dplain = result["plain_traffic"], result["drafter_plain_traffic"]
        assert "recompute.attention" not in plain
        for mode, got in result["modes"].items():
            assert got["decoder_loss_equal"] and got["decoder_grads_equal"], (rank, mode)
            assert got["drafter_loss_equal"] and got["drafter_grads_equal"], (rank, mode)
            ckpt, dckpt = got["ckpt_traffic"], got["drafter_ckpt_traffic"]
            assert ckpt["attention"] == plain["attention"], mode  # first forward + backward: unchanged
            assert dckpt["attention"] == dplain["attention"], mode
        full, selective = result["modes"]["full"], result["modes"]["selective"]
        # the recompute repeats exactly the forward's collectives (one per layer)
        assert full["ckpt_traffic"]["recompute.attention"]["bytes"] == result["forward_bytes"] > 0
        assert full["ckpt_traffic"]["recompute.attention"]["calls"] == 3
        assert full["drafter_ckpt_traffic"]["recompute.attention"]["bytes"] > 0
        assert "recompute.attention" not in selective["ckpt_traffic"]
        assert "recompute.attention" not in selective["drafter_ckpt_traffic"]


def _memory_step(mode: str) -> tuple[int, torch.Tensor, dict[str, torch.Tensor]]:
    config = DecoderConfig(
        vocab_size=256, hidden_size=64, intermediate_size=256, num_layers=6, num_heads=4, num_kv_heads=2, head_dim=16
    )
    model = Decoder(config, dtype=torch.float64, seed=0)
    checkpoint_layers(model.layers, mode)  # type: ignore[arg-type]
    ctx = single_process_context()
    seq_len, block_size = 512, 16
    plan = build_rank_plan(ctx, seq_len, block_size)
    objective = build_objective("bd3", mask_token_id=255, block_size=block_size)
    ids = torch.randint(0, 255, (2, seq_len), generator=torch.Generator().manual_seed(1))
    corrupted = objective.corrupt({"input_ids": ids}, corruption_generator(0, 0, 0))
    with PeakMemory() as peak:
        loss, _ = rank_loss(model, corrupted, plan, global_denominator=corrupted.denominator(), world_size=1)
        loss.backward()
    return peak.bytes, loss.detach(), _grads(model)


def _memory_worker(rank: int, world: int) -> list[tuple[int, torch.Tensor, dict[str, torch.Tensor]]]:
    # A discarded first step takes the one-time allocations (thread pools, kernel caches), which
    # would otherwise be charged to whichever mode runs first.
    _memory_step("full")
    return [_memory_step(mode) for mode in ("none", "full", "selective")]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_checkpointing_cuts_the_peak_memory_of_a_step() -> None:
    """``full`` keeps the least; ``selective`` keeps each layer's attention output and statistics on top
    (here, one process: no gathered K/V), still well under a plain step."""
    with fixed_mmap_threshold():  # freed activations go back to the OS, so the RSS peak is the step's
        plain, ckpt, selective = run_local(_memory_worker, 1, timeout_s=240)[0]
    assert torch.equal(plain[1], ckpt[1]) and _same(plain[2], ckpt[2])
    assert torch.equal(plain[1], selective[1]) and _same(plain[2], selective[2])
    ratio = plain[0] / max(ckpt[0], 1)
    print(
        f"peak memory growth of a float64 step: plain {plain[0] / 2**20:.1f} MiB, "
        f"checkpointed {ckpt[0] / 2**20:.1f} MiB ({ratio:.2f}x less), selective {selective[0] / 2**20:.1f} MiB"
    )
    assert ratio > 2.5, (plain[0], ckpt[0])  # measured 4.2-4.3x with the warm-up step
    assert ckpt[0] < selective[0] < plain[0] / 1.5, (plain[0], ckpt[0], selective[0])


def test_a_checkpointed_run_logs_the_plain_runs_losses(tmp_path: Path) -> None:
    artifact = make_artifact(tmp_path / "art")
    plain = train(tiny_config(artifact), run_dir=tmp_path / "plain")
    for mode in ("full", "selective"):
        checkpointed = train(tiny_config(artifact, **{"train.activation_checkpointing": mode}), run_dir=tmp_path / mode)
        assert checkpointed.losses == plain.losses and len(plain.losses) == 4, mode
        assert checkpointed.val_losses == plain.val_losses, mode


def test_unknown_mode_is_rejected() -> None:
    with pytest.raises(ValueError, match="train.activation_checkpointing"):
        checkpoint_layers([], "attention")  # type: ignore[arg-type]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "case",
    [
        VerifyCase(Topology(dp=2), fsdp=True, activation_checkpointing="selective", micro_batches=2),
        VerifyCase(Topology(cp=2, bp=2), transport="streaming", activation_checkpointing="selective", doc_length=9),
        VerifyCase(Topology(cp=2), window=5, activation_checkpointing="selective"),
    ],
    ids=["fsdp-accumulation", "csbp-streaming-documents", "cp-window"],
)
def test_selective_checkpointing_passes_verification_on_other_layouts(case: VerifyCase) -> None:
    """Beyond the collective CSBP ring above: FSDP2 with gradient accumulation (a fresh store per micro-step
    and the recompute's parameter all-gathers), the streaming ring over packed documents (its backward
    re-circulates K/V instead of keeping them), a sliding-window halo exchange."""
    from csbp.engine.verify import verify

    result = verify(case, timeout_s=300)
    assert result.ok, result


def test_selective_keeps_nothing_alive_once_a_graph_is_dropped_without_its_backward() -> None:
    """A forward with gradients whose graph is dropped unused (an out-of-memory error mid-step, a loss
    never backpropagated) frees what selective kept. The kept ``out`` is the attention Function's
    output, whose ``grad_fn`` leads back to the checkpoint frame that holds the store: keeping it as
    returned made a cycle through the C++ autograd graph that no garbage collection breaks, so the
    layer's kept results, and the whole graph behind them, leaked with every such forward."""
    import gc
    import weakref

    from csbp.attention import kept_forwards

    model = Decoder(tiny_model_config(num_layers=2), dtype=torch.float64, seed=0)
    checkpoint_layers(model.layers, "selective")
    case = VerifyCase(Topology())
    ctx = single_process_context()
    plan = build_rank_plan(ctx, case.seq_len, case.block_size)
    corrupted = corrupted_batch(case)
    stores: list[weakref.ref] = []

    class WatchedStore(kept_forwards.KeptForwards):
        def __init__(self) -> None:
            super().__init__()
            stores.append(weakref.ref(self))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("csbp.training.activation_checkpointing.KeptForwards", WatchedStore)
        loss, _ = rank_loss(model, corrupted, plan, global_denominator=corrupted.denominator(), world_size=1)
    assert len(stores) == 2 and all(len(ref().results) == 1 for ref in stores)
    del loss, _
    gc.collect()
    assert [ref for ref in stores if ref() is not None] == []
