"""A local stand-in for the Kubernetes API server: one InferencePool and its pods.

Enough of the API for the official ``kubernetes`` client: GET an
InferencePool (v1), list pods with a label selector, and watch them
(``watch=true``: one JSON event per line, streamed until ``timeoutSeconds``
or until the stub stops). Tests change pods with ``put_pod`` / ``delete_pod``
and every open watch sees the event.
"""
from __future__ import annotations

import json
import queue
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit


def pod(name: str, ip: str | None, ready: bool = True, labels: dict[str, str] | None = None,
        deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "ns", "labels": labels or {"app": "srv"}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: dict[str, Any] = {"phase": "Running",
                              "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "status": status}


class FakeKubeAPI:
    def __init__(self, pool: dict[str, Any], namespace: str = "ns") -> None:
        self.pool, self.namespace = pool, namespace
        self.pods: dict[str, dict[str, Any]] = {}
        self.version = 1
        self.watchers: list[queue.Queue] = []
        self.log: list[tuple[int, dict[str, Any]]] = []  # (resourceVersion, event): replayed to late watches
        self.requests: list[str] = []
        self.lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # watches stream in chunks, as the real API server does

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802
                stub.requests.append(self.path)
                stub.handle(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def kubeconfig(self, path: str) -> str:
        with open(path, "w") as fh:
            json.dump({"apiVersion": "v1", "kind": "Config", "current-context": "stub",
                       "clusters": [{"name": "stub", "cluster": {"server": self.url}}],
                       "users": [{"name": "stub", "user": {"token": "t"}}],
                       "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "stub"}}]}, fh)
        return path

    def __enter__(self) -> "FakeKubeAPI":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for w in list(self.watchers):
            w.put(None)
        self.server.shutdown()
        self.server.server_close()

    # -- changes ------------------------------------------------------------
    def _event(self, kind: str, obj: dict[str, Any]) -> None:
        with self.lock:
            self.version += 1
            obj = json.loads(json.dumps(obj))
            obj["metadata"]["resourceVersion"] = str(self.version)
            event = {"type": kind, "object": obj}
            self.log.append((self.version, event))
            for w in self.watchers:
                w.put(event)

    def put_pod(self, p: dict[str, Any]) -> None:
        kind = "MODIFIED" if p["metadata"]["name"] in self.pods else "ADDED"
        self.pods[p["metadata"]["name"]] = p
        self._event(kind, p)

    def delete_pod(self, name: str) -> None:
        self._event("DELETED", self.pods.pop(name))

    # -- requests -----------------------------------------------------------
    def _matches(self, p: dict[str, Any], selector: str) -> bool:
        want = dict(part.split("=", 1) for part in selector.split(",") if part)
        return all(p["metadata"]["labels"].get(k) == v for k, v in want.items())

    def handle(self, h: BaseHTTPRequestHandler) -> None:
        parts = urlsplit(h.path)
        q = {k: v[0] for k, v in parse_qs(parts.query).items()}
        pool_path = f"/apis/inference.networking.k8s.io/v1/namespaces/{self.namespace}/inferencepools/"
        if parts.path.startswith(pool_path):
            if parts.path[len(pool_path):] != self.pool["metadata"]["name"]:
                return self._json(h, 404, {"kind": "Status", "status": "Failure", "reason": "NotFound",
                                           "code": 404})
            return self._json(h, 200, self.pool)
        if parts.path == f"/api/v1/namespaces/{self.namespace}/pods":
            selector = q.get("labelSelector", "")
            if q.get("watch", "").lower() in ("true", "1"):
                return self._watch(h, selector, float(q.get("timeoutSeconds", "30")),
                                   int(q.get("resourceVersion", "0") or 0))
            items = [p for p in self.pods.values() if self._matches(p, selector)]
            return self._json(h, 200, {"apiVersion": "v1", "kind": "PodList", "items": items,
                                       "metadata": {"resourceVersion": str(self.version)}})
        self._json(h, 404, {"kind": "Status", "code": 404, "reason": "NotFound"})

    @staticmethod
    def _json(h: BaseHTTPRequestHandler, status: int, body: dict[str, Any]) -> None:
        raw = json.dumps(body).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(raw)))
        h.end_headers()
        h.wfile.write(raw)

    def _watch(self, h: BaseHTTPRequestHandler, selector: str, timeout: float, since: int) -> None:
        """Events after resourceVersion ``since`` (as the API server does), then live ones."""
        events: queue.Queue = queue.Queue()
        with self.lock:
            for version, event in self.log:
                if version > since:
                    events.put(event)
            self.watchers.append(events)
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Transfer-Encoding", "chunked")
        h.send_header("Connection", "close")
        h.end_headers()
        h.close_connection = True

        def chunk(data: bytes) -> None:
            h.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            h.wfile.flush()

        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                try:
                    event = events.get(timeout=0.1)
                except queue.Empty:
                    continue
                if event is None:
                    break
                if self._matches(event["object"], selector):
                    chunk(json.dumps(event).encode() + b"\n")
            chunk(b"")  # the last chunk: the watch ends
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            with self.lock:
                self.watchers.remove(events)
