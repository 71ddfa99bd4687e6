"""What ``csbp plan`` itself needs in memory to plan ``L`` tokens, checked before any work.

Measured with ``/usr/bin/time -v`` (max RSS less the interpreter's ~38 MiB) on CPU, ``csbp plan
--model nemotron-8b --gpus 8 --gpu h200`` (nothing fits there, so the fix's shorter ``L`` are planned too)::

    tokens   B    --doc-length   bytes per token
    4M       32   -              58
    16M      32   -              51   (80 before row_pairs counted a chunk at a time)
    4M       32   8192           137
    16M      32   8192           139
    16M      4    -              160
    16M      1    -              563

so about 48 bytes per token, 96 more with documents, and 576 per block (the schedules' Python
tuples), each rounded up for a margin.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from csbp.plan.workload import Workload

PLANNER_BYTES_PER_TOKEN = 48
"""Peak memory of planning a block-diffusion or AR workload per token of the sequence, measured (max
RSS less the interpreter's, CPU, B = 32, no documents: 51 bytes at 16M tokens, 58 at 4M; the two int64
prefix sums of every row's allowed pairs at ``L`` and at the shorter ``L`` a nothing-fits fix tries,
the ranks' runs), less the per-block term below, with a margin (the prefix sums' whole-row
temporaries, about 40 bytes more, are now counted a chunk at a time)."""
PLANNER_DOCUMENT_BYTES_PER_TOKEN = 96
"""What packed documents (``--doc-length``, ``--data``, a run config's ``data.document_mask``) add per
token: measured 85 to 88 bytes (each position's document bounds, kept for every ``L`` planned)."""
PLANNER_BYTES_PER_BLOCK = 576
"""Per block of ``B`` tokens: the block schedules, Python tuples (measured about 540 bytes a block:
563 bytes per token at B = 1, 160 at B = 4, 16M tokens)."""
DRAFTER_PLANNER_BYTES_PER_TOKEN = 16
"""A DFlash drafter's planning counts no row pairs (measured 2 to 8 bytes per token)."""


def planner_bytes_per_token(workload: Workload) -> float:
    """Bytes :func:`run_plan` needs per token of the sequence for ``workload`` (the constants above)."""
    if workload.objective.is_drafter:
        return DRAFTER_PLANNER_BYTES_PER_TOKEN
    documents = PLANNER_DOCUMENT_BYTES_PER_TOKEN if workload.doc_length is not None else 0
    return PLANNER_BYTES_PER_TOKEN + documents + PLANNER_BYTES_PER_BLOCK / max(workload.objective.block, 1)


def check_planner_memory(seq_len: int, workload: Workload) -> None:
    """``ValueError`` before any work when planning ``seq_len`` tokens of ``workload`` would need more
    than this machine's memory (``--seq-len 10**12`` was numpy's ArrayMemoryError traceback: 7.28 TiB
    for one array; the bound of the two prefix sums alone, 16 bytes per token, let 300M to 1.6G tokens
    run out of memory on a 24 GiB machine)."""
    from csbp.plan.hardware import machine_ram_gib

    have = machine_ram_gib() * 2**30
    per_token = planner_bytes_per_token(workload)
    if seq_len * per_token > have:
        what = " with documents" if workload.doc_length is not None and not workload.objective.is_drafter else ""
        raise ValueError(
            f"--seq-len {seq_len}: csbp plan counts every row's allowed pairs, and planning {seq_len} rows of block "
            f"size {workload.objective.block}{what} takes about {per_token:.0f} bytes per token "
            f"({seq_len * per_token / 2**30:.0f} GiB), more than this machine's {have / 2**30:.0f} GiB of memory "
            f"(fix: --seq-len {int(have // per_token)} or less)"
        )
