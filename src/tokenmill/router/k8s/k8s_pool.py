"""Pool membership from the Kubernetes API: the ready pods an InferencePool selects.

This is how the Gateway API Inference Extension's reference endpoint picker
finds its replicas: read the InferencePool (its pod selector and target
port), then watch the pods matching the selector; a pod counts once it has
an IP, is Ready and is not being deleted. The headless-Service DNS mode
(``--backend-dns``) stays the simple alternative that needs no API access;
this one needs RBAC to get the InferencePool and to list/watch pods, and
follows the pool's own selector rather than a Service's.

The official ``kubernetes`` client is synchronous, so the watch runs on a
daemon thread; the router's health loop reads ``endpoints()`` every beat
and is woken by ``on_change`` when membership moves.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable

log = logging.getLogger("tokenmill.router")

GROUP = "inference.networking.k8s.io"
VERSIONS = ("v1", "v1alpha2")  # the GA API first; v1alpha2 pools have a flat selector
NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def default_namespace() -> str:
    """POD_NAMESPACE (downward API), else the service account's namespace, else 'default'."""
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        with open(NAMESPACE_FILE, encoding="utf-8") as fh:
            return fh.read().strip() or "default"
    except OSError:
        return "default"


def pool_selector(pool: dict[str, Any]) -> tuple[dict[str, str], int]:
    """(matchLabels, target port) of an InferencePool object, v1 or v1alpha2."""
    spec = pool.get("spec") or {}
    selector = spec.get("selector") or {}
    labels = selector.get("matchLabels", selector) if isinstance(selector, dict) else {}
    if not labels or not all(isinstance(v, str) for v in labels.values()):
        raise ValueError("the InferencePool has no label selector (spec.selector.matchLabels)")
    ports = spec.get("targetPorts") or []
    port = ports[0].get("number") if ports else spec.get("targetPortNumber")
    if not isinstance(port, int):
        raise ValueError("the InferencePool has no target port (spec.targetPorts[0].number)")
    return dict(labels), port


def pod_ready(pod: Any) -> bool:
    """An IP, the Ready condition true, and no deletion under way."""
    status, meta = pod.status, pod.metadata
    if status is None or not status.pod_ip or (meta is not None and meta.deletion_timestamp):
        return False
    return any(c.type == "Ready" and c.status == "True" for c in status.conditions or [])


def _url(ip: str, port: int) -> str:
    return f"http://[{ip}]:{port}" if ":" in ip else f"http://{ip}:{port}"


class PoolMembership:
    """The ready pods of one InferencePool, kept current by a watch."""

    def __init__(self, pool: str, namespace: str | None = None, api_client: Any = None,
                 on_change: Callable[[], None] | None = None, watch_timeout_s: int = 300) -> None:
        self.pool = pool
        self.namespace = namespace or default_namespace()
        self.on_change = on_change
        self.watch_timeout_s = watch_timeout_s
        self._api_client = api_client
        self._pods: dict[str, str] = {}  # pod name -> base URL, ready pods only
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.labels: dict[str, str] = {}
        self.port = 0

    # -- set-up -----------------------------------------------------------
    def _client(self) -> Any:
        if self._api_client is None:
            from kubernetes import client, config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                # KUBECONFIG read now (the client reads it once, at import), else ~/.kube/config
                config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)
            self._api_client = client.ApiClient()
        return self._api_client

    def read_pool(self) -> None:
        """Read the InferencePool's selector and port (raises with a clear message)."""
        from kubernetes import client
        from kubernetes.client.exceptions import ApiException

        api = client.CustomObjectsApi(self._client())
        last: Exception | None = None
        for version in VERSIONS:
            try:
                obj = api.get_namespaced_custom_object(GROUP, version, self.namespace, "inferencepools", self.pool)
            except ApiException as exc:
                last = exc
                if exc.status == 404:
                    continue
                raise RuntimeError(f"cannot read InferencePool {self.namespace}/{self.pool}: "
                                   f"HTTP {exc.status} {exc.reason}") from None
            self.labels, self.port = pool_selector(obj)
            return
        raise RuntimeError(f"InferencePool {self.namespace}/{self.pool} not found ({last and last.reason})")

    @property
    def selector(self) -> str:
        return ",".join(f"{k}={v}" for k, v in sorted(self.labels.items()))

    # -- membership -------------------------------------------------------
    def endpoints(self) -> set[str]:
        with self._lock:
            return set(self._pods.values())

    def _apply(self, kind: str, pod: Any) -> None:
        name = pod.metadata.name
        with self._lock:
            before = self._pods.get(name)
            if kind != "DELETED" and pod_ready(pod):
                self._pods[name] = _url(pod.status.pod_ip, self.port)
            else:
                self._pods.pop(name, None)
            changed = before != self._pods.get(name)
        if changed:
            log.info("pool %s: pod %s %s", self.pool, name, "in" if name in self._pods else "out")
            if self.on_change:
                self.on_change()

    def _relist(self, core: Any) -> str:
        pods = core.list_namespaced_pod(self.namespace, label_selector=self.selector)
        fresh = {p.metadata.name: _url(p.status.pod_ip, self.port) for p in pods.items if pod_ready(p)}
        with self._lock:
            changed = fresh != self._pods
            self._pods = fresh
        if changed and self.on_change:
            self.on_change()
        return pods.metadata.resource_version

    def sync_once(self) -> str:
        """List the pods now (used at start, and after the watch loses its place)."""
        from kubernetes import client

        return self._relist(client.CoreV1Api(self._client()))

    def _watch_loop(self) -> None:
        from kubernetes import client, watch
        from kubernetes.client.exceptions import ApiException

        core = client.CoreV1Api(self._client())
        version: str | None = None
        while not self._stop.is_set():
            try:
                if version is None:
                    version = self._relist(core)
                w = watch.Watch()
                for event in w.stream(core.list_namespaced_pod, self.namespace, label_selector=self.selector,
                                      resource_version=version, timeout_seconds=self.watch_timeout_s):
                    if self._stop.is_set():
                        w.stop()
                        break
                    obj = event["object"]
                    if event["type"] == "ERROR":
                        version = None  # e.g. 410 Gone: our resourceVersion is too old
                        break
                    version = obj.metadata.resource_version or version
                    self._apply(event["type"], obj)
            except ApiException as exc:
                log.warning("watching pods of pool %s: HTTP %s %s", self.pool, exc.status, exc.reason)
                version = None
                self._stop.wait(1.0)
            except Exception as exc:  # noqa: BLE001 - connection drops: relist and go on
                log.warning("watching pods of pool %s: %s", self.pool, exc)
                version = None
                self._stop.wait(1.0)

    def start(self) -> None:
        """Read the pool, list its pods, then keep watching on a daemon thread."""
        self.read_pool()
        self.sync_once()
        log.info("pool %s/%s: pods %s on port %d, %d ready", self.namespace, self.pool, self.selector,
                 self.port, len(self._pods))
        self._thread = threading.Thread(target=self._watch_loop, name="tokenmill-pool-watch", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 0.5) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

