"""``csbp verify``: a self-test that every parallel layout equals one process, on this machine.

Examples::

    csbp verify --nproc 4 --cp 2 --bp 2                # one layout
    csbp verify --nproc 4                              # every valid layout on 4 processes
    csbp verify --nproc 4 --cp 2 --bp 4 --transport streaming --window 8 --dtype float32
    csbp verify --nproc 4 --objective dflash               # DFlash drafter training, every layout
    csbp verify --nproc 4 --objective dflash --doc-length 6  # DFlash with packed documents (+ cp-aware)
    csbp verify --device cuda --nproc 2                # NCCL, one process per GPU
    csbp verify --nproc 4 --doc-length 6                   # packed documents (mean 6 tokens), every layout
    csbp verify --nproc 4 --seq-len 128 --doc-length 24 --schedule balanced  # blocks dealt by document cost
    csbp verify --nproc 4 --block-size 16 --diagonal sdpa  # the fused-SDPA block diagonal, every layout
    csbp verify --nproc 4 --clean pieces               # clean context as flash pieces, every layout
    csbp verify --random 20 --seed 7                   # 20 random layouts/objectives/documents on <= 4 processes
    csbp verify --random 20 --seed 7 --nproc 8         # ... on <= 8 processes (cp=3, bp=6, dp2 x cp2 x bp2, ...)

Processes are launched here: on the CPU (gloo, one thread each) by default, or with
``--device cuda`` one per GPU over NCCL (``--nproc`` larger than the visible GPUs is refused before
anything starts). The single-process reference always runs on the CPU, every layer's attention dense
under the closed-form mask predicates (``csbp.engine.oracle``), so even ``--nproc 1`` (the one-process
layout on the tiled kernels) checks the kernels against something other than themselves. Exit status
1 if any layout is outside its tolerance (1e-9 relative for float64, 1e-4 for float32).
"""

from __future__ import annotations

import argparse

from csbp.attention.backends import check_backend_trains_on
from csbp.attention.diagonal import check_diagonal_backend
from csbp.cli.options import add_clean_option, add_diagonal_option, check_layout_flags, positive_int
from csbp.devices import DEVICE_KINDS, resolve_device
from csbp.engine.verify import VerifyCase, check_case, layouts_for, verify
from csbp.schedules import SCHEDULES
from csbp.topology import Topology, sequence_error_in_flags


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "verify",
        help="check that parallel layouts equal one process",
        description="Run one forward/backward of a small decoder (or DFlash drafter) in every valid layout of "
        "--nproc gloo processes (or the one --dp/--cp/--bp give) and on one process; print the relative error "
        "of the loss and of the worst parameter gradient, and exit 1 if any layout is outside the tolerance.",
    )
    parser.add_argument("--nproc", type=positive_int, default=4, help="processes to launch (default 4)")
    parser.add_argument("--dp", type=positive_int, default=None, help="data-parallel degree (default nproc / local)")
    parser.add_argument("--cp", type=positive_int, default=None, help="context-parallel degree")
    parser.add_argument("--bp", type=positive_int, default=None, help="block-parallel degree")
    parser.add_argument(
        "--transport",
        choices=("collective", "streaming", "halo"),
        default="collective",
        help="ring transport; halo: all-to-all of only the clean rows a remote query may see (cp-aware for cp-only)",
    )
    parser.add_argument(
        "--doc-length",
        type=positive_int,
        default=None,
        help="pack random documents of this mean length (document masking on); every layout adds cp-aware",
    )
    parser.add_argument("--window", type=positive_int, default=None, help="sliding window W (tokens, incl. the query)")
    parser.add_argument(
        "--schedule", choices=SCHEDULES, default="dual_end",
        help="block schedule over BP ranks; balanced: dealt by document cost (with --doc-length, else dual_end)",
    )
    parser.add_argument("--seq-len", type=positive_int, default=32)
    parser.add_argument("--block-size", type=positive_int, default=4)
    parser.add_argument("--samples", type=positive_int, default=2, help="samples per data-parallel replica")
    parser.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--device", choices=DEVICE_KINDS, default="cpu",
        help="cpu: gloo processes (default); cuda: one process per GPU over NCCL",
    )
    parser.add_argument(
        "--backend", choices=("auto", "tiles", "flex"), default="auto",
        help="attention backend of the layouts (auto: flex on CUDA, tiles on CPU; flex on CPU runs FlexAttention's "
        "exact dense implementations, for checking); the reference runs dense attention under the mask predicates",
    )
    add_diagonal_option(parser, reference=True)
    add_clean_option(parser, reference=True)
    parser.add_argument(
        "--objective",
        choices=("bd3", "dflash"),
        default="bd3",
        help="bd3: a decoder on a BD3 batch (default); dflash: a DFlash drafter against a frozen target",
    )
    parser.add_argument(
        "--random", type=positive_int, default=None, metavar="N",
        help="draw N random valid cases (layout on <= --nproc (2-8) processes, dtype, objective, block size, sequence length, "
        "ragged documents, window, schedule, transport, kernels, accumulation, checkpointing, FSDP) from "
        "--seed, --seed+1, ...; each line names its seed: --random 1 --seed THAT reruns it",
    )
    parser.add_argument("--log", default=None, metavar="PATH", help="with --random: append one JSON line per case")
    parser.set_defaults(func=run_verify)


