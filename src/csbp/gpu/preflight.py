"""Before the device check starts: are csbp's Python dependencies importable here?

A device machine runs its image's own ``python3`` (its own torch, no package registry), with csbp
from ``src/`` (``make gpu-check``). A package csbp needs but the image lacks (pydantic, on the
H200 image) would otherwise fail the check half-way, inside a stage; ``missing_packages`` names
it before anything starts and ``missing_message`` says how to bring it (``make gpu-wheels``). A torch
older than ``OLDEST_TORCH`` (pyproject's floor: the oldest the suite has passed under; FlexAttention's
``AuxRequest``, which the flex backend calls, is newer than 2.8) is named the same way.
Standard library only, so it runs whatever is missing.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
import sys

RUNTIME_MODULES: dict[str, str] = {
    "torch": "torch",
    "numpy": "numpy",
    "pyyaml": "yaml",
    "pydantic": "pydantic",
    "tqdm": "tqdm",
    "safetensors": "safetensors",
    "tokenizers": "tokenizers",
    "matplotlib": "matplotlib",
    "tensorboard": "tensorboard",
    "pyarrow": "pyarrow",
    "jinja2": "jinja2",
}
"""pyproject's ``[project] dependencies`` (distribution name -> import name; a test keeps them equal)."""

OLDEST_TORCH = (2, 11)
"""pyproject's ``torch>=`` (a test keeps them equal)."""

CHECK_MODULES: dict[str, str] = {"pytest": "pytest"}
"""What the check itself runs besides csbp (the ``cuda-tests`` stage)."""


def missing_packages() -> list[str]:
    """Distribution names of the dependencies that cannot be imported here."""
    needed = {**RUNTIME_MODULES, **CHECK_MODULES}
    return [name for name, module in needed.items() if importlib.util.find_spec(module) is None]


def missing_message(missing: list[str]) -> str:
    """The one line printed when ``missing`` is not empty."""
    return (
        f"gpu-check: error: missing Python package(s) {', '.join(missing)}; on a device machine (no registry) run "
        "`make gpu-wheels` where pip works, carry .whl and run `make gpu-check` there (README, The device check); "
        "elsewhere run `make install`"
    )


def torch_too_old(version: str | None = None) -> str | None:
    """The line refusing an installed torch older than ``OLDEST_TORCH`` (``version``: the installed
    distribution's, read without importing torch), or None (also when no version can be read)."""
    if version is None:
        try:
            version = importlib.metadata.version("torch")
        except importlib.metadata.PackageNotFoundError:
            return None
    numbers = re.match(r"(\d+)\.(\d+)", version)
    if numbers is None or (int(numbers[1]), int(numbers[2])) >= OLDEST_TORCH:
        return None
    oldest = ".".join(map(str, OLDEST_TORCH))
    return (f"gpu-check: error: torch {version} is older than {oldest}, the oldest csbp runs under (FlexAttention's "
            f"AuxRequest, the direct backward); use a device image with torch >= {oldest}")


def report_missing() -> int | None:
    """Print ``missing_message`` (or ``torch_too_old``'s line) to stderr and return exit status 2 when a
    dependency is missing (or torch is too old)."""
    missing = missing_packages()
    problem = missing_message(missing) if missing else torch_too_old()
    if problem is None:
        return None
    print(problem, file=sys.stderr)
    return 2
