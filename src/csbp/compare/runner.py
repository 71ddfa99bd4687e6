"""Train the layouts of ``csbp compare`` one after the other on the same processes, resumably.

:func:`run_compare` validates every layout's config against its data and output directory before
any process starts (round 1's, and every round's that has a directory to resume; the later rounds
differ only in their seed, checked for the last, and are checked when reached: :class:`PlannedRounds`,
:mod:`csbp.compare.rounds`), then, round by round, runs
:func:`_compare_worker` on ``nproc`` gloo processes started for that round (in this process when
``nproc == 1``). The worker trains each layout of the round in the round's order with
:func:`csbp.training.trainer.train` and a :class:`csbp.compare.budget.BudgetHook`, in the layout's
run directory (``OUT/<layout>/``, or ``OUT/round-<r>/<layout>/`` with ``--repeats`` > 1; a normal
run directory: ``metrics.jsonl``, checkpoints, ``final/``). A finished layout leaves ``result.json``
there.

One comparison at a time writes ``OUT``: the launching process holds ``OUT/.lock`` throughout.
Interrupt (Ctrl-C, a killed process) and rerun with ``--resume``: finished layouts (of every round)
are read back, the interrupted one continues from its last time-point checkpoint with its clock, and
the rest run.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from csbp.atomic import write_text_atomic
from csbp.compare.budget import BudgetHook, load_budget_state, step_time_summary
from csbp.compare.layouts import LAYOUT_NAMES, layout_config
from csbp.compare.rounds import layout_dir, round_config, round_order, round_seed
from csbp.config.schema import MAX_SEED, RunConfig
from csbp.parallel.launch import run_local
from csbp.training.memory_fit import check_state_fits
from csbp.training.preflight import check_run, check_validation_rows
from csbp.training.resume_config import flat_config, with_added_fields
from csbp.training.run_dir_checks import check_new_run_dir
from csbp.training.run_lock import LOCK_FILE, run_dir_lock
from csbp.training.trainer import train

RESULT_FILE = "result.json"
OPTIONS_FILE = "compare_options.json"
"""``OUT/compare_options.json``: the budget, points, process count, rounds, layouts and run config a
comparison started with."""


@dataclass(frozen=True)
class CompareOptions:
    """What ``csbp compare`` runs: ``layouts`` for ``budget_s`` training seconds each on ``nproc``
    processes, evaluated at ``points`` equal intervals, in ``out_dir``; ``repeats`` rounds of every
    layout (:mod:`csbp.compare.rounds`)."""

    layouts: tuple[str, ...]
    budget_s: float
    nproc: int
    out_dir: Path
    points: int = 5
    resume: bool = False
    metric: str | None = None
    repeats: int = 1


@dataclass(frozen=True)
class LayoutRun:
    """Layout ``layout`` of round ``round`` (1-based), trained with ``cfg`` (the round's seed) in
    ``run_dir``."""

    round: int
    layout: str
    cfg: RunConfig
    run_dir: Path


HIGHER_IS_BETTER = ("acceptance_length", "accept_rate_", "token_accuracy", "tau_mean", "candidate_recall")


def validation_metrics(cfg: RunConfig) -> list[str]:
    """The validation metrics ``cfg``'s run logs (``val_<name>`` in ``metrics.jsonl``): ``val_loss``,
    the unclipped ``nelbo``/``ppl_bound`` of the diffusion objectives, a DFlash drafter's token
    metrics and, with ``objective.dflash.eval_prompts`` >= 1, its speculative-decoding acceptance."""
    names = ["val_loss"]
    dflash = cfg.objective.dflash
    if cfg.objective.name in ("bd3", "mdlm", "fast_dllm_v2"):
        names += ["nelbo", "ppl_bound"]
    elif cfg.objective.name == "dflash" and dflash is not None:
        names += ["token_accuracy", "tau_mean"]
        if dflash.selector_rank > 0:
            names += ["selector_loss", "candidate_recall"]
        if dflash.eval_prompts > 0:
            names += ["acceptance_length", *(f"accept_rate_{k}" for k in range(1, cfg.objective.block_size or 1))]
    return names


def metric_of(cfg: RunConfig, name: str | None = None) -> tuple[str, bool]:
    """The compared metric (``name``, else ``acceptance_length`` for DFlash and ``val_loss``
    otherwise) and whether higher is better; ``val_nelbo`` names ``nelbo``. Raises ValueError with
    the valid names for an unknown one."""
    valid = validation_metrics(cfg)
    if name is None:
        name = "acceptance_length" if cfg.objective.name == "dflash" else "val_loss"
    elif name not in valid and name.startswith("val_") and name[4:] in valid:
        name = name[4:]
    dflash = cfg.objective.dflash
    if name not in valid and name.startswith("accept") and dflash is not None and dflash.eval_prompts < 1:
        raise ValueError(
            f"objective.dflash.eval_prompts: 0 turns off the speculative-decoding validation that measures "
            f"{name} (fix: set it >= 1, e.g. 8, or compare --metric tau_mean)"
        )
    if name not in valid:
        raise ValueError(
            f"--metric {name}: not a validation metric of objective {cfg.objective.name} "
            f"(fix: one of {', '.join(valid)})"
        )
    return name, name.startswith(HIGHER_IS_BETTER)


def plan_layouts(cfg: RunConfig, options: CompareOptions) -> PlannedRounds:
    """Every round's layouts in the order the round trains them, each config checked against the
    data and its run directory (raises ValueError); the rounds of :class:`PlannedRounds`, built
    lazily past those checked here (their work does not grow with ``--repeats``)."""
    if not options.layouts or len(set(options.layouts)) != len(options.layouts):
        raise ValueError(f"--layouts: give distinct layouts from {', '.join(LAYOUT_NAMES)}, e.g. cp,csbp")
    if not (math.isfinite(options.budget_s) and options.budget_s > 0):
        raise ValueError(f"--budget-s {options.budget_s}: must be a finite number > 0")
    for flag, value in (("--points", options.points), ("--nproc", options.nproc), ("--repeats", options.repeats)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{flag} {value!r}: must be an integer >= 1")
    metric_of(cfg, options.metric)
    _check_out_dir(options)
    _check_resumed_options(cfg, options)
    if options.points > cfg.train.max_steps:  # 2**62 points: one record per point a step passes, no end
        raise ValueError(
            f"--points {options.points}: each time point is evaluated at the end of a training step, and the run "
            f"stops at train.max_steps={cfg.train.max_steps}, so more points than steps cannot each have their own "
            f"(fix: --points {cfg.train.max_steps} or fewer, or raise train.max_steps)"
        )
    last_seed = round_seed(cfg, options.repeats - 1)
    if last_seed > MAX_SEED:
        raise ValueError(
            f"--repeats {options.repeats}: round {options.repeats} trains with seed run.seed + {options.repeats - 1} = "
            f"{last_seed}, above the largest seed {MAX_SEED} (fix: --repeats {MAX_SEED - cfg.run.seed + 1} or fewer, "
            "or a lower run.seed)"
        )
    return PlannedRounds(cfg, options)


class PlannedRounds:
    """The rounds of a comparison, round ``r`` a list of its :class:`LayoutRun` in training order.

    Rounds differ only in their seed (checked by :func:`plan_layouts` for the last, the largest) and
    their directories, so round 1 and, on ``--resume``, every round with a directory in ``--out`` are
    checked here, before any trains; a round without one (inside a new or checked ``--out``) is built
    and checked when it is reached. Checking every round up front made ``--repeats 2**62`` build
    configs without end before training."""

    def __init__(self, cfg: RunConfig, options: CompareOptions) -> None:
        self.cfg, self.options = cfg, options
        on_disk = {0}
        if options.resume and options.repeats > 1 and options.out_dir.is_dir():
            for entry in options.out_dir.iterdir():
                number = entry.name.removeprefix("round-")
                if entry.name.startswith("round-") and number.isdigit() and 1 <= int(number) <= options.repeats:
                    on_disk.add(int(number) - 1)
        self._checked = {index: self._plan(index) for index in sorted(on_disk)}

    def _plan(self, index: int) -> list[LayoutRun]:
        cfg = round_config(self.cfg, index)
        return [_plan_layout(cfg, name, index, self.options) for name in round_order(self.options.layouts, index)]

    def __len__(self) -> int:
        return self.options.repeats

    def __getitem__(self, index: int) -> list[LayoutRun]:
        if not 0 <= index < self.options.repeats:
            raise IndexError(f"round index {index} out of range")
        return self._checked[index] if index in self._checked else self._plan(index)

    def __iter__(self) -> Iterator[list[LayoutRun]]:
        for index in range(self.options.repeats):
            yield self[index]


def _plan_layout(cfg: RunConfig, name: str, round_index: int, options: CompareOptions) -> LayoutRun:
    """Layout ``name`` of round ``round_index`` (0-based), checked against its data and run directory."""
    layout_cfg = layout_config(cfg, name, options.nproc)
    if layout_cfg.world_size != options.nproc:
        raise ValueError(f"layout {name!r} needs {layout_cfg.world_size} processes, not --nproc {options.nproc}")
    run_dir = layout_dir(options.out_dir, name, round_index, options.repeats)
    resumable = options.resume and load_budget_state(run_dir) is not None
    done = options.resume and (run_dir / RESULT_FILE).is_file()
    if not done:
        if not resumable:
            check_new_run_dir(run_dir, "--out")  # only a layout run csbp wrote is removed
            shutil.rmtree(run_dir, ignore_errors=True)  # interrupted before its first time point
        inputs = check_run(
            layout_cfg, run_dir=run_dir, resume=resumable, stop_step=layout_cfg.train.max_steps,
            resume_restart=f"compare the changed config into a new --out instead of {options.out_dir}",
        )
        if inputs.val_split is None:
            raise ValueError(
                "data.val: csbp compare evaluates on validation data, and the run has none "
                "(fix: prepare the data with --val-fraction, or set data.val)"
            )
        check_validation_rows(layout_cfg, inputs.val_split.num_rows)
        check_state_fits(layout_cfg, inputs, local_ranks=options.nproc)
    return LayoutRun(round=round_index + 1, layout=name, cfg=layout_cfg, run_dir=run_dir)


def _check_out_dir(options: CompareOptions) -> None:
    """A new comparison starts in an empty ``--out`` (its lock file aside: :mod:`csbp.training.run_lock`)."""
    out = options.out_dir
    if not options.resume and out.is_dir() and any(entry.name != LOCK_FILE for entry in out.iterdir()):
        raise ValueError(f"--out {out} is not empty (fix: --resume to continue that comparison, or another --out)")


def _recorded_options(cfg: RunConfig, options: CompareOptions) -> dict[str, Any]:
    return {
        "budget_s": options.budget_s,
        "points": options.points,
        "nproc": options.nproc,
        "repeats": options.repeats,
        "layouts": list(options.layouts),
        "config": json.loads(json.dumps(cfg.model_dump(mode="json"))),
    }


def _check_resumed_options(cfg: RunConfig, options: CompareOptions) -> None:
    """A resumed comparison keeps the run config, budget, points, process count and rounds it started
    with (and, with more than one round, its ``--layouts``, which set every round's order): the layouts
    already trained were measured under them (one line naming the field or flag otherwise). A
    non-empty ``--out`` without ``compare_options.json`` is no comparison, and an empty or missing one has
    nothing to resume (as ``csbp train --resume`` refuses: a mistyped ``--out`` started a new comparison)."""
    path = options.out_dir / OPTIONS_FILE
    if not options.resume:
        return
    if not path.is_file():
        if options.out_dir.is_dir() and any(entry.name != LOCK_FILE for entry in options.out_dir.iterdir()):
            raise ValueError(
                f"--out {options.out_dir}: no {OPTIONS_FILE}, so it holds no csbp compare run to resume (fix: "
                "another --out)"
            )
        raise ValueError(
            f"--resume: --out {options.out_dir} holds no comparison to resume (fix: drop --resume to start one "
            "there, or pass the --out of the interrupted comparison)"
        )
    started = json.loads(path.read_text(encoding="utf-8"))
    started.setdefault("repeats", 1)  # started before --repeats: one round
    recorded = _recorded_options(cfg, options)
    _check_same_config(started.get("config"), recorded.pop("config"), options.out_dir)
    layouts, before = recorded.pop("layouts"), started.get("layouts")
    for key, value in recorded.items():
        if key in started and started[key] != value:
            flag = "--" + key.replace("_", "-")
            raise ValueError(
                f"{flag} {value:g}: the comparison in {options.out_dir} was started with {flag} {started[key]:g}, "
                f"and its layouts so far were measured under it (fix: {flag} {started[key]:g} to resume it, or "
                "another --out)"
            )
    if options.repeats > 1 and before is not None and before != layouts:
        first, now = ",".join(before), ",".join(layouts)
        raise ValueError(
            f"--layouts {now}: the comparison in {options.out_dir} was started with --layouts {first}, whose order "
            f"sets the order of every round (fix: --layouts {first} to resume it, or another --out)"
        )


def _check_same_config(started: dict[str, Any] | None, current: dict[str, Any], out_dir: Path) -> None:
    """Every field of the run config as the comparison started (none recorded: nothing to check).
    Unlike ``csbp train --resume``, nothing may change: a finished layout is read back as it is, so a
    changed learning rate, attention backend or ``train.eval_batches`` would compare unlike runs."""
    if started is None:
        return
    before, after = with_added_fields(flat_config(started)), flat_config(current)
    for name in sorted(set(before) | set(after)):
        old, new = before.get(name), after.get(name)
        if old != new:
            raise ValueError(
                f"{name}: the comparison in {out_dir} was started with {name}={json.dumps(old)}, the config sets "
                f"{json.dumps(new)}; its layouts so far were trained under the first (fix: set {name}: "
                f"{json.dumps(old)} to resume, or compare the changed config into a new --out instead of {out_dir})"
            )


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _train_layout(run: LayoutRun, options: CompareOptions, rank: int) -> dict[str, Any]:
    cfg, run_dir = run.cfg, run.run_dir
    state = load_budget_state(run_dir) if options.resume else None
    if state is None and rank == 0:
        shutil.rmtree(run_dir, ignore_errors=True)  # nothing resumable: start this layout afresh
    _barrier()
    metric, _ = metric_of(cfg, options.metric)
    if rank == 0:  # which layout the progress lines below belong to
        rounds = f"round {run.round}/{options.repeats}: " if options.repeats > 1 else ""
        print(f"{rounds}{run.layout}, seed {cfg.run.seed}", flush=True)
    hook = BudgetHook(
        budget_s=options.budget_s,
        num_points=options.points,
        metric=metric,
        max_steps=cfg.train.max_steps,
        run_dir=run_dir,
        state=state,
    )
    if not hook.finished:  # a layout interrupted after its last point only lacks result.json
        train(cfg, run_dir=run_dir, resume=state is not None, hook=hook)
    result = {
        "layout": run.layout,
        "round": run.round,
        "seed": cfg.run.seed,
        "topology": {key: cfg.topology.model_dump()[key] for key in ("dp", "cp", "bp", "replicate_clean_prefix")},
        "steps": hook.state.step,
        "clock_s": hook.state.clock_s,
        "step_s": step_time_summary(hook.state.step_seconds),
        "points": [asdict(point) for point in hook.state.points],
    }
    if rank == 0:
        write_text_atomic(run_dir / RESULT_FILE, json.dumps(result, indent=1) + "\n")
    _barrier()
    return result


def _finished(run: LayoutRun, options: CompareOptions) -> dict[str, Any] | None:
    """The result of a layout a resumed comparison finished before, else None."""
    result_file = run.run_dir / RESULT_FILE
    if options.resume and result_file.is_file():
        return json.loads(result_file.read_text(encoding="utf-8"))
    return None


def _compare_worker(
    rank: int, world_size: int, runs: list[LayoutRun], options: CompareOptions
) -> list[dict[str, Any]]:
    """Train (or read back) the layouts of one round in its order; their results in that order."""
    return [_finished(run, options) or _train_layout(run, options, rank) for run in runs]


def run_compare(
    cfg: RunConfig, options: CompareOptions, *, announce: Callable[[], None] | None = None,
) -> list[dict[str, Any]]:
    """Train every layout of every round (module docstring); the results round by round, each
    round's in ``options.layouts`` order (whatever order it trained in), each with its ``round``
    (1-based) and ``seed``, and each point's ``metric`` the ``options.metric`` (also for points of a resumed comparison that
    was started with another one: every point keeps ``val_loss`` and all validation metrics). This
    process holds ``OUT/.lock`` throughout (:mod:`csbp.training.run_lock`): a second comparison in
    ``--out`` is refused before it checks or removes anything there. ``announce`` runs once every layout
    is checked, before any trains (the command's header: a refusal stays its one line)."""
    _check_out_dir(options)  # before the lock file is created in it
    with run_dir_lock(options.out_dir, flag="--out", what="comparison directory"):
        return _run_compare(cfg, options, announce)


def _run_compare(cfg: RunConfig, options: CompareOptions, announce: Callable[[], None] | None) -> list[dict[str, Any]]:
    rounds = plan_layouts(cfg, options)
    if announce is not None:
        announce()
    options.out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(options.out_dir / OPTIONS_FILE, json.dumps(_recorded_options(cfg, options), indent=1) + "\n")
    metric, _ = metric_of(cfg, options.metric)
    results = []
    for runs in rounds:
        trained = {result["layout"]: result for result in _run_round(cfg, runs, options)}
        results += [_with_metric({**trained[name], "round": runs[0].round}, metric) for name in options.layouts]
    return results


def _run_round(cfg: RunConfig, runs: list[LayoutRun], options: CompareOptions) -> list[dict[str, Any]]:
    """One round on processes of its own (in this process on one process, or when every layout of
    the round is finished and only read back)."""
    finished = [_finished(run, options) for run in runs]
    if all(result is not None for result in finished):
        return finished  # type: ignore[return-value]
    if options.nproc == 1:
        return _compare_worker(0, 1, runs, options)
    generous = len(runs) * (3 * options.budget_s + 1800)  # evaluations, exports and a loaded machine
    per_rank = run_local(
        _compare_worker,
        options.nproc,
        (runs, options),
        timeout_s=cfg.train.collective_timeout_s,
        join_timeout_s=generous,
    )
    return per_rank[0]


def _with_metric(result: dict[str, Any], metric: str) -> dict[str, Any]:
    points = [
        {**point, "metric": point["val_loss"] if metric == "val_loss" else point["metrics"][metric]}
        for point in result["points"]
    ]
    return {**result, "points": points}
