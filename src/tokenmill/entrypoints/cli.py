"""`tokenmill` command line: one entry point, one subcommand per package.

Each package that offers a subcommand exposes ``register(subparsers)`` which
adds its parser and sets ``func`` (called with the parsed args, returning an
exit code). Packages are imported lazily so `tokenmill bench` never imports
torch and `tokenmill serve` never imports the load generator.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# (module, description) for each subcommand provider, in help order.
_PROVIDERS: list[str] = [
    "tokenmill.entrypoints.serve_cli",
    "tokenmill.entrypoints.generate_cli",
    "tokenmill.bench.cli",
    "tokenmill.router.cli",
    "tokenmill.evaluate.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _PROVIDERS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:  # a provider not written yet
            if exc.name and name.startswith(exc.name):
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
