"""Shared test hygiene: one thread per process, float64 default off, no leftover process groups;
tests marked ``cuda`` are skipped (with the reason) where torch sees no CUDA device; the quiet
``transformers`` fixture of the tests that compare against transformers' own models."""

from __future__ import annotations

import atexit
import os
from types import ModuleType

import pytest
import torch
import torch.distributed as dist

torch.set_num_threads(1)

# One pytest process compiles FlexAttention for every test's shapes, dtypes and grad modes, more than
# one training run does; csbp turns dynamo's recompile limit into an error (``csbp.attention.flex``),
# so the suite raises the limit it starts from instead of failing on the sum of unrelated tests.
torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 512)
torch._dynamo.config.accumulated_recompile_limit = max(torch._dynamo.config.accumulated_recompile_limit, 2048)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available() or os.environ.get("CSBP_CUDA_TESTS_DEVICE") == "cpu":
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False); run `make gpu-check`")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def transformers() -> ModuleType:
    """The transformers package, quiet (no warnings, no progress bars), for the tests that compare csbp's
    Hugging Face import and export with transformers' own models; skipped where it is not installed."""
    module = pytest.importorskip("transformers")
    module.logging.set_verbosity_error()
    module.utils.logging.disable_progress_bar()
    return module


@pytest.fixture(autouse=True)
def _hygiene():
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    forget_forced_exit()


def forget_forced_exit() -> None:
    """Drop the ``os._exit`` a torchrun rank registers for interpreter exit (``skip_teardown_at_exit``).

    Registered in the pytest process by a test, it replaced pytest's exit status with 0, so a
    failing suite passed CI (2026-12-04: 4 failures, exit status 0). No test may leave it behind."""
    from csbp.training import worker

    atexit.unregister(worker._leave_now)
