"""`quantkit recipes [NAME]`: the built-in recipes with their one-line descriptions, or one recipe's YAML."""

from __future__ import annotations

import argparse
import sys


def register(sub) -> None:
    p = sub.add_parser("recipes", help="list the built-in recipes (or print one)",
                       description="List the built-in recipes with their descriptions; with NAME, print that "
                                   "recipe's YAML (copy it to make your own, and pass the file to --recipe).")
    p.add_argument("name", nargs="?", help="a built-in recipe to print")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import yaml

    from quantkit.quantization.recipe import builtin_recipes

    recipes = builtin_recipes()
    if args.name:
        if args.name not in recipes:
            print(f"quantkit recipes: error: no built-in recipe {args.name!r}; built-in recipes: "
                  f"{', '.join(sorted(recipes))}", file=sys.stderr)
            return 2
        print(recipes[args.name].read_text(), end="")
        return 0
    width = max(len(name) for name in recipes)
    for name in sorted(recipes):
        data = yaml.safe_load(recipes[name].read_text()) or {}
        description = data.get("description", "") if isinstance(data, dict) else ""
        print(f"{name:<{width}}  {description}")
    print("\nuse one with: quantkit quantize MODEL --recipe NAME --out DIR  (or --recipe path/to/your.yaml)")
    return 0
