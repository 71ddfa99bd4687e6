"""Counted collectives: values against hand-computed expectations and byte counts against the formulas.

Workers return what every operation produced plus the counter snapshot; the parent recomputes the
expected tensors from the same per-rank data functions. All values are small multiples of 1/4,
so sums are exact in float32 and float64 and tensors are compared with ``torch.equal``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from csbp.parallel.comm import Comm, Pending, TrafficCounter, serialized_collectives
from csbp.parallel.launch import run_local

DTYPES = (torch.float64, torch.float32)
ROWS, COLS = 3, 2  # shard shape [ROWS, COLS]


def _shard(global_rank: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.arange(ROWS * COLS, dtype=dtype).reshape(ROWS, COLS) + 10 * global_rank


def _full(global_rank: int, size: int, dtype: torch.dtype) -> torch.Tensor:
    values = torch.arange(size * ROWS * COLS, dtype=dtype).reshape(size * ROWS, COLS)
    return (values + 0.5) * (global_rank + 1)


def _split(src: int, dst: int) -> int:
    """Rows group rank ``src`` sends to group rank ``dst``: uneven, with zeros."""
    return (src + 2 * dst) % 3


def _a2a_rows(global_src: int, dst: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    base = 1000 * global_src + 10 * dst + torch.arange(count, dtype=dtype)
    return base[:, None] + 0.25 * torch.arange(COLS, dtype=dtype)[None, :]


def _exercise(comm: Comm, dtype: torch.dtype) -> dict:
    """Run every operation once on ``comm``; one counter category per operation."""
    me, size = comm.rank, comm.size
    g = comm.global_ranks[me]
    counter = comm.counter
    out: dict = {}
    out["all_gather"], _ = comm.all_gather(_shard(g, dtype), category="all_gather")
    gathered, pending = comm.all_gather(_shard(g, dtype), async_op=True, category="all_gather_async")
    out["all_gather_counted_at_issue"] = counter.bytes("all_gather_async")
    out["all_gather_async"] = pending.wait()
    out["all_gather_async_same_tensor"] = pending.wait() is gathered
    out["reduce_scatter"], _ = comm.reduce_scatter(_full(g, size, dtype), category="reduce_scatter")
    _, pending = comm.reduce_scatter(_full(g, size, dtype), async_op=True, category="reduce_scatter_async")
    out["reduce_scatter_async"] = pending.wait()
    send_splits = [_split(me, d) for d in range(size)]
    recv_splits = [_split(s, me) for s in range(size)]
    send = torch.cat([_a2a_rows(g, d, send_splits[d], dtype) for d in range(size)])
    out["all_to_all"], pending = comm.all_to_all(send, send_splits, recv_splits, category="all_to_all")
    out["all_to_all_blocking_has_no_pending"] = pending is None
    received, pending = comm.all_to_all(send, send_splits, recv_splits, async_op=True, category="all_to_all_async")
    out["all_to_all_counted_at_issue"] = counter.bytes("all_to_all_async")
    sorted_rows = pending.then(lambda rows: rows.flip(0))  # post-processing runs after the transfer
    out["all_to_all_not_done_before_wait"] = not pending.done and not sorted_rows.done
    out["all_to_all_async"] = pending.wait()
    out["all_to_all_async_same_tensor"] = pending.wait() is received
    out["all_to_all_then"] = sorted_rows.wait()
    with serialized_collectives():  # the same transfer and bytes, waited for at issue
        _, pending = comm.all_to_all(send, send_splits, recv_splits, async_op=True, category="all_to_all_serialized")
    out["all_to_all_serialized_done_at_issue"] = pending.done
    out["all_to_all_serialized"] = pending.wait()
    for direction in (-1, 1):
        out[f"ring_{direction}"] = comm.ring_shift(_shard(g, dtype), direction, category=f"ring_{direction}")
        handle = comm.ring_shift_async(_shard(g, dtype), direction, category=f"ring_async_{direction}")
        out[f"ring_async_{direction}_counted_at_issue"] = counter.bytes(f"ring_async_{direction}")
        out[f"ring_async_{direction}"] = handle.wait()
    out["all_reduce"] = comm.all_reduce(_shard(g, dtype))  # default category
    src = min(1, size - 1)
    out["broadcast"] = comm.broadcast(_shard(g, dtype), src, category="broadcast")
    out["counter"] = counter.snapshot()
    return out


def _run_group(group: dist.ProcessGroup | None) -> dict:
    comm = Comm(group, TrafficCounter())
    return {
        "global_ranks": comm.global_ranks,
        "rank": comm.rank,
        "results": {str(dtype): _exercise(Comm(group, TrafficCounter()), dtype) for dtype in DTYPES},
    }


def _world_worker(rank: int, world: int) -> dict:
    return {"world": _run_group(None)}


GROUP_FAMILIES = {
    "pairs": [[0, 1], [2, 3]],
    "strided_pairs": [[0, 2], [1, 3]],
    "triple": [[0, 1, 2]],
    "singletons": [[0], [1], [2], [3]],
}


def _subgroup_worker(rank: int, world: int) -> dict:
    report: dict = {"world": _run_group(None)}
    for name, families in GROUP_FAMILIES.items():
        for members in families:
            group = dist.new_group(members)  # every rank joins every new_group call, member or not
            if rank in members:
                report[name] = _run_group(group)
            else:
                try:
                    Comm(group)
                    report[f"{name}_non_member"] = "no error"
                except ValueError as exc:
                    report[f"{name}_non_member"] = str(exc)
    return report


def _check(report: dict) -> None:
    """Assert every value and byte count of one rank's ``_run_group`` report."""
    members, me = report["global_ranks"], report["rank"]
    size = len(members)
    for dtype in DTYPES:
        res = report["results"][str(dtype)]
        itemsize = torch.empty((), dtype=dtype).element_size()
        shard_bytes = ROWS * COLS * itemsize
        gathered = torch.cat([_shard(m, dtype) for m in members])
        assert torch.equal(res["all_gather"], gathered)
        assert torch.equal(res["all_gather_async"], gathered)
        assert res["all_gather_async_same_tensor"]
        reduced = sum(_full(m, size, dtype) for m in members)[me * ROWS : (me + 1) * ROWS]
        assert torch.equal(res["reduce_scatter"], reduced)
        assert torch.equal(res["reduce_scatter_async"], reduced)
        received = torch.cat([_a2a_rows(members[s], me, _split(s, me), dtype) for s in range(size)])
        assert torch.equal(res["all_to_all"], received)
        assert torch.equal(res["all_to_all_async"], received) and res["all_to_all_async_same_tensor"]
        assert torch.equal(res["all_to_all_then"], received.flip(0))
        assert res["all_to_all_blocking_has_no_pending"] and res["all_to_all_not_done_before_wait"]
        assert torch.equal(res["all_to_all_serialized"], received) and res["all_to_all_serialized_done_at_issue"]
        for direction in (-1, 1):
            from_neighbour = _shard(members[(me - direction) % size], dtype)
            assert torch.equal(res[f"ring_{direction}"], from_neighbour)
            assert torch.equal(res[f"ring_async_{direction}"], from_neighbour)
        assert torch.equal(res["all_reduce"], sum(_shard(m, dtype) for m in members))
        src = min(1, size - 1)
        assert torch.equal(res["broadcast"], _shard(members[src], dtype))

        if size == 1:
            assert res["counter"] == {}, "a size-1 group must issue and count nothing"
            continue
        rows_to_others = sum(_split(me, d) for d in range(size) if d != me)
        expected_bytes = {
            "all_gather": (size - 1) * shard_bytes,
            "all_gather_async": (size - 1) * shard_bytes,
            "reduce_scatter": (size - 1) * shard_bytes,
            "reduce_scatter_async": (size - 1) * shard_bytes,
            "all_to_all": rows_to_others * COLS * itemsize,
            "all_to_all_async": rows_to_others * COLS * itemsize,
            "all_to_all_serialized": rows_to_others * COLS * itemsize,
            "ring_-1": shard_bytes,
            "ring_1": shard_bytes,
            "ring_async_-1": shard_bytes,
            "ring_async_1": shard_bytes,
            "attention": 2 * (size - 1) * shard_bytes // size,
            "broadcast": (size - 1) * shard_bytes if me == src else 0,
        }
        assert res["counter"] == {k: {"bytes": v, "calls": 1} for k, v in sorted(expected_bytes.items())}
        assert res["all_gather_counted_at_issue"] == (size - 1) * shard_bytes
        assert res["ring_async_-1_counted_at_issue"] == shard_bytes
        assert res["all_to_all_counted_at_issue"] == rows_to_others * COLS * itemsize


