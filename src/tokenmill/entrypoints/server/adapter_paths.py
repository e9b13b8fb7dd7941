"""Where a tenant may load a LoRA adapter from: inside its own ``adapter_dirs`` only.

Why real paths: a path is judged by the file it reaches, not by how it is
spelled. ``..`` components are refused outright (there is no honest reason to
climb out of a folder one was given), and what is left is resolved with every
symlink followed (``os.path.realpath``) and must still lie inside one of the
tenant's folders, themselves resolved the same way. A symlink inside an
allowed folder that points elsewhere is refused, and so is one inside the
adapter folder: each file the loader will open (``adapter_config.json``, the
weights, a GGUF file) is checked the same way, so a link to another tenant's
weights or to a server file reaches nothing.

The answer is the resolved path, or None for every kind of refusal (outside,
escaping, missing, not an adapter): the route turns None into one message
that says nothing about the server's files, so a caller cannot map them.
"""
from __future__ import annotations

import os
from typing import Sequence

from ...model.lora.lora import CONFIG_FILE, WEIGHTS_FILES


def _inside(path: str, root: str) -> bool:
    """Whether the resolved ``path`` is ``root`` or below it (both already real paths)."""
    try:
        return os.path.commonpath([path, root]) == root
    except ValueError:  # different drives, or a relative path against an absolute one
        return False


def _candidates(given: str, dirs: Sequence[str]) -> list[str]:
    """The paths ``given`` may mean: itself when absolute, else under each allowed folder in order."""
    if os.path.isabs(given):
        return [given]
    return [os.path.join(d, given) for d in dirs]


def _files_read(real: str) -> list[str]:
    """The files the loader opens for the adapter at ``real`` (engine/adapters.py: read_adapter)."""
    if os.path.isfile(real):
        return [real]
    present = [os.path.join(real, n) for n in (CONFIG_FILE, *WEIGHTS_FILES) if os.path.lexists(os.path.join(real, n))]
    return present if os.path.join(real, CONFIG_FILE) in present else []


def allowed_adapter_path(given: str, dirs: Sequence[str]) -> str | None:
    """The real path of the adapter ``given`` names when it lies, with every file the loader
    reads, inside one of ``dirs``; None otherwise (whatever the reason)."""
    if not given or "\x00" in given or ".." in given.replace("\\", "/").split("/"):
        return None
    roots = [os.path.realpath(d) for d in dirs if os.path.isabs(d)]
    for candidate in _candidates(given, dirs):
        real = os.path.realpath(candidate)
        root = next((r for r in roots if _inside(real, r)), None)
        if root is None or not os.path.exists(real):
            continue
        files = _files_read(real)
        if files and all(_inside(os.path.realpath(f), root) and os.path.isfile(f) for f in files):
            return real
    return None