def _requested_topologies(args: argparse.Namespace) -> list[Topology]:
    if args.nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {args.nproc}")
    if args.cp is None and args.bp is None and args.dp is None:
        found = layouts_for(args.nproc)
        if args.transport != "collective" and all(t.cp == 1 for t in found):  # was: ran, the flag ignored
            raise ValueError(
                f"--transport {args.transport} needs a CP ring, and no layout of --nproc {args.nproc} has cp > 1 "
                "(fix: --nproc 2 or more, or drop --transport)"
            )
        return found
    cp, bp = args.cp or 1, args.bp or 1
    check_layout_flags(cp, bp)
    local = max(cp, bp)
    if args.dp is None and args.nproc % local:  # was: "Topology.dp must be a positive integer, got 0"
        raise ValueError(
            f"--nproc {args.nproc} is not a multiple of max(--cp, --bp) = {local} "
            f"(fix: --nproc {max(local, args.nproc - args.nproc % local)}, or set --dp)"
        )
    dp = args.dp if args.dp is not None else args.nproc // local
    topology = Topology(dp=dp, cp=cp, bp=bp, replicate_clean_prefix=(cp == 1 and bp > 1))
    topology.check_world_size(args.nproc)
    if args.transport != "collective" and cp == 1:  # was: verified, the flag ignored (the train config refuses it)
        raise ValueError(
            f"--transport {args.transport} needs a CP ring (--cp > 1) (fix: --cp 2 or more, or drop --transport)"
        )
    return [topology]


def _transport_for(topology: Topology, transport: str) -> str:
    """``--transport`` for one layout of the every-layout table: ``streaming`` and ``halo`` are ring
    transports, so the layouts without a CP ring (``cp == 1``) run theirs (local attention) as ``collective``."""
    return "collective" if topology.cp == 1 else transport


