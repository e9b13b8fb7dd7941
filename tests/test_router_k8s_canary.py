"""Offline checks of deploy/kubernetes/canary: two InferencePools behind one weighted HTTPRoute,
and the SLO guard wired to them (its arguments parse, its weights and names match, its Role
allows exactly the HTTPRoute update it needs). Schema checks of the built-in kinds run in
test_router_k8s.py, which covers every manifest under deploy/kubernetes."""
from __future__ import annotations

import argparse
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1] / "deploy" / "kubernetes"


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _build(folder: Path) -> dict[tuple[str, str], dict]:
    """Resources (recursively) plus strategic-merge patches that replace spec fields, as kustomize would here."""
    k = yaml.safe_load((folder / "kustomization.yaml").read_text())
    objs: dict[tuple[str, str], dict] = {}
    for res in k["resources"]:
        p = (folder / res).resolve()
        for d in (_build(p).values() if p.is_dir() else _docs(p)):
            key = (d["kind"], d["metadata"]["name"])
            assert key not in objs, f"duplicate {key}"
            objs[key] = d
    for patch in k.get("patches", []):
        for d in _docs(folder / patch["path"]):
            key = (d["kind"], d["metadata"]["name"])
            assert key in objs, f"patch of a missing object {key}"
            objs[key]["spec"].update(d["spec"])
    return objs


def _container(dep: dict) -> dict:
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


def _router_args(args: list[str]):
    from tokenmill.router.canary.canary_cli import config_from_args as canary_from_args
    from tokenmill.router.cli import config_from_args, register

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    ns = parser.parse_args([a.replace("$(POD_NAMESPACE)", "default").replace("$(ADMIN_KEY)", "k") for a in args])
    cfg = config_from_args(ns)
    cfg.canary = canary_from_args(ns)
    cfg.validate()
    return cfg


def test_two_pools_behind_one_weighted_route_and_the_guard():
    objs = _build(ROOT / "canary")
    pools = {n: o for (k, n), o in objs.items() if k == "InferencePool"}
    assert set(pools) == {"tokenmill-pool", "tokenmill-pool-int4"}
    # Each pool selects its own replicas, through its own endpoint picker.
    servers = {"tokenmill-pool": objs[("Deployment", "tokenmill-server")],
               "tokenmill-pool-int4": objs[("Deployment", "tokenmill-server-int4")]}
    for name, pool in pools.items():
        sel = pool["spec"]["selector"]["matchLabels"]
        assert sel.items() <= servers[name]["spec"]["template"]["metadata"]["labels"].items()
        other = next(d for n, d in servers.items() if n != name)
        assert not sel.items() <= other["spec"]["template"]["metadata"]["labels"].items()
        epp = objs[("Deployment", pool["spec"]["endpointPickerRef"]["name"])]
        args = _container(epp)["args"]
        if "--pool-name" in args:  # members from the Kubernetes API: this pool's own selector
            assert args[args.index("--pool-name") + 1] == name
        else:  # members from a headless Service's DNS
            headless = args[args.index("--backend-dns") + 1].split(".")[0]
            svc = objs[("Service", headless)]
            assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["selector"].items() <= sel.items()
        assert _router_args(args).endpoint_picker
    int4_args = _container(servers["tokenmill-pool-int4"])["args"]
    assert int4_args[int4_args.index("--quantization") + 1] == "int4"
    from tokenmill.entrypoints.cli import serve_cli

    parser = argparse.ArgumentParser()
    serve_cli.register(parser.add_subparsers())
    parser.parse_args(int4_args)
    # One HTTPRoute, two weighted InferencePool refs.
    route = objs[("HTTPRoute", "tokenmill-route")]
    (rule,) = route["spec"]["rules"]
    refs = {r["name"]: r for r in rule["backendRefs"]}
    assert set(refs) == set(pools) and all(r["kind"] == "InferencePool" for r in refs.values())
    weights = {n: r["weight"] for n, r in refs.items()}
    # The guard: same split, backendRef names of both pools, the route it may update.
    guard = objs[("Deployment", "tokenmill-canary-guard")]
    cfg = _router_args(_container(guard)["args"])
    cc = cfg.canary
    assert [v.name for v in cc.variants] == ["base", "int4"]
    assert cc.k8s_httproute == route["metadata"]["name"]
    assert {cc.k8s_backend_refs[v]: w for v, w in {"base": 100 - cc.split["int4"], "int4": cc.split["int4"]}.items()} \
        == weights
    assert cc.slo.active() and cc.state_file.startswith("/state/")
    for v in cc.variants:  # each variant points at the ClusterIP Service of its replicas
        host = v.backends[0].split("//")[1].split(":")[0]
        svc = objs[("Service", host)]
        pool = pools[cc.k8s_backend_refs[v.name]]
        assert svc["spec"]["selector"].items() <= pool["spec"]["selector"]["matchLabels"].items()
    spec = guard["spec"]["template"]["spec"]
    sa = spec["serviceAccountName"]
    binding = objs[("RoleBinding", "tokenmill-canary-guard")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa}] and ("ServiceAccount", sa) in objs
    role = objs[("Role", binding["roleRef"]["name"])]
    (rule,) = role["rules"]
    assert rule["apiGroups"] == ["gateway.networking.k8s.io"] and rule["resources"] == ["httproutes"]
    assert rule["resourceNames"] == [route["metadata"]["name"]] and set(rule["verbs"]) == {"get", "update"}
    (vol,) = spec["volumes"]
    assert ("PersistentVolumeClaim", vol["persistentVolumeClaim"]["claimName"]) in objs
    assert guard["spec"]["replicas"] == 1
