"""Figures are written whole or not at all (csbp.figures.save_figure)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from csbp.figures import save_figure  # noqa: E402


def test_a_figure_is_written_in_its_suffixes_format_and_closed(tmp_path: Path) -> None:
    figure, axis = plt.subplots()
    axis.plot([0, 1], [1, 0])
    out = save_figure(figure, tmp_path / "sub" / "plot.svg")
    assert out.read_text().lstrip().startswith("<?xml") and not plt.fignum_exists(figure.number)
    assert sorted(p.name for p in out.parent.iterdir()) == ["plot.svg"]


def test_a_failed_write_leaves_the_old_file_and_no_partial(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    old = tmp_path / "loss.png"
    old.write_bytes(b"old")
    figure, _ = plt.subplots()

    def broken(target: object, **_: object) -> None:  # the image is rendered in memory, then written
        target.write(b"half") if hasattr(target, "write") else Path(target).write_bytes(b"half")  # type: ignore[arg-type]
        raise OSError("disk full")

    monkeypatch.setattr(figure, "savefig", broken)
    with pytest.raises(OSError, match="disk full"):
        save_figure(figure, old)
    assert old.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["loss.png"]
