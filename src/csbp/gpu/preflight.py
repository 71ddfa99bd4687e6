"""Before the device check starts: are csbp's Python dependencies importable here?

A device machine runs its image's own ``python3`` (its own torch, no package registry), with csbp
from ``src/`` (``make gpu-check``). A package csbp needs but the image lacks (pydantic, on the
H200 image) would otherwise fail the check half-way, inside a stage; ``missing_packages`` names
it before anything starts and ``missing_message`` says how to bring it (``make gpu-wheels``).
Standard library only, so it runs whatever is missing.
"""

from __future__ import annotations

import importlib.util
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


def report_missing() -> int | None:
    """Print ``missing_message`` to stderr and return exit status 2 when a dependency is missing."""
    missing = missing_packages()
    if not missing:
        return None
    print(missing_message(missing), file=sys.stderr)
    return 2
