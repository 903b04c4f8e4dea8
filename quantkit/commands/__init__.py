"""Subcommands of the quantkit CLI: each module exposes register(subparsers) and run(args) -> int."""
