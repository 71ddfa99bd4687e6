"""Counts in the lines users read: ``1 batch``, ``2 batches`` (never ``1 batches``), and sizes in GiB."""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``"<n> <noun>"`` with ``noun`` in the plural unless ``n`` is 1 (``plural`` when not ``noun + 's'``)."""
    return f"{n} {noun if n == 1 else (plural or noun + 's')}"


def size(n_bytes: float) -> str:
    """``n_bytes`` for a reader: ``"512.0 MiB"`` below a GiB, ``"1,536.0 GiB"``, ``"1.5e+13 GiB"`` past a million."""
    value = n_bytes / 2**30
    if value < 1:
        return f"{n_bytes / 2**20:.1f} MiB"
    return f"{value:.2g} GiB" if value >= 1e6 else f"{value:,.1f} GiB"
