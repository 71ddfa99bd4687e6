"""``csbp bench kernels``: one layer's attention kernels, forward and backward, on one device.

For every context length ``L`` and block size ``B`` it runs the BD3 mask over the ``[x_t ; x_0]``
rows (``2L`` queries and keys) in two forms per backend, through the same transport code the
training uses (``csbp.attention.transports.local``: its autograd Function, so the output and the
gradients come back in the inputs' dtype, as in training), plus the block-diagonal partial alone:

* ``mixed``: CP-only's view, one partial over all ``2L`` keys under the irregular mask, through the
  transport (its backward from the merged statistics: on ``flex`` the kernel's backward handed them,
  ``--flex-backward direct``, or a recomputed forward first);
* ``mixed-ag`` (``flex`` only): the same BlockMask as one FlexAttention call under torch's own
  autograd (``csbp.attention.flex.flex_autograd_attention``), the field's standard call, with no
  recomputation: the strongest single-call baseline, which ``decomp x`` compares against when it is
  the faster of the two;
* ``decomposed``: CSBP's view, the noisy block-diagonal partial (noisy x noisy, whole blocks) plus
  the clean-interval partial (all rows x clean keys, block-causal), merged online in fp32; once
  per block-diagonal kernel of ``--diagonals`` (``csbp.attention.diagonal``: ``matmul``, ``sdpa``,
  ``sdpa_fold`` or ``flex``; the ``diagonal`` column), so e.g. ``--diagonals flex sdpa`` on CUDA
  measures FlexAttention's BlockMask against one batched FlashAttention call for the noisy blocks;
  and once per clean-context kernel of ``--clean-kernels`` (the ``clean`` column): ``pieces``, the
  dense and causal pieces as fused flash calls plus a small residual on the backend
  (``csbp.attention.flash_pieces``, what training runs), or ``generic``, one backend partial; the
  ``flex`` diagonal with ``pieces`` is what the local transport runs for it: the noisy blocks folded
  into the residual's one Flex call (no separate block-diagonal partial, one merge fewer);
* ``diagonal``: that block-diagonal partial alone on the ``L`` noisy rows (its ``L*B`` pairs), per
  kernel: the kernel's own time, which the decomposed step's noise can hide;

and dense SDPA over all ``(2L)^2`` pairs of the same shapes as the baseline (on CUDA whatever kernel
SDPA picks), plus on CUDA the ``flash2`` and ``cudnn`` rows at the first length: FlashAttention-2
and cuDNN over the same pairs through the calls the flash pieces make (``csbp.attention.flash_ops``).
Per record: median time of forward + backward (every repeat in ``times_s``; ``speedup_within_noise``
when a decomposed row's repeats overlap the faster mixed form's, ``vs_dense_within_noise`` when its
seconds per allowed pair overlap dense SDPA's, ``csbp.bench.spread``), TFLOP/s counted on the mask's allowed pairs only
(``csbp.bench.measure.attention_flops``; dense SDPA on all pairs), the ratio of that rate to dense
SDPA's, the decomposed form's speedup over the faster mixed form (``t_mixed / t_decomposed``), the time to
build one form's per-step plans (tile plans with their mask strips, or BlockMasks; built once per
step and reused by every layer), the first forward + backward's time and the graphs dynamo compiled
for the row (on CUDA the FlexAttention compilations, the other cost trap of a block-sparse kernel:
a row that compiles more than its shapes need is recompiling), and, on CPU, the number of aten ops
one forward + backward issues.

Everything of one invocation runs side by side in one process, so the ratios compare kernels on
one machine state. Usage::

    csbp bench kernels                                           # CPU: tiles vs dense SDPA
    csbp bench kernels --diagonals matmul sdpa                   # CPU: both block-diagonal kernels
    csbp bench kernels --device cuda --dtype bfloat16 --seq-lens 8192 32768 131072 --diagonals flex sdpa \\
        --num-heads 16 --num-kv-heads 4 --head-dim 128 --block-sizes 16 128 --json k.json --png k.png
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from csbp.attention.backends import (
    PartialPlan,
    check_backend,
    plan_block_diagonal,
    plan_partial,
    resolve_backend,
)
from csbp.attention.diagonal import check_diagonal, resolve_diagonal
from csbp.attention.flash_ops import flash_kernel
from csbp.attention.flash_pieces import FlashPiecesPartial
from csbp.attention.flex import FlexPartial, flex_autograd_attention
from csbp.attention.flex_backward import flex_backward_mode, resolve_flex_backward
from csbp.attention.layouts import reference_layout
from csbp.attention.rows import Rows
from csbp.attention.transports.local import (
    LocalAttentionPlan,
    local_attention_function,
)
from csbp.bench.common import (
    print_header,
)
from csbp.bench.kernel_profile import StepProfile, count_aten_ops, profile_step
from csbp.bench.kernel_timing import (
    build_and_time,
    check_clean_kernels,
    compiled_graphs,
    dense_flash_times,
    dense_sdpa_times,
    median,
)
from csbp.bench.measure import allowed_pairs, attention_flops
from csbp.bench.spread import rates_within_noise, within_noise

FUSED_ROWS = {"flash": "flash2", "cudnn": "cudnn"}
"""``backend`` column of the dense rows timing ``csbp.attention.flash_ops``' CUDA kernels over all pairs."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class KernelRecord:
    """One row of the table (and of the ``--json`` output)."""

    device: str
    dtype: str
    seq_len: int
    block_size: int
    backend: str  # tiles, flex, or sdpa (the dense baseline)
    form: str  # mixed, decomposed, or dense
    diagonal: str  # the decomposed form's block-diagonal kernel (matmul, sdpa, flex); "-" otherwise
    clean: str  # the decomposed form's clean-context kernel: pieces (flash pieces + residual) or generic; "-"
    time_s: float
    useful_pairs: int
    tflops: float
    vs_dense: float
    decomposed_speedup: float  # t_mixed / t_decomposed, the faster mixed form (decomposed rows only, else nan)
    mask_build_s: float
    aten_ops: int  # ops of one forward + backward (CPU only, else 0)
    first_call_s: float = float("nan")  # the first forward + backward, compilation included (nan: not timed)
    compiled_graphs: int = 0  # graphs dynamo compiled for this row (FlexAttention; 0 on tiles)
    flex_backward: str = "-"  # flex rows: how merged partials ran their backward (direct or recompute)
    times_s: tuple[float, ...] = ()  # every timed repeat; ``time_s`` is their median
    speedup_within_noise: bool = False  # decomposed rows: its repeats and the faster mixed form's overlap
    vs_dense_within_noise: bool = False  # its seconds per allowed pair and dense SDPA's (per pair) overlap
    launches: int = 0  # --profile-top: kernels one step launched (CUDA) or aten ops it ran (CPU); 0: not profiled
    top_kernels: tuple[tuple[str, float, int], ...] = ()  # --profile-top: (name, ms, calls), costliest first
    busy_ms: float = math.nan  # --profile-top: the device's busy time in one step (kernel self times summed)
    wall_ms: float = math.nan  # --profile-top: one unprofiled step's wall time, in which the host ...
    issue_ms: float = math.nan  # ... issued the step in this long
    syncs: int = 0  # --profile-top: CUDA calls in one step that made the host wait for the device
    attention_ms: float = math.nan  # --profile-top: of busy_ms, attention and matmul kernels (the rest: passes)
    topology: str = "-"  # rank rows (--layouts, csbp.bench.kernel_ranks): the layout, e.g. cp4/bp8 ...
    rank: int = -1  # ... the rank timed (its busiest) ...
    dense_shape: tuple[int, int] = (0, 0)  # ... its dense baseline's (query rows, key rows); (0, 0): 2L x 2L ...
    transport: str = "-"  # ... and its ring transport (collective, streaming; "-": no ring)


