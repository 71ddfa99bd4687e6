"""A randomised exactness sweep: draw layouts nobody picked by hand and check each equals one process.

``csbp verify`` checks hand-picked problems (a fixed sequence length, power-of-two sizes, one mean
document length). Bugs hide in the combinations nobody picked, so :func:`draw_case` draws, from one
integer seed, a *valid* configuration of every knob the engine exposes:

* the topology (data, CP-only, BP-only, CSBP, each times ``dp``) on at most ``max_nproc`` (up to 8)
  processes, non-power-of-two rings included (``cp=3``, ``bp=6``, ``cp=5``, ...); on 5-8 ranks the
  shapes stay tiny (a block size whose shortest sequence is at most 64 tokens, <= 2 samples and
  micro-batches; DFlash keeps its <= 48 tokens and <= 3 samples);
* the dtype: float32 in one case of five (both sides of the comparison), else float64;
* block size and a sequence length that only just satisfies the zigzag rules (chunks of one block);
* the objective (``bd3``, ``fast_dllm_v2``, ``mdlm``, ``dflash``), and for the first three, sometimes
  their unclipped-NELBO validation form (``val_nelbo``); for DFlash the loss (CE or KL, LK
  variants), weighting, anchor sampling, context rule, DFlash2 convolutions and selector, and a
  sliding-window draft layer (every row keeps a valid anchor, as training requires: a row left
  without one is redrawn); the LM-head loss in chunks of a few rows;
* transport (collective, streaming, halo), window (smaller than, equal to or larger than a block),
  block schedule (dual-end, contiguous, balanced), diagonal and clean-context kernels;
* explicit, ragged document boundaries per sample: 1-token documents, documents ending exactly on
  block or zigzag-chunk boundaries, one document spanning every shard, trailing padding, ids that do
  not start at 0; several samples per rank with different documents each;
* gradient accumulation with uneven supervision per row and micro-batch (some rows supervise
  nothing), RoPE positions restarting at documents, activation checkpointing, FSDP2, and the
  trainer's bucketed gradient all-reduce overlapped with the last backward (small buckets).

A draw whose whole batch scores no token (loss and every gradient 0 on both sides: a comparison
that cannot fail) gets fully supervised rows until it scores something.

Each draw is reproducible alone: case ``i`` of ``csbp verify --random N --seed S`` is
``draw_case(S + i)``, so ``csbp verify --random 1 --seed S+i`` reruns it.

Invalid run configs drawn at random, each to be refused, are drawn by the tests (``tests/fuzz_invalid.py``).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, replace
from typing import Any

from csbp.dflash.config import DFlashObjectiveConfig
from csbp.dflash.verify import DFlashVerifyCase, anchorless_rows, verify_dflash
from csbp.engine.verify import OBJECTIVES, VerifyCase, corrupted_batches, layouts_for, verify
from csbp.interrupts import Interrupted
from csbp.topology import Topology

FuzzCase = VerifyCase | DFlashVerifyCase
MAX_SEQ_LEN = 64
"""Longest drawn sequence (keeps a case at a few seconds on one CPU core per process)."""
MAX_NPROC = 8
"""Most processes a drawn case uses (an 8-rank gloo case takes a few seconds on 2 cores)."""
FLOAT32_SHARE = 0.2
"""Share of cases drawn in float32 (the rest float64); both sides of the comparison run in it."""


def check_nproc(max_nproc: int) -> None:
    """Fail closed (one line) unless cases can be drawn on ``2 <= max_nproc <= MAX_NPROC`` processes."""
    if isinstance(max_nproc, bool) or not isinstance(max_nproc, int) or not 2 <= max_nproc <= MAX_NPROC:
        raise ValueError(
            f"--nproc {max_nproc}: --random draws layouts on 2 to {MAX_NPROC} processes "
            f"(one process would compare the reference with itself) (fix: --nproc {min(max(max_nproc, 2), MAX_NPROC)})"
        )


def _topologies(max_nproc: int) -> list[Topology]:
    check_nproc(max_nproc)
    found: list[Topology] = []
    for nproc in range(2, max_nproc + 1):  # one process would compare the reference with itself
        found += [t for t in layouts_for(nproc) if t not in found]
    return found


def _pick(rng: random.Random, weighted: dict[Any, float]) -> Any:
    return rng.choices(list(weighted), weights=list(weighted.values()))[0]


def _checkpointing(draw: float) -> str:
    """``train.activation_checkpointing`` of a case from one uniform draw: 15% checkpointed, half of
    them ``selective`` (one draw, as when it was on/off, so the draws after it stay the same)."""
    return "full" if draw < 0.075 else "selective" if draw < 0.15 else "none"


def draw_documents(rng: random.Random, seq_len: int, block_size: int, chunk: int) -> tuple[int, ...]:
    """The doc ids of one packed row: a document-length style, then maybe trailing padding (-1).

    ``chunk`` is the zigzag chunk length ``L / (2 cp)`` (boundaries there end a document exactly on
    a shard boundary)."""
    style = _pick(rng, {"ragged": 3, "ones": 1, "block_aligned": 1, "chunk_aligned": 1, "single": 1, "mixed": 2})
    lengths: list[int] = []
    left = seq_len
    while left > 0:
        if style == "ones":
            n = 1 if rng.random() < 0.6 else rng.randint(1, 6)
        elif style == "block_aligned":
            n = block_size * rng.randint(1, 3)
        elif style == "chunk_aligned":
            n = chunk * rng.randint(1, 2)
        elif style == "single":
            n = seq_len
        elif style == "mixed":
            n = rng.choice([1, 1, block_size, block_size + 1, chunk, chunk - 1 or 1, 2 * chunk + 1, seq_len // 2])
        else:
            n = max(1, int(rng.expovariate(1.0 / rng.choice([2, 5, 9]))))
        n = min(max(n, 1), left)
        lengths.append(n)
        left -= n
    first = rng.choice([0, 0, rng.randint(1, 40)])  # a packed row may start mid-corpus
    ids = [first + d for d, n in enumerate(lengths) for _ in range(n)]
    if rng.random() < 0.25:  # the last row of a split ends in padding
        pad = rng.randint(1, max(1, seq_len // 2))
        ids[seq_len - pad :] = [-1] * pad
    return tuple(ids)


def _unit(topology: Topology, block_size: int, *, mdlm: bool) -> int:
    """The step of valid sequence lengths (the zigzag rules of ``Topology.validate_sequence``)."""
    if mdlm:
        return 2
    if topology.layout == "cp":
        return topology.cp * block_size
    if topology.layout == "csbp":
        return 2 * topology.cp * block_size
    return block_size


def _shortest(topology: Topology, block_size: int, *, mdlm: bool) -> int:
    """The shortest valid sequence: a multiple of the unit, ``bp`` blocks, more than one block."""
    unit = _unit(topology, block_size, mdlm=mdlm)
    smallest = max(unit, topology.bp * block_size, block_size + 1, 4)
    return -(-smallest // unit) * unit


def _sequence_length(rng: random.Random, topology: Topology, block_size: int, *, mdlm: bool) -> int:
    unit = _unit(topology, block_size, mdlm=mdlm)
    smallest = _shortest(topology, block_size, mdlm=mdlm)
    choices = list(range(smallest, MAX_SEQ_LEN + 1, unit)) or [smallest]
    return rng.choice(choices[:4]) if rng.random() < 0.7 else rng.choice(choices)


def draw_case(seed: int, max_nproc: int = 4) -> FuzzCase:
    """A random valid case on at most ``max_nproc`` (2 to ``MAX_NPROC``) processes, a pure function of
    its arguments (see the module docstring)."""
    rng = random.Random(seed)
    objective = _pick(rng, {"bd3": 5, "fast_dllm_v2": 2, "mdlm": 1, "dflash": 2})
    assert objective in (*OBJECTIVES, "dflash")
    topologies = _topologies(max_nproc)
    if objective == "mdlm":
        topologies = [t for t in topologies if t.layout == "data"]
    topology = rng.choice(topologies)
    if objective == "dflash":
        return _draw_dflash(rng, seed, topology)
    blocks = {1: 1, 2: 2, 3: 2, 4: 3, 5: 1, 8: 1}
    if topology.world_size > 4:  # 5-8 ranks: only block sizes whose shortest sequence fits MAX_SEQ_LEN
        blocks = {b: w for b, w in blocks.items() if _shortest(topology, b, mdlm=objective == "mdlm") <= MAX_SEQ_LEN}
    block_size = _pick(rng, blocks)
    seq_len = _sequence_length(rng, topology, block_size, mdlm=objective == "mdlm")
    if objective == "mdlm":
        block_size = min(block_size, seq_len)
    samples = _pick(rng, {1: 2, 2: 2, 3: 1})
    micro_batches = _pick(rng, {1: 3, 2: 2, 3: 1})
    if topology.world_size > 4:  # tiny shapes: at most 2 samples and 2 micro-batches on 5-8 ranks
        samples, micro_batches = min(samples, 2), min(micro_batches, 2)
    rows = micro_batches * topology.dp * samples
    documents = rng.random() < 0.6
    chunk = seq_len // (2 * topology.cp)
    doc_ids = tuple(draw_documents(rng, seq_len, block_size, max(chunk, 1)) for _ in range(rows)) if documents else None
    supervision = tuple(rng.choice([0.0, 0.1, 0.5, 0.8, 1.0]) for _ in range(rows)) if rng.random() < 0.5 else None
    window = None
    if objective != "mdlm" and rng.random() < 0.35:  # single-stream objectives have no windowed mask
        window = rng.choice([1, max(1, block_size - 1), block_size, block_size + 1, 2 * block_size + 1,
                             rng.randint(1, seq_len), seq_len + 3])
    transport = "collective"
    if topology.cp > 1:
        transport = _pick(rng, {"collective": 2, "streaming": 2, "halo": 1})
    schedule = _pick(rng, {"dual_end": 2, "contiguous": 1, "balanced": 1}) if topology.bp > 1 else "dual_end"
    return _supervising(VerifyCase(
        topology=topology,
        seq_len=seq_len,
        block_size=block_size,
        transport=transport,
        window=window,
        samples=samples,
        seed=seed,
        diagonal=rng.choice(["auto", "matmul", "sdpa", "sdpa_fold"]),
        clean=_pick(rng, {"generic": 3, "pieces": 1}),
        schedule=schedule,
        objective=objective,
        nelbo=rng.random() < 0.2,
        doc_ids=doc_ids,
        supervision=supervision,
        micro_batches=micro_batches,
        reset_positions=documents and rng.random() < 0.3,
        activation_checkpointing=_checkpointing(rng.random()),
        fsdp=topology.dp > 1 and rng.random() < 0.2,
        grad_buckets=rng.choice([None, 2048, 16384, 2**25]) if rng.random() < 0.5 else None,
        ce_chunk_rows=rng.choice([1024, 1024, 3, 7]),
        dtype="float32" if rng.random() < FLOAT32_SHARE else "float64",  # drawn last: earlier draws unchanged
    ))


def _supervised(case: VerifyCase) -> bool:
    """Whether ``case``'s corrupted batch scores any token (else its loss and every gradient are 0 on
    both sides, and the comparison proves nothing)."""
    return any(bool((batch.labels >= 0).any()) for batch in corrupted_batches(case, case.topology.dp))


def _supervising(case: VerifyCase) -> VerifyCase:
    """``case``, or (when its whole batch scores nothing: about 1 draw in 35, low supervision on short
    rows) the same case with rows ``0, 1, ...`` fully supervised, up to the first that scores something.
    Rows supervising nothing next to rows that do (a rank owning no scored token) stay in the draws."""
    if _supervised(case):
        return case
    rows = case.micro_batches * case.topology.dp * case.samples
    shares = list(case.supervision or (0.8,) * rows)
    for row in range(rows):
        shares[row] = 1.0
        candidate = replace(case, supervision=tuple(shares))
        if _supervised(candidate):
            return candidate
    return case  # still nothing (short rows whose corruption masks no scored token: ~1 draw in 400): kept


def _draw_dflash(rng: random.Random, seed: int, topology: Topology) -> DFlashVerifyCase:
    unit = 2 * topology.cp  # DFlash context shards: 2*cp equal zigzag chunks (not whole blocks)
    seq_len = rng.choice([n for n in range(unit, 49, unit) if n >= 12])
    samples = _pick(rng, {1: 1, 2: 2, 3: 1})
    rows = samples * topology.dp
    doc_ids = None
    if rng.random() < 0.6:
        doc_ids = tuple(draw_documents(rng, seq_len, 4, max(1, seq_len // (2 * topology.cp))) for _ in range(rows))
    transport = _pick(rng, {"collective": 2, "streaming": 1, "halo": 1}) if topology.cp > 1 else "collective"
    loss = _pick(rng, {"ce": 3, "kl": 1})
    objective = DFlashObjectiveConfig(
        max_anchors=max(rng.choice([2, 4, 6, 9]), topology.bp), gamma=rng.choice([None, 4.0, 7.0]), loss=loss,
        anchor_sampling=rng.choice(["uniform", "locality"]), context=rng.choice(["strict", "inclusive"]),
        weighting=_pick(rng, {"decay": 3, "dpace": 1}),
        lk_loss_type=_pick(rng, {"ce": 3, "tv": 1, "lambda": 1}) if loss == "ce" else "ce",
        ce_chunk_rows=rng.choice([1024, 5]),  # 5: the chunked LM-head loss crosses chunk boundaries
    )
    options: dict[str, Any] = {}
    if rng.random() < 0.3:  # DFlash2: block convolutions and the anchor selector
        options |= {"conv_kernel_size": 2, "conv_group_size": 8, "selector_rank": 4, "selector_top_k": 40}
    if rng.random() < 0.3:  # a sliding-window draft layer
        options |= {"layer_types": ("sliding_attention", "full_attention"), "sliding_window": rng.randint(1, 9)}
    case = DFlashVerifyCase(
        topology=topology, objective=objective, seq_len=seq_len, samples=samples, seed=seed,
        transport=transport, doc_ids=doc_ids, diagonal=rng.choice(["auto", "matmul", "sdpa"]),
        drafter_options=options, perturb_extras=bool(options), selector_scale=rng.choice([0.0, 0.5, 1.0]),
        dtype="float32" if rng.random() < FLOAT32_SHARE else "float64",  # drawn last: earlier draws unchanged
    )
    return _with_anchors(rng, case, unit)


def _with_anchors(rng: random.Random, case: DFlashVerifyCase, unit: int) -> DFlashVerifyCase:
    """``case``, or (when some row has no valid anchor: 1-token documents, padding and the random
    supervision can leave none) a valid redraw: the bad rows' documents again, then one document
    each, then another sequence length. Valid draws are returned unchanged (the redraws use the
    generator after every other draw), so seeds keep naming the cases they named."""
    for attempt in range(64):
        bad = anchorless_rows(case)
        if not bad:
            return case
        rows = [list(row) for row in case.doc_ids] if case.doc_ids is not None else [
            [0] * case.seq_len for _ in range(case.samples * case.topology.dp)]
        if attempt >= 8:  # the supervision itself may hold no two consecutive tokens: another length
            seq_len = rng.choice([n for n in range(unit, 49, unit) if n >= 12])
            case = replace(case, seq_len=seq_len, doc_ids=tuple((0,) * seq_len for _ in rows))
            continue
        for r in bad:
            rows[r] = list(draw_documents(rng, case.seq_len, 4, max(1, case.seq_len // (2 * case.topology.cp)))
                           if attempt < 7 else (0,) * case.seq_len)
        case = replace(case, doc_ids=tuple(tuple(row) for row in rows))
    raise AssertionError(f"DFlash draw {case.seed}: no batch with a valid anchor in every row")


def describe(case: FuzzCase) -> dict[str, Any]:
    """A compact, JSON-ready description (documents as run lengths, ``p`` = padding)."""
    t = case.topology
    out: dict[str, Any] = {
        "topology": f"dp{t.dp}xcp{t.cp}xbp{t.bp}", "layout": t.layout, "L": case.seq_len,
        "samples": case.samples, "transport": case.transport, "backend": case.backend, "diagonal": case.diagonal,
        "dtype": getattr(case, "dtype", "float64"),
    }
    if isinstance(case, DFlashVerifyCase):
        o = case.objective
        out |= {"objective": "dflash", "max_anchors": o.max_anchors, "gamma": o.gamma, "loss": o.loss,
                "anchor_sampling": o.anchor_sampling, "context": o.context, "weighting": o.weighting,
                "lk_loss_type": o.lk_loss_type, "ce_chunk_rows": o.ce_chunk_rows,
                "drafter": sorted(case.drafter_options), "selector_scale": case.selector_scale}
    else:
        out |= {
            "objective": case.objective + ("+nelbo" if case.nelbo else ""), "B": case.block_size,
            "window": case.window, "schedule": case.schedule, "clean": case.clean,
            "micro_batches": case.micro_batches, "supervision": case.supervision,
            "reset_positions": case.reset_positions, "ac": case.activation_checkpointing, "fsdp": case.fsdp,
            "grad_buckets": case.grad_buckets, "ce_chunk_rows": case.ce_chunk_rows,
        }
    doc_ids = case.doc_ids
    out["documents"] = None if doc_ids is None else [_run_lengths(row) for row in doc_ids]
    return out


def _run_lengths(row: tuple[int, ...]) -> str:
    runs: list[str] = []
    start = 0
    for i in range(1, len(row) + 1):
        if i == len(row) or row[i] != row[start]:
            runs.append(f"p{i - start}" if row[start] < 0 else str(i - start))
            start = i
    return ",".join(runs)


@dataclass(frozen=True)
class FuzzResult:
    """One drawn case's outcome: ``status`` is ``ok``, ``FAIL`` (outside tolerance) or ``ERROR``."""

    seed: int
    case: dict[str, Any]
    status: str
    loss_rel_err: float | None = None
    grad_rel_err: float | None = None
    worst_param: str = ""
    seconds: float = 0.0
    error: str = ""


