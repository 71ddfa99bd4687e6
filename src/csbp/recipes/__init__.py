"""Packaged run recipes: validated YAML configs shipped inside the wheel (``recipes/*.yaml``).

A recipe's first comment line is its one-line summary (shown by ``csbp recipes list``).

Usage::

    list_recipes()                          # ['demo', 'fast-dllm-v2-demo', 'mdlm-demo']
    copy_recipe("demo", ".")                # ./demo.yaml, ready to edit
    cfg = load_run_config("demo", ["train.max_steps=10"])   # a file path or a recipe name

Relative paths in a recipe used *by name* are resolved against the working directory (a copied
recipe resolves them against its own directory, like any config file).
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

from csbp.atomic import unwritable_reason, write_text_atomic
from csbp.config import RunConfig, load_config

_SUFFIX = ".yaml"


def list_recipes() -> list[str]:
    """Names of the packaged recipes, sorted."""
    root = resources.files(__name__)
    return sorted(entry.name[: -len(_SUFFIX)] for entry in root.iterdir() if entry.name.endswith(_SUFFIX))


def recipe_path(name: str) -> Path:
    """Filesystem path of the packaged recipe ``name`` (``ValueError`` if there is none)."""
    names = list_recipes()
    if name not in names:
        close = difflib.get_close_matches(name, names, n=1)
        hint = f"did you mean {close[0]}?" if close else f"available: {', '.join(names)}"
        raise ValueError(f"unknown recipe {name!r} (fix: {hint})")
    return Path(str(resources.files(__name__).joinpath(name + _SUFFIX)))


def recipe_summary(name: str) -> str:
    """The recipe's first comment line, without the ``#``."""
    first = recipe_path(name).read_text(encoding="utf-8").splitlines()[:1]
    return first[0].lstrip("#").strip() if first and first[0].startswith("#") else ""


def copy_recipe(name: str, dest: str | Path, *, overwrite: bool = False) -> Path:
    """Copy recipe ``name`` to ``dest`` (a directory, or a ``.yaml`` file path); return the new file.

    Refuses to replace an existing file unless ``overwrite``.
    """
    source = recipe_path(name)
    dest = Path(dest)
    is_yaml = dest.suffix in (".yaml", ".yml")
    if not dest.is_dir() and not is_yaml and (dest.suffix or dest.exists()):
        # x.txt became a directory x.txt/ holding demo.yaml
        what, into = ("an existing file", "a directory") if dest.exists() else (
            f"a {dest.suffix} file name", f"mkdir {dest} first to copy into it")
        raise ValueError(
            f"DEST {dest}: {what}; a recipe is copied to a .yaml file or into a directory "
            f"(fix: DEST {dest.with_suffix(_SUFFIX)}, or {into})"
        )
    target = dest / (name + _SUFFIX) if dest.is_dir() or not is_yaml else dest
    if target.exists() and not overwrite:
        raise ValueError(f"{target} already exists (fix: pass --overwrite, or choose another destination)")
    problem = unwritable_reason(target.parent)
    if problem is not None:
        raise ValueError(f"{target}: {problem} (fix: choose another destination)")
    write_text_atomic(target, source.read_text(encoding="utf-8"))  # --overwrite never leaves half a file
    return target


def load_run_config(spec: str | Path, overrides: Sequence[str] = ()) -> RunConfig:
    """Load a config from a YAML file path, or a packaged recipe by name.

    An existing file wins; otherwise ``spec`` must name a recipe, whose relative paths resolve
    against the working directory. Raises ``ValueError`` for a directory (naming the config inside it)
    and ``FileNotFoundError`` when it is neither.
    """
    if not str(spec).strip():  # Path("") is the working directory: "  is a directory, not a config file"
        raise ValueError(f"CONFIG {str(spec)!r} is empty (fix: pass a YAML file, or a recipe name ({', '.join(list_recipes())}))")
    path = Path(spec)
    if path.is_file():
        return load_config(path, overrides)
    if str(spec) in list_recipes():
        return load_config(recipe_path(str(spec)), overrides, relative_to=Path.cwd(), source=f"recipe {spec}")
    if path.is_dir():
        raise ValueError(f"{spec} is a directory, not a config file (fix: {_config_inside(path)})")
    raise FileNotFoundError(
        f"no config file or recipe named {str(spec)!r} (recipes: {', '.join(list_recipes())})"
    )


def _config_inside(directory: Path) -> str:
    """What to pass instead of ``directory``: its ``config.yaml`` (a run directory's), else its YAML
    files, else a config file or a recipe."""
    if (directory / "config.yaml").is_file():
        return f"pass the config inside it: {directory / 'config.yaml'}"
    try:
        found = sorted(p for p in directory.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file())
    except OSError:  # unreadable: say what a config is
        found = []
    if found:
        return f"pass a YAML file inside it: {', '.join(str(p) for p in found[:3])}"
    return f"pass a YAML file, or a recipe name ({', '.join(list_recipes())})"
