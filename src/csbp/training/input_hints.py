"""What to tell a user whose configured input path is not what its field needs.

Data (``data.train``, ``data.val``) must be a prepared artifact; ``model.init_from`` and
``objective.dflash.target`` a HF checkpoint directory (:func:`checkpoint_directory_fix`: a run
directory or a checkpoint gets the way to its model, not "point it at a checkpoint").

A relative path is resolved against the config file's directory, or against the working directory
for a recipe used by name and for ``--set`` (:mod:`csbp.config.loading`). Run from the wrong
directory, or with a config copied elsewhere, it names a directory that does not exist, and
"prepare data there" would be the wrong advice. :func:`missing_artifact_problem` looks for the
artifact the path most likely meant — only to name it in the message: nothing here changes which
data a run reads.

* ``data.train: .../manifest.json``: the artifact is the directory holding it;
* ``data.train: artifacts``: a directory of artifacts names them;
* a copied config (``/elsewhere/configs/artifacts/x``): ``artifacts/x`` under the working directory;
* a recipe run from a subdirectory (``docs/artifacts/x``): ``artifacts/x`` beside an enclosing
  directory of the working directory, and that directory is where to run from.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from csbp.data.corpus import demo_prepare_command

MANIFEST = "manifest.json"


def is_artifact(path: Path) -> bool:
    """Whether ``path`` is a directory holding a data artifact's manifest."""
    return (path / MANIFEST).is_file()


def artifacts_inside(path: Path) -> list[Path]:
    """The artifacts directly inside the directory ``path`` (``artifacts/`` for ``artifacts/demo``), sorted."""
    try:
        return sorted(entry for entry in Path(path).iterdir() if is_artifact(entry))
    except OSError:  # absent, not a directory, unreadable
        return []


def is_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a directory holding a HF checkpoint's ``config.json``."""
    return (path / "config.json").is_file()


def artifact_under_cwd(path: Path, wanted: Callable[[Path], bool] = is_artifact) -> Path | None:
    """An artifact (``wanted``: else what it accepts) in the working directory at one of ``path``'s last
    few components (``artifacts/x`` for ``/elsewhere/configs/artifacts/x``), the usual result of a copied
    config in another directory or a config in a subdirectory naming a path of the working directory."""
    parts = path.parts
    for count in range(1, min(len(parts) - 1, 4) + 1):
        candidate = Path.cwd() / Path(*parts[-count:])
        if candidate != path and wanted(candidate):
            return candidate
    return None


def artifact_above_cwd(path: Path) -> tuple[Path, Path] | None:
    """``(artifact, directory)`` for a ``path`` inside the working directory that names an artifact
    when taken relative to an enclosing ``directory`` instead (``docs/artifacts/x`` from ``docs/``
    when ``artifacts/x`` is beside ``docs``), nearest first; None otherwise."""
    cwd = Path.cwd().absolute()
    try:
        relative = Path(path).absolute().relative_to(cwd)
    except ValueError:
        return None
    if not relative.parts:
        return None
    for directory in cwd.parents:
        if is_artifact(directory / relative):
            return directory / relative, directory
    return None


def missing_artifact_problem(path: Path, field: str) -> str:
    """One line ``field: <what is wrong> (fix: ...)`` for a configured ``path`` that is not a
    prepared data artifact."""
    path = Path(path)
    if path.name == MANIFEST and path.is_file():
        return (
            f"{field}: {path} is the artifact's manifest file; {field} names the artifact directory "
            f"(fix: set {field}: {path.parent})"
        )
    inside = artifacts_inside(path)
    if inside:
        return (
            f"{field}: {path} is a directory of artifacts, not one ({', '.join(p.name for p in inside[:3])}"
            f"{', ...' if len(inside) > 3 else ''}) (fix: set {field}: {inside[0]}, or the one you mean)"
        )
    nearby = artifact_under_cwd(path)
    if nearby is not None:
        return (
            f"{field}: {path} is not a prepared data artifact, but {nearby} is (relative paths in a config "
            f"file resolve against the file's directory) (fix: set {field}: {nearby})"
        )
    above = artifact_above_cwd(path)
    if above is not None:
        found, directory = above
        return (
            f"{field}: {path} is not a prepared data artifact, but {found} is (a recipe used by name and --set "
            f"resolve relative paths against the working directory, {Path.cwd()}) (fix: run from {directory}, "
            f"or pass --set {field}={found})"
        )
    where = ""
    if _inside_cwd(path):
        where = (
            f" (a recipe used by name and --set resolve relative paths against the working directory, "
            f"{Path.cwd()}; a config file against its own directory)"
        )
    relative = path.absolute().relative_to(Path.cwd().absolute()).as_posix() if _inside_cwd(path) else None
    command = demo_prepare_command(relative) if relative is not None else None
    if command is not None:  # a packaged recipe's own data: the exact command (what the Makefile runs)
        return (f"{field}: {path} is not a prepared data artifact{where} (fix: prepare it with `{command}`, or run "
                "from the directory holding it)")
    return (
        f"{field}: {path} is not a prepared data artifact{where} (fix: prepare it with `csbp data prepare ... "
        f"--out {path}`, or run from the directory holding your artifacts, or set {field} to its absolute path)"
    )


def missing_input_hint(path: Path) -> str:
    """The parenthesised hint of ``csbp config validate``'s note on a data path that does not exist."""
    nearby = artifact_under_cwd(path)
    if nearby is not None:
        return f" (but {nearby} is an artifact: relative paths resolve against the config file's directory)"
    above = artifact_above_cwd(path)
    if above is not None:
        found, directory = above
        return (
            f" (but {found} is an artifact: a recipe used by name resolves relative paths against the working "
            f"directory; run from {directory}, or pass --set with the absolute path)"
        )
    return " (prepare it with `csbp data prepare`)"


def _inside_cwd(path: Path) -> bool:
    try:
        Path(path).absolute().relative_to(Path.cwd().absolute())
    except ValueError:
        return False
    return True


def checkpoint_directory_fix(directory: Path, fallback: str, field: str | None = None) -> str:
    """The fix for a ``directory`` given where a HF checkpoint directory (``config.json``) belongs: the
    export of a run directory, the way to export a training checkpoint, for a config ``field`` a
    checkpoint at the same relative path under the working directory (as for ``data.train``,
    :func:`missing_artifact_problem`), else ``fallback``."""
    directory = Path(directory)
    if (directory / "final" / "config.json").is_file():
        return f"it is a run directory: use its export, {directory / 'final'}"
    if (directory / "trainer_state.json").is_file() or (directory / "checkpoints").is_dir():
        return f"it holds training checkpoints: export one first (csbp export {directory} --out DIR) and use DIR"
    nearby = artifact_under_cwd(directory, is_checkpoint) if field is not None else None
    if nearby is not None:
        return (
            f"{nearby} is a HF checkpoint directory (relative paths in a config file resolve against the file's "
            f"directory): set {field}: {nearby}"
        )
    return fallback
