"""Keep a Gateway API HTTPRoute's backend weights in step with the router's split.

In Kubernetes a canary is two InferencePools (base and variant) behind one
HTTPRoute whose ``backendRefs`` carry weights (deploy/kubernetes/canary/).
When the router's guard rolls a variant back, the gateway must stop sending
it traffic too. Given a ServiceAccount allowed to ``get`` and ``update``
``httproutes`` in its namespace, the router reads the route, sets the weight
of each backendRef that names a variant's pool, and writes it back (with the
resourceVersion it read, so a concurrent edit is retried rather than lost).

Without that access the caller only alerts (an ERROR line in the log).
"""
from __future__ import annotations

import os
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def set_weights(route: dict[str, Any], weights: dict[str, float], refs: dict[str, str]) -> int:
    """Set backendRef weights in an HTTPRoute object in place; returns how many refs changed.

    ``refs`` maps variant -> backendRef name (default: the variant's own name).
    Gateway API weights are relative integers; percentages are rounded.
    """
    by_ref = {refs.get(v, v): int(round(w)) for v, w in weights.items()}
    changed = 0
    for rule in route.get("spec", {}).get("rules", []) or []:
        for ref in rule.get("backendRefs", []) or []:
            name = ref.get("name")
            if name in by_ref and ref.get("weight") != by_ref[name]:
                ref["weight"] = by_ref[name]
                changed += 1
    return changed


@dataclass
class HTTPRouteWeights:
    api_url: str  # https://KUBERNETES_SERVICE_HOST:PORT
    namespace: str
    name: str
    token: str
    refs: dict[str, str] = field(default_factory=dict)
    verify: Any = True  # an ssl.SSLContext for the cluster CA, or False in tests

    @classmethod
    def in_cluster(cls, route: str, refs: dict[str, str] | None = None, sa_dir: Path = SA_DIR) -> "HTTPRouteWeights":
        """From the pod's ServiceAccount; raises OSError/ValueError when not running in a cluster."""
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise ValueError("KUBERNETES_SERVICE_HOST is not set (not in a cluster)")
        token = (sa_dir / "token").read_text().strip()
        ns, _, name = route.rpartition("/")
        if not ns:
            ns = (sa_dir / "namespace").read_text().strip()
        ctx = ssl.create_default_context(cafile=str(sa_dir / "ca.crt"))
        if ":" in host:
            host = f"[{host}]"
        return cls(f"https://{host}:{port}", ns, name, token, dict(refs or {}), ctx)

    @property
    def path(self) -> str:
        return f"/apis/gateway.networking.k8s.io/v1/namespaces/{self.namespace}/httproutes/{self.name}"

    async def apply(self, weights: dict[str, float], client: httpx.AsyncClient | None = None) -> int:
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        own = client is None
        client = client or httpx.AsyncClient(verify=self.verify, timeout=10.0, trust_env=False)
        try:
            for _ in range(3):
                r = await client.get(self.api_url + self.path, headers=headers)
                r.raise_for_status()
                route = r.json()
                changed = set_weights(route, weights, self.refs)
                if not changed:
                    return 0
                put = await client.put(self.api_url + self.path, headers=headers, json=route)
                if put.status_code == 409:  # edited meanwhile: read again
                    continue
                put.raise_for_status()
                return changed
            raise RuntimeError("HTTPRoute kept changing under us (409 three times)")
        finally:
            if own:
                await client.aclose()
