"""``csbp eval --nproc N [--cp C --bp B]``: the same evaluation on ``N`` local processes.

The ranks form ``Topology(dp = N / max(C, B), cp = C, bp = B)`` (BP-only ``cp = 1 < bp`` recomputes
the clean prefix on every rank, as ``replicate_clean_prefix`` does in training): data-parallel
replica ``r`` scores batches ``n ≡ r (mod dp)``, and the ranks of one replica share each batch
through the training engine's plan for that layout, exactly as in training. Batch ``n`` is
corrupted as on one process, so the report equals the one-process report (up to summation order).
Each rank returns its CE sums; the parent adds them, and adds token counts once per replica.
Processes run on the CPU over gloo (or one GPU each over NCCL with ``device="cuda"``).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from csbp.data.artifact import open_artifact
from csbp.engine.context import build_parallel_context
from csbp.evaluation.runner import (
    EvalOptions,
    EvalReport,
    EvalSums,
    build_report,
    check_scored_tokens,
    eval_plan,
    score_split,
)
from csbp.evaluation.settings import EvalSettings
from csbp.models.hf_io import load_hf_checkpoint, read_hf_config
from csbp.parallel.launch import run_local
from csbp.topology import Topology


def eval_topology(nproc: int, cp: int, bp: int, settings: EvalSettings, seq_len: int) -> Topology:
    """The layout of ``--nproc/--cp/--bp``, checked against the model (one ``ValueError`` line)."""
    local = max(cp, bp)
    if nproc % local:
        raise ValueError(f"--nproc {nproc} is not a multiple of max(--cp, --bp) = {local} (fix: --nproc {local})")
    if not settings.uses_clean_stream and local > 1:
        raise ValueError(f"--cp/--bp: {settings.objective} has no clean stream to shard (fix: --cp 1 --bp 1, scale with --nproc)")
    topology = Topology(dp=nproc // local, cp=cp, bp=bp, replicate_clean_prefix=cp == 1 < bp)
    if local > 1:
        try:
            topology.validate_sequence(seq_len, settings.block_size)
        except ValueError as exc:
            # its fix names seq_len= and block_size=, config fields: here they are the data's and the model's
            reason = str(exc).split(" (fix: ")[0]
            raise ValueError(
                f"--cp {cp} --bp {bp}: the data's rows of {seq_len} tokens do not split over this layout: {reason} "
                f"(fix: {_layout_fixes(cp, bp, seq_len, settings.block_size)})"
            ) from None
    return topology


SCAN_LIMIT = 4096
"""How many ``--cp``/``--bp`` values a refused layout's fix looks at on each side of the given one."""


def _layout_fixes(cp: int, bp: int, seq_len: int, block_size: int) -> str:
    """``--cp 2 or 4, or --bp ...``: the nearest ``--cp`` (at this ``--bp``) and ``--bp`` (at this ``--cp``)
    whose layout splits rows of ``seq_len`` tokens in blocks of ``block_size``, else one process per batch."""

    def fits(c: int, b: int) -> bool:
        if c > 1 and b > 1 and b % c:
            return False
        try:
            Topology(cp=c, bp=b, replicate_clean_prefix=c == 1 < b).validate_sequence(seq_len, block_size)
        except ValueError:
            return False
        return True

    fixes = []
    largest = seq_len // block_size
    for flag, given, other in (("--cp", cp, lambda v: fits(v, bp)), ("--bp", bp, lambda v: fits(cp, v))):
        # outwards from the given value, SCAN_LIMIT candidates a side (all of them took seconds at 1M rows)
        below = next((v for v in range(given - 1, max(1, given - SCAN_LIMIT), -1) if other(v)), None)
        above = next((v for v in range(given + 1, min(largest, given + SCAN_LIMIT) + 1) if other(v)), None)
        nearest = [v for v in (below, above) if v is not None]
        if nearest and given > 1:
            fixes.append(f"{flag} {' or '.join(map(str, nearest))}")
    return ", or ".join([*fixes, "--cp 1 --bp 1: one process per batch, --nproc N scores N at once"])


def evaluate_parallel(
    model_dir: Path,
    data_dir: Path,
    split_name: str,
    settings: EvalSettings,
    options: EvalOptions,
    topology: Topology,
    *,
    dtype: torch.dtype | None = None,
    device: str = "cpu",
    timeout_s: float = 3600.0,
) -> EvalReport:
    """Score ``data_dir``'s ``split_name`` on ``topology.world_size`` processes (module docstring)."""
    vocab_size = read_hf_config(model_dir).vocab_size
    check_scored_tokens(open_artifact(data_dir).split(split_name), settings, options, vocab_size=vocab_size)
    started = time.perf_counter()
    results = run_local(
        _rank,
        topology.world_size,
        (model_dir, data_dir, split_name, settings, options, topology, dtype),
        timeout_s=timeout_s,
        device="cuda" if device.startswith("cuda") else "cpu",
    )
    ce = EvalSums([0.0] * options.samples, [0.0] * options.samples)
    counts = EvalSums([0.0] * options.samples, [0.0] * options.samples)
    for sums, first_of_replica in results:
        ce.nelbo = [a + b for a, b in zip(ce.nelbo, sums.nelbo, strict=True)]
        ce.ltr += sums.ltr
        if first_of_replica:
            counts.nelbo_tokens = [a + b for a, b in zip(counts.nelbo_tokens, sums.nelbo_tokens, strict=True)]
            counts.ltr_tokens += sums.ltr_tokens
            counts.rows += sums.rows
    split = open_artifact(data_dir).split(split_name)
    return build_report(ce, counts, split, settings, options, time.perf_counter() - started)


def _rank(
    rank: int,
    world: int,
    model_dir: Path,
    data_dir: Path,
    split_name: str,
    settings: EvalSettings,
    options: EvalOptions,
    topology: Topology,
    dtype: torch.dtype | None,
) -> tuple[EvalSums, bool]:
    ctx = build_parallel_context(topology)
    model, _ = load_hf_checkpoint(model_dir, dtype=dtype, device=ctx.device)
    split = open_artifact(data_dir).split(split_name)
    plan = eval_plan(settings, split.seq_len, ctx)
    sums = score_split(
        model, split, settings, plan, options,
        replica=ctx.coords.dp_rank, replicas=topology.dp, progress=rank == 0,
    )
    return sums, ctx.coords.local_rank == 0