def build_form(
    rows: Rows, num_noisy: int, block_size: int, backend: str, form: str, diagonal: str = "auto", clean: str = "generic"
) -> LocalAttentionPlan:
    """The ``mixed`` or ``decomposed`` local plan of the packed ``[noisy ; clean]`` rows (the
    decomposed one with the ``diagonal`` block-diagonal kernel and the ``clean`` clean-context kernel,
    ``csbp.attention.backends.CLEAN_KERNELS``: one ``backend`` partial, or flash pieces plus a residual,
    which holds the noisy blocks too with the ``flex`` diagonal, as in the local transport)."""
    if form == "mixed":
        return LocalAttentionPlan(rows, rows, num_noisy, None, False, None, plan_partial(rows, rows, backend=backend))
    if clean != "generic" and resolve_diagonal(diagonal, backend, block_size) == "flex":
        # the local transport's plan: clean pieces plus one Flex residual holding the noisy blocks too
        folded = plan_partial(rows, rows, backend=backend, clean=clean)
        if not isinstance(folded, FlashPiecesPartial):
            raise ValueError(f"no clean piece at L={num_noisy}, B={block_size}: the folded form would be the mixed one")
        return LocalAttentionPlan(rows, rows, num_noisy, None, False, None, folded)
    clean_rows = rows.select(slice(num_noisy, None))
    return LocalAttentionPlan(
        rows,
        rows,
        num_noisy,
        block_size,
        False,
        None,
        plan_partial(rows, clean_rows, backend=backend, clean=clean),
        plan_block_diagonal(
            rows.select(slice(0, num_noisy)), block_size=block_size, backend=backend, diagonal=diagonal
        ),
    )


