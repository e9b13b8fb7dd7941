"""`tokenmill` command line: one entry point, one subcommand per package.

Each package that offers a subcommand exposes ``register(subparsers)`` which
adds its parser and sets ``func`` (called with the parsed args, returning an
exit code). The list of providers is fixed: a provider that fails to import
is a broken install and stops the command line with the import error, rather
than quietly leaving its subcommand out. The providers' modules import only
what their flags need, so `tokenmill bench` never imports torch and
`tokenmill serve` never imports the load generator.
"""
from __future__ import annotations

import argparse
import importlib
import sys

# (module, the subcommands its register() adds), in help order.
PROVIDERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("tokenmill.entrypoints.cli.serve_cli", ("serve",)),
    ("tokenmill.entrypoints.cli.generate_cli", ("generate",)),
    ("tokenmill.bench.cli", ("bench", "trace", "usage", "plan")),
    ("tokenmill.router.cli", ("route",)),
    ("tokenmill.evaluate.cli", ("eval",)),
)
COMMANDS: tuple[str, ...] = tuple(c for _, commands in PROVIDERS for c in commands)


def build_parser() -> argparse.ArgumentParser:
    from ... import __version__
    from ...settings.cli_args import Parser

    parser = Parser(prog="tokenmill", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"tokenmill {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, commands in PROVIDERS:
        importlib.import_module(name).register(sub)
        missing = [c for c in commands if c not in sub.choices]
        if missing:
            raise RuntimeError(f"{name}.register() did not add the subcommand(s) {', '.join(missing)}")
    return parser


def main(argv: list[str] | None = None) -> int:
    from ...settings.cli_args import expand_config, unknown_flags_message

    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[0] if argv and not argv[0].startswith("-") else None
    sub = _subparser(parser, command)
    if sub is not None and any(a == "--config" or a.startswith("--config=") for a in argv):
        argv = [argv[0]] + expand_config(argv[1:], sub, prog=sub.prog)
    args, extras = parser.parse_known_args(argv)
    if extras:  # one line naming the first flag not understood, under the command's name
        prog = sub.prog if sub is not None else parser.prog
        print(f"{prog}: error: {unknown_flags_message(extras)} (see {prog} --help)", file=sys.stderr)
        return 2
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    from ...model.support import UnsupportedModel
    from ...files.unsupported import StartupRefused

    try:
        return int(args.func(args) or 0)
    except (UnsupportedModel, StartupRefused) as exc:  # one line naming what is not supported and what is; no traceback
        print(f"tokenmill {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _subparser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return None


if __name__ == "__main__":
    sys.exit(main())
