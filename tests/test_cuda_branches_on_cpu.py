"""CUDA-only branches that no CPU run executed (coverage of the dry run, the CUDA test bodies with
``CSBP_CUDA_TESTS_DEVICE=cpu`` and the kernel tests), run here on the CPU with stand-ins, so that a
renamed argument or a changed return shape fails in CI instead of in a short GPU lease.

* ``flash_ops.flash_kernel`` / ``flash_supported`` on CUDA tensors (fake ones: no GPU needed), with the
  device's compute capability stood in;
* ``csbp bench kernels``' fused dense rows (``flash2``, ``cudnn``: ``kernel_timing.dense_flash_times``),
  through the FlashAttention-2 and cuDNN stand-ins of ``test_block_diagonal_sdpa`` and
  ``test_cudnn_pieces_on_cpu``, and a kernel that fails on the device leaving a ``nan`` row;
* ``kernel_timing.build_and_time``'s CUDA branch (a failing form is a ``nan`` row and one line);
* ``kernel_profile.profile_step`` / ``count_syncs`` on CUDA: torch's own profiler event classes holding
  CUDA kernels, and the sync-debug warnings counted;
* the CUDA side of ``PeakMemory``, ``plan.auto.gpu_preset`` and ``csbp doctor``.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import csbp.attention.flash_ops as flash_ops
import csbp.bench.kernel_timing as kernel_timing
import csbp.bench.kernels as kernels
from csbp.cli.main import main
from test_block_diagonal_sdpa import flash2_stand_in
from test_cudnn_pieces_on_cpu import cudnn_stand_in

CUDA = torch.device("cuda", 0)


@pytest.mark.parametrize("capability", [(8, 0), (9, 0), (7, 5)])
def test_flash_kernel_on_cuda_follows_dtype_head_dim_and_capability(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int]
) -> None:
    """FlashAttention-2: fp16/bf16, head dim a multiple of 8 up to 256; cuDNN: the same up to 128; both sm80+;
    nothing else (fp32, fp64, other head dims) has a fused kernel on CUDA, so callers take their own path."""
    asked: list[object] = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: asked.append(device) or capability)
    modern = capability >= (8, 0)
    with FakeTensorMode():
        for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
            for dim in (8, 12, 64, 128, 192, 256, 264):
                q = torch.empty(1, 2, 4, dim, dtype=dtype, device="cuda")
                fused = modern and dtype in (torch.bfloat16, torch.float16) and dim % 8 == 0
                assert flash_ops.flash_kernel(q) == ("flash" if fused and dim <= 256 else None), (dtype, dim)
                assert flash_ops.flash_kernel(q, "cudnn") == ("cudnn" if fused and dim <= 128 else None), (dtype, dim)
    assert asked and all(torch.device(device).type == "cuda" for device in asked)  # the tensor's device


@pytest.fixture
def fused_kernels_on_cpu(monkeypatch: pytest.MonkeyPatch) -> dict[str, list]:
    """The CUDA branch of ``flash_ops`` taken on the CPU with the FlashAttention-2 and cuDNN stand-ins
    (bf16 in and out, their lse layouts); yields each stand-in's calls."""
    calls: dict[str, list] = {"flash": [], "cudnn": []}
    flash_forward, flash_backward = flash2_stand_in(calls["flash"])
    cudnn_forward, cudnn_backward = cudnn_stand_in(calls["cudnn"])
    take_cuda_branch = lambda q, cuda_kernel="flash": cuda_kernel  # noqa: E731
    monkeypatch.setattr(flash_ops, "flash_kernel", take_cuda_branch)
    monkeypatch.setattr(kernels, "flash_kernel", take_cuda_branch)  # the bench's "is there a fused row here?"
    monkeypatch.setattr(flash_ops, "_FLASH_FORWARD", flash_forward)
    monkeypatch.setattr(flash_ops, "_FLASH_BACKWARD", flash_backward)
    monkeypatch.setattr(flash_ops, "_CUDNN_FORWARD", cudnn_forward)
    monkeypatch.setattr(flash_ops, "_CUDNN_BACKWARD", cudnn_backward)
    return calls