def build_forms(rows: Rows, num_noisy: int, block_size: int, backend: str) -> dict[str, LocalAttentionPlan]:
    """The ``mixed`` and ``decomposed`` (``auto`` diagonal) local plans of the packed rows."""
    return {form: build_form(rows, num_noisy, block_size, backend, form) for form in ("mixed", "decomposed")}


@dataclass(frozen=True)
class KernelJob:
    """One measured row of a backend: a form of one (length, block size), with its kernels."""

    seq_len: int
    block_size: int
    backend: str
    form: str  # mixed, mixed-ag, decomposed or diagonal
    diagonal: str = "-"
    clean: str = "-"


def kernel_jobs(
    seq_lens: Sequence[int],
    block_sizes: Sequence[int],
    backends: Sequence[str],
    diagonals_of: Callable[[str, int], list[str]],
    clean_kernels: Sequence[str],
    *,
    primary_first: int = 0,
) -> list[KernelJob]:
    """The rows to measure, in order (the dense rows come before a shape's first job): per length, block
    size and backend, the mixed form (and ``mixed-ag`` on flex), the decomposed form per clean kernel
    and block-diagonal kernel (``diagonals_of(backend, block)``; clean-major), then the block-diagonal
    partial alone per kernel. With ``primary_first = N > 0`` the *primary* rows (the mixed forms and the
    first ``N`` decomposed variants) of every length come first, then the others in the same order: a
    run cut short by a time limit still has the comparison at every length."""
    primary: list[KernelJob] = []
    rest: list[KernelJob] = []
    for seq_len in seq_lens:
        for block in block_sizes:
            for backend in dict.fromkeys(backends):
                kernels = diagonals_of(backend, block)
                decomposed = [KernelJob(seq_len, block, backend, "decomposed", kernel, clean)
                              for clean in clean_kernels for kernel in kernels]
                mixed = [KernelJob(seq_len, block, backend, "mixed")]
                mixed += [KernelJob(seq_len, block, backend, "mixed-ag")] if backend == "flex" else []
                diagonal = [KernelJob(seq_len, block, backend, "diagonal", kernel) for kernel in kernels]
                if primary_first > 0:
                    primary += mixed + decomposed[:primary_first]
                    rest += decomposed[primary_first:] + diagonal
                else:
                    primary += mixed + decomposed + diagonal
    return primary + rest