def run_case(seed: int, case: FuzzCase, *, timeout_s: float = 120.0) -> FuzzResult:
    """Verify ``case`` on its own processes and report, never raising (an exception is ``ERROR``)."""
    started = time.perf_counter()
    try:
        result = verify_dflash(case, timeout_s=timeout_s) if isinstance(case, DFlashVerifyCase) else verify(
            case, timeout_s=timeout_s
        )
    except Interrupted:
        raise
    except Exception as exc:  # a crash is a finding, recorded with its last line
        return FuzzResult(seed, describe(case), "ERROR", seconds=time.perf_counter() - started, error=_last_line(exc))
    return _outcome(seed, case, result, time.perf_counter() - started)


def _outcome(seed: int, case: FuzzCase, result: Any, seconds: float) -> FuzzResult:
    return FuzzResult(
        seed, describe(case), "ok" if result.ok else "FAIL", result.loss_rel_err, result.grad_rel_err,
        result.worst_param, seconds,
    )


def _last_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    text = lines[-1] if lines else ""
    return f"{type(exc).__name__}: {text}"[:500]


def _batch_worker(rank: int, world: int, cases: list[FuzzCase]) -> list[tuple[str, Any]]:
    """Every case of one world size on the same processes (one launch: imports and spawns dominate a
    small case's time); each case builds its own process groups."""
    from csbp.dflash.verify import _worker as dflash_worker
    from csbp.engine.verify import _worker as engine_worker

    out: list[tuple[str, Any]] = []
    for case in cases:
        worker = dflash_worker if isinstance(case, DFlashVerifyCase) else engine_worker
        try:
            out.append(("ok", worker(rank, world, case)))
        except Exception as exc:  # reported per case; the parent reruns it alone
            out.append(("error", _last_line(exc)))
    return out


