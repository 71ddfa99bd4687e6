"""Gradient synchronisation overlapped with backward, and no host sync per micro-step.

* ``OverlappedGradientSync`` on 2 gloo ranks gives exactly ``average_gradients``'s gradients, with
  every bucket launched from inside the last backward (none left for ``finish``), no extra
  full-size buffer (``.grad`` is a view of its bucket) and the same gradient bytes.
* A training step reads tensors on the host a fixed number of times, whatever ``grad_accum`` is
  (the old loop called ``.item()`` once per micro-step).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from csbp.engine.block_diffusion import build_rank_plan
from csbp.engine.context import build_parallel_context, single_process_context
from csbp.engine.grad_buckets import OverlappedGradientSync
from csbp.engine.grads import average_gradients
from csbp.engine.verify import MASK_TOKEN_ID, VOCAB_SIZE, tiny_model_config
from csbp.models.attention_fns import CausalAttention
from csbp.models.decoder import Decoder
from csbp.objectives import build_objective
from csbp.parallel.launch import run_local
from csbp.topology import Topology
from csbp.training.step import StepRunner


def _loss(model: Decoder, seed: int) -> torch.Tensor:
    ids = torch.randint(0, VOCAB_SIZE, (2, 16), generator=torch.Generator().manual_seed(seed))
    hidden = model(ids, torch.arange(16), CausalAttention())
    return model.logits(hidden).pow(2).mean()


def _sync_worker(rank: int, world: int) -> dict[str, object]:
    ctx = build_parallel_context(Topology(dp=2))
    reference = Decoder(tiny_model_config(), dtype=torch.float64, seed=0)
    overlapped = Decoder(tiny_model_config(), dtype=torch.float64, seed=0)
    sync = OverlappedGradientSync(overlapped.parameters(), ctx.world_comm("gradients"), bucket_bytes=8192)
    for micro in range(2):  # two micro-batches, different on each rank
        _loss(reference, 10 * rank + micro).backward()
    average_gradients(reference.parameters(), ctx.world_comm("reference"))
    sync.zero_grad()
    for micro in range(2):
        if micro == 1:
            sync.arm()
        _loss(overlapped, 10 * rank + micro).backward()
    launched_in_backward = sync._next_launch
    sync.finish()
    views = all(
        p.grad.data_ptr() == view.data_ptr()
        for bucket in sync.buckets
        for p, view in zip(bucket.params, bucket.views, strict=True)
    )
    equal = all(
        torch.equal(a.grad, b.grad)
        for a, b in zip(reference.parameters(), overlapped.parameters(), strict=True)
    )
    return {
        "equal": equal,
        "views": views,
        "buckets": len(sync.buckets),
        "launched_in_backward": launched_in_backward,
        "bytes": (ctx.counter.bytes("reference"), ctx.counter.bytes("gradients")),
    }


@pytest.mark.multiprocess
def test_overlapped_sync_equals_average_gradients_and_launches_inside_backward() -> None:
    for result in run_local(_sync_worker, 2, timeout_s=120):
        assert result["equal"] and result["views"]
        assert result["buckets"] > 3  # small buckets: several all-reduces in flight
        assert result["launched_in_backward"] == result["buckets"]
        reference_bytes, bucket_bytes = result["bytes"]
        assert reference_bytes == bucket_bytes > 0  # the same gradients, cut into buckets


def test_sync_fails_closed_when_grads_are_set_to_none() -> None:
    model = nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = OverlappedGradientSync(model.parameters(), None)
    model(torch.ones(1, 4)).sum().backward()
    optimizer.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match="zero_grad"):
        sync.arm()
    with pytest.raises(RuntimeError, match="without arm"):
        OverlappedGradientSync(model.parameters(), None).finish()
    sync = OverlappedGradientSync(model.parameters(), None)
    sync.arm()
    model.bias.grad = None  # dropped between the last backward and finish
    with pytest.raises(RuntimeError, match="zero_grad"):
        sync.finish()


def test_average_gradients_gives_every_trainable_parameter_a_gradient() -> None:
    """A parameter that got no gradient on this rank (no supervised row) gets zeros, so every rank
    all-reduces the same buffer; frozen parameters are left alone."""
    model = nn.Linear(4, 4)
    model.bias.requires_grad_(False)
    average_gradients(model.parameters(), None)
    assert torch.equal(model.weight.grad, torch.zeros(4, 4)) and model.bias.grad is None


class _HostReads:
    """Counts reads of tensor values on the host (``item``, ``tolist``, ``float()``, ``bool()``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        for name in ("item", "tolist", "__float__", "__bool__", "__int__"):
            original = getattr(torch.Tensor, name)

            def counted(tensor: torch.Tensor, *args: object, _original=original) -> object:
                self.count += 1
                return _original(tensor, *args)

            monkeypatch.setattr(torch.Tensor, name, counted)


def _host_reads_of_a_step(grad_accum: int, monkeypatch: pytest.MonkeyPatch) -> int:
    """Host reads of one ``train_step`` with ``grad_accum`` micro-batches (corruption is drawn on the
    host before the step, as the loader would, so it is not counted)."""
    ctx = single_process_context()
    model = Decoder(tiny_model_config(), dtype=torch.float64, seed=0)
    objective = build_objective("bd3", mask_token_id=MASK_TOKEN_ID, block_size=4)
    runner = StepRunner(
        model, objective, build_rank_plan(ctx, 32, 4), ctx,
        device=torch.device("cpu"), precision="fp64", seed=0, ce_chunk_rows=64,
    )
    runner.grad_sync = OverlappedGradientSync(model.parameters(), None)
    generator = torch.Generator().manual_seed(3)
    batches = [
        {"input_ids": torch.randint(0, MASK_TOKEN_ID, (2, 32), generator=generator)} for _ in range(grad_accum)
    ]
    corrupted = [runner._corrupt_on_host(batch, 1, micro) for micro, batch in enumerate(batches)]
    runner._corrupt_on_host = lambda batch, step, micro, objective=None: corrupted[micro]  # type: ignore[method-assign]
    with monkeypatch.context() as patch:
        reads = _HostReads(patch)
        runner.train_step(batches, 1)
        runner.grad_sync.finish()
        return reads.count


def test_a_step_reads_the_host_a_fixed_number_of_times(monkeypatch: pytest.MonkeyPatch) -> None:
    one, four = _host_reads_of_a_step(1, monkeypatch), _host_reads_of_a_step(4, monkeypatch)
    assert one == four, f"host reads per step: {one} with grad_accum=1, {four} with grad_accum=4"
