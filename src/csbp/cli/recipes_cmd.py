"""``csbp recipes [list] | show NAME | copy NAME DEST [--overwrite]``: the packaged run recipes
(``csbp recipes`` alone lists them)."""

from __future__ import annotations

import argparse

from csbp.cli.options import path_option
from csbp.recipes import copy_recipe, list_recipes, recipe_path, recipe_summary


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "recipes", help="list, show and copy packaged run recipes",
        usage="%(prog)s [-h] [ACTION ...]",
        description="List, show and copy the packaged run recipes (no ACTION: list them).",
    )
    parser.set_defaults(func=run_list)  # an ACTION's own func replaces it
    actions = parser.add_subparsers(dest="recipes_command", metavar="ACTION", prog=parser.prog)

    list_parser = actions.add_parser("list", help="list the packaged recipes")
    list_parser.set_defaults(func=run_list)

    show = actions.add_parser("show", help="print a recipe's YAML")
    show.add_argument("name", metavar="NAME", help="packaged recipe (csbp recipes list)")
    show.set_defaults(func=run_show)

    copy = actions.add_parser("copy", help="copy a recipe to a file or directory to edit it")
    copy.add_argument("name", metavar="NAME", help="packaged recipe (csbp recipes list)")
    copy.add_argument("dest", metavar="DEST", type=path_option, help="destination directory or .yaml file")
    copy.add_argument(
        "--overwrite", "--force", action="store_true", dest="force",
        help="replace an existing file (--force is the same flag)",
    )
    copy.set_defaults(func=run_copy)


def run_list(args: argparse.Namespace) -> int:
    names = list_recipes()
    width = max(len(name) for name in names)
    for name in names:
        print(f"{name:<{width}}  {recipe_summary(name)}")
    return 0


def run_show(args: argparse.Namespace) -> int:
    print(recipe_path(args.name).read_text(encoding="utf-8"), end="")
    return 0


def run_copy(args: argparse.Namespace) -> int:
    target = copy_recipe(args.name, args.dest, overwrite=args.force)
    print(f"wrote {target}")
    return 0
