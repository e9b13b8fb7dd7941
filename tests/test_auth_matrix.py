"""The API key in front of every route (fast, tiny model): the route table is read from the
app itself, and every route x (no key, wrong key, right key) is sent through real uvicorn
servers with and without ``--root-path``, and through a parent app that mounts the server.

A route added later is covered without editing this file; one that must answer without a key
has to be listed in OPEN below (and in auth.OPEN_ROUTES), which is the point."""
from __future__ import annotations

import re
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

import httpx
import pytest

from fake_backend import free_port
from test_server_support import make_tiny_app
from tokenmill.entrypoints.server.auth import OPEN_ROUTES, route_path
from tokenmill.entrypoints.console.console import mount_console

KEY = "matrix-key"
CREDENTIALS = {"none": {}, "wrong": {"Authorization": "Bearer not-the-key"},
               "right": {"Authorization": f"Bearer {KEY}"}}
ROOT = "/api"

# route -> what it answers without a valid key (None: the route is served as with one)
OPEN: dict[tuple[str, str], int | None] = {
    ("GET", "/health"): None, ("GET", "/metrics"): None, ("GET", "/openapi.json"): None,
    ("GET", "/docs"): None, ("GET", "/docs/oauth2-redirect"): None, ("GET", "/redoc"): None,
    ("GET", "/"): 401,  # the console's sign-in form (HTML), not the API's refusal
    ("GET", "/ui/login"): None, ("POST", "/ui/login"): None, ("POST", "/ui/logout"): None,
}


def route_table(routes: list[Any], prefix: str = "") -> list[tuple[str, str]]:
    """(method, concrete path) for every route of the app, included routers and mounts too."""
    out: list[tuple[str, str]] = []
    for route in routes:
        original = getattr(route, "original_router", None)
        if original is not None:  # FastAPI's include_router
            out += route_table(original.routes, prefix + route.include_context.prefix)
            continue
        path = prefix + route.path
        concrete = re.sub(r"\{[^}]+\}", "x", path)
        methods = getattr(route, "methods", None)
        if methods is None:  # a mount: a file under it
            out.append(("GET", concrete + "/index.html"))
            continue
        out += [(m, concrete) for m in sorted(methods) if m != "HEAD"]
    return sorted(set(out))


@pytest.fixture(scope="module")
def app() -> Iterator[Any]:
    app = make_tiny_app(api_key=KEY)
    mount_console(app)
    yield app
    app.state.tokenmill.aengine.shutdown()


@contextmanager
def uvicorn_server(app: Any, root_path: str) -> Iterator[str]:
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           root_path=root_path, lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def _send(client: httpx.Client, method: str, path: str, headers: dict[str, str]) -> httpx.Response:
    if method == "GET":
        return client.get(path, headers=headers)
    if path == "/ui/login" or path.endswith("/ui/login"):
        return client.post(path, data={"key": "x"}, headers=headers)
    return client.request(method, path, json={}, headers=headers)  # a body the route refuses, or takes


def _refused(r: httpx.Response) -> bool:
    if r.status_code != 401 or not r.headers.get("content-type", "").startswith("application/json"):
        return False
    body = r.json()
    if body.get("type") == "error":  # Anthropic's shape, on /v1/messages
        return body["error"]["type"] == "authentication_error"
    return body["error"]["code"] == "invalid_api_key"


def _check_matrix(client: httpx.Client, table: list[tuple[str, str]], prefix: str = "",
                  unstripped: str = "") -> list[str]:
    """Every route x credential; returns what went wrong (empty: all as expected)."""
    bad: list[str] = []
    for method, path in table:
        for cred, headers in CREDENTIALS.items():
            r = _send(client, method, prefix + path, headers)
            where = f"{method} {prefix + path} [{cred}] -> {r.status_code}"
            if r.status_code >= 500:
                bad.append(where + " (server error)")
            elif (method, path) in OPEN:
                if _refused(r):
                    bad.append(where + " (an open route refused)")
                expected = OPEN[(method, path)]
                if cred != "right" and expected is not None and r.status_code != expected:
                    bad.append(where + f" (expected {expected})")
            elif cred == "right":
                if r.status_code in (401, 403):
                    bad.append(where + " (the right key refused)")
            elif not _refused(r):
                bad.append(where + " (served without a valid key)")
            if unstripped and (method, path) not in OPEN and cred != "right":
                # the prefix left in by a proxy that does not strip it: still behind the key
                r = _send(client, method, unstripped + path, headers)
                if not _refused(r):
                    bad.append(f"{method} {unstripped + path} [{cred}] -> {r.status_code} (served without a key)")
    return bad


def test_route_table_lists_what_the_open_set_says(app):
    table = route_table(app.routes)
    paths = {p for _, p in table}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/reset_prefix_cache",
            "/v1/responses", "/v1/engine/stats", "/console/index.html"} <= paths
    assert {p for _, p in OPEN} == OPEN_ROUTES - {"/ping"}  # every open route is listed in this test
    assert len(table) >= 20


@pytest.mark.parametrize("root_path", ["", ROOT])
def test_auth_matrix_through_uvicorn(app, root_path):
    table = route_table(app.routes)
    with uvicorn_server(app, root_path) as url, httpx.Client(base_url=url, timeout=30) as client:
        bad = _check_matrix(client, table, unstripped=root_path)
    assert not bad, "\n".join(bad)


def test_auth_matrix_mounted_under_a_parent_app(app):
    from starlette.applications import Starlette
    from starlette.routing import Mount

    parent = Starlette(routes=[Mount(ROOT, app=app)])
    table = route_table(app.routes)
    with uvicorn_server(parent, "") as url, httpx.Client(base_url=url, timeout=30) as client:
        bad = _check_matrix(client, table, prefix=ROOT)
    assert not bad, "\n".join(bad)


def test_route_path_strips_the_root_exactly():
    assert route_path({"path": "/api/v1/models", "root_path": "/api"}) == "/v1/models"
    assert route_path({"path": "/apiv1/models", "root_path": "/api"}) == "/apiv1/models"
    assert route_path({"path": "/v1/models", "root_path": "/api"}) == "/v1/models"
    assert route_path({"path": "/api", "root_path": "/api"}) == ""
    assert route_path({"path": "/health", "root_path": ""}) == "/health"
