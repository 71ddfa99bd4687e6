"""Randomized end-to-end sweep: ``csbp train`` and ``csbp eval --nproc`` layouts against one process.

``csbp verify --random`` (csbp.engine.fuzz) drives the engine directly. This script goes through the
user-facing paths instead, on tiny prepared artifacts (the test suite's ``make_artifact``):

* ``train``: a random run config (objective bd3/fast_dllm_v2, block size, sequence length 32 or 48,
  CP-only/BP-only/CSBP on 2-4 ranks, each sometimes times ``dp`` = 2 or 3 (data-only ``dp`` too,
  at most 6 ranks, FSDP2 sometimes), transport, schedule, window, document masking and
  ``reset_positions``, accumulation, micro-batch size, activation checkpointing, gradient clipping),
  3 optimizer steps in float64 with validation after every step, against the same config on one
  process: every step's loss, ``val_loss`` and ``val_nelbo`` must agree to 1e-9 relative. With
  ``dp = D`` the one process reads micro-batches of ``D * micro_batch_size`` rows (the loader's global
  batch, whose consecutive shards the replicas read) and corrupts shard ``d`` with replica ``d``'s
  generator ``corruption_generator(seed, step, d, micro_step)`` (:func:`emulated_replicas`), so both
  sides train on the same rows with the same noise;
* ``eval``: a random float64 model scored by ``evaluate_parallel`` (objective bd3/fast_dllm_v2/mdlm,
  layouts up to 4 ranks, window, documents, ``reset_positions``, micro-batch size, LTR on/off)
  against ``evaluate_model`` on one process: NELBO, LTR NLL and token counts.

One JSON line per case on stdout (among the trainer's own progress lines). Usage (from the repository root; at most 6 ranks at once)::

    OMP_NUM_THREADS=1 .venv/bin/python tests/fuzz/train_eval_sweep.py --train 40 --eval 16 --seed 0 --out /tmp/sweep
    OMP_NUM_THREADS=1 .venv/bin/python tests/fuzz/train_eval_sweep.py --train 8 --eval 0 --dp-only --out /tmp/sweep
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the suite's helpers (test_training_run)

TOLERANCE = 1e-9
LAYOUTS: tuple[dict[str, Any], ...] = (
    {"cp": 2}, {"cp": 2, "bp": 2}, {"bp": 2, "replicate_clean_prefix": True}, {"cp": 2, "bp": 4}, {"cp": 4},
    {"cp": 4, "bp": 4}, {"bp": 4, "replicate_clean_prefix": True}, {"bp": 3, "replicate_clean_prefix": True},
    {"cp": 3}, {"cp": 3, "bp": 3},
)
MAX_TRAIN_RANKS = 6
"""Most ranks of one drawn train case (dp * max(cp, bp))."""


def _fits(layout: dict[str, Any], seq_len: int, block_size: int) -> bool:
    from csbp.topology import Topology

    try:
        Topology(**layout).validate_sequence(seq_len, block_size)
    except ValueError:
        return False
    return True


def _local(layout: dict[str, Any]) -> int:
    return max(layout.get("cp", 1), layout.get("bp", 1))


def _draw_dp(rng: random.Random, layout: dict[str, Any], seq_len: int, block: int) -> tuple[int, dict[str, Any]]:
    """``(dp, layout)``: dp = 1 half the time, else 2 or 3 replicas of a layout (redrawn among those
    that fit ``MAX_TRAIN_RANKS`` with 2 replicas) or, one time in five, plain data parallelism."""
    if rng.random() < 0.5:
        return 1, layout
    if rng.random() < 0.2:
        return rng.choice([2, 3]), {}
    fitting = [t for t in LAYOUTS if _fits(t, seq_len, block) and 2 * _local(t) <= MAX_TRAIN_RANKS]
    layout = dict(rng.choice(fitting)) if fitting else {}
    return rng.choice([d for d in (2, 3) if d * _local(layout) <= MAX_TRAIN_RANKS]), layout


def draw_train(seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(config changes, layout)`` of train case ``seed`` (dotted keys for ``tiny_config``)."""
    rng = random.Random(seed)
    objective = rng.choice(["bd3", "bd3", "fast_dllm_v2"])
    seq_len = rng.choice([32, 48])
    block = rng.choice([b for b in (2, 3, 4, 6, 8) if seq_len % b == 0])
    layout = dict(rng.choice([t for t in LAYOUTS if _fits(t, seq_len, block)]))
    dp, layout = _draw_dp(rng, layout, seq_len, block)
    documents = rng.random() < 0.6
    changes: dict[str, Any] = {
        "model.dtype": "float64", "train.precision": "fp64", "data.seq_len": seq_len, "train.max_steps": 3,
        "train.eval_every": 1, "train.eval_batches": 2, "train.save_every": 0, "train.generate_after": False,
        "train.grad_accum": rng.choice([1, 2, 3]), "train.micro_batch_size": rng.choice([1, 2, 3]),
        "data.document_mask": documents, "objective.name": objective, "objective.block_size": block,
    }
    if rng.random() < 0.35:
        changes["topology.window"] = rng.randint(1, seq_len)
    if documents and rng.random() < 0.3:
        changes["data.reset_positions"] = True
    if rng.random() < 0.25:
        changes["train.activation_checkpointing"] = "full"
    if rng.random() < 0.2:
        changes["optim.grad_clip"] = 0.05  # clipping reads the global gradient norm
    layout_changes = {f"topology.{k}": v for k, v in layout.items()}
    if dp > 1:
        layout_changes["topology.dp"] = dp
        if rng.random() < 0.25:
            layout_changes["train.fsdp"] = True  # HSDP over (model-input group, dp) when local > 1
    if layout.get("cp", 1) > 1:
        layout_changes["topology.transport"] = rng.choice(["collective", "streaming", "halo"])
    if layout.get("bp", 1) > 1:
        layout_changes["topology.schedule"] = rng.choice(["dual_end", "contiguous", "balanced"])
    return changes, layout_changes


