"""Every ``cuda``-marked test module, run on the CPU with ``CSBP_CUDA_TESTS_DEVICE=cpu`` (the dry run their
docstrings describe), in a pytest subprocess per module.

Without CUDA the suite skips those tests, so a refactor that renamed a helper they call, changed a
signature or a return shape only they use, or dropped a field of a case they build passed CI and first
failed in ``make gpu-check``'s ``cuda-tests`` stage, on a rare 15-minute device lease. The gpu-check dry
run (``tests/test_gpu_check_run.py``) runs three of them; here every body runs, on the CPU's kernels
(tiles, ``cpu-flash``, FlexAttention's eager forward and direct backward where this torch traces it, gloo
for NCCL), so what is left for the device is its kernels, not the test code.

Measured on one CPU thread: about 70 s for the five modules, 20 s of it inductor compiling the
``train.compile`` step on a cold cache, 12 s training every objective. Each module must collect and pass
at least one test: a module that no longer imports fails here, not only at collection on the device.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
CUDA_MODULES = sorted(
    path.name for path in TESTS.glob("test_*.py")
    if path.name != Path(__file__).name and "pytest.mark.cuda" in path.read_text(encoding="utf-8")
)

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def test_the_cuda_modules_are_found() -> None:
    assert {"test_cuda.py", "test_flex_cuda.py", "test_single_gpu_cuda.py"} <= set(CUDA_MODULES), CUDA_MODULES


@pytest.mark.parametrize("module", CUDA_MODULES)
def test_cuda_test_bodies_run_on_the_cpu(module: str) -> None:
    env = {**os.environ, "CSBP_CUDA_TESTS_DEVICE": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    argv = [sys.executable, "-m", "pytest", "-m", "cuda", "-o", "addopts=", "-p", "no:cacheprovider",
            "-p", "no:logging", "-q", "-rfEs", "--tb=short", str(TESTS / module)]
    # its own process group: on a timeout the module's gloo worker processes are killed with it
    child = subprocess.Popen(argv, cwd=TESTS.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True, start_new_session=True)
    try:
        output, _ = child.communicate(timeout=900)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        output = child.communicate()[0]
        pytest.fail(f"{module} on the CPU ran past 900 s:\n" + "\n".join(output.strip().splitlines()[-60:]))
    tail = "\n".join(output.strip().splitlines()[-60:])
    assert child.returncode == 0, f"{module} on the CPU (CSBP_CUDA_TESTS_DEVICE=cpu) exited {child.returncode}:\n{tail}"
    passed = re.search(r"(\d+) passed", output)
    assert passed and int(passed[1]) > 0, f"{module}: no cuda test body ran on the CPU:\n{tail}"

