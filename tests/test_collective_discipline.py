"""NCCL's rules for collectives, asserted on the CPU over gloo for the ring transports.

gloo forgives what NCCL does not, so a layout that passes every CPU test can still fail, or hang,
on its first multi-GPU run. Each worker of one 2-process gloo run wraps every ``torch.distributed``
collective that ``csbp.parallel.comm.Comm`` issues (and any direct ``dist.all_reduce`` /
``dist.broadcast``), runs one step of each ring layout below, and returns what it saw. The
parent then asserts, for every call:

* every tensor lives on the device the group's backend serves (``csbp.devices.backend_device``:
  the CPU for gloo, the current GPU for NCCL) and is contiguous;
* its dtype is one NCCL carries;
* ``all_to_all`` split sizes are Python ``int`` (not tensors or NumPy integers), and what rank
  ``s`` sends to rank ``d`` is what ``d`` expects from ``s``;
* every member of a group issues the same collectives in the same order with the same dtype
  and element count (a mismatch hangs NCCL), and two ranks interleave the groups they share the
  same way (opposite orders on two communicators can deadlock);
* every asynchronous work (``async_op=True``, ``batch_isend_irecv``) is waited for;
* a layer's attention (forward and backward of every transport's autograd Function, its plan
  already built) issues no operation that synchronises a GPU with the host (``.item()``,
  ``nonzero``, boolean indexing, ``unique``, ...: recorded as aten ops under a dispatch mode);
  one per layer would stall every layer on CUDA. ``.tolist()`` and ``.cpu()`` of a CPU tensor
  do not reach the dispatcher; ``tests/test_single_gpu_cuda.py`` catches those on a GPU.

The layouts: BD3 CSBP (cp=2, bp=2) with the collective, streaming and window transports, packed
documents (the halo transport) with the dual-end and the document-aware ``balanced`` schedule,
CP-only ``halo`` (cp=2); DFlash CSBP with the all-gather and with the document-aware context
exchange (async all-to-all), and with the KL loss (the target pass's K/V all-gathers and the
teacher rows' all-to-all). Device placement itself is checked by ``Comm`` on every call;
``tests/test_cuda.py`` runs the same code on CUDA.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from csbp.devices import backend_device
from csbp.parallel.launch import run_local
from csbp.topology import Topology

NCCL_DTYPES = {
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int32,
    torch.int64, torch.bool,
}
"""The dtypes ``ProcessGroupNCCL`` maps to an NCCL data type (float8 left out: csbp sends none)."""


def _cases() -> list[tuple[str, str, Any]]:
    from csbp.dflash.config import DFlashObjectiveConfig
    from csbp.dflash.verify import DFlashVerifyCase
    from csbp.engine.verify import VerifyCase

    csbp = Topology(cp=2, bp=2)
    return [
        ("bd3-collective", "bd3", VerifyCase(csbp)),
        ("bd3-streaming", "bd3", VerifyCase(csbp, transport="streaming")),
        ("bd3-window", "bd3", VerifyCase(csbp, window=6)),
        ("bd3-documents", "bd3", VerifyCase(csbp, seq_len=16, doc_length=3)),
        ("bd3-documents-balanced", "bd3", VerifyCase(csbp, doc_length=3, schedule="balanced")),
        ("bd3-cp-aware", "bd3", VerifyCase(Topology(cp=2), seq_len=16, doc_length=3, transport="halo")),
        ("dflash-all-gather", "dflash", DFlashVerifyCase(csbp)),
        ("dflash-context-exchange", "dflash", DFlashVerifyCase(csbp, doc_length=6)),
        ("dflash-kl-teacher", "dflash", DFlashVerifyCase(csbp, objective=DFlashObjectiveConfig(loss="kl"))),
    ]


SYNCING_OPS = {
    "_local_scalar_dense", "nonzero", "masked_select", "is_nonzero", "equal", "unique_consecutive", "_unique",
    "_unique2", "unique_dim", "bincount", "histc",
}
"""aten ops that wait for a CUDA device's result on the host (``.item()``, ``bool(t)``, ``int(t)`` and
``float(t)`` are ``_local_scalar_dense``); ``repeat_interleave`` without ``output_size`` and indexing
with a boolean mask are added by ``_syncs``."""


def _syncs(func: Any, args: tuple, kwargs: dict) -> bool:
    name = func.overloadpacket.__name__
    if name in SYNCING_OPS:
        return True
    if name == "repeat_interleave":
        return isinstance(args[0], torch.Tensor) and args[0].dim() > 0 and kwargs.get("output_size") is None
    if name in ("index", "index_put", "index_put_") and len(args) > 1:
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
    return False


class _HostSyncs(TorchDispatchMode):
    """Records the host-synchronising aten ops run inside it."""

    def __init__(self, found: list[str]) -> None:
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if _syncs(func, args, kwargs):
            self.found.append(str(func))
        return func(*args, **kwargs)


# ---------------------------------------------------------------- in each worker: the recorder


class _Recorder:
    def __init__(self) -> None:
        self.case = ""
        self.calls: list[dict[str, Any]] = []
        self.layers: list[dict[str, Any]] = []  # one per attention forward or backward

    def layer(self, kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` (an attention autograd Function's forward or backward), recording its host syncs."""
        def wrapped(*args: Any) -> Any:
            found: list[str] = []
            with _HostSyncs(found):
                result = fn(*args)
            self.layers.append({"case": self.case, "kind": kind, "syncs": found})
            return result
        return staticmethod(wrapped)

    def record(self, op: str, group: dist.ProcessGroup | None, tensors: list[torch.Tensor], **extra: Any) -> dict:
        ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else tuple(range(dist.get_world_size()))
        entry = {
            "case": self.case,
            "op": op,
            "group": (getattr(group, "group_name", None), ranks),
            "position": ranks.index(dist.get_rank()),
            "expected_device": str(backend_device(group)),
            "tensors": [(str(t.device), t.dtype, t.is_contiguous(), t.numel()) for t in tensors],
            "waited": True,
            "async": False,
            **extra,
        }
        self.calls.append(entry)
        return entry


