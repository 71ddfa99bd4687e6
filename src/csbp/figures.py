"""Saving matplotlib figures so that a reader never finds a half-written image.

Every plot csbp draws (``loss.png``, the benchmark and comparison figures) is written to a hidden
file beside its destination and renamed over it, then the figure is closed to free its memory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def save_figure(figure: Any, path: str | os.PathLike[str], *, dpi: int | None = None) -> Path:
    """Write ``figure`` (a ``matplotlib.figure.Figure``) to ``path`` atomically, in the format its
    suffix names (png without one), close it and return ``path``."""
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.tmp")
    try:
        figure.savefig(partial, dpi=dpi, format=path.suffix.lstrip(".") or "png")
        os.replace(partial, path)
    finally:
        plt.close(figure)
        partial.unlink(missing_ok=True)
    return path
