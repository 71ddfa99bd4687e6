"""Where a process computes and how its process group reaches the other processes.

One rule for every entry point (``csbp train``, ``csbp verify``, ``csbp bench``, the tests):

* ``--device cpu``: gloo, one CPU process per rank;
* ``--device cuda``: NCCL, one process per GPU; local rank ``r`` computes on ``cuda:r``. The device
  is selected with ``torch.cuda.set_device`` *before* the process group and its sub-groups are
  created, and ``init_process_group`` gets ``device_id`` so NCCL binds its communicators to that
  GPU eagerly instead of guessing one per collective.

``tensors_to`` moves a nested structure of tensors (a corrupted batch, row indices, a plan made of
frozen dataclasses) to the compute device in one call.

Usage::

    device = resolve_device("cuda", nproc=4)       # ValueError (one line) when 4 GPUs are not visible
    select_device(device_for_rank(device, local_rank))
    dist.init_process_group(**process_group_options(device_for_rank(device, local_rank)))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any, Literal, TypeVar, get_args

import torch
import torch.distributed as dist
from torch import Tensor

DeviceKind = Literal["cpu", "cuda"]
DEVICE_KINDS: tuple[str, ...] = get_args(DeviceKind)
T = TypeVar("T")


def resolve_device(kind: str, *, nproc: int = 1) -> torch.device:
    """The device type ``kind`` (``cpu`` or ``cuda``) checked against this machine for ``nproc``
    processes: CUDA needs one visible GPU per process."""
    if kind not in DEVICE_KINDS:
        raise ValueError(f"--device {kind!r}: choose one of {DEVICE_KINDS}")
    if kind == "cpu":
        return torch.device("cpu")
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if visible == 0:
        raise ValueError("--device cuda: no CUDA device is visible to torch here (fix: use --device cpu)")
    if nproc > visible:
        raise ValueError(
            f"--nproc {nproc} on CUDA needs one GPU per process but {visible} GPU(s) are visible "
            f"(fix: --nproc {visible} or less)"
        )
    return torch.device("cuda")


def device_for_rank(kind: torch.device | str, local_rank: int) -> torch.device:
    """The device local rank ``local_rank`` computes on: ``cuda:<local_rank>`` or the CPU."""
    kind = torch.device(kind)
    return torch.device("cuda", local_rank) if kind.type == "cuda" else torch.device("cpu")


def select_device(device: torch.device) -> None:
    """Make ``device`` this process's current CUDA device (no-op on the CPU). Call before creating
    any process group."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def process_group_options(device: torch.device) -> dict[str, Any]:
    """Keyword arguments of ``init_process_group`` for a process computing on ``device``."""
    if device.type == "cuda":
        if device.index is None:
            raise ValueError(f"process_group_options needs an indexed CUDA device (cuda:N), got {device}")
        return {"backend": "nccl", "device_id": device}
    return {"backend": "gloo"}


def backend_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device ``group``'s collectives move tensors of (default: the world group): the current GPU
    when its backend is NCCL, else the CPU (also without ``torch.distributed``)."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for ``device``'s queued work (CUDA); nothing to wait for on the CPU. Timings need it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def same_device(a: torch.device, b: torch.device) -> bool:
    """``a`` and ``b`` are the same device (``cuda`` without an index means the current one)."""
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    current = torch.cuda.current_device() if a.index is None or b.index is None else 0
    return (current if a.index is None else a.index) == (current if b.index is None else b.index)


def tensors_to(obj: T, device: torch.device | str) -> T:
    """A copy of ``obj`` with every tensor moved to ``device``: tensors, tuples, lists, dicts and
    dataclasses (rebuilt with ``dataclasses.replace``) are walked; anything else (communicators,
    ints, strings) is kept as is. Objects without a tensor are returned unchanged."""
    device = torch.device(device)
    if isinstance(obj, Tensor):
        return obj.to(device)  # type: ignore[return-value]
    if isinstance(obj, (tuple, list)):
        moved = [tensors_to(item, device) for item in obj]
        if all(m is o for m, o in zip(moved, obj)):
            return obj
        return type(obj)(moved) if type(obj) in (tuple, list) else type(obj)(*moved)  # type: ignore[return-value]
    if isinstance(obj, dict):
        return {key: tensors_to(value, device) for key, value in obj.items()}  # type: ignore[return-value]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {}
        for f in dataclasses.fields(obj):
            if f.init:
                value = getattr(obj, f.name)
                moved = tensors_to(value, device)
                if moved is not value:
                    changes[f.name] = moved
        return dataclasses.replace(obj, **changes) if changes else obj  # type: ignore[type-var]
    return obj


def iter_tensors(obj: object) -> Iterator[Tensor]:
    """Every tensor ``tensors_to`` would move (to check where a plan lives)."""
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            yield from iter_tensors(item)
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from iter_tensors(value)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name))
