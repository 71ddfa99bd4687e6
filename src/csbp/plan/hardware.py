"""Hardware presets of the cost model, with their sources.

A preset holds nominal numbers only; what a machine really achieves (fraction of peak in GEMMs and
attention, of link bandwidth, overlap) is the calibration's business (``csbp.plan.calibration``).

Sources:

* H100 / H200 (SXM): NVIDIA H100 and H200 Tensor Core GPU datasheets (989 TFLOP/s dense BF16,
  HBM3 3.35 TB/s / HBM3e 4.8 TB/s, NVLink 4 at 900 GB/s bidirectional = 450 GB/s per direction).
  The usable memory (66 GiB of 80 GB, 127 GiB of 141 GB: what an allocator peak may reach next to
  the CUDA context, NCCL buffers and fragmentation) and the 50 GB/s per-GPU NIC (400 Gb/s
  InfiniBand NDR) are the values of the published CSBP runs
  (``csbp/plan/data/published-csbp-runs.json``, "hardware").
* A100 (SXM4 80 GB): NVIDIA A100 datasheet (312 TFLOP/s dense BF16, 2.04 TB/s, NVLink 3 at
  600 GB/s bidirectional = 300 GB/s per direction), 200 Gb/s HDR InfiniBand = 25 GB/s per GPU; usable
  memory taken as for the H100 (the same 80 GB part, same allowance).
* ``cpu``: one gloo process of one thread per "GPU" on this machine (what ``csbp bench`` runs).
  The peak is a nominal 0.1 TFLOP/s (one AVX2 core, 2 FMA x 8 fp32 lanes at ~3 GHz); the
  shared-memory "link" a nominal 5 GB/s; memory is this machine's RAM (``/proc/meminfo``) divided
  among the processes of a node (each node of a multi-node job its own). Only calibrated numbers
  (``calibration-cpu.json``) make these meaningful.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from csbp.plan.layout import divisors


@dataclass(frozen=True)
class Hardware:
    """Nominal numbers of one accelerator (per device) and its node.

    Attributes:
        name: display name.
        peak_tflops: dense matmul peak in the training dtype, TFLOP/s.
        mem_gib: memory an allocator peak may reach, GiB.
        hbm_tbps: memory bandwidth, TB/s (optimizer step).
        intra_gbps: per-direction bandwidth to a device of the same node, GB/s.
        inter_gbps: per-device network bandwidth to another node, GB/s.
        gpus_per_node: devices per node.
        source: where the numbers come from.
        processes: the "devices" are processes of this machine (the ``cpu`` preset): no node size.
    """

    name: str
    peak_tflops: float
    mem_gib: float
    hbm_tbps: float
    intra_gbps: float
    inter_gbps: float
    gpus_per_node: int
    source: str
    processes: bool = False


PRESETS: dict[str, Hardware] = {
    "h100": Hardware("H100", 989.0, 66.0, 3.35, 450.0, 50.0, 8, "NVIDIA H100 SXM datasheet; published runs"),
    "h200": Hardware("H200", 989.0, 127.0, 4.8, 450.0, 50.0, 8, "NVIDIA H200 SXM datasheet; published runs"),
    "a100": Hardware("A100", 312.0, 66.0, 2.04, 300.0, 25.0, 8, "NVIDIA A100 SXM4 80GB datasheet"),
    "cpu": Hardware(
        "CPU (gloo, 1 thread/process)", 0.1, 0.0, 0.02, 5.0, 5.0, 1024, "nominal; see calibration", processes=True
    ),
}


def hardware(name: str, *, gpus: int, gpus_per_node: int | None = None) -> Hardware:
    """The preset ``name`` (``h100``, ``h200``, ``a100``, ``cpu``) for a job of ``gpus`` devices;
    ``cpu`` gets this machine's RAM divided by the processes of one node (``gpus``, at most ``gpus_per_node``). A job of more than one node fills whole
    nodes: ``gpus`` must then be a multiple of the devices per node (``ValueError`` otherwise)."""
    if name not in PRESETS:
        raise ValueError(f"--gpu {name!r} is not a known preset: choose from {', '.join(PRESETS)}")
    hw = PRESETS[name]
    if gpus_per_node is not None:
        if gpus_per_node < 1:
            raise ValueError(f"--gpus-per-node must be >= 1, got {gpus_per_node}")
        hw = replace(hw, gpus_per_node=gpus_per_node)
    if gpus > hw.gpus_per_node and gpus % hw.gpus_per_node:
        per_node = hw.gpus_per_node
        source = f"--gpus-per-node {per_node}" if gpus_per_node is not None else f"the {name} preset's {per_node} per node"
        divisor = divisors(gpus, at_most=per_node)[-1]
        lower = gpus // per_node * per_node
        raise ValueError(
            f"--gpus {gpus} is not a multiple of {source}: a job on more than one node fills whole nodes "
            f"(fix: --gpus {lower} or {lower + per_node}, or --gpus-per-node {divisor} or another divisor of {gpus})"
        )
    if name == "cpu":  # the processes of one node share its RAM: a job of several nodes fills each with gpus_per_node
        hw = replace(hw, mem_gib=machine_ram_gib() / max(min(gpus, hw.gpus_per_node), 1))
    return hw


def machine_ram_gib() -> float:
    """Total RAM of this machine in GiB (``/proc/meminfo``; 16 GiB where it cannot be read)."""
    kib = meminfo_kib().get("MemTotal")
    return kib / 2**20 if kib else 16.0


def meminfo_kib() -> dict[str, int]:
    """The ``kB`` counts of ``/proc/meminfo`` by name (``MemTotal``, ``SwapTotal``, ...); empty where
    it cannot be read."""
    meminfo = Path("/proc/meminfo")
    if not meminfo.is_file():
        return {}
    counts = {}
    for line in meminfo.read_text().splitlines():
        name, _, value = line.partition(":")
        fields = value.split()
        if fields and fields[0].isdigit():
            counts[name] = int(fields[0])
    return counts
