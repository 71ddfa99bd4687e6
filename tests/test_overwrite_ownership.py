"""``--overwrite`` replaces a directory only when every entry in it is a file csbp writes there."""

from __future__ import annotations

from pathlib import Path

import pytest

from csbp.atomic import Ownership, write_directory_atomically

OWNED = Ownership(what="data artifact", marker="manifest.json", names=frozenset({"manifest.json", "tokens.bin"}))


def _fill(staging: Path) -> None:
    (staging / "manifest.json").write_text("{}")


@pytest.mark.parametrize("kind", ["directory", "link to a directory"])
def test_an_entry_with_csbp_s_name_that_is_not_a_file_keeps_the_directory(tmp_path: Path, kind: str) -> None:
    """A subdirectory named like an artifact file used to pass, and the replacement deleted its files."""
    target, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    target.mkdir()
    (target / "manifest.json").write_text("{}")
    elsewhere.mkdir()
    (elsewhere / "thesis.tex").write_text("precious")
    if kind == "directory":
        (target / "tokens.bin").mkdir()
        (target / "tokens.bin" / "thesis.tex").write_text("precious")
    else:
        (target / "tokens.bin").symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(ValueError, match="has 'tokens.bin', which is not a regular file"):
        write_directory_atomically(target, _fill, overwrite=True, owned=OWNED)
    assert (elsewhere / "thesis.tex").read_text() == "precious"
    assert sorted(p.name for p in target.iterdir()) == ["manifest.json", "tokens.bin"]


def test_a_directory_of_csbp_s_files_is_still_replaced(tmp_path: Path) -> None:
    target = tmp_path / "out"
    target.mkdir()
    for name in OWNED.names:
        (target / name).write_text("old")
    write_directory_atomically(target, _fill, overwrite=True, owned=OWNED)
    assert [p.name for p in target.iterdir()] == ["manifest.json"]


def test_an_existing_output_names_the_flag_and_the_python_keyword_apart(tmp_path: Path) -> None:
    """It read "pass --overwrite / overwrite=True", one spelling of a flag glued to a Python keyword."""
    target = tmp_path / "out"
    target.mkdir()
    with pytest.raises(ValueError) as info:
        write_directory_atomically(target, _fill, overwrite=False, owned=OWNED)
    assert str(info.value) == (
        f"--out {target}: already exists (fix: choose another path, or pass --overwrite)"
    )