def run_verify(args: argparse.Namespace) -> int:
    if args.random is not None:
        return run_verify_random(args)
    if args.log is not None:
        raise ValueError("--log records --random cases: add --random N or drop --log")
    resolve_device(args.device, nproc=args.nproc)  # fail closed: --nproc GPUs must be visible
    if args.objective == "dflash":
        return run_verify_dflash(args)
    backend = check_backend_trains_on(args.backend, args.device, where="--backend", verification=True)
    check_diagonal_backend(args.diagonal, backend, where="--diagonal")
    cases = []
    for t in _requested_topologies(args):
        transports = [_transport_for(t, args.transport)]
        if args.doc_length is not None and t.layout == "cp" and args.transport != "halo":
            transports.append("halo")  # the mask-aware CP baseline next to the generic one
        for transport in transports:
            cases.append(
                VerifyCase(
                    topology=t,
                    seq_len=args.seq_len,
                    block_size=args.block_size,
                    transport=transport,
                    window=args.window,
                    dtype=args.dtype,
                    samples=args.samples,
                    seed=args.seed,
                    doc_length=args.doc_length,
                    device=args.device,
                    backend=backend,
                    diagonal=args.diagonal,
                    clean=args.clean,
                    schedule=args.schedule,
                )
            )
    for case in cases:  # fail closed before launching anything
        try:
            check_case(case)
        except ValueError as error:
            raise ValueError(sequence_error_in_flags(str(error))) from None
    documents = "" if args.doc_length is None else f" doc_length={args.doc_length} (document mask)"
    device = "" if args.device == "cpu" else f" device={args.device}"
    print(f"csbp verify: L={args.seq_len} B={args.block_size} dtype={args.dtype} nproc={args.nproc} backend={backend}"
          f"{documents}{device}")
    columns = [case.columns for case in cases]  # as wide as their longest entry (`halo balanced`)
    shape_width = max(12, *(len(shape) for _, shape, _ in columns))
    detail_width = max(12, *(len(detail) for _, _, detail in columns))
    header = (f"{'layout':<8} {'topology':<{shape_width}} {'detail':<{detail_width}} {'loss rel err':>13} "
              f"{'grad rel err':>13}  status")
    print(header)
    print("-" * len(header))
    failed = 0
    for case, (name, shape, detail) in zip(cases, columns):
        result = verify(case)
        status = "ok" if result.ok else f"FAIL (tol {result.tolerance:g}, worst {result.worst_param})"
        failed += not result.ok
        print(f"{name:<8} {shape:<{shape_width}} {detail:<{detail_width}} {result.loss_rel_err:>13.2e} "
              f"{result.grad_rel_err:>13.2e}  {status}", flush=True)
    print(verdict(failed, len(cases)))
    return 1 if failed else 0


def verdict(failed: int, total: int) -> str:
    """The last line of a layout table: ``all 4 layouts equal one process within tolerance``, ``the 1
    layout equals one process within tolerance``, ``1 of 4 layouts exceeds the tolerance``."""
    if not failed:
        return all_equal(total, "layout")
    return f"{count_of(failed, total, 'layout')} {'exceeds' if failed == 1 else 'exceed'} the tolerance"


def all_equal(total: int, noun: str) -> str:
    """``all 4 layouts equal one process within tolerance`` (``the 1 layout equals ...``)."""
    if total == 1:
        return f"the 1 {noun} equals one process within tolerance"
    return f"all {total} {noun}s equal one process within tolerance"


def count_of(part: int, total: int, noun: str) -> str:
    """``1 of 4 layouts``, ``1 of 1 layout``."""
    return f"{part} of {total} {noun}{'' if total == 1 else 's'}"


