"""The LoRA flags of `tokenmill serve` (vLLM's names) and their checks.

Apart from the adapter routes so that building the command line (`tokenmill --help`,
the light commands) imports no torch.
"""
from __future__ import annotations

import argparse
import json
from typing import Any


def add_lora_arguments(p: Any) -> None:
    """vLLM's LoRA flags."""
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (PEFT folders)")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="adapters to load at start: name=path, or vLLM's JSON "
                        '{"name": ..., "path": ...}')
    p.add_argument("--max-loras", type=int, default=1,
                   help="adapters resident at once; others load on demand, least recently used "
                        "evicted (default 1)")
    p.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank accepted (default 16)")


def parse_lora_modules(values: list[str] | None) -> list[tuple[str, str]]:
    """``name=path`` or ``{"name": ..., "path": ...}`` -> [(name, path)]; ValueError names the bad one."""
    out: list[tuple[str, str]] = []
    for value in values or []:
        value = value.strip()
        if value.startswith("{"):
            try:
                item = json.loads(value)
                name, path = str(item["name"]), str(item["path"])
            except (json.JSONDecodeError, KeyError, TypeError):
                raise ValueError(f"--lora-modules {value}: expected name=path or "
                                 '{"name": ..., "path": ...}') from None
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {value}: expected name=path")
        if any(name == n for n, _ in out):
            raise ValueError(f"--lora-modules: the name {name!r} is given twice")
        out.append((name, path))
    return out


def check_lora_args(args: argparse.Namespace) -> str | None:
    """A one-line problem with the LoRA flags, or None."""
    modules = getattr(args, "lora_modules", None)
    if modules and not args.enable_lora:
        return "--lora-modules needs --enable-lora"
    if args.max_loras < 1 or args.max_lora_rank < 1:
        return "--max-loras and --max-lora-rank must be positive"
    try:
        parse_lora_modules(modules)
    except ValueError as exc:
        return str(exc)
    return None
