"""Outputs named by a device or a pipe (``--json /dev/null``, ``/dev/stdout``, a FIFO) are written into,
never replaced: the atomic ``os.replace`` put a regular file in place of ``/dev/null`` (run as root, for the
whole machine: later ``> /dev/null`` redirections then filled a file, and a test expecting a character
device failed). Plain files still go through the temporary file and ``os.replace``."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from csbp.atomic import streams_to, write_json_atomic, write_text_atomic
from csbp.cli.options import output_file


def read_fifo(path: Path, into: list[bytes]) -> threading.Thread:
    """A reader of the pipe (a writer blocks until one opens it)."""

    def read() -> None:
        with open(path, "rb") as stream:
            into.append(stream.read())

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def test_a_pipe_is_written_into_and_stays_a_pipe(tmp_path: Path) -> None:
    fifo = tmp_path / "out.json"
    os.mkfifo(fifo)
    link = tmp_path / "link.json"
    link.symlink_to(fifo)
    for target, write in ((fifo, lambda p: write_json_atomic(p, {"a": 1})), (link, lambda p: write_text_atomic(p, "x"))):
        received: list[bytes] = []
        reader = read_fifo(fifo, received)
        write(target)
        reader.join(timeout=10)
        assert received and (received[0] == b"x" or received[0].startswith(b"{") and b'"a": 1' in received[0])
        assert stat.S_ISFIFO(os.stat(fifo).st_mode) and link.is_symlink()
    assert streams_to(fifo) and streams_to(link) and output_file(str(fifo)) == fifo
    assert not list(tmp_path.glob(".*tmp*"))  # no temporary file was made beside it


def test_an_unwritable_pipe_is_refused_before_any_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found when the output was written, after the whole run, before (root may write anything, so the
    check's answer is simulated)."""
    import argparse

    fifo = tmp_path / "out.json"
    os.mkfifo(fifo)
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    with pytest.raises(argparse.ArgumentTypeError, match=f"^{fifo}: not writable \\(fix: choose another path\\)$"):
        output_file(str(fifo))


def test_a_figure_goes_into_a_pipe(tmp_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from csbp.figures import save_figure

    fifo = tmp_path / "plot.png"
    os.mkfifo(fifo)
    received: list[bytes] = []
    reader = read_fifo(fifo, received)
    save_figure(plt.figure(figsize=(1, 1)), fifo, dpi=10)
    reader.join(timeout=10)
    assert received[0].startswith(b"\x89PNG") and stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_a_character_device_stays_one(tmp_path: Path) -> None:
    """A null device node of our own (creating one needs root: skipped otherwise)."""
    null = tmp_path / "null"
    try:
        os.mknod(null, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("creating a device node needs root")
    write_json_atomic(null, {"discarded": True})
    assert stat.S_ISCHR(os.stat(null).st_mode) and streams_to(null)


def test_regular_files_are_still_replaced_whole(tmp_path: Path) -> None:
    target = tmp_path / "out.json"
    target.write_text("old")
    before = os.stat(target).st_ino
    write_text_atomic(target, "new")
    assert target.read_text() == "new" and os.stat(target).st_ino != before  # a new file renamed over it
    assert not streams_to(target) and not streams_to(tmp_path / "missing")


def test_a_descriptor_name_redirected_to_a_file_is_written_into(tmp_path: Path) -> None:
    """``--json /dev/stdout > out.txt``: ``/dev/stdout`` links to ``/proc/self/fd/1``, which then resolves to
    a regular file, so it is no device; replacing it put a regular file in place of the ``/dev/stdout`` link.
    A link of our own to a descriptor stands in for it (never ``/dev`` itself)."""
    redirected = tmp_path / "out.txt"
    with open(redirected, "w", encoding="utf-8") as held:
        link = tmp_path / "stdout"
        link.symlink_to(f"/proc/self/fd/{held.fileno()}")
        assert streams_to(link) and streams_to(f"/dev/fd/{held.fileno()}")
        write_text_atomic(link, "written into\n")
        assert link.is_symlink() and redirected.read_text() == "written into\n"
        assert output_file(str(link)) == link
    assert not list(tmp_path.glob(".*tmp*"))
