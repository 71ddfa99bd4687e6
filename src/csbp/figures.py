"""Saving matplotlib figures so that a reader never finds a half-written image.

Every plot csbp draws (``loss.png``, the benchmark and comparison figures) is rendered in memory, the
figure closed to free its memory, and the image written to a unique hidden file beside its destination,
flushed to disk and renamed over it (a device or pipe, ``/dev/null``, is written into instead:
:func:`csbp.atomic.streams_to`).
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any


def save_figure(figure: Any, path: str | os.PathLike[str], *, dpi: int | None = None) -> Path:
    """Write ``figure`` (a ``matplotlib.figure.Figure``) to ``path`` atomically, in the format its
    suffix names (png without one), close it and return ``path``. The image is rendered in memory
    (image writers seek, which a pipe cannot) and written by :func:`csbp.atomic.write_bytes_atomic`."""
    import matplotlib.pyplot as plt

    from csbp.atomic import write_bytes_atomic

    path = Path(path)
    image = io.BytesIO()
    try:
        figure.savefig(image, dpi=dpi, format=path.suffix.lstrip(".") or "png")
    finally:
        plt.close(figure)
    write_bytes_atomic(path, image.getvalue())
    return path