def run_kernel_bench(
    seq_lens: list[int],
    block_sizes: list[int],
    backends: list[str],
    *,
    device: str = "cpu",
    dtype: str = "float32",
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    warmup: int = 1,
    repeats: int = 3,
    count_ops: bool = True,
    clock: str = "wall",
    diagonals: tuple[str, ...] = ("auto",),
    clean_kernels: tuple[str, ...] = ("generic", "pieces"),
    flex_backward: str = "auto",
    primary_first: int = 0,
    profile_top: int = 0,
    profile_seq_lens: tuple[int, ...] | None = None,
    progress: Callable[[KernelRecord], None] | None = None,
    header: str | None = None,
    forms: bool = True,
) -> list[KernelRecord]:
    """Measure every (length, block size): dense SDPA, then each backend's mixed form, its decomposed
    form once per kernel of ``diagonals`` and of ``clean_kernels``, and its block-diagonal partial alone
    (``diagonal``) once per kernel of ``diagonals``;
    ``progress`` sees each record as soon as it is measured; ``header`` is printed once every input is
    checked, before anything is measured (a bad input prints nothing but its error line). Merged flex
    partials run their backward by ``flex_backward`` (``csbp.attention.flex_backward``; the ``mixed-ag``
    row needs neither way). ``primary_first`` orders the rows by ``kernel_jobs``: the mixed forms and
    the first ``primary_first`` decomposed variants at every length before any other row (a run cut short by a time limit has measured the long lengths).
    ``profile_top``: each row's step once more under the profiler, at ``profile_seq_lens`` (None: every
    length), its launches and costliest kernels in the record (``csbp.bench.kernel_profile``). With
    ``forms=False`` it checks the inputs, prints the header and measures nothing (``--no-forms``)."""
    dev = torch.device(device)
    concrete = [resolve_backend(check_backend(b), dev) for b in backends]

    def kernels(backend: str, block: int) -> list[str]:
        """The distinct concrete block-diagonal kernels ``diagonals`` name for ``backend`` at ``block``."""
        return list(dict.fromkeys(resolve_diagonal(d, backend, block) for d in diagonals))

    for backend in concrete:  # fails closed (unknown name, flex diagonal off the flex backend) before measuring
        for name in diagonals:
            resolve_diagonal(check_diagonal(name, where="--diagonals"), backend)
    check_clean_kernels(clean_kernels, dev, "--clean-kernels")
    if "flex" in concrete and dev.type != "cuda":
        raise ValueError("--backends flex needs --device cuda (FlexAttention has no CPU backward)")
    resolved_backward = resolve_flex_backward(flex_backward, where="--flex-backward")
    if profile_top < 0:
        raise ValueError(f"--profile-top must be >= 0 (0: off), got {profile_top}")
    if primary_first < 0:
        raise ValueError(f"--primary-first must be >= 0 (0: off), got {primary_first}")
    if warmup < 0 or repeats < 1:  # was: an IndexError after the first row's header
        raise ValueError(f"--warmup must be >= 0 and --repeats >= 1, got {warmup} and {repeats}")
    if clock == "cpu" and (dev.type != "cpu" or torch.get_num_threads() != 1):
        raise ValueError("--clock cpu measures one CPU thread: use --device cpu with OMP_NUM_THREADS=1")
    for seq_len in seq_lens:  # fail closed before measuring anything
        for block in block_sizes:
            if seq_len % block:
                raise ValueError(f"--seq-lens {seq_len} must be a multiple of every --block-sizes value ({block})")
    print_header(header)
    if not forms:
        return []
    torch_dtype = DTYPES[dtype]
    records: list[KernelRecord] = []

    def add(record: KernelRecord) -> None:
        if record.backend == "flex":
            record = replace(record, flex_backward=resolved_backward)
        records.append(record)
        if progress is not None:
            progress(record)

    jobs = kernel_jobs(seq_lens, block_sizes, concrete, kernels, clean_kernels, primary_first=primary_first)
    held_len, held = -1, ()  # the current length and its q, k, v, dout (one length held at a time)
    dense: dict[int, tuple[tuple[float, ...], dict[str, tuple[float, ...]]]] = {}  # seq_len -> repeats (+ fused)
    shapes: dict[tuple[int, int], tuple[Rows, int]] = {}  # (seq_len, block) -> (rows, allowed pairs)
    mixed_times: dict[tuple[int, int, str], tuple[float, ...]] = {}  # the faster mixed form's repeats per shape
    n_flops = {"num_heads": num_heads, "head_dim": head_dim}
    with flex_backward_mode(flex_backward):  # merged flex partials differentiate this way
        for job in jobs:
            seq_len, block, n = job.seq_len, job.block_size, 2 * job.seq_len
            if held_len != seq_len:  # seeded by the length: a second pass draws the same values
                gen = torch.Generator(device=dev).manual_seed(seq_len)
                q = torch.randn(1, num_heads, n, head_dim, device=dev, dtype=torch_dtype, generator=gen)
                k, v = (torch.randn(1, num_kv_heads, n, head_dim, device=dev, dtype=torch_dtype, generator=gen)
                        for _ in "kv")
                held_len, held = seq_len, (q, k, v, torch.randn_like(q))
            q, k, v, dout = held
            if seq_len not in dense:
                dense_times = dense_sdpa_times(q, k, v, dout, dev, warmup, repeats, clock)
                # The fused call flash pieces make (FlashAttention-2 on CUDA), over all pairs: is it as fast as
                # SDPA's pick? Their rates hardly depend on L: timed at the first length only (at 128K each
                # costs ~10 s of a budget).
                fused = {
                    name: dense_flash_times(q, k, v, dout, dev, warmup, repeats, clock, name)
                    for name in ("flash", "cudnn") if flash_kernel(q, name) == name and seq_len == seq_lens[0]
                }
                dense[seq_len] = (dense_times, fused)
            dense_times, fused = dense[seq_len]
            dense_rate = attention_flops(n * n, **n_flops) / median(dense_times) / 1e12
            if (seq_len, block) not in shapes:  # the first job of this shape: its dense rows first
                rows = reference_layout(seq_len, block).rows.to(dev)
                shapes[seq_len, block] = (rows, allowed_pairs(rows, block_size=block))
                add(KernelRecord(device, dtype, seq_len, block, "sdpa", "dense", "-", "-", median(dense_times), n * n,
                                 dense_rate, 1.0, float("nan"), 0.0, 0, times_s=dense_times))
                for name, fused_times in fused.items():
                    rate = attention_flops(n * n, **n_flops) / median(fused_times) / 1e12
                    add(KernelRecord(device, dtype, seq_len, block, FUSED_ROWS[name], "dense", "-", "-",
                                     median(fused_times), n * n, rate, rate / dense_rate, float("nan"), 0.0, 0,
                                     times_s=fused_times,
                                     vs_dense_within_noise=within_noise(fused_times, dense_times)))
            rows, pairs = shapes[seq_len, block]
            backend, form, diagonal, clean = job.backend, job.form, job.diagonal, job.clean
            graphs_before = compiled_graphs()
            step, build_s, first_s, times = build_and_time(
                functools.partial(_form_step, q, k, v, dout, rows, seq_len, block, backend, form, diagonal, clean),
                dev, warmup, repeats, clock, label=f"L={seq_len} B={block} {backend} {form} {diagonal} {clean}",
            )
            ops = count_aten_ops(step) if count_ops and dev.type == "cpu" and step is not None else 0
            profiled = None
            if profile_top and step is not None and (profile_seq_lens is None or seq_len in profile_seq_lens):
                try:
                    profiled = profile_step(step, dev, top=profile_top)
                except RuntimeError as error:  # a profiler this machine lacks (CUPTI) costs the profile, not the row
                    print(f"csbp bench kernels: L={seq_len} B={block} {backend} {form} not profiled: {error}")
            useful = seq_len * block if form == "diagonal" else pairs  # diagonal: the noisy blocks only
            time_s = median(times)
            rate = attention_flops(useful, **n_flops) / time_s / 1e12
            key = (seq_len, block, backend)
            best_mixed = median(mixed_times.get(key, (math.nan,)))
            if form.startswith("mixed") and (math.isnan(best_mixed) or time_s < best_mixed):
                mixed_times[key] = times  # the faster mixed form (a failed one is nan and never faster)
            mixed = mixed_times.get(key, (math.nan,))
            speedup = median(mixed) / time_s if form == "decomposed" else float("nan")
            add(KernelRecord(device, dtype, seq_len, block, backend, form, diagonal, clean, time_s, useful, rate,
                             rate / dense_rate, speedup, build_s, ops, first_s, compiled_graphs() - graphs_before,
                             times_s=times, speedup_within_noise=form == "decomposed" and within_noise(times, mixed),
                             vs_dense_within_noise=rates_within_noise(times, useful, dense_times, n * n),
                             **_profile_fields(profiled)))
    return records