def _train(root: Path, name: str, changes: dict[str, Any]) -> dict[str, Any]:
    from csbp.training import train
    from csbp.training.metrics import read_metrics
    from test_training_run import tiny_config

    run_dir = root / "runs" / name
    summary = train(tiny_config(root / f"art{changes['data.seq_len']}", **changes), run_dir=run_dir)
    rows = read_metrics(run_dir / "metrics.jsonl")
    return {"losses": summary.losses,
            "val": [v for r in rows if "val_loss" in r for v in (r["val_loss"], r["val_nelbo"])]}


def _train_ranks(rank: int, world: int, root: str, jobs: list[tuple[int, dict[str, Any]]]) -> list[Any] | None:
    out = [_train(Path(root), f"{seed}-layout", changes) for seed, changes in jobs]
    return out if rank == 0 else None


def _relative(values: list[float], refs: list[float]) -> float:
    assert len(values) == len(refs), (values, refs)
    return max((abs(a - b) / abs(b) if b else abs(a) for a, b in zip(values, refs, strict=True)), default=0.0)


@contextlib.contextmanager
def emulated_replicas(dp: int) -> Iterator[None]:
    """One process plays ``dp`` data-parallel replicas: micro-batch rows ``[d*S, (d+1)*S)`` (replica
    ``d``'s shard of the loader's global batch) are corrupted with replica ``d``'s generator, and the
    shards' corrupted rows concatenated (normalisers summed, as the dp all-reduce sums them)."""
    from csbp.objectives.base import corruption_generator
    from csbp.training.step import StepRunner

    original = StepRunner._corrupt_on_host  # training and validation both corrupt through it

    def corrupt(self: StepRunner, batch: dict[str, Any], step: int, micro_step: int, objective: Any = None) -> Any:
        rows = int(batch["input_ids"].shape[0]) // dp
        parts = [
            (objective or self.objective).corrupt(
                {name: value[d * rows : (d + 1) * rows] for name, value in batch.items()},
                corruption_generator(self.seed, step, d, micro_step=micro_step),
            )
            for d in range(dp)
        ]
        return _concatenated(parts)

    StepRunner._corrupt_on_host = corrupt  # type: ignore[method-assign]
    try:
        yield
    finally:
        StepRunner._corrupt_on_host = original  # type: ignore[method-assign]


def _concatenated(parts: list[Any]) -> Any:
    import torch

    tensors = {name: torch.cat([getattr(p, name) for p in parts])
               for name in ("noisy_ids", "clean_ids", "labels", "weights", "doc_ids")}
    if parts[0].noise_levels is not None:
        tensors["noise_levels"] = torch.cat([p.noise_levels for p in parts])
    return replace(parts[0], **tensors, loss_normaliser=sum(p.loss_normaliser for p in parts))


def _reference(root: Path, seed: int, changes: dict[str, Any], dp: int) -> dict[str, Any]:
    """The one-process run of a case with ``dp`` replicas (``micro_batch_size * dp`` rows per micro-batch)."""
    if dp == 1:
        return _train(root, f"{seed}-one", changes)
    with emulated_replicas(dp):
        return _train(root, f"{seed}-one", {**changes, "train.micro_batch_size": changes["train.micro_batch_size"] * dp})


def sweep_train(root: Path, seeds: list[int]) -> None:
    from csbp.parallel.launch import run_local

    by_world: dict[int, list[tuple[int, dict[str, Any], dict[str, Any]]]] = {}
    for seed in seeds:
        changes, layout = draw_train(seed)
        local = max(layout.get("topology.cp", 1), layout.get("topology.bp", 1))
        by_world.setdefault(layout.get("topology.dp", 1) * local, []).append((seed, changes, layout))
    for world, cases in sorted(by_world.items()):
        refs = [_reference(root, seed, changes, layout.get("topology.dp", 1)) for seed, changes, layout in cases]
        jobs = [(seed, {**changes, **layout}) for seed, changes, layout in cases]
        outs = run_local(_train_ranks, world, (str(root), jobs), timeout_s=300, join_timeout_s=300 * len(jobs))[0]
        for (seed, changes, layout), ref, out in zip(cases, refs, outs, strict=True):
            loss_err, val_err = _relative(out["losses"], ref["losses"]), _relative(out["val"], ref["val"])
            ok = max(loss_err, val_err) <= TOLERANCE and len(ref["losses"]) == 3 and len(ref["val"]) == 8  # step 0 + 3 steps, 2 numbers each
            print(json.dumps({"kind": "train", "seed": seed, "status": "ok" if ok else "FAIL", "loss_err": loss_err,
                              "val_err": val_err, "config": {**changes, **layout}}), flush=True)


