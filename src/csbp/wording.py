"""Counted nouns in the lines users read: ``1 batch``, ``2 batches`` (never ``1 batches``)."""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``"<n> <noun>"`` with ``noun`` in the plural unless ``n`` is 1 (``plural`` when not ``noun + 's'``)."""
    return f"{n} {noun if n == 1 else (plural or noun + 's')}"
