"""The text tables of ``csbp bench train`` (``csbp.bench.train_bench``): every layout's metrics with
their ratio to CP-only, the step time's spread over the repeats (``±``, a ``~`` on a ratio within it,
``csbp.bench.spread``), with ``--activation-checkpointing none full`` the memory cut and time cost
of checkpointing per layout, and with ``--compile none layers`` the step time of each compile mode."""

from __future__ import annotations

from typing import TYPE_CHECKING

from csbp.bench.common import Column, format_ratio_table
from csbp.bench.spread import NOISE_MARK, NOISE_NOTE, within_noise

if TYPE_CHECKING:
    from csbp.bench.train_bench import TrainRecord

TABLE_COLUMNS = [
    Column("objective", "objective", "<13"),
    Column("seq_len", "seq_len", ">7"),
    Column("layout", "layout", "<13"),
    Column("step s", "step_time_s", ">8.3f", vs_cp=True, times="step_times_s", spread=True),
    Column("tok/s", "tokens_per_s", ">9.0f", vs_cp=True, times="step_times_s"),
    Column("peak MiB", "peak_mem_bytes", ">9.1f", vs_cp=True, shown=lambda v: v / 2**20),
    Column("attn MiB/rank", "attention_bytes_per_rank", ">13.2f", vs_cp=True, shown=lambda v: v / 2**20),
    Column("loss0", "loss_step0", ">8.4f"),
    Column("ac", "activation_checkpointing", "<4"),
    Column("compile", "compile", "<7"),
]


def format_table(records: list[TrainRecord]) -> str:
    """A text table with each metric and its ratio to CP-only at the same objective, length,
    activation-checkpointing and compile mode; followed by the checkpointing table and the compile
    table where both of their modes were measured."""
    table = format_ratio_table(records, ("objective", "seq_len", "activation_checkpointing", "compile"), TABLE_COLUMNS)
    extra = [t for t in (format_checkpointing_table(records), format_compile_table(records)) if t]
    return "\n\n".join([table, *extra])


def format_compile_table(records: list[TrainRecord]) -> str:
    """Step time eager and compiled (``train.compile: layers``) per layout and checkpointing mode, their
    ratio and whether step 0's loss agrees (empty when the records do not hold both modes)."""
    by_key = {(r.objective, r.seq_len, r.layout, r.activation_checkpointing, r.compile): r for r in records}
    header = (
        f"{'objective':<13} {'seq_len':>7} {'layout':<13} {'ac':<4} {'step s none':>11} {'step s layers':>13} "
        f"{'speedup':>8} {'loss0 rel diff':>14}"
    )
    lines, marked = [], False
    for (objective, seq_len, layout, ac, mode), eager in by_key.items():
        compiled = by_key.get((objective, seq_len, layout, ac, "layers"))
        if mode != "none" or compiled is None:
            continue
        noisy = within_noise(eager.step_times_s, compiled.step_times_s)
        marked |= noisy
        loss_diff = abs(compiled.loss_step0 - eager.loss_step0) / abs(eager.loss_step0) if eager.loss_step0 else 0.0
        lines.append(
            f"{objective:<13} {seq_len:>7} {layout:<13} {ac:<4} {eager.step_time_s:>11.3f} {compiled.step_time_s:>13.3f} "
            f"{eager.step_time_s / compiled.step_time_s:>7.2f}{NOISE_MARK if noisy else ' '} {loss_diff:>14.1e}"
        )
    if not lines:
        return ""
    title = "train.compile: step time per layout, eager (none) vs compiled (layers)"
    return "\n".join([title, header, "-" * len(header), *lines, *([NOISE_NOTE] if marked else [])])


def format_checkpointing_table(records: list[TrainRecord]) -> str:
    """Peak memory per rank and step time without and with activation checkpointing, per layout and
    checkpointing mode (``full``, ``selective``), with ``selective``'s step time against ``full``'s
    when both ran (empty when the records hold no mode besides ``none``)."""
    by_key = {(r.objective, r.seq_len, r.layout, r.activation_checkpointing): r
              for r in records if r.compile == records[0].compile}  # one compile mode: the first run
    header = (
        f"{'objective':<13} {'seq_len':>7} {'layout':<13} {'ac':<9} {'peak MiB none':>13} {'peak MiB ac':>11} "
        f"{'mem cut':>7} {'step s none':>11} {'step s ac':>9} {'time x':>6} {'recompute MiB/rank':>18} {'vs full':>7}"
    )
    lines, marked = [], False
    for (objective, seq_len, layout, mode), plain in by_key.items():
        if mode != "none":
            continue
        full = by_key.get((objective, seq_len, layout, "full"))
        for ac in ("full", "selective"):
            kept = by_key.get((objective, seq_len, layout, ac))
            if kept is None:
                continue
            cut = plain.peak_mem_bytes / kept.peak_mem_bytes if kept.peak_mem_bytes else float("nan")
            noisy = within_noise(plain.step_times_s, kept.step_times_s)
            versus = ""
            if ac != "full" and full is not None:
                versus_noisy = within_noise(full.step_times_s, kept.step_times_s)
                versus = f"{kept.step_time_s / full.step_time_s:.2f}{NOISE_MARK if versus_noisy else ' '}"
                noisy |= versus_noisy
            marked |= noisy
            lines.append(
                f"{objective:<13} {seq_len:>7} {layout:<13} {ac:<9} {plain.peak_mem_bytes / 2**20:>13.1f} "
                f"{kept.peak_mem_bytes / 2**20:>11.1f} {cut:>6.2f}x {plain.step_time_s:>11.3f} "
                f"{kept.step_time_s:>9.3f} {kept.step_time_s / plain.step_time_s:>5.2f}"
                f"{NOISE_MARK if within_noise(plain.step_times_s, kept.step_times_s) else ' '}"
                f"{kept.recompute_bytes_per_rank / 2**20:>18.2f} {versus:>7}"
            )
    if not lines:
        return ""
    title = "activation checkpointing: peak memory per rank and step time, none vs each mode (vs full: selective's step time / full's)"
    return "\n".join([title, header, "-" * len(header), *lines, *([NOISE_NOTE] if marked else [])])

