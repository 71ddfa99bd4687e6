"""The rounds of ``csbp compare --repeats R``: each round's seed, layout order and directories.

Round ``r`` (1-based) trains every layout once. Within a round every layout has the same seed,
``run.seed + r - 1``, so the layouts of a round start from the same weights, read the same rows and
(at the same ``dp``) draw the same masks: their difference is a *paired* one, with the training
noise shared. Between rounds the seed changes, so the spread over rounds holds the training noise
(initialisation, data order, corruption draws, the validation corruption) as well as the timing
noise. Round 1 keeps ``run.seed``: one round is the comparison without ``--repeats``.

Round ``r`` runs the layouts in ``--layouts`` order rotated left by ``r - 1`` (``cp,csbp`` then
``csbp,cp``, ...): over a multiple of the number of layouts, every layout runs first, second, ...
equally often, so the first layout's warm-up and a drift of the machine's load over the comparison
fall on every layout alike. Each round starts its own processes (on more than one process), so each
round's first layout pays the process warm-up.

Directories: ``OUT/<layout>/`` with one round (as without ``--repeats``), else
``OUT/round-<r>/<layout>/``.
"""

from __future__ import annotations

from pathlib import Path

from csbp.config.loading import config_from_dict
from csbp.config.schema import RunConfig


def round_order(layouts: tuple[str, ...], round_index: int) -> tuple[str, ...]:
    """The order round ``round_index`` (0-based) trains ``layouts`` in: rotated left by ``round_index``."""
    shift = round_index % len(layouts)
    return layouts[shift:] + layouts[:shift]


def round_seed(cfg: RunConfig, round_index: int) -> int:
    """``run.seed`` of round ``round_index`` (0-based): ``cfg.run.seed + round_index``."""
    return cfg.run.seed + round_index


def round_config(cfg: RunConfig, round_index: int) -> RunConfig:
    """``cfg`` with round ``round_index``'s seed (``cfg`` itself for the first round)."""
    if round_index == 0:
        return cfg
    data = cfg.model_dump(mode="json")
    data["run"]["seed"] = round_seed(cfg, round_index)
    return config_from_dict(data, source=f"round {round_index + 1}")


def layout_dir(out_dir: Path, layout: str, round_index: int, repeats: int) -> Path:
    """The run directory of ``layout`` in round ``round_index`` (0-based) of ``repeats`` rounds."""
    return out_dir / layout if repeats == 1 else out_dir / f"round-{round_index + 1}" / layout


def balance_note(layouts: tuple[str, ...], repeats: int, *, compiled: bool = False) -> str | None:
    """A note when ``repeats`` rounds do not put every layout in every position equally often, or, for a
    ``compiled`` run (``train.compile: layers``), when one round leaves the compilation to its first layout."""
    if repeats % len(layouts) == 0 and repeats > 1:
        return None
    if repeats == 1:
        if not compiled or len(layouts) == 1:
            return None
        return (
            f"note: train.compile: the layouts of a round share their processes' compiled code, so {layouts[0]}, "
            f"which ran first, paid the compilation in its budget (fix: --repeats a multiple of {len(layouts)}, which "
            "puts every layout first equally often)"
        )
    return (
        f"note: {repeats} rounds of {len(layouts)} layouts: the rotated orders do not run every layout in every "
        f"position equally often, so order effects are only partly balanced (fix: --repeats a multiple of "
        f"{len(layouts)})"
    )
