"""`tokenmill`'s subcommand list: every command is there, and a provider that cannot be
imported stops the command line instead of vanishing from it."""
from __future__ import annotations

import re

import pytest

from tokenmill.entrypoints.cli import main as cli

EXPECTED = {"serve", "generate", "bench", "trace", "usage", "plan", "route", "eval"}


def _listed_commands(help_text: str) -> set[str]:
    """The names in the COMMAND block of the top-level --help."""
    block = help_text.split("positional arguments:", 1)[1].split("options:", 1)[0]
    return {m.group(1) for m in re.finditer(r"^ {4}(\w+) {2,}", block, re.M)}


def test_help_lists_every_subcommand_and_each_has_its_own_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--help"])
    assert exit_.value.code == 0
    assert _listed_commands(capsys.readouterr().out) == EXPECTED
    for command in sorted(EXPECTED):
        with pytest.raises(SystemExit) as exit_:
            cli.main([command, "--help"])
        assert exit_.value.code == 0, command
        assert capsys.readouterr().out.startswith(f"usage: tokenmill {command}"), command


def test_a_provider_that_cannot_be_imported_fails_loudly(monkeypatch):
    monkeypatch.setattr(cli, "PROVIDERS", cli.PROVIDERS + (("tokenmill.no_such_cli", ("nothing",)),))
    with pytest.raises(ModuleNotFoundError, match="tokenmill.no_such_cli"):
        cli.build_parser()


def test_a_provider_that_forgets_its_subcommand_fails_loudly(monkeypatch):
    monkeypatch.setattr(cli, "PROVIDERS", (("tokenmill.entrypoints.cli.generate_cli", ("generate", "serve")),))
    with pytest.raises(RuntimeError, match="did not add the subcommand.*serve"):
        cli.build_parser()