BENCH = ["bench", "kernels", "--device", "cpu", "--backends", "tiles", "--dtype", "bfloat16", "--num-heads", "2",
         "--num-kv-heads", "1", "--head-dim", "16", "--block-sizes", "8", "--seq-lens", "32", "64", "--repeats", "1",
         "--warmup", "0", "--clean-kernels", "generic", "--no-op-count"]


def _bench_rows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> tuple[list[dict], str]:
    path = tmp_path / "kernels.json"
    assert main([*BENCH, "--json", str(path)]) == 0
    return json.loads(path.read_text()), capsys.readouterr().out


def test_the_fused_dense_rows_time_both_cuda_kernels(
    fused_kernels_on_cpu: dict[str, list], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On CUDA the first length also times FlashAttention-2 and cuDNN over all pairs (the rows ``flash2`` and
    ``cudnn``, forward and backward, against dense SDPA); the later lengths do not."""
    rows, out = _bench_rows(tmp_path, capsys)
    fused = [r for r in rows if r["backend"] in ("flash2", "cudnn")]
    assert [(r["backend"], r["form"], r["seq_len"]) for r in fused] == [("flash2", "dense", 32), ("cudnn", "dense", 32)]
    for row in fused:
        assert row["time_s"] > 0 and math.isfinite(row["vs_dense"]) and row["useful_pairs"] == 64 * 64
    assert fused_kernels_on_cpu["flash"] == [1] and fused_kernels_on_cpu["cudnn"] == ["forward", "backward"]
    assert "flash2" in out and "failed" not in out


def test_a_fused_kernel_that_fails_on_the_device_leaves_a_nan_row(
    fused_kernels_on_cpu: dict[str, list], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    def unsupported(*args: object, **kwargs: object) -> None:
        raise RuntimeError("cuDNN Frontend error: no valid execution plans\nthe rest of its message")

    monkeypatch.setattr(flash_ops, "_CUDNN_FORWARD", unsupported)
    rows, out = _bench_rows(tmp_path, capsys)
    (cudnn,) = [r for r in rows if r["backend"] == "cudnn"]
    assert math.isnan(cudnn["time_s"]) and math.isnan(cudnn["vs_dense"])
    assert "the cudnn kernel failed on this machine: cuDNN Frontend error: no valid execution plans\n" in out
    assert {r["backend"] for r in rows} == {"sdpa", "flash2", "cudnn", "tiles"} and len(rows) == 10


def test_a_form_that_fails_on_cuda_is_a_nan_row_and_on_the_cpu_an_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    synced: list[torch.device] = []
    monkeypatch.setattr(kernel_timing, "synchronize", synced.append)
    emptied: list[bool] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))

    def build() -> Callable[[], None]:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\ndetails")

    step, build_s, first_s, times = kernel_timing.build_and_time(build, CUDA, 0, 1, "wall", label="L=64 flex mixed")
    assert step is None and math.isnan(build_s) and math.isnan(first_s) and math.isnan(times[0])
    assert capsys.readouterr().out == (
        "csbp bench kernels: L=64 flex mixed failed: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n"
    )
    assert emptied == [True] and synced == [CUDA]
    with pytest.raises(torch.OutOfMemoryError):
        kernel_timing.build_and_time(build, torch.device("cpu"), 0, 1, "wall", label="L=64 tiles mixed")


@contextlib.contextmanager
def _sync_debug_stand_in(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[object]]:
    """torch.cuda's sync-debug mode and ``synchronize`` on a CPU build; yields the modes set."""
    modes: list[object] = []
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    yield modes


def test_profile_step_on_cuda_ranks_the_device_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the profile is the device's kernels (torch's own event classes, as ``key_averages`` gives
    them; CPU-side ``aten::`` events left out), by self device time, and every synchronising call one
    step makes is counted (the sync-debug mode's warnings), the mode restored after."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import EventList, FunctionEvent

    import csbp.bench.kernel_profile as kernel_profile

    def event(index: int, name: str, microseconds: int, kind: DeviceType) -> FunctionEvent:
        return FunctionEvent(index, name, 0, 0, microseconds, use_device="cuda", device_type=kind, stack=[],
                             input_shapes=[])

    events = EventList([
        event(1, "flash_fwd_kernel", 300, DeviceType.CUDA), event(2, "flash_fwd_kernel", 300, DeviceType.CUDA),
        event(3, "elementwise_kernel<copy>", 100, DeviceType.CUDA), event(4, "aten::add", 5000, DeviceType.CPU),
    ])
    asked: list[object] = []

    class Profile:
        def __init__(self, activities: list[object]) -> None:
            asked.extend(activities)

        def __enter__(self) -> Profile:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def key_averages(self) -> object:
            events._build_tree()
            return events.key_averages()

    monkeypatch.setattr(torch.profiler, "profile", Profile)
    with _sync_debug_stand_in(monkeypatch) as modes:
        def step() -> None:
            if modes and modes[-1] == "warn":
                warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)

        profiled = kernel_profile.profile_step(step, CUDA, top=2)
    assert torch.profiler.ProfilerActivity.CUDA in asked
    assert profiled.launches == 3 and profiled.syncs == 1 and modes == ["warn", 0]
    assert profiled.top == (("flash_fwd_kernel", 0.6, 2), ("elementwise_kernel<copy>", 0.1, 1))
    assert profiled.busy_ms == pytest.approx(0.7) and profiled.attention_ms == pytest.approx(0.6)


