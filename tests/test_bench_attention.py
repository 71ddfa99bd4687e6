"""``csbp bench attention``: how the layouts are measured against each other.

The launch itself is replaced by a stand-in that records what it was asked to run, so these tests
need no processes; the multi-process runs of the benchmark are in ``test_documents_exactness.py``
and ``test_schedule_balanced.py``.
Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_bench_attention.py -q``
"""

from __future__ import annotations

from typing import Any

import pytest

import csbp.bench.attention as attention_bench


def _fake_results(layout_index: int) -> dict[str, float]:
    return {
        "step_time_s": 1.0 + layout_index,
        "kv_bytes": 100.0 * (layout_index + 1),
        "flops": 1e9 * (layout_index + 1),
        "peak": 1000.0 * (layout_index + 1),
        "serial_step_time_s": float("nan"),
        "halo": 0.0,
    }


def test_layouts_of_one_length_share_one_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every layout of a sequence length runs in one launch (steps interleaved in the same processes),
    not one launch per layout one after the other: a drift of the machine's load between launches
    would otherwise bias the layouts that run last. Each layout keeps its own transport and schedule,
    and each record gets its own layout's results."""
    launches: list[tuple[list[Any], Any]] = []

    def fake_launch(worker: Any, nproc: int, cell: list[Any], cfg: Any, **kwargs: Any) -> list[list[dict[str, float]]]:
        launches.append((list(cell), cfg))
        return [[_fake_results(index)] * nproc for index in range(len(cell))]

    monkeypatch.setattr(attention_bench, "launch_cell", fake_launch)
    layouts = ["cp", "cp-aware", "csbp", "csbp-balanced"]
    records = attention_bench.run_attention_bench([64, 128], nproc=2, layouts=layouts, block_size=8, repeats=1)

    assert len(launches) == 2  # one per sequence length
    for (cell, cfgs), seq_len in zip(launches, (64, 128), strict=True):
        assert len(cell) == len(layouts)
        assert [c.seq_len for c in cfgs] == [seq_len] * len(layouts)
        assert [c.transport for c in cfgs] == ["collective", "halo", "collective", "collective"]
        assert [c.schedule for c in cfgs] == ["dual_end", "dual_end", "dual_end", "balanced"]
    assert [(r.seq_len, r.layout) for r in records] == [(n, name) for n in (64, 128) for name in layouts]
    for index, record in enumerate(records[: len(layouts)]):
        assert record.step_time_s == 1.0 + index
        assert record.kv_bytes_per_rank == 100 * (index + 1)
        assert record.peak_mem_bytes == 1000 * (index + 1)


@pytest.mark.parametrize(("device", "backend", "expected"), [("cuda", "auto", "flex"), ("cuda", "flex", "flex"),
                                                              ("cpu", "auto", "tiles")])
def test_backend_resolves_on_the_benchmark_device(
    device: str, backend: str, expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--backend auto`` means the backend of the device the processes run on, as in ``bench train``:
    flex with ``--device cuda`` (``--backend flex`` is accepted there), tiles on the CPU. It used to be
    resolved for the CPU whatever ``--device`` said, so a CUDA run timed the tiles and refused flex."""
    import torch

    from csbp.cli.main import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    seen: dict[str, Any] = {}

    def fake_run(seq_lens: list[int], **kwargs: Any) -> list[Any]:
        seen.update(kwargs)
        return []

    monkeypatch.setattr(attention_bench, "run_attention_bench", fake_run)
    argv = ["bench", "attention", "--device", device, "--nproc", "2", "--backend", backend, "--seq-lens", "64"]
    assert main(argv) == 0
    assert seen["backend"] == expected and seen["device"] == device


def test_a_measured_step_starts_with_nothing_of_the_previous_step_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    """Peak memory is the growth of the resident set over a step above what was resident when it began,
    so the previous step's output, input and autograd graph (with the tensors the transports keep on
    it) must be gone by then. The benchmark used to keep them in loop variables until the next step's
    forward replaced them, which read ~12 MiB (cp) and ~10 MiB (csbp) less than a step needs at 16K."""
    import weakref
    from contextlib import contextmanager

    import torch
    import torch.distributed as dist

    from csbp.topology import Topology

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # the conftest destroys it
    outputs: list[weakref.ref[torch.Tensor]] = []
    forward = attention_bench.AttentionStack.forward

    def recording_forward(self: Any, *args: Any) -> torch.Tensor:
        out = forward(self, *args)
        outputs.append(weakref.ref(out))
        return out

    real_measured_step = attention_bench.measured_step
    alive_at_start: list[int] = []

    @contextmanager
    def checking_measured_step(counter: Any = None) -> Any:
        alive_at_start.append(sum(ref() is not None for ref in outputs))
        with real_measured_step(counter) as step:
            yield step

    monkeypatch.setattr(attention_bench.AttentionStack, "forward", recording_forward)
    monkeypatch.setattr(attention_bench, "measured_step", checking_measured_step)
    cfg = attention_bench.AttentionBenchConfig(seq_len=64, block_size=8, warmup=1, repeats=2, ablate_overlap=True)
    (summary,) = attention_bench._worker(0, 1, [Topology()], (cfg,))
    assert len(outputs) == len(alive_at_start) == 6  # (1 warm-up + 2) steps, each overlapped and serialized
    assert alive_at_start == [0] * 6
    assert summary["step_time_s"] > 0 and summary["flops"] > 0
