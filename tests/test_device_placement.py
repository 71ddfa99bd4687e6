"""Device correctness on CPU (issue 7, defects 0, 1 and 6's refusals).

A GPU is not needed to show where a tensor lives: the ``meta`` device stands in for "a device that
is not the CPU". Rows given on the CPU must serve calls on another device (a plan built there once,
reused by every layer), every collective must get tensors on the context's device (checked by
``Comm``, also in a world of size 1), and the device is selected before any process group exists.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from csbp.attention.transports.local import LocalAttentionFn
from csbp.devices import iter_tensors, process_group_options, resolve_device, tensors_to
from csbp.engine.block_diffusion import build_rank_plan
from csbp.engine.context import ParallelContext, build_parallel_context, single_process_context
from csbp.parallel.comm import Comm
from csbp.parallel.launch import run_local
from csbp.topology import Topology
from csbp.training.dflash_step import DFlashStepRunner
from csbp.training.step import StepRunner
from test_kernel import bd3_rows, random_qkv

META = torch.device("meta")


def _on(obj: object, device: torch.device) -> bool:
    tensors = list(iter_tensors(obj))
    return bool(tensors) and all(t.device == device for t in tensors)


@pytest.fixture
def world_of_one():
    """A gloo process group of one rank in this process (the conftest destroys it afterwards)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield


# ----------------------------------------------------------------------------- defect 0: plans


def test_local_attention_plans_once_per_call_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows given on the CPU serve calls on another device with a plan built there, once."""
    from csbp.attention.transports import local

    built: list[torch.device] = []
    used: list[object] = []
    build = local.build_local_attention_plan

    def spy_build(rows, **kwargs):  # noqa: ANN001, ANN003, ANN202
        built.append(rows.pos.device)
        if rows.pos.device == META:  # planning needs real tensors; stand in for a GPU plan
            return SimpleNamespace(query_rows=rows)
        return build(rows, **kwargs)

    monkeypatch.setattr(local, "build_local_attention_plan", spy_build)
    monkeypatch.setattr(local, "local_attention", lambda q, k, v, plan: used.append(plan) or q)
    noisy = [4, 5, 6, 7, 12, 13, 14, 15]
    attn = LocalAttentionFn(bd3_rows(noisy, list(range(16)), 4), num_noisy=len(noisy), tile_rows=4)
    q, k, v = (t.to(META) for t in random_qkv(24, 24))
    for _ in range(3):  # three layers
        attn(q, k, v, 0)
    assert built == [torch.device("cpu"), META]  # before the fix: CPU rows only, "rows are on cpu but q on meta"
    assert used[0] is used[1] is used[2] and used[0].query_rows.pos.device == META


@pytest.mark.parametrize("uses_clean_stream", [True, False])
def test_rank_plans_build_their_attention_plan_on_the_compute_device_only(
    uses_clean_stream: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank plan (built once per step with packed documents) plans its attention on the context's
    device at once: CPU rows of a GPU run cost no CPU plan that no call would use (0.05-0.24 s at
    16K-64K on this machine's CPU, per sample and step)."""
    from csbp.attention.transports import local

    built: list[torch.device] = []

    def spy_build(rows, **kwargs):  # noqa: ANN001, ANN003, ANN202
        built.append(rows.pos.device)
        return SimpleNamespace(query_rows=rows)

    monkeypatch.setattr(local, "build_local_attention_plan", spy_build)
    build_rank_plan(single_process_context(META), 16, 4, uses_clean_stream=uses_clean_stream)
    assert built == [META]  # before: [cpu] here, and the device's own plan at the first call


def test_rank_plan_indices_are_cached_per_device() -> None:
    plan = build_rank_plan(single_process_context(), 16, 4)
    index = plan.indices(META)
    assert index is plan.indices(META) and _on(index, META)
    assert torch.equal(plan.indices(torch.device("cpu")).positions, plan.rows.pos)