def test_peak_memory_on_cuda_is_the_allocators_peak_over_the_region(monkeypatch: pytest.MonkeyPatch) -> None:
    from csbp.bench.measure import PeakMemory
    from csbp.gpu.train_table import _PeakBytes

    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 3 << 20)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 10 << 20)
    with PeakMemory(CUDA) as peak:
        pass
    assert peak.bytes == 7 << 20 and calls == ["sync", "reset", "sync"]
    with _PeakBytes(CUDA) as absolute:
        pass
    assert absolute.bytes == 10 << 20


@pytest.mark.parametrize(
    ("name", "gib", "preset"),
    [("NVIDIA H200", 139.8, "h200"), ("NVIDIA H100 80GB HBM3", 79.2, "h100"), ("NVIDIA A100-SXM4-80GB", 79.2, "a100"),
     ("Tesla V100-SXM2-32GB", 31.7, "no preset describes it"),
     # each matched a preset by substring before: other links, other memory
     ("NVIDIA GH200 480GB", 95.0, "no preset describes it"),
     ("NVIDIA H100 PCIe", 79.2, "its links are not the h100 preset's SXM NVLink"),
     ("NVIDIA H200 NVL", 139.8, "its links are not the h200 preset's SXM NVLink"),
     ("NVIDIA A100-SXM4-40GB", 39.4, "it has 39 GiB, the a100 preset plans with 66")],
)
def test_topology_auto_takes_the_cuda_devices_preset(
    monkeypatch: pytest.MonkeyPatch, name: str, gib: float, preset: str
) -> None:
    from csbp.plan.auto import gpu_preset
    from csbp.plan.calibration import packaged_calibration
    from csbp.plan.hardware import PRESETS, hardware

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: SimpleNamespace(total_memory=gib * 2**30))
    if preset not in PRESETS:
        with pytest.raises(ValueError, match=re.escape(f"topology: auto has no hardware preset for {name!r} ({preset}): ")):
            gpu_preset()
        return
    assert gpu_preset() == preset
    assert hardware(preset, gpus=8, gpus_per_node=8) and packaged_calibration(preset)  # what auto plans with