class _TrackedWork:
    """A backend ``Work`` that notes in its log entry when it is waited for."""

    def __init__(self, work: Any, entry: dict) -> None:
        self._work, self._entry = work, entry
        entry["waited"], entry["async"] = False, True

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        self._entry["waited"] = True
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _tracked(work: Any, entry: dict) -> Any:
    return _TrackedWork(work, entry) if work is not None else None


def _install(recorder: _Recorder) -> None:
    """Wrap the collectives ``Comm`` calls (module attributes, looked up at call time)."""
    from csbp.parallel import comm as comm_module

    def single(op: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(out: torch.Tensor, inp: torch.Tensor, group: Any = None, async_op: bool = False) -> Any:
            entry = recorder.record(op, group, [inp, out])
            return _tracked(fn(out, inp, group=group, async_op=async_op), entry) if async_op else fn(
                out, inp, group=group, async_op=async_op)
        return wrapped

    all_to_all_single, all_reduce, broadcast, batch = (
        dist.all_to_all_single, dist.all_reduce, dist.broadcast, dist.batch_isend_irecv)

    def all_to_all(out: torch.Tensor, inp: torch.Tensor, output_split_sizes: Any = None,
                   input_split_sizes: Any = None, group: Any = None, async_op: bool = False) -> Any:
        entry = recorder.record("all_to_all", group, [inp, out], send_splits=input_split_sizes,
                                recv_splits=output_split_sizes, row_numel=inp[:1].numel() if len(inp) else None)
        work = all_to_all_single(out, inp, output_split_sizes, input_split_sizes, group=group, async_op=async_op)
        return _tracked(work, entry) if async_op else work

    def reduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Any:
        entry = recorder.record("all_reduce", group, [tensor])
        work = all_reduce(tensor, op=op, group=group, async_op=async_op)
        return _tracked(work, entry) if async_op else work

    def bcast(tensor: torch.Tensor, src: Any = None, group: Any = None, async_op: bool = False, **kwargs: Any) -> Any:
        entry = recorder.record("broadcast", group, [tensor])
        work = broadcast(tensor, src=src, group=group, async_op=async_op, **kwargs)
        return _tracked(work, entry) if async_op else work

    def p2p(ops: list[dist.P2POp]) -> list[Any]:
        entry = recorder.record("p2p", ops[0].group, [o.tensor for o in ops],
                                kinds=sorted(o.op.__name__ for o in ops))
        return [_tracked(w, entry) for w in batch(ops)]

    comm_module._all_gather_single = single("all_gather", comm_module._all_gather_single)
    comm_module._reduce_scatter_single = single("reduce_scatter", comm_module._reduce_scatter_single)
    dist.all_to_all_single, dist.all_reduce, dist.broadcast, dist.batch_isend_irecv = all_to_all, reduce, bcast, p2p


def _worker(rank: int, world: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    from csbp.attention.transports.function import TransportFunction
    from csbp.dflash import verify as dflash_verify
    from csbp.dflash.attention import _ShardedDraftAttention
    from csbp.engine import verify as bd3_verify

    recorder = _Recorder()
    _install(recorder)
    TransportFunction.forward = recorder.layer("forward", TransportFunction.forward)
    TransportFunction.backward = recorder.layer("backward", TransportFunction.backward)
    _ShardedDraftAttention._forward = recorder.layer("forward", _ShardedDraftAttention._forward)
    _ShardedDraftAttention._backward = recorder.layer("backward", _ShardedDraftAttention._backward)
    for name, kind, case in _cases():
        recorder.case = name
        (bd3_verify._worker if kind == "bd3" else dflash_verify._worker)(rank, world, case)
    return recorder.calls, recorder.layers


# ---------------------------------------------------------------- in the parent: the rules


@pytest.fixture(scope="module")
def recorded() -> list[tuple[list[dict[str, Any]], list[dict[str, Any]]]]:
    """Per rank: ``(collective calls, attention layers)``."""
    return run_local(_worker, 2, timeout_s=240)


@pytest.fixture(scope="module")
def calls_by_rank(recorded: list[tuple[list[dict[str, Any]], list[dict[str, Any]]]]) -> list[list[dict[str, Any]]]:
    return [calls for calls, _ in recorded]


def _signature(call: dict[str, Any]) -> tuple:
    """What every member of the group must agree on (all-to-all splits are checked pairwise)."""
    dtypes = tuple(t[1] for t in call["tensors"])
    if call["op"] == "all_to_all":
        return call["op"], dtypes, len(call["send_splits"])
    return call["op"], dtypes, tuple(t[3] for t in call["tensors"])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_every_collective_keeps_nccls_rules(calls_by_rank: list[list[dict[str, Any]]]) -> None:
    calls = [call for rank_calls in calls_by_rank for call in rank_calls]
    ops_by_case: dict[str, set[tuple[str, bool]]] = defaultdict(set)
    for call in calls:
        ops_by_case[call["case"]].add((call["op"], call["async"]))
        where = f"{call['case']}: {call['op']} on group {call['group'][1]}"
        for device, dtype, contiguous, _ in call["tensors"]:
            assert device == call["expected_device"], f"{where}: a tensor on {device}"
            assert contiguous, f"{where}: a non-contiguous tensor"
            assert dtype in NCCL_DTYPES, f"{where}: dtype {dtype} has no NCCL type"
        assert call["waited"], f"{where}: an asynchronous work was never waited for"
        if call["op"] == "all_to_all":
            for splits in (call["send_splits"], call["recv_splits"]):
                assert all(type(s) is int for s in splits), f"{where}: split sizes {splits!r} are not Python ints"
    # the layouts exercise what they are here for (the overlapped collectives asynchronously)
    assert {("all_gather", True), ("reduce_scatter", True), ("all_reduce", False)} <= ops_by_case["bd3-collective"]
    assert ("p2p", True) in ops_by_case["bd3-streaming"]
    for case in ("bd3-window", "bd3-documents", "bd3-documents-balanced", "bd3-cp-aware", "dflash-context-exchange"):
        assert ("all_to_all", True) in ops_by_case[case], case
    assert ("all_gather", True) in ops_by_case["dflash-all-gather"]
    assert any(op[0] == "all_to_all" for op in ops_by_case["dflash-kl-teacher"])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_group_members_issue_the_same_collectives_in_the_same_order(
    calls_by_rank: list[list[dict[str, Any]]],
) -> None:
    sequences: dict[tuple, dict[int, list[dict[str, Any]]]] = defaultdict(lambda: defaultdict(list))
    for rank_calls in calls_by_rank:
        for call in rank_calls:
            sequences[call["case"], call["group"]][call["position"]].append(call)
    assert sequences
    for (case, (_, ranks)), by_position in sequences.items():
        assert sorted(by_position) == list(range(len(ranks))), f"{case}: a member of {ranks} issued nothing"
        members = [by_position[p] for p in range(len(ranks))]
        signatures = [[_signature(c) for c in member] for member in members]
        assert all(s == signatures[0] for s in signatures), f"{case}: group {ranks} members disagree: {signatures}"
        for index, call in enumerate(members[0]):
            if call["op"] != "all_to_all":
                continue
            for s, sender in enumerate(members):
                for d, receiver in enumerate(members):
                    sent, expected = sender[index]["send_splits"][d], receiver[index]["recv_splits"][s]
                    assert sent == expected, f"{case}: call {index} of {ranks}: {s} sends {sent} rows to {d}, which expects {expected}"



@pytest.mark.multiprocess
@pytest.mark.slow
def test_ranks_interleave_their_shared_groups_in_the_same_order(calls_by_rank: list[list[dict[str, Any]]]) -> None:
    """Two NCCL communicators whose collectives two ranks issue in opposite orders can deadlock: for
    every pair of ranks, their calls on the groups they share interleave the same way."""
    def shared(calls: list[dict[str, Any]], ranks: set[int]) -> list[tuple]:
        return [(c["case"], c["group"], c["op"]) for c in calls if ranks <= set(c["group"][1])]

    for a, calls_a in enumerate(calls_by_rank):
        for b in range(a + 1, len(calls_by_rank)):
            on_a, on_b = shared(calls_a, {a, b}), shared(calls_by_rank[b], {a, b})
            assert on_a, f"ranks {a} and {b} share no collective"
            assert on_a == on_b, f"ranks {a} and {b} interleave their groups differently"


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_layers_attention_never_waits_for_the_device(
    recorded: list[tuple[list[dict[str, Any]], list[dict[str, Any]]]],
) -> None:
    layers = [layer for _, rank_layers in recorded for layer in rank_layers]
    assert {layer["case"] for layer in layers} == {name for name, _, _ in _cases()}
    assert {layer["kind"] for layer in layers} == {"forward", "backward"}
    syncing = [f"{layer['case']} {layer['kind']}: {layer['syncs']}" for layer in layers if layer["syncs"]]
    assert not syncing, "host syncs inside a layer's attention:\n" + "\n".join(syncing)
