"""Saving matplotlib figures so that a reader never finds a half-written image.

Every plot csbp draws (``loss.png``, the benchmark and comparison figures) is written to a hidden
file beside its destination and renamed over it (a device or pipe, ``/dev/null``, is written into
instead: :func:`csbp.atomic.streams_to`), then the figure is closed to free its memory.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any


def save_figure(figure: Any, path: str | os.PathLike[str], *, dpi: int | None = None) -> Path:
    """Write ``figure`` (a ``matplotlib.figure.Figure``) to ``path`` atomically, in the format its
    suffix names (png without one), close it and return ``path``."""
    import matplotlib.pyplot as plt

    from csbp.atomic import streams_to

    path = Path(path)
    image_format = path.suffix.lstrip(".") or "png"
    if streams_to(path):  # /dev/null, a pipe: written into, never replaced by a regular file
        image = io.BytesIO()  # image writers seek, which a pipe cannot
        try:
            figure.savefig(image, dpi=dpi, format=image_format)
        finally:
            plt.close(figure)
        with open(path, "wb") as stream:
            stream.write(image.getvalue())
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.tmp")
    try:
        figure.savefig(partial, dpi=dpi, format=image_format)
        os.replace(partial, path)
    finally:
        plt.close(figure)
        partial.unlink(missing_ok=True)
    return path
