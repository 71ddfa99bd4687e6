"""Memory a long run must not accumulate: what a step leaves behind in process-wide caches or in the
metrics writer is bounded by a constant, not by the number of steps. Document masking packs new
documents into every row, so anything keyed by a row's documents is never asked for again after its
step; the caches keep only what the same step (or ``csbp plan``) asks for again. And a process that
trains several times (``csbp compare`` trains every layout of a round in the same processes) ends
each run with what it started with: no model, gradient buffer, process group, socket or thread of
an earlier run stays behind."""

from __future__ import annotations

import gc
import os
import tracemalloc
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from csbp.attention import counts
from csbp.attention.counts import rank_schedule
from csbp.attention.documents import random_documents
from csbp.engine.grad_buckets import OverlappedGradientSync
from csbp.parallel.launch import run_local
from csbp.training.metrics import MetricsWriter, read_metrics
from csbp.training.trainer import train


def _rows(seq_len: int, count: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """``count`` rows of distinct packed documents (mean length 97), as ``DocBounds``."""
    generator = torch.Generator().manual_seed(seed)
    rows = [random_documents(seq_len, 97, generator) for _ in range(count)]
    return [(row.start.numpy(), row.stop.numpy()) for row in rows]


def _retained(work: Callable[[], None]) -> int:
    """Bytes Python's allocators still hold after ``work`` (its temporaries collected)."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        work()
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def _clear_document_caches() -> None:
    counts._document_schedule.cache_clear()
    kept = getattr(counts, "_row_costs_kept", None)
    if kept is not None:
        kept.clear()
        counts._row_costs_bytes = 0
    else:  # the lru_cache before the byte bound
        counts._document_row_costs.cache_clear()


@pytest.fixture(autouse=True)
def _fresh_document_caches():
    _clear_document_caches()
    yield
    _clear_document_caches()


def test_balanced_schedules_of_many_distinct_rows_hold_no_more_than_a_few_rows() -> None:
    """A training run with ``schedule: balanced`` and document masking asks for the schedule of a new
    row every step: what the caches keep must stop growing after a few rows (512 kept schedules
    were over 1 GB per rank at 1M tokens)."""
    seq_len, block, cp, bp = 16384, 4, 2, 4
    rows = _rows(seq_len, 64)

    def schedule(chosen: list[tuple[np.ndarray, np.ndarray]]) -> Callable[[], None]:
        return lambda: [rank_schedule(seq_len, block, cp, bp, "balanced", docs) for docs in chosen]  # type: ignore[func-returns-value]

    after_16 = _retained(schedule(rows[:16]))
    _clear_document_caches()
    after_64 = _retained(schedule(rows))
    assert after_64 < 1.25 * after_16, (after_16, after_64)


def test_row_costs_stay_under_their_byte_bound_and_own_their_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cost prefix sums of a row are ``[L+1]`` int64 arrays: the rows kept are bounded in bytes
    (16 rows at 1M tokens held 256 MiB), and no kept array is a view pinning a larger one."""
    seq_len, block = 65536, 64
    one_row = 2 * (seq_len + 1) * 8 + (seq_len // block) * 8
    monkeypatch.setattr(counts, "ROW_COSTS_BYTES", 2 * one_row + one_row // 2, raising=False)
    rows = _rows(seq_len, 20, seed=1)
    retained = _retained(lambda: [rank_schedule(seq_len, block, 1, 4, "balanced", docs) for docs in rows])  # type: ignore[func-returns-value]
    schedules = counts.DOCUMENT_SCHEDULES_KEPT * (seq_len // block) * 40  # ints and tuple slots, generously
    assert retained < 3 * one_row + schedules, (retained, one_row)


def test_one_rows_layouts_still_price_its_documents_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bounds keep the reuse the caches are for: every BP rank's layout of one row (and every
    ring member's in its exchange plan) prices the row's documents once."""
    priced = []
    block_costs = counts.block_costs
    monkeypatch.setattr(counts, "block_costs", lambda *args: priced.append(1) or block_costs(*args))
    docs = _rows(4096, 1, seed=2)[0]
    first = [rank_schedule(4096, 8, 2, 4, "balanced", docs) for _ in range(2 * 4)]
    assert len(priced) == 1 and all(schedule is first[0] for schedule in first)


def test_the_metrics_writer_keeps_no_record_of_past_steps(tmp_path: Path) -> None:
    """Every step's record goes to ``metrics.jsonl`` and TensorBoard; none stays in memory (a kept
    list grew by about 440 bytes a step on rank 0)."""
    writer = MetricsWriter(tmp_path, enabled=True, start_step=0, total_steps=10**6)

    def record(step: int) -> dict[str, float]:
        return {"step": step, "loss": 1.0 + step * 1e-6, "lr": 1e-3, "grad_norm": 0.5,
                "tokens_per_s": 1e4 + step, "peak_mem_bytes": 1e9 + step, "elapsed_s": float(step)}

    for step in range(1, 101):  # TensorBoard's and tqdm's first-use allocations
        writer.log(record(step))
    retained = _retained(lambda: [writer.log(record(step)) for step in range(101, 2101)])  # type: ignore[func-returns-value]
    writer.close()
    assert retained < 64 * 1024, retained
    assert len(read_metrics(tmp_path / "metrics.jsonl")) == 2100


def test_a_dropped_gradient_sync_frees_its_model() -> None:
    """The parameters' gradient hooks must not keep the sync (and through its buckets the
    parameters) alive: once the trainer drops both, the model and its gradient buffers are freed."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    sync = OverlappedGradientSync(model.parameters(), None)
    sync.arm()
    model(torch.ones(2, 8)).sum().backward()  # the hooks ran
    sync.finish()
    freed = [weakref.ref(model[0].weight), weakref.ref(sync)]
    del model, sync
    gc.collect()
    assert all(ref() is None for ref in freed)


def _process_state() -> tuple[int, int, int]:
    """(open file descriptors, threads, live ``nn.Parameter`` objects) of this process."""
    gc.collect()
    threads = len(os.listdir("/proc/self/task"))
    params = sum(isinstance(obj, torch.nn.Parameter) for obj in gc.get_objects())
    return len(os.listdir("/proc/self/fd")), threads, params


def _train_three_times(rank: int, world: int, config: dict, root: str) -> list[tuple[int, int, int]]:
    from csbp.config import config_from_dict

    states = []
    for run in range(3):
        train(config_from_dict(config), run_dir=Path(root) / f"run{run}")
        states.append(_process_state())
    return states


@pytest.mark.multiprocess
@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts open files through /proc")
def test_training_again_in_the_same_processes_leaves_nothing_of_the_earlier_run(tmp_path: Path) -> None:
    """Three tiny CSBP trainings on the same two gloo processes: after each one every rank has the
    same open files, threads and live parameters as after the first (each run kept its process
    groups, about 23 descriptors and 15 threads a rank, and its whole model before)."""
    from test_training_run import config_dict, make_artifact

    artifact = make_artifact(tmp_path / "data")
    config = config_dict(artifact, **{"topology.cp": 2, "topology.bp": 2, "train.max_steps": 2,
                                      "train.grad_accum": 1, "train.eval_every": 0, "train.save_every": 0})
    for rank_states in run_local(_train_three_times, 2, (config, str(tmp_path / "runs")), timeout_s=240):
        assert rank_states[0] == rank_states[1] == rank_states[2], rank_states


def _verify_three_cases(rank: int, world: int) -> list[tuple[int, int]]:
    """The fuzz sweep's batch worker runs several cases in one process; (fds, threads) after each."""
    from csbp.dflash.verify import DFlashVerifyCase
    from csbp.dflash.verify import _worker as dflash_worker
    from csbp.engine.verify import VerifyCase
    from csbp.engine.verify import _worker as engine_worker
    from csbp.topology import Topology

    states = []
    for worker, case in [(engine_worker, VerifyCase(Topology(cp=2))), (dflash_worker, DFlashVerifyCase(Topology(cp=2))),
                         (engine_worker, VerifyCase(Topology(cp=2, bp=2), seed=1))]:
        worker(rank, world, case)
        states.append(_process_state()[:2])
    return states


@pytest.mark.multiprocess
@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="counts open files through /proc")
def test_verify_cases_in_one_process_leave_no_process_groups_behind() -> None:
    """Each verify case builds its own process groups; a batch of cases in one process (``csbp verify
    --random``) must end every case with the descriptors and threads it had after the first."""
    for rank_states in run_local(_verify_three_cases, 2, (), timeout_s=240):
        assert rank_states[0] == rank_states[1] == rank_states[2], rank_states