def test_tensors_to_moves_nested_plans_and_keeps_the_rest() -> None:
    rows = bd3_rows([0, 1], [0, 1], 2)
    marker = object()
    moved = tensors_to({"rows": rows, "pair": (rows.pos, 3), "other": marker}, META)
    assert _on(moved, META) and moved["other"] is marker and moved["pair"][1] == 3
    assert tensors_to((1, "a"), META) == (1, "a")


# ----------------------------------------------------------------------------- defect 1: collectives


def test_comm_rejects_tensors_off_its_device_even_in_a_world_of_one(world_of_one) -> None:  # noqa: ANN001
    comm = Comm(None, device=META)
    with pytest.raises(ValueError, match="on cpu was given to a collective whose device is meta"):
        comm.all_reduce(torch.zeros(2))
    with pytest.raises(ValueError, match="Comm.all_gather"):
        comm.all_gather(torch.zeros(2))
    assert comm.all_reduce(torch.zeros(2, device=META)).device == META
    gloo = Comm(None)  # default: the device the backend serves
    assert gloo.device == torch.device("cpu")
    with pytest.raises(ValueError, match="Comm.broadcast"):
        gloo.broadcast(torch.zeros(2, device=META), 0)
    assert Comm(None).all_reduce(torch.ones(1)).item() == 1.0


def test_context_comms_carry_the_context_device(world_of_one) -> None:  # noqa: ANN001
    ctx = build_parallel_context(Topology(), META)
    assert ctx.device == META and ctx.is_distributed
    for comm in (ctx.ring_comm(), ctx.dp_comm("x"), ctx.world_comm("x"), ctx.model_input_comm("x")):
        assert comm is not None and comm.device == META


class _RecordingComm:
    """Stands in for a context's comm: records where reduced tensors live, returns ``value``."""

    size = 2

    def __init__(self, value: list[float]) -> None:
        self.value, self.devices = value, []

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        self.devices.append(t.device)
        return torch.tensor(self.value, dtype=t.dtype)


def test_step_runners_reduce_on_the_context_device(monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = single_process_context(META)
    comm = _RecordingComm([5.0])
    monkeypatch.setattr(ParallelContext, "dp_comm", lambda self, category: comm)
    monkeypatch.setattr(ParallelContext, "world_comm", lambda self, category: comm)
    runner = StepRunner.__new__(StepRunner)
    runner.ctx = ctx
    assert runner._sum_over(2.0, "dp") == 5.0 and runner._sum_over(2.0, "world") == 5.0
    sums = _RecordingComm([float(i) for i in range(7)])
    monkeypatch.setattr(ParallelContext, "dp_comm", lambda self, category: sums)
    totals = DFlashStepRunner._global(SimpleNamespace(ctx=ctx), [[1.0] * 7, [2.0] * 7])  # type: ignore[arg-type]
    assert totals["loss"] == 0.0 and totals["covered"] == 6.0
    assert comm.devices == [META, META] and sums.devices == [META]


class _Stop(Exception):
    """Raised by a stand-in collective once it has recorded its tensor (a meta tensor has no values)."""


def test_direct_collectives_outside_comm_use_the_compute_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """DFlash's served-acceptance broadcast and csbp compare's budget maximum call torch.distributed
    directly; under NCCL a CPU tensor there fails on the first multi-GPU run (a world of one never
    reaches them)."""
    from csbp.compare import budget

    devices: list[torch.device] = []

    def collective(tensor: torch.Tensor, *args: object, **kwargs: object) -> None:
        devices.append(tensor.device)
        raise _Stop

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "broadcast", collective)
    monkeypatch.setattr(dist, "all_reduce", collective)
    monkeypatch.setattr(budget, "backend_device", lambda group=None: META)
    runner = SimpleNamespace(
        ctx=SimpleNamespace(coords=SimpleNamespace(rank=1), device=META),
        drafter=SimpleNamespace(config=SimpleNamespace(block_size=4)),
    )
    with pytest.raises(_Stop):
        DFlashStepRunner.served_acceptance(runner, split=None)  # type: ignore[arg-type]
    with pytest.raises(_Stop):
        budget._max_over_ranks(1.5)
    assert devices == [META, META]  # before: [cpu, cpu]


