"""The local launcher returns per-rank results and surfaces worker errors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from csbp.parallel.launch import WorkerError, run_local


def _sum_ranks(rank: int, world: int) -> float:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return float(t.item())


def _fail_on_one(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("boom")


def test_run_local_all_reduce():
    assert run_local(_sum_ranks, 3) == [3.0, 3.0, 3.0]


def test_run_local_reports_rank_error():
    with pytest.raises(WorkerError, match="rank 1: ValueError: boom"):
        run_local(_fail_on_one, 2, timeout_s=20)
