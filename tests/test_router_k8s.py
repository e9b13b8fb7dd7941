"""Offline checks of deploy/kubernetes: built-in kinds against the official
Kubernetes OpenAPI schemas (kubernetes-validate, strict mode), the Gateway
API and Inference Extension kinds against their documented required fields,
and the wiring between objects (selectors, ports, names, args)."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"
VARIANTS = ["device-plugin", "dra", "cpu", "multi-gpu", "lora"]
K8S_VERSION = "1.34.0"  # first release with resource.k8s.io/v1 (DRA GA)
CRD_KINDS = {
    ("inference.networking.k8s.io/v1", "InferencePool"),
    ("gateway.networking.k8s.io/v1", "Gateway"),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"),
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
}


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _merge(base, patch):
    """Strategic merge as kustomize applies it to these manifests: maps merge
    key by key, lists of named items merge item by item on `name`, any other
    value is replaced."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = dict(base)
        for key, value in patch.items():
            out[key] = _merge(base[key], value) if key in base else value
        return out
    named = lambda xs: isinstance(xs, list) and xs and all(isinstance(x, dict) and "name" in x for x in xs)
    if named(base) and named(patch):
        by_name = {x["name"]: x for x in base}
        out = [_merge(by_name[x["name"]], x) if x["name"] in by_name else x for x in patch]
        patched = {x["name"] for x in patch}
        return [x for x in base if x["name"] not in patched] + out
    return patch


def _kustomize(folder: Path) -> list[dict]:
    """Resolve a kustomization's resources (files and nested folders) and its
    patches like kustomize would."""
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert k["kind"] == "Kustomization"
    out: list[dict] = []
    for res in k["resources"]:
        p = (folder / res).resolve()
        out += _kustomize(p) if p.is_dir() else _docs(p)
    for entry in k.get("patches", []):
        for patch in _docs(folder / entry["path"]):
            ident = (patch["kind"], patch["metadata"]["name"])
            (i,) = [i for i, d in enumerate(out) if (d["kind"], d["metadata"]["name"]) == ident]
            out[i] = _merge(out[i], patch)
    return out


def _patch_files() -> set[Path]:
    """Files that kustomizations apply as patches: partial objects by design."""
    out = set()
    for k in ROOT.rglob("kustomization.yaml"):
        for entry in yaml.safe_load(k.read_text()).get("patches", []):
            out.add((k.parent / entry["path"]).resolve())
    return out


def _objects(variant: str) -> dict[tuple[str, str], dict]:
    objs = {}
    for d in _kustomize(ROOT / variant):
        key = (d["kind"], d["metadata"]["name"])
        assert key not in objs, f"duplicate {key}"
        objs[key] = d
    return objs


def _all_manifests() -> list[tuple[str, dict]]:
    """Every whole object in the tree, and each variant's objects with its
    patches applied (so a patched Deployment is validated as deployed)."""
    out = []
    patches = _patch_files()
    for path in sorted(ROOT.rglob("*.yaml")):
        if path.name in ("kustomization.yaml", "prometheus-adapter-values.yaml") or path.resolve() in patches:
            continue
        out += [(str(path.relative_to(ROOT)), d) for d in _docs(path)]
    for patch in sorted(patches):
        folder = patch.parent
        idents = {(d["kind"], d["metadata"]["name"]) for d in _docs(patch)}
        out += [(f"{folder.name} ({d['kind']} {d['metadata']['name']}, patched)", d)
                for d in _kustomize(folder) if (d["kind"], d["metadata"]["name"]) in idents]
    return out


def test_every_manifest_parses_and_has_identity():
    docs = _all_manifests()
    assert len(docs) >= 12
    for where, d in docs:
        assert d.get("apiVersion") and d.get("kind"), where
        assert d["metadata"].get("name"), where
        assert d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "tokenmill", where


@pytest.mark.parametrize("where,doc", [(w, d) for w, d in _all_manifests()
                                        if (d["apiVersion"], d["kind"]) not in CRD_KINDS])
def test_builtin_kinds_validate_against_official_schemas(where, doc):
    import kubernetes_validate

    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_validator_rejects_a_broken_manifest():
    # The schema check above must be able to fail: a misspelt field is caught.
    import kubernetes_validate

    doc = _objects("cpu")[("Deployment", "tokenmill-server")]
    bad = yaml.safe_load(yaml.safe_dump(doc))
    bad["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {"path": "/health"}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def _server(objs) -> tuple[dict, dict]:
    dep = objs[("Deployment", "tokenmill-server")]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    return dep, container


def _port(container: dict, name: str) -> int:
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name)


@pytest.mark.parametrize("variant", VARIANTS)
def test_model_server_wiring(variant):
    objs = _objects(variant)
    dep, c = _server(objs)
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    http = _port(c, "http")
    assert c["args"][0] == "serve" and c["args"][c["args"].index("--port") + 1] == str(http)
    assert c["args"][c["args"].index("--host") + 1] == "0.0.0.0"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert c[probe]["httpGet"]["path"] == "/health" and c[probe]["httpGet"]["port"] in ("http", http)
    # The model comes from the volume.
    model = c["args"][c["args"].index("--model") + 1]
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "models"]
    assert model.startswith(mount["mountPath"] + "/") and mount["readOnly"]
    (vol,) = [v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "models"]
    assert ("PersistentVolumeClaim", vol["persistentVolumeClaim"]["claimName"]) in objs
    assert c["resources"]["requests"]["cpu"] and c["resources"]["limits"]["memory"]
    # Both Services select the pods and target the named port.
    for name in ("tokenmill-server", "tokenmill-server-headless"):
        svc = objs[("Service", name)]
        assert svc["spec"]["selector"].items() <= pod_labels.items()
        assert svc["spec"]["ports"][0]["targetPort"] in ("http", http)
    assert objs[("Service", "tokenmill-server-headless")]["spec"]["clusterIP"] == "None"
    # The HPA scales this Deployment on waiting requests.
    hpa = objs[("HorizontalPodAutoscaler", "tokenmill-server")]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "tokenmill-server"}
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "vllm_num_requests_waiting"
    assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]