def draw_eval(seed: int) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """``(settings, options, layout)`` of eval case ``seed`` on the 48-token artifact."""
    rng = random.Random(seed)
    objective = rng.choice(["bd3", "bd3", "fast_dllm_v2", "mdlm"])
    block = 48 if objective == "mdlm" else rng.choice([1, 2, 3, 4, 6, 8])
    layouts = [{"dp": 2}, {"dp": 3}] if objective == "mdlm" else [
        {"dp": 2}, {"dp": 3}, {"dp": 2, "cp": 2}, *[t for t in LAYOUTS if _fits(t, 48, block)]]
    documents = rng.random() < 0.6
    settings = {"objective": objective, "block_size": block, "mask_token_id": 300, "document_mask": documents,
                "window": None if objective == "mdlm" or rng.random() < 0.6 else rng.randint(1, 20),
                "reset_positions": documents and rng.random() < 0.4}
    options = {"samples": 2, "micro_batch_size": rng.choice([1, 2, 3]), "max_batches": rng.choice([2, 3]),
               "seed": seed, "left_to_right": rng.random() < 0.5}
    return settings, options, rng.choice(layouts)


def sweep_eval(root: Path, seeds: list[int]) -> None:
    import torch

    from csbp.data import open_artifact
    from csbp.engine.verify import tiny_model_config
    from csbp.evaluation.parallel import evaluate_parallel
    from csbp.evaluation.runner import EvalOptions, evaluate_model
    from csbp.evaluation.settings import EvalSettings
    from csbp.models.decoder import Decoder
    from csbp.models.hf_io import export_hf_checkpoint, load_hf_checkpoint
    from csbp.topology import Topology

    config = replace(tiny_model_config(), vocab_size=301)  # the artifacts' 300 ids and [M] = 300
    model_dir = root / "model"
    if not model_dir.exists():
        export_hf_checkpoint(Decoder(config, dtype=torch.float64, seed=3), config, model_dir)
    for seed in seeds:
        settings_kw, options_kw, layout = draw_eval(seed)
        settings, options = EvalSettings(**settings_kw), EvalOptions(**options_kw)
        topology = Topology(**{"replicate_clean_prefix": layout.get("cp", 1) == 1 < layout.get("bp", 1), **layout})
        model, _ = load_hf_checkpoint(model_dir, dtype=torch.float64)
        one = evaluate_model(model, open_artifact(root / "art48").split("train"), settings, options, progress=False)
        many = evaluate_parallel(model_dir, root / "art48", "train", settings, options, topology,
                                 dtype=torch.float64, timeout_s=120)
        errs = {key: _relative([getattr(many, key)], [getattr(one, key)])
                for key in ("nelbo", "ltr_nll") if getattr(one, key) is not None}
        counts = (many.rows, many.nelbo_tokens, many.ltr_tokens) == (one.rows, one.nelbo_tokens, one.ltr_tokens)
        ok = counts and max(errs.values()) <= TOLERANCE
        print(json.dumps({"kind": "eval", "seed": seed, "status": "ok" if ok else "FAIL", "errors": errs,
                          "counts_equal": counts, "settings": settings_kw, "options": options_kw, "layout": layout}),
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--train", type=int, default=10, help="train cases")
    parser.add_argument("--eval", type=int, default=5, help="eval cases")
    parser.add_argument("--seed", type=int, default=0, help="first seed")
    parser.add_argument("--dp-only", action="store_true", help="train: only the seeds that draw dp > 1")
    parser.add_argument("--out", type=Path, required=True, help="scratch directory (artifacts, run directories)")
    args = parser.parse_args()
    from test_training_run import make_artifact

    args.out.mkdir(parents=True, exist_ok=True)
    for seq_len in (32, 48):
        if not (args.out / f"art{seq_len}").exists():
            make_artifact(args.out / f"art{seq_len}", seq_len=seq_len, num_docs=90)
    started = time.perf_counter()
    train_seeds = list(range(args.seed, args.seed + args.train))
    if args.dp_only:
        draws = (s for s in range(args.seed, args.seed + 100 * args.train) if "topology.dp" in draw_train(s)[1])
        train_seeds = [next(draws) for _ in range(args.train)]
    sweep_train(args.out, train_seeds)
    sweep_eval(args.out, list(range(args.seed, args.seed + args.eval)))
    print(json.dumps({"seconds": round(time.perf_counter() - started, 1)}))


if __name__ == "__main__":
    main()
