"""Shared test hygiene: one thread per process, float64 default off, no leftover process groups."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _hygiene():
    dtype = torch.get_default_dtype()
    yield
    torch.set_default_dtype(dtype)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
