"""What ``make gpu-check`` runs where: the CUDA profile (the real check) and the CPU dry run.

The real check measures on CUDA at the issue's sizes. ``python -m csbp.gpu.check --dry-run-cpu``
walks the same code (every stage's command line, the pytest and kernel-row parsing, the training
table, the summary table and the incremental ``gpu-check.json``) on the CPU at tiny sizes, in
about half a minute, so that a mistake in the check's own code never costs a GPU session. Its
numbers mean nothing; its JSON says ``"dry_run": true``.

A profile only says *what* each stage runs; ``csbp.gpu.check`` builds and runs the commands::

    profile = CPU_DRY_RUN if args.dry_run_cpu else CUDA
    argv = [sys.executable, "-m", "csbp", "bench", "kernels", *profile.kernels, "--json", path]
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from csbp.models.config import DecoderConfig

KERNEL_BENCH_ARGS: tuple[str, ...] = (
    "--device", "cuda", "--backends", "flex", "--dtype", "bfloat16", "--num-heads", "16", "--num-kv-heads", "4",
    "--head-dim", "128", "--block-sizes", "16", "128", "--seq-lens", "16384", "131072", "65536", "32768", "8192",
    "--diagonals", "sdpa", "flex", "--clean-kernels", "pieces-cudnn", "pieces", "generic", "--repeats", "2",
    "--primary-first", "2", "--profile-top", "6", "--profile-seq-lens", "16384",
)
"""``csbp bench kernels`` options of the ``kernels`` stage on CUDA (``--json`` is added: next to
``gpu-check.json``). The lengths are the issue's range 8K-128K, the kernel targets' two ends first (16K,
then 128K, then 64K, 32K, 8K): every length compiles Flex for new shapes (a few graphs, two with a backward
kernel), and 128K's rows take the longest, so the 150 s stage may end early (the rows measured are kept),
and a run cut short then misses the middle of the range rather than its upper end, which the verdict
needs. ``--primary-first``
measures dense attention, the mixed forms and the two decomposed forms expected fastest (the clean pieces on
cuDNN, 1.8x FlashAttention-2's rate on the first H200 run, with the noisy blocks as one batched FlashAttention call
or folded into the pieces' Flex residual; the jobs are clean-major) at every length before the other decomposed
kernels: on the first H200 run the stage's 150 s held the primary rows of three lengths and most of the others, so
the primary rows of 32K and 8K now come before the other kernels' rows. ``--profile-top`` breaks each 16K row's step into its costliest CUDA kernels
(``csbp.bench.kernel_profile``): on the first H200 run the decomposed form lost to one Flex call at 16K
only, and that breakdown says where: in its kernels, or in device time left idle (busy against wall time,
the host's issue time and its synchronising calls)."""


LAYOUT_BENCH_ARGS: tuple[str, ...] = (
    "--device", "cuda", "--backends", "flex", "--dtype", "bfloat16", "--num-heads", "16", "--num-kv-heads", "4",
    "--head-dim", "128", "--block-sizes", "128", "--seq-lens", "65536", "--no-forms",
    "--layouts", "cp4/bp8", "cp4", "bp4", "--layout-clean", "generic", "pieces-cudnn", "--repeats", "2",
)
"""``csbp bench kernels --layouts`` options of the ``layouts`` stage on CUDA: the busiest rank of fused CSBP
(cp = 4 x bp = 8), the CP-only baseline (cp = 4) and BP-only (bp = 4) at 64K, B = 128, each through its transport
(``csbp.bench.kernel_ranks``): the issue's "every layout at >= 0.6x dense" measured per layout. Every layout runs
the training default (``generic``) before any runs the cuDNN pieces: each new rank shape compiles Flex, so the 60 s
stage may end early, and then it has every layout once."""


@dataclass(frozen=True)
class CheckProfile:
    """The device and the sizes every stage runs at.

    Attributes:
        name: ``cuda`` or ``cpu-dry-run``.
        device: the torch device type the stages use.
        cuda_tests: ``pytest -m cuda`` arguments after the marker (selection and paths).
        verify: extra ``csbp verify`` arguments (the dry run verifies one layout).
        kernels: ``csbp bench kernels`` arguments, without ``--json``.
        layouts: ``csbp bench kernels --no-forms --layouts ...`` arguments, without ``--json``.
        table: ``TableConfig`` fields that replace what the command line gives.
        child_env: environment variables set for every command stage.
        stand_in_gpus: the GPU count the stages see in the dry run (None: the visible GPUs).
    """

    name: str
    device: str
    cuda_tests: tuple[str, ...]
    verify: tuple[str, ...]
    kernels: tuple[str, ...]
    layouts: tuple[str, ...] = ()
    table: Mapping[str, object] = field(default_factory=dict)
    child_env: Mapping[str, str] = field(default_factory=dict)
    stand_in_gpus: int | None = None


CUDA = CheckProfile(
    name="cuda", device="cuda", cuda_tests=("tests",), verify=(), kernels=KERNEL_BENCH_ARGS, layouts=LAYOUT_BENCH_ARGS
)

DRY_RUN_MODEL = DecoderConfig(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8
)
"""The training table's model in the dry run (the verify model's sizes)."""

CPU_DRY_RUN = CheckProfile(
    name="cpu-dry-run",
    device="cpu",
    # the CUDA test bodies on the CPU (CSBP_CUDA_TESTS_DEVICE=cpu): a few cases (one is skipped where the
    # direct flex backward is missing)
    cuda_tests=("-k", "bf16_autocast or long_block_mask or dflash_draft_attention_on_flex",
                "tests/test_cuda.py", "tests/test_flex_cuda.py", "tests/test_block_diagonal_cuda.py"),
    verify=("--cp", "2"),
    kernels=(
        "--device", "cpu", "--backends", "tiles", "--dtype", "float32", "--num-heads", "2", "--num-kv-heads", "1",
        "--head-dim", "8", "--block-sizes", "4", "--seq-lens", "32", "--diagonals", "matmul", "sdpa",
        "--repeats", "1", "--warmup", "0", "--no-op-count", "--primary-first",
    ),
    layouts=(
        "--device", "cpu", "--backends", "tiles", "--dtype", "float32", "--num-heads", "2", "--num-kv-heads", "1",
        "--head-dim", "8", "--block-sizes", "4", "--seq-lens", "32", "--no-forms", "--layouts", "cp2/bp2", "cp2",
        "--repeats", "1", "--warmup", "0",
    ),
    table={
        "seq_lens": (32, 64), "decomposed_seq_lens": (64,), "decomposed_clean": "pieces",
        "compiled_seq_lens": (64,), "selective_seq_lens": (64,), "profile_seq_lens": (64,),
        "block_size": 4, "model": DRY_RUN_MODEL, "dflash_seq_len": 64, "dflash_anchors": 4,
        "dflash_draft_layers": 1, "warmup": 1, "repeats": 1,
    },
    child_env={"CSBP_CUDA_TESTS_DEVICE": "cpu", "OMP_NUM_THREADS": "1"},
    stand_in_gpus=2,
)