# ----------------------------------------------------------------------------- process groups


def test_device_is_selected_before_any_process_group(world_of_one, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: events.append(f"set_device {device}"))
    new_group = dist.new_group
    monkeypatch.setattr(dist, "new_group", lambda *a, **kw: (events.append("new_group"), new_group(*a, **kw))[1])
    ctx = build_parallel_context(Topology(), torch.device("cuda", 0))
    assert events[0] == "set_device cuda:0" and "new_group" in events[1:]
    assert ctx.device == torch.device("cuda", 0)
    assert process_group_options(torch.device("cuda", 3)) == {"backend": "nccl", "device_id": torch.device("cuda", 3)}
    assert process_group_options(torch.device("cpu")) == {"backend": "gloo"}
    with pytest.raises(ValueError, match="indexed CUDA device"):
        process_group_options(torch.device("cuda"))


def test_cuda_requests_are_refused_with_one_line_when_gpus_are_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_device("cpu", nproc=8) == torch.device("cpu")
    with pytest.raises(ValueError, match="choose one of"):
        resolve_device("tpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("cuda", nproc=2) == torch.device("cuda")
    with pytest.raises(ValueError) as error:
        resolve_device("cuda", nproc=4)
    assert str(error.value) == (
        "--nproc 4 on CUDA needs one GPU per process but 2 GPU(s) are visible (fix: --nproc 2 or less)"
    )
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        run_local(print, 2, device="cuda")  # refused before any process starts


@pytest.mark.parametrize(
    "argv",
    [
        ["verify", "--device", "cuda", "--nproc", "2"],
        ["verify", "--device", "cuda", "--nproc", "2", "--objective", "dflash"],
        ["bench", "attention", "--device", "cuda", "--nproc", "2"],
        ["bench", "train", "--device", "cuda", "--nproc", "2"],
        ["bench", "dflash", "--device", "cuda", "--nproc", "2"],
    ],
    ids=["verify", "verify-dflash", "bench-attention", "bench-train", "bench-dflash"],
)
def test_cli_refuses_more_processes_than_gpus_with_one_line(
    argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from csbp.cli.main import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "csbp: error: --nproc 2 on CUDA needs one GPU per process but 1 GPU(s) are visible "
        "(fix: --nproc 1 or less)\n"
    )


def test_csbp_train_refuses_more_local_processes_than_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    from csbp.training.launcher import LaunchOptions, check_process_count

    cfg = SimpleNamespace(world_size=2, topology=SimpleNamespace(dp=2, cp=1, bp=1))
    check_process_count(cfg, 2, LaunchOptions())  # type: ignore[arg-type]  # CPU: any count
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"^--nproc 2 on CUDA needs one GPU per process"):
        check_process_count(cfg, 2, LaunchOptions())  # type: ignore[arg-type]


def test_csbp_train_selects_the_gpu_then_binds_nccl_to_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from csbp.training import worker

    events: list[tuple[str, object]] = []
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: events.append(("set_device", device)))

    def init_process_group(**kwargs: object) -> None:
        events.append(("init_process_group", kwargs))
        raise RuntimeError("stop here")

    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    cfg = SimpleNamespace(train=SimpleNamespace(collective_timeout_s=5.0))
    with pytest.raises(RuntimeError, match="stop here"):
        worker.train_in_process_group(cfg, run_dir=None, resume=False, max_steps=None)  # type: ignore[arg-type]
    assert events[0] == ("set_device", torch.device("cuda", 1))
    name, kwargs = events[1]
    assert name == "init_process_group" and kwargs["backend"] == "nccl"  # type: ignore[index]
    assert kwargs["device_id"] == torch.device("cuda", 1)  # type: ignore[index]
