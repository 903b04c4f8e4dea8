"""`quantkit refmodel build NAME`: (re)train a built-in reference model."""

from __future__ import annotations

from quantkit.refmodels import add_build_arguments, run_build


def register(sub) -> None:
    p = sub.add_parser("refmodel", help="build the built-in reference models (ref:tiny, ref:small)")
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    actions.required = True
    build = actions.add_parser("build", help="train a reference model deterministically")
    add_build_arguments(build)
    build.set_defaults(func=run_build)