def _profile_fields(profiled: StepProfile | None) -> dict[str, object]:
    if profiled is None:
        return {}
    return {"launches": profiled.launches, "top_kernels": profiled.top, "busy_ms": profiled.busy_ms,
            "wall_ms": profiled.wall_ms, "issue_ms": profiled.issue_ms, "syncs": profiled.syncs,
            "attention_ms": profiled.attention_ms}


def _form_step(
    q: Tensor, k: Tensor, v: Tensor, dout: Tensor, rows: Rows, num_noisy: int, block: int, backend: str, form: str,
    diagonal: str, clean: str,
) -> Callable[[], None]:
    """Plan ``form`` (``mixed``, ``mixed-ag``, ``decomposed`` or ``diagonal``: the block-diagonal partial
    alone, on the noisy rows) and return its forward + backward step."""
    if form == "mixed-ag":
        return _flex_autograd_step(q, k, v, dout, plan_partial(rows, rows, backend=backend))
    if form != "diagonal":
        plan = (
            build_form(rows, num_noisy, block, backend, form, diagonal, clean)
            if form == "decomposed" else build_form(rows, num_noisy, block, backend, form)
        )
        return _local_step(q, k, v, dout, plan)
    partial = plan_block_diagonal(rows.select(slice(0, num_noisy)), block_size=block, backend=backend, diagonal=diagonal)
    noisy = [t[:, :, :num_noisy] for t in (q, k, v, dout)]

    def step() -> None:
        out, lse = partial.forward(*noisy[:3])
        partial.backward(*noisy[:3], out, lse, noisy[3])

    return step


def _flex_autograd_step(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, partial: PartialPlan) -> Callable[[], None]:
    """One FlexAttention call over ``partial``'s BlockMask, forward + torch's autograd backward."""
    if not isinstance(partial, FlexPartial):
        raise ValueError("the mixed-ag form is one FlexAttention call: it needs the flex backend")
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]

    def step() -> None:
        for leaf in leaves:
            leaf.grad = None
        flex_autograd_attention(*leaves, partial).backward(dout)

    return step


def _local_step(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, plan: LocalAttentionPlan) -> Callable[[], None]:
    """One forward + backward through the local transport's autograd Function over ``plan``, as training
    runs it: the output and the gradients come back in the inputs' dtype (their casts are timed too)."""
    leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]

    def step() -> None:
        for leaf in leaves:
            leaf.grad = None
        local_attention_function(*leaves, plan).backward(dout)

    return step
