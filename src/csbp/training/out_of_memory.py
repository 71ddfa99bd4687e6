"""One line naming the fixes that apply when a training step runs out of memory, instead of torch's
traceback.

Before any rank starts, ``csbp train`` refuses weights and optimizer state that cannot fit
(:mod:`csbp.training.memory_fit`); what comes on top (activations, gathered K/V, the LM head's logits
chunk) depends on the layout and the kernels, and is found out by the first step. When a step fails
for memory (``torch.OutOfMemoryError`` on CUDA, the CPU allocator's ``can't allocate memory``), the
rank raises :class:`OutOfDeviceMemory`: which rank, which step, how much its GPU held, and the config
changes that lower a step's memory and are not already set (activation checkpointing, a smaller
micro-batch with the same tokens per step, FSDP over the data-parallel ranks, more ranks per sample,
a smaller LM-head chunk, no weight average), with ``csbp plan``, whose memory model ranks the layouts
that fit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from csbp.config.rules import SINGLE_STREAM_OBJECTIVES
from csbp.config.schema import RunConfig

CPU_ALLOCATOR_FAILURE = "can't allocate memory"
"""What torch's CPU allocator says when ``malloc`` fails (a ``RuntimeError``, not an OutOfMemoryError)."""


class OutOfDeviceMemory(ValueError):
    """A step ran out of memory; ``str()`` is one line with the fixes (no traceback is shown)."""


def is_out_of_memory(exc: BaseException) -> bool:
    """True for an allocation failure on the GPU or the CPU, also when it is wrapped: ``torch.compile``
    raises one met while compiling as its ``BackendCompilerFailed`` (``inner_exception``), others chain it
    as their cause."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, torch.OutOfMemoryError):
            return True
        if isinstance(current, RuntimeError) and CPU_ALLOCATOR_FAILURE in str(current):
            return True
        inner = getattr(current, "inner_exception", None)
        current = inner if isinstance(inner, BaseException) else current.__cause__
    return False


def memory_fixes(cfg: RunConfig) -> list[str]:
    """The config changes that lower a step's memory, that ``cfg`` has not made yet and that its
    objective accepts (the config rules refuse FSDP for dflash, ``cp``/``bp`` for the single-stream
    objectives and ``grad_accum > 1`` for a ``lambda`` DFlash loss), most effective first."""
    train, topo, objective = cfg.train, cfg.topology, cfg.objective
    fixes = []
    if train.activation_checkpointing == "none":
        fixes.append("train.activation_checkpointing: full (keeps one layer's activations, not all)")
    elif train.activation_checkpointing == "selective":
        fixes.append("train.activation_checkpointing: full (recomputes the attention instead of keeping its "
                     "output and gathered K/V per layer)")
    lambda_loss = objective.name == "dflash" and objective.dflash is not None and objective.dflash.lk_loss_type == "lambda"
    if train.micro_batch_size > 1 and not lambda_loss:
        # the largest smaller divisor keeps the rows per step exactly (3 -> 1 x 3, not 1 x 2)
        smaller = max(d for d in range(1, train.micro_batch_size) if train.micro_batch_size % d == 0)
        accum = train.grad_accum * train.micro_batch_size // smaller
        fixes.append(f"train.micro_batch_size: {smaller} with train.grad_accum: {accum} (the same tokens per step)")
    if topo.dp > 1 and not train.fsdp and objective.name != "dflash":
        fixes.append("train.fsdp: true (shards weights, gradients and AdamW state over the dp ranks)")
    if objective.name not in SINGLE_STREAM_OBJECTIVES:
        fixes.append("more ranks per sample (topology.cp / topology.bp) to split each sequence")
    if objective.ce_chunk_rows > 256:
        fixes.append(f"objective.ce_chunk_rows: {objective.ce_chunk_rows // 4} (a smaller logits chunk)")
    if cfg.optim.ema_decay is not None:
        fixes.append("optim.ema_decay: null (drops the weight average's copy of the weights)")
    return fixes or ["a shorter data.seq_len, a smaller model or a device with more memory"]


def _held(device: torch.device) -> str:
    """`` (NAME: A of T GiB allocated)`` on CUDA, empty elsewhere or when the device cannot say."""
    if device.type != "cuda":
        return ""
    try:
        total = torch.cuda.get_device_properties(device).total_memory
        allocated = torch.cuda.memory_allocated(device)
        name = torch.cuda.get_device_name(device)
    except Exception:  # noqa: BLE001 - a report must not fail on the way
        return ""
    return f" ({name}: {allocated / 2**30:.1f} of {total / 2**30:.1f} GiB allocated)"


def out_of_memory_message(
    cfg: RunConfig, exc: BaseException, *, rank: int, step: int, device: torch.device
) -> str:
    """The one line of :class:`OutOfDeviceMemory` for ``exc`` on ``rank`` after ``step`` (the last completed
    step: the failure was in the next step, or in the validation or checkpoint that follows ``step``)."""
    reported = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return (
        f"rank {rank} ran out of memory on {device} after step {step}{_held(device)}: activations, gathered "
        f"K/V and the logits chunk come on top of the weights (fix: {'; or '.join(memory_fixes(cfg))}; "
        f"`csbp plan --model <this config> --gpus N` predicts which layouts fit) [{reported}]"
    )


@contextlib.contextmanager
def named_out_of_memory(
    cfg: RunConfig, *, rank: int, device: torch.device, step: Callable[[], int]
) -> Iterator[None]:
    """Turn an allocation failure inside the block into :class:`OutOfDeviceMemory` (``step()``: the last
    completed step); any other error passes unchanged."""
    try:
        yield
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        raise OutOfDeviceMemory(out_of_memory_message(cfg, exc, rank=rank, step=step(), device=device)) from exc