def test_doctor_on_a_cuda_machine_names_its_gpus_nccl_and_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    from csbp.cli.doctor_cmd import collect_environment

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: SimpleNamespace(name="NVIDIA H200", total_memory=143 * 2**30))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 3))
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    rows = {(section, item): value for section, item, value in collect_environment()}
    assert rows["cuda", "device 1"] == "NVIDIA H200, 143 GiB" and rows["cuda", "runtime"].endswith("2 device(s)")
    assert rows["nccl", "version"] == "2.27.3" and rows["bf16", "cuda"] == "yes"
    import torch.utils._triton as triton_utils

    monkeypatch.setattr(triton_utils, "has_triton", lambda: False)
    rows = {(section, item): value for section, item, value in collect_environment()}
    assert rows["compile", "train.compile"] == "no on cuda: Triton is not installed (it comes with torch's CUDA wheels)"


def test_the_training_tables_cuda_rows_train_on_the_cpu(
    monkeypatch: pytest.MonkeyPatch, fused_kernels_on_cpu: dict[str, list]
) -> None:
    """The device check's training table as CUDA runs it (the flex backend; ``bd3 decomposed``: cuDNN clean
    pieces with the noisy blocks folded into their one Flex residual; the DFlash row on flex), at tiny sizes
    on the CPU: the direct Flex backward under aot_eager and the cuDNN stand-in instead of the device's
    kernels. Every row trains, and the decomposed form gives the plain form's loss."""
    import dataclasses

    import csbp.gpu.train_table as train_table
    from csbp.attention.backends import check_backend_trains_on
    from csbp.attention.flex_backward import flex_backward_mode
    from csbp.gpu.profile import DRY_RUN_MODEL

    monkeypatch.setattr(train_table, "check_backend_trains_on",  # flex trains on the CPU only to verify
                        lambda name, device, where: check_backend_trains_on(name, device, where=where, verification=True))
    cfg = train_table.TableConfig(
        seq_lens=(128,), decomposed_seq_lens=(128,), block_size=16, model=dataclasses.replace(DRY_RUN_MODEL, head_dim=16),
        backend="flex", dflash_seq_len=128, dflash_anchors=4, dflash_draft_layers=1, warmup=0, repeats=1,
    )
    assert (cfg.decomposed_diagonal, cfg.decomposed_clean) == ("auto", "pieces-cudnn")  # what CUDA runs
    with flex_backward_mode("direct"):
        rows = train_table.run_train_table(cfg, torch.device("cpu"))
    assert [(row.kind, row.status) for row in rows] == [
        ("bd3", "ok (1 timed)"), ("bd3 decomposed", "ok (1 timed)"), ("dflash a=4", "ok (1 timed)"),
    ]
    assert "forward" in fused_kernels_on_cpu["cudnn"] and "backward" in fused_kernels_on_cpu["cudnn"]
    assert rows[1].loss == pytest.approx(rows[0].loss, rel=1e-2)


def test_every_form_the_kernels_stage_times_on_cuda_steps_on_the_cpu(fused_kernels_on_cpu: dict[str, list]) -> None:
    """The rows of the device check's ``kernels`` stage (``gpu.profile.KERNEL_BENCH_ARGS``: the flex backend,
    the sdpa and flex diagonals, cuDNN pieces, FlashAttention-2 pieces and one Flex call for the clean context),
    planned and stepped (forward and backward) at a tiny length on the CPU, where ``csbp bench kernels`` refuses
    flex and cuDNN pieces: the direct Flex backward under aot_eager and the fused stand-ins instead. The
    ``mixed-ag`` row, FlexAttention's own autograd, has no CPU backward."""
    from csbp.attention.diagonal import resolve_diagonal
    from csbp.attention.flex_backward import flex_backward_mode
    from csbp.attention.layouts import reference_layout
    from csbp.cli.main import build_parser
    from csbp.gpu.profile import KERNEL_BENCH_ARGS

    args = build_parser().parse_args(["bench", "kernels", *KERNEL_BENCH_ARGS])
    seq_len = 128
    jobs = kernels.kernel_jobs(
        [seq_len], args.block_sizes, args.backends,
        lambda backend, block: list(dict.fromkeys(resolve_diagonal(d, backend, block) for d in args.diagonals)),
        args.clean_kernels, primary_first=args.primary_first,
    )
    gen = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(1, 4, 2 * seq_len, 16, generator=gen).bfloat16() for _ in "qd")
    k, v = (torch.randn(1, 1, 2 * seq_len, 16, generator=gen).bfloat16() for _ in "kv")
    stepped = []
    with flex_backward_mode("direct"):
        for job in jobs:
            if job.form == "mixed-ag":
                continue
            rows = reference_layout(seq_len, job.block_size).rows
            kernels._form_step(q, k, v, dout, rows, seq_len, job.block_size, job.backend, job.form, job.diagonal,
                               job.clean)()
            stepped.append((job.block_size, job.form, job.diagonal, job.clean))
    assert len(stepped) == 2 * (1 + 3 * 2 + 2)  # per block size: mixed, 3 clean x 2 diagonal kernels, 2 diagonals
    assert fused_kernels_on_cpu["flash"] and fused_kernels_on_cpu["cudnn"].count("backward") >= 2