def run_verify_dflash(args: argparse.Namespace) -> int:
    """The same self-test for DFlash drafter training (float64, the drafter's parameters); with
    ``--doc-length`` every sample packs random documents and CP-only also runs as ``cp-aware``
    (``--transport halo``: the context exchange of only the rows an anchor may see); with
    ``--window W`` the drafter's first layer slides (window ``W``), whose window rows CSBP exchanges
    in one-document samples too (the ``context`` column says ``exchange`` where some sample's layer
    kind exchanges)."""
    from csbp.dflash.config import DFlashObjectiveConfig
    from csbp.dflash.exchange import context_exchange_kinds
    from csbp.dflash.layouts import dflash_layout
    from csbp.dflash.verify import DFlashVerifyCase, anchorless_rows, build_models, verify_dflash

    ignored = [flag for flag, changed in (("--block-size", args.block_size != 4), ("--schedule", args.schedule != "dual_end"))
               if changed]
    if ignored:  # was: silently ignored (the drafter's blocks are 4 tokens; anchors are dealt, not blocks)
        raise ValueError(
            f"--objective dflash verifies a drafter with blocks of 4 whose anchors are dealt to BP ranks: "
            f"drop {' and '.join(ignored)}"
        )
    if args.dtype != "float64":
        raise ValueError("--objective dflash verifies in float64: drop --dtype")
    if args.doc_length == 1:  # was: a table header, then "sequence has no valid DFlash anchor ... drop such rows"
        raise ValueError(
            "--doc-length 1 packs only one-token documents, where a DFlash drafter has no anchor (a supervised "
            "token followed by one of its own document): use --doc-length 2 or more"
        )
    sliding = {} if args.window is None else {
        "layer_types": ("sliding_attention", "full_attention"), "sliding_window": args.window}
    backend = check_backend_trains_on(args.backend, args.device, where="--backend", verification=True)  # as for bd3
    check_diagonal_backend(args.diagonal, backend, where="--diagonal")
    topologies = _requested_topologies(args)
    for t in topologies:  # fail closed before launching anything
        if t.cp > 1 and args.seq_len % (2 * t.cp):
            raise ValueError(f"--seq-len {args.seq_len} must be a multiple of 2*cp={2 * t.cp} for DFlash context shards")
    for t in topologies:  # was: the table's header, then "sequence has no valid DFlash anchor" (e.g. --seq-len 4)
        bad = anchorless_rows(DFlashVerifyCase(topology=t, seq_len=args.seq_len, samples=args.samples,
                                               seed=args.seed, doc_length=args.doc_length))
        if bad:
            documents = "" if args.doc_length is None else f" --doc-length {args.doc_length}"
            raise ValueError(
                f"--seq-len {args.seq_len}{documents} --seed {args.seed}: sample {bad[0]} of the DFlash batch of "
                f"{t.dp * args.samples} samples has no valid anchor (a supervised token followed by one of its "
                "document; the odd samples end in 4 padding tokens): use a longer --seq-len"
                + (", a longer --doc-length" if documents else "") + " or another --seed"
            )
    cases = []
    for t in topologies:
        transports = [_transport_for(t, args.transport)]
        if args.doc_length is not None and t.layout == "cp" and args.transport != "halo":
            transports.append("halo")  # the mask-aware CP baseline next to the generic one, as for bd3
        cases += [(t, transport) for transport in transports]
    documents = "" if args.doc_length is None else f" doc_length={args.doc_length}"
    documents += "" if args.window is None else f" window={args.window}"
    device = "" if args.device == "cpu" else f" device={args.device}"
    print(f"csbp verify (dflash): L={args.seq_len} dtype=float64 nproc={args.nproc} backend={backend}{documents}{device}")
    header = f"{'layout':<8} {'topology':<12} {'context':<10} {'loss rel err':>13} {'grad rel err':>13}  status"
    print(header)
    print("-" * len(header))
    failed = 0
    for t, transport in cases:
        objective = DFlashObjectiveConfig(max_anchors=max(6, t.bp), gamma=7.0)
        case = DFlashVerifyCase(topology=t, objective=objective, seq_len=args.seq_len,
                                samples=args.samples, seed=args.seed, device=args.device, backend=backend,
                                diagonal=args.diagonal, clean=args.clean, transport=transport,
                                doc_length=args.doc_length, drafter_options=sliding)
        result = verify_dflash(case)
        status = "ok" if result.ok else f"FAIL (tol {result.tolerance:g}, worst {result.worst_param})"
        failed += not result.ok
        name = {"data": "data", "cp": "cp-only", "bp": "bp-only", "csbp": "csbp"}[t.layout]
        if t.layout == "cp" and transport == "halo":
            name = "cp-aware"
        shape = f"dp{t.dp}xcp{t.cp}xbp{t.bp}"
        # how context K/V move: "exchange" where some sample (the batch always packs documents in
        # some, and has one-document samples unless --doc-length) plans some layer kind for it
        context = "-" if t.cp == 1 else "all-gather"
        config, layout = build_models(case)[1].config, dflash_layout(t, 0)
        packs = (True,) if args.doc_length is not None else (True, False)
        if t.cp > 1 and any(any(context_exchange_kinds(config, layout, transport, packs_documents=p)) for p in packs):
            context = "exchange"
        print(f"{name:<8} {shape:<12} {context:<10} {result.loss_rel_err:>13.2e} {result.grad_rel_err:>13.2e}  "
              f"{status}", flush=True)
    print(verdict(failed, len(cases)))
    return 1 if failed else 0