def run_sweep(
    seeds: list[int], max_nproc: int, *, batch: int = 8, timeout_s: float = 120.0, report: Any = None,
    backend: str = "tiles",
) -> list[FuzzResult]:
    """Draw and verify ``draw_case(seed, max_nproc)`` for every seed (see :func:`run_cases`), its
    layouts on attention ``backend`` (the reference is always the dense oracle): the draws do not depend
    on it, so a seed names the same case on either backend."""
    drawn = [(seed, draw_case(seed, max_nproc)) for seed in seeds]
    if backend != "tiles":
        drawn = [(seed, replace(case, backend=backend)) for seed, case in drawn]
    return run_cases(drawn, batch=batch, timeout_s=timeout_s, report=report)


def run_cases(
    drawn: list[tuple[int, FuzzCase]], *, batch: int = 8, timeout_s: float = 120.0, report: Any = None,
) -> list[FuzzResult]:
    """Verify every ``(seed, case)``, ``batch`` cases of one world size per launch (a window of
    ``4 * batch`` cases at a time, so results keep coming); a case that errors (and every later case
    of its launch) is rerun alone, so each error is its own. ``report(result)`` is called as results
    arrive (in launch order)."""
    from csbp.dflash.verify import compare_dflash
    from csbp.dflash.verify import reference as dflash_reference
    from csbp.engine.verify import check_case, compare, reference
    from csbp.parallel.launch import run_local

    results: list[FuzzResult] = []

    def emit(result: FuzzResult) -> None:
        results.append(result)
        if report is not None:
            report(result)

    launches: list[tuple[int, list[tuple[int, FuzzCase]]]] = []
    for start in range(0, len(drawn), 4 * batch):
        by_world: dict[int, list[tuple[int, FuzzCase]]] = {}
        for seed, case in drawn[start : start + 4 * batch]:
            by_world.setdefault(case.topology.world_size, []).append((seed, case))
        launches += [(world, cases[i : i + batch]) for world, cases in sorted(by_world.items())
                     for i in range(0, len(cases), batch)]
    for world, chunk in launches:
        started = time.perf_counter()
        try:
            refs = []
            for _, case in chunk:
                if isinstance(case, VerifyCase):
                    check_case(case)
                    refs.append(reference(case))
                else:
                    refs.append(dflash_reference(case))
            outputs = run_local(_batch_worker, world, ([c for _, c in chunk],), timeout_s=timeout_s,
                                join_timeout_s=timeout_s * len(chunk) + 60)
        except Interrupted:
            raise
        except Exception:  # a crash or hang of the launch: attribute it case by case
            for seed, case in chunk:
                emit(run_case(seed, case, timeout_s=timeout_s))
            continue
        seconds = (time.perf_counter() - started) / len(chunk)
        for index, ((seed, case), (loss_ref, grads_ref)) in enumerate(zip(chunk, refs, strict=True)):
            per_rank = [rank_out[index] for rank_out in outputs]
            if any(status != "ok" for status, _ in per_rank):
                for later_seed, later_case in chunk[index:]:
                    emit(run_case(later_seed, later_case, timeout_s=timeout_s))
                break
            values = [value for _, value in per_rank]
            if isinstance(case, DFlashVerifyCase):
                result: Any = compare_dflash(case, values, loss_ref, grads_ref)
            else:
                result = compare(case, values, loss_ref, grads_ref)
            emit(_outcome(seed, case, result, seconds))
    return results