def test_every_rank_row_the_layouts_stage_times_on_cuda_runs_on_the_cpu(fused_kernels_on_cpu: dict[str, list]) -> None:
    """The ``layouts`` stage's rows (``gpu.profile.LAYOUT_BENCH_ARGS``: the busiest rank of cp4/bp8, cp4 and
    bp4 on the flex backend, the generic clean kernel and cuDNN pieces) at a tiny length on the CPU, through
    ``run_rank_rows`` itself (on the CPU a failing row raises instead of becoming a nan row)."""
    from csbp.bench.kernel_ranks import check_layouts, parse_topologies, run_rank_rows
    from csbp.cli.main import build_parser
    from csbp.gpu.profile import LAYOUT_BENCH_ARGS

    args = build_parser().parse_args(["bench", "kernels", *LAYOUT_BENCH_ARGS])
    topologies = parse_topologies(args.layouts)
    seq_len, block = 1024, 64
    check_layouts(topologies, [seq_len], [block])
    records = run_rank_rows(
        [seq_len], [block], args.backends, topologies, device=torch.device("cpu"), dtype=args.dtype, num_heads=4,
        num_kv_heads=1, head_dim=16, warmup=0, repeats=1, clock="wall", clean_kernels=args.layout_clean,
        transports=args.layout_transports, flex_backward="direct",
    )
    assert [(r.topology, r.clean, r.transport) for r in records] == [
        (name, clean, "-" if name == "bp4" else "collective") for clean in args.layout_clean for name in args.layouts
    ]
    assert all(r.time_s > 0 and r.flex_backward == "direct" for r in records)
    assert fused_kernels_on_cpu["cudnn"].count("backward") >= 2


def test_cuda_device_identity_and_the_nccl_backends_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """``same_device``: ``cuda`` without an index is the current GPU; ``backend_device``: an NCCL group moves
    tensors of the current GPU (gloo: the CPU)."""
    import torch.distributed as dist

    from csbp.devices import backend_device, same_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert same_device(torch.device("cuda"), torch.device("cuda", 1))
    assert not same_device(torch.device("cuda"), torch.device("cuda", 0))
    assert not same_device(torch.device("cuda", 0), torch.device("cuda", 1))
    assert not same_device(torch.device("cuda", 0), torch.device("cpu"))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    for backend, device in (("nccl", torch.device("cuda", 1)), ("gloo", torch.device("cpu"))):
        monkeypatch.setattr(dist, "get_backend", lambda group=None, name=backend: name)
        assert backend_device() == device


def test_a_training_table_row_out_of_memory_on_cuda_frees_the_cache_and_the_table_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from csbp.gpu.check import no_cuda_message
    from csbp.gpu.train_table import TableRow, _run_row

    emptied: list[bool] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))

    def out_of_memory() -> TableRow:
        raise torch.OutOfMemoryError("CUDA out of memory")

    assert _run_row("bd3", 65536, out_of_memory, CUDA) == TableRow("bd3", 65536, "out of memory", "-")
    assert emptied == [True]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert no_cuda_message() is None  # a GPU: the check runs