RANDOM_FIXED = ("dp", "cp", "bp", "doc_length", "window", "objective", "transport", "schedule")


def run_verify_random(args: argparse.Namespace) -> int:
    """``--random N``: cases ``draw_case(seed + i)`` for ``i < N`` on at most ``--nproc`` CPU processes,
    one line each (and one JSON line in ``--log``); exit 1 if any is outside tolerance or crashes."""
    import json
    from dataclasses import asdict

    import torch

    from csbp.engine.fuzz import FLOAT32_SHARE, FuzzResult, check_nproc, run_sweep
    from csbp.engine.verify import TOLERANCES

    defaults = {"dp": None, "cp": None, "bp": None, "doc_length": None, "window": None, "objective": "bd3",
                "transport": "collective", "schedule": "dual_end"}
    fixed = [f"--{name.replace('_', '-')}" for name in RANDOM_FIXED if getattr(args, name) != defaults[name]]
    if fixed or args.device != "cpu" or args.dtype != "float64":
        raise ValueError(
            f"--random draws the layout, objective, dtype and documents itself (CPU): drop "
            f"{', '.join(fixed) or '--device/--dtype'}"
        )
    ignored = [flag for flag, changed in (("--diagonal", args.diagonal != "auto"), ("--clean", args.clean != "generic"))
               if changed]
    if ignored:
        raise ValueError(f"--random draws the attention kernels itself: drop {' and '.join(ignored)}")
    check_nproc(args.nproc)
    backend = check_backend_trains_on(args.backend, args.device, where="--backend", verification=True)
    print(f"csbp verify --random {args.random}: seeds {args.seed}..{args.seed + args.random - 1}, "
          f"<= {args.nproc} processes, float64 (tol {TOLERANCES[torch.float64]:g}) and 1 in "
          f"{round(1 / FLOAT32_SHARE)} float32 (tol {TOLERANCES[torch.float32]:g}), backend {backend}")
    failed = 0

    def report(result: FuzzResult) -> None:
        nonlocal failed
        failed += result.status != "ok"
        c = result.case
        what = f"{c['objective']:<18} {c['topology']:<12} L={c['L']:<3} {c['dtype'][5:]:<3} {c['transport']}"
        errors = "" if result.loss_rel_err is None else f"{result.loss_rel_err:9.2e} {result.grad_rel_err:9.2e}"
        print(f"seed {result.seed:<6} {what:<52} {errors:>19}  {result.status} {result.error}".rstrip(), flush=True)
        if args.log is not None:
            with open(args.log, "a", encoding="utf-8") as log:
                log.write(json.dumps(asdict(result)) + "\n")

    run_sweep(list(range(args.seed, args.seed + args.random)), args.nproc, report=report, backend=backend)
    if failed:
        print(f"{count_of(failed, args.random, 'random case')} failed (rerun one: csbp verify --random 1 --seed SEED)")
        return 1
    print(all_equal(args.random, "random case"))
    return 0
