"""Argument parsing habits shared by every `tokenmill` command line.

Imports only the standard library (and PyYAML for ``--config``, when asked):
`tokenmill bench` and `tokenmill route` parse their flags with this module
and must stay runnable without torch.

- ``Parser`` turns argparse's prefix matching off (``--data`` must not be
  read as ``--dataset``) and reports a bad command line in one line, with no
  usage dump and no traceback.
- ``human_int`` reads vLLM's size suffixes (``32k`` = 32,000, ``32K`` =
  32,768), so a launch line written for vLLM means the same here.
- ``expand_config`` applies ``--config FILE.yaml`` as the parser's defaults,
  so a flag given on the command line wins.
"""
from __future__ import annotations

import argparse
import sys
from typing import Any, NoReturn, Sequence

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def human_int(text: str) -> int:
    """'4k' -> 4000, '4K' -> 4096, '1.5m' -> 1500000, '25.6k' -> 25600, '512' -> 512."""
    value = str(text).strip()
    if not value:
        raise argparse.ArgumentTypeError("empty number")
    unit = value[-1]
    try:
        if unit in _DECIMAL:
            return int(round(float(value[:-1]) * _DECIMAL[unit]))
        if unit in _BINARY:
            return int(round(float(value[:-1]) * _BINARY[unit]))
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number (suffixes: k/m/g = 1000s, K/M/G = 1024s)") from None


class Parser(argparse.ArgumentParser):
    """ArgumentParser with no prefix matching and one-line errors.

    Sub-parsers made through ``add_subparsers`` are of this class too, so the
    rule holds for every command."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments: "):
            message = unknown_flags_message(message.split(": ", 1)[1].split())
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# Flags of `vllm serve` that make no sense for tokenmill, with the reason given
# instead of a bare "unknown flag".
VLLM_ONLY_FLAGS: dict[str, str] = {
    "--pipeline-parallel-size": "pipeline parallelism is not implemented",
    "-pp": "pipeline parallelism is not implemented",
    "--data-parallel-size": "run several replicas behind `tokenmill route` instead",
    "-dp": "run several replicas behind `tokenmill route` instead",
}


def unknown_flags_message(extras: Sequence[str]) -> str:
    """One line naming what was not understood (flags first, then stray values)."""
    flags = [e for e in extras if e.startswith("-")]
    name = (flags or list(extras) or ["?"])[0].split("=", 1)[0]
    if name in VLLM_ONLY_FLAGS:
        return f"{name} is a vLLM flag tokenmill does not take: {VLLM_ONLY_FLAGS[name]}"
    if flags:
        more = f" (and {', '.join(f.split('=', 1)[0] for f in flags[1:])})" if len(flags) > 1 else ""
        return f"unknown flag {name}{more}"
    return f"unexpected argument {name!r}"


def _config_default(action: argparse.Action, value: Any) -> Any:
    """A YAML value as the default of ``action``. Strings stay strings, so argparse
    converts them with the flag's own type (``4k`` -> 4000) as if typed."""
    if action.nargs == 0:  # a switch
        if not isinstance(value, bool):
            raise ValueError("expects true or false")
        if isinstance(action, argparse.BooleanOptionalAction):
            return value
        return action.const if value else (not action.const)
    if isinstance(value, (list, tuple)):
        if action.nargs not in ("+", "*"):
            raise ValueError("takes one value, not a list")
        return [str(v) for v in value]
    if value is None:
        return None
    text = str(value).lower() if isinstance(value, bool) else str(value)
    if action.choices is not None and text not in action.choices:
        raise ValueError(f"{text!r} is not one of {', '.join(map(str, action.choices))}")
    return [text] if action.nargs in ("+", "*") else text


def expand_config(argv: Sequence[str], parser: argparse.ArgumentParser, *,
                  prog: str = "tokenmill") -> list[str]:
    """Apply ``--config FILE`` in ``argv`` to ``parser`` and return ``argv`` without it.

    Keys are the long flag names without dashes (``max-model-len`` or
    ``max_model_len``); booleans switch flags on or off, lists give several
    values. The file's values become the parser's defaults, so a flag on the
    command line wins wherever it stands."""
    argv = list(argv)
    for i, tok in enumerate(argv):
        if tok == "--config" or tok.startswith("--config="):
            path = tok.split("=", 1)[1] if "=" in tok else (argv[i + 1] if i + 1 < len(argv) else None)
            end = i + 1 if "=" in tok else i + 2
            break
    else:
        return argv
    if not path:
        _die(prog, "--config needs a YAML file")
    try:
        import yaml
    except ImportError:
        _die(prog, "--config needs PyYAML (pip install pyyaml)")
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh) or {}
    except OSError as exc:
        _die(prog, f"--config {path}: {exc.strerror or exc}")
    except yaml.YAMLError as exc:
        _die(prog, f"--config {path}: not valid YAML ({str(exc).splitlines()[0]})")
    if not isinstance(data, dict):
        _die(prog, f"--config {path}: expected a mapping of flag names to values")
    defaults: dict[str, Any] = {}
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        action = next((a for a in parser._actions if flag in a.option_strings), None)
        if action is None:
            _die(prog, f"--config {path}: unknown key {key!r}")
        try:
            defaults[action.dest] = _config_default(action, value)
        except ValueError as exc:
            _die(prog, f"--config {path}: {key}: {exc}")
    parser.set_defaults(**defaults)
    return argv[:i] + argv[end:]


def _die(prog: str, message: str) -> NoReturn:
    sys.stderr.write(f"{prog}: error: {message}\n")
    raise SystemExit(2)