@pytest.mark.multiprocess
def test_collectives_two_processes():
    reports = run_local(_world_worker, 2, timeout_s=60)
    for rank, report in enumerate(reports):
        assert report["world"]["global_ranks"] == [0, 1] and report["world"]["rank"] == rank
        _check(report["world"])


@pytest.mark.multiprocess
def test_collectives_four_processes_and_subgroups():
    reports = run_local(_subgroup_worker, 4, timeout_s=60)
    for rank, report in enumerate(reports):
        _check(report["world"])
        for name, families in GROUP_FAMILIES.items():
            members = next((m for m in families if rank in m), None)
            if members is None:
                assert "not in the group" in report[f"{name}_non_member"]
                continue
            assert report[name]["global_ranks"] == members
            assert report[name]["rank"] == members.index(rank)
            _check(report[name])
    # the all_to_all splits exercised zero-sized sends and receives
    assert any(_split(s, d) == 0 for s in range(4) for d in range(4) if s != d)


def test_single_process_comm_short_circuits():
    assert not dist.is_initialized()
    _check({"global_ranks": [0], "rank": 0, "results": {str(d): _exercise(Comm(None), d) for d in DTYPES}})
    comm = Comm(None)
    shard = _shard(0, torch.float64)
    out, pending = comm.all_gather(shard, async_op=True)
    assert out is shard and isinstance(pending, Pending) and pending.wait() is shard
    out, pending = comm.all_to_all(shard, [ROWS], [ROWS], async_op=True)
    assert out is shard and isinstance(pending, Pending) and pending.wait() is shard
    assert comm.counter.calls() == 0 and comm.counter.bytes() == 0


def test_traffic_counter():
    counter = TrafficCounter()
    counter.add("kv", 10)
    counter.add("kv", 5)
    counter.add("dkv", 7)
    assert counter.bytes("kv") == 15 and counter.calls("kv") == 2
    assert counter.bytes() == 22 and counter.calls() == 3 and counter.bytes("missing") == 0
    assert counter.snapshot() == {"dkv": {"bytes": 7, "calls": 1}, "kv": {"bytes": 15, "calls": 2}}
    counter.reset()
    assert counter.snapshot() == {} and counter.bytes() == 0
    with pytest.raises(ValueError, match="nbytes"):
        counter.add("kv", -1)


def test_invalid_arguments_raise():
    comm = Comm(None)
    with pytest.raises(ValueError, match="one split per group rank"):
        comm.all_to_all(torch.zeros(2, 1), [1, 1], [2])
    with pytest.raises(ValueError, match="must sum to"):
        comm.all_to_all(torch.zeros(2, 1), [3], [3])
    with pytest.raises(ValueError, match="src_group_rank"):
        comm.broadcast(torch.zeros(2), 1)
    with pytest.raises(ValueError, match="multiple of the group size"):
        comm.reduce_scatter(torch.zeros(()))
