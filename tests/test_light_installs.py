"""Installs sized to their use: the load tester and the router run without torch; every
directly imported package is declared; `make serve` installs no test tooling."""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"

# Runs tokenmill's CLI with some top-level packages made unimportable, as on an install without them.
BLOCKER = """
import sys
blocked = set(sys.argv[1].split(","))
class Blocker:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
sys.meta_path.insert(0, Blocker())
sys.argv = ["tokenmill"] + sys.argv[2:]
from tokenmill.entrypoints.cli.main import main
try:
    code = main()
except SystemExit as exc:  # --help and --version exit from argparse
    code = exc.code
leaked = sorted(m for m in sys.modules if m.split(".")[0] in blocked)
assert not leaked, leaked
sys.exit(code)
"""


def run_without(blocked: str, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", BLOCKER, blocked, *argv], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


@pytest.mark.parametrize("argv", [["route", "--help"], ["bench", "--help"], ["trace", "analyze", "--help"],
                                  ["--version"], ["--help"]])
def test_help_without_torch(argv):
    proc = run_without("torch,numpy,safetensors,gguf,matplotlib,grpc,envoy", *argv)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip()


def test_a_bench_run_without_torch(tmp_path):
    sys.path.insert(0, os.path.dirname(__file__))
    from fake_openai_server import FakeServer

    with FakeServer() as srv:
        proc = run_without("torch,numpy,matplotlib,grpc", "bench", "--base-url", srv.url, "--num-prompts", "2",
                           "--random-input-len", "8", "--random-output-len", "2", "--save-result",
                           "--result-dir", str(tmp_path), "--result-filename", "r.json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "r.json").exists() and (tmp_path / "r.tokenmill.json").exists()


def test_endpoint_picker_without_grpc_says_which_extra(tmp_path):
    proc = run_without("torch,grpc,envoy", "route", "--backend", "http://127.0.0.1:9", "--endpoint-picker",
                       "--port", "0")
    assert proc.returncode == 2
    assert "pip install 'tokenmill[router]'" in proc.stderr


# import name -> distribution name, where they differ
DISTRIBUTIONS = {"yaml": "pyyaml", "google": "protobuf", "envoy": "xds-protos", "grpc": "grpcio",
                 "grpc_health": "grpcio-health-checking", "prometheus_client": "prometheus-client", "zmq": "pyzmq",
                 "opentelemetry": "opentelemetry-sdk"}


def _imported_packages() -> dict[str, set[str]]:
    """Top-level third-party packages each source file imports -> the files."""
    found: dict[str, set[str]] = {}
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top != "tokenmill":
                    found.setdefault(top, set()).add(str(path.relative_to(SRC)))
    return found


def _declared() -> tuple[set[str], dict[str, set[str]]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(reqs: list[str]) -> set[str]:
        out = set()
        for r in reqs:
            name = r.split(";")[0]
            for sep in "<>=![ ~":
                name = name.split(sep)[0]
            out.add(name.strip().lower().replace("_", "-"))
        return out

    return names(project["dependencies"]), {k: names(v) for k, v in project["optional-dependencies"].items()}


def test_every_imported_package_is_declared():
    base, extras = _declared()
    everything = base.union(*extras.values())
    missing = {pkg: sorted(files) for pkg, files in _imported_packages().items()
               if DISTRIBUTIONS.get(pkg, pkg).lower().replace("_", "-") not in everything}
    assert not missing, missing
    # the server and offline API need nothing from the extras; the light commands' extras hold no torch
    assert {"torch", "fastapi", "starlette", "anyio", "uvicorn", "pyyaml"} <= base
    assert "matplotlib" in extras["bench"] and {"grpcio", "xds-protos", "protobuf"} <= extras["router"]
    assert not {"matplotlib", "grpcio", "xds-protos", "pytest"} & base


def test_make_serve_installs_no_test_tooling_and_asks_for_cpu_torch():
    if shutil.which("make") is None:
        pytest.skip("no make")
    env = dict(os.environ, PATH="/usr/bin:/bin")
    flavour = "" if shutil.which("nvidia-smi", path=env["PATH"]) else "+cpu"  # the CPU build without CUDA
    out = subprocess.run(["make", "-n", "-B", "serve"], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=60).stdout
    assert "tokenmill serve" in out
    assert "[test]" not in out and "pytest" not in out
    assert f'"torch==2.13.0{flavour}"' in out
    test_out = subprocess.run(["make", "-n", "-B", "test"], capture_output=True, text=True, cwd=ROOT, env=env,
                              timeout=60).stdout
    assert "-e '.[test]'" in test_out


def test_router_tests_and_fake_backends_run_without_torch(tmp_path):
    """As on `pip install '.[router]'` where torch is absent: a sitecustomize blocks torch in the
    test run and in every fake backend process it starts."""
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        "class _NoTorch:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'torch':\n"
        "            raise ModuleNotFoundError(\"No module named 'torch' (blocked)\", name=name)\n"
        "sys.meta_path.insert(0, _NoTorch())\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(SRC)]))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "tests/test_router_unit.py",
         "tests/test_router_ext_proc.py::test_fallback_list_puts_the_pick_first_then_the_least_loaded"],
        capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout.splitlines()[-1]