def test_accelerator_variants():
    _, dp = _server(_objects("device-plugin"))
    assert dp["resources"]["limits"]["nvidia.com/gpu"] == "1"
    _, cpu = _server(_objects("cpu"))
    assert not any("gpu" in k for k in cpu["resources"].get("limits", {}))
    objs = _objects("dra")
    dep, c = _server(objs)
    assert not any("nvidia.com" in k for k in c["resources"].get("limits", {}))
    claims = {cl["name"] for cl in c["resources"]["claims"]}
    pod_claims = {pc["name"]: pc for pc in dep["spec"]["template"]["spec"]["resourceClaims"]}
    assert claims and claims <= set(pod_claims)
    for pc in pod_claims.values():
        rct = objs[("ResourceClaimTemplate", pc["resourceClaimTemplateName"])]
        assert rct["apiVersion"] == "resource.k8s.io/v1"
        (req,) = rct["spec"]["spec"]["devices"]["requests"]
        assert req["exactly"]["deviceClassName"] and req["exactly"]["count"] == 1


@pytest.mark.parametrize("variant", VARIANTS)
def test_inference_pool_endpoint_picker_and_route(variant):
    objs = _objects(variant)
    dep, server = _server(objs)
    pool = objs[("InferencePool", "tokenmill-pool")]
    spec = pool["spec"]
    # InferencePool v1: selector.matchLabels (1..64), exactly one target port, an EPP ref.
    labels = spec["selector"]["matchLabels"]
    assert 1 <= len(labels) <= 64
    assert labels.items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert len(spec["targetPorts"]) == 1 and spec["targetPorts"][0]["number"] == _port(server, "http")
    ref = spec["endpointPickerRef"]
    assert ref.get("kind", "Service") == "Service" and ref["failureMode"] in ("FailOpen", "FailClose")
    epp_svc = objs[("Service", ref["name"])]
    svc_port = next(p for p in epp_svc["spec"]["ports"] if p["port"] == ref["port"]["number"])
    assert svc_port.get("appProtocol") == "http2"  # gRPC
    epp = objs[("Deployment", "tokenmill-epp")]
    (ec,) = epp["spec"]["template"]["spec"]["containers"]
    assert epp_svc["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    grpc_port = _port(ec, svc_port["targetPort"]) if isinstance(svc_port["targetPort"], str) else svc_port["targetPort"]
    args = ec["args"]
    assert args[0] == "route" and "--endpoint-picker" in args
    assert args[args.index("--grpc-port") + 1] == str(grpc_port)
    assert ec["readinessProbe"]["grpc"] == {"port": grpc_port, "service": "readiness"}
    assert ec["livenessProbe"]["grpc"] == {"port": grpc_port, "service": "liveness"}
    # The picker takes its replicas from this InferencePool through the API, and may read it.
    assert args[args.index("--pool-name") + 1] == pool["metadata"]["name"]
    account = epp["spec"]["template"]["spec"]["serviceAccountName"]
    assert ("ServiceAccount", account) in objs
    binding = objs[("RoleBinding", "tokenmill-epp")]
    assert {"kind": "ServiceAccount", "name": account} in binding["subjects"]
    role = objs[("Role", binding["roleRef"]["name"])]
    grants = {(g, r): set(rule["verbs"]) for rule in role["rules"]
              for g in rule["apiGroups"] for r in rule["resources"]}
    assert {"get"} <= grants[("inference.networking.k8s.io", "inferencepools")]
    assert {"list", "watch"} <= grants[("", "pods")]
    # The DNS mode the manifest's comment offers still points at the pool's port.
    headless = objs[("Service", "tokenmill-server-headless")]
    assert headless["spec"]["ports"][0]["port"] == spec["targetPorts"][0]["number"]
    # The EPP's own CLI accepts these arguments.
    import argparse

    from tokenmill.router.cli import config_from_args, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    cfg = config_from_args(parser.parse_args([a.replace("$(POD_NAMESPACE)", "default") for a in args]))
    cfg.validate()
    assert cfg.endpoint_picker and cfg.grpc_port == grpc_port
    # Gateway and HTTPRoute: the route hangs off the gateway and points at the pool.
    gw = objs[("Gateway", "inference-gateway")]
    assert gw["spec"]["gatewayClassName"] and gw["spec"]["listeners"][0]["port"] == 80
    route = objs[("HTTPRoute", "tokenmill-route")]
    assert route["spec"]["parentRefs"][0]["name"] == gw["metadata"]["name"]
    (backend,) = route["spec"]["rules"][0]["backendRefs"]
    assert backend == {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "tokenmill-pool"}


def test_server_args_are_known_to_tokenmill_serve():
    """Every flag the manifests pass to the container parses as a `tokenmill serve` line."""
    from tokenmill.entrypoints.cli.main import build_parser

    for variant in VARIANTS:
        _, c = _server(_objects(variant))
        args = build_parser().parse_args(c["args"])  # an unknown flag exits 2 here
        assert args.command == "serve" and args.port == int(c["args"][c["args"].index("--port") + 1])
