"""Pool membership from the Kubernetes API, with the official client pointed at a local stub:
the InferencePool's selector and port, ready pods only, changes followed by the watch, and the
endpoint picker routing to exactly those pods."""
from __future__ import annotations


import grpc
import pytest

pytest.importorskip("kubernetes")

from conftest import wait_until  # noqa: E402
from fake_backend import start_fakes  # noqa: E402
from fake_kube_api import FakeKubeAPI, pod  # noqa: E402
from test_router_ext_proc import Stream, _body_msgs, _completion, _headers_msg, _mutation_value  # noqa: E402
from tokenmill.router.config import RouterConfig  # noqa: E402
from tokenmill.router.k8s.k8s_pool import PoolMembership, pool_selector  # noqa: E402
from tokenmill.router.server import RouterServer  # noqa: E402


def inference_pool(port: int, name: str = "pool") -> dict:
    return {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
            "metadata": {"name": name, "namespace": "ns"},
            "spec": {"selector": {"matchLabels": {"app": "srv"}}, "targetPorts": [{"number": port}],
                     "endpointPickerRef": {"name": "epp", "port": {"number": 9002}}}}



@pytest.fixture
def kube(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)  # not in a cluster: use KUBECONFIG
    with FakeKubeAPI(inference_pool(8000)) as api:
        monkeypatch.setenv("KUBECONFIG", api.kubeconfig(str(tmp_path / "kubeconfig")))
        yield api


def test_pool_selector_reads_v1_and_v1alpha2_shapes():
    assert pool_selector(inference_pool(8000)) == ({"app": "srv"}, 8000)
    alpha = {"spec": {"selector": {"app": "srv"}, "targetPortNumber": 9000}}
    assert pool_selector(alpha) == ({"app": "srv"}, 9000)
    with pytest.raises(ValueError, match="selector"):
        pool_selector({"spec": {"targetPorts": [{"number": 1}]}})


def test_membership_follows_ready_pods_through_the_watch(kube):
    kube.put_pod(pod("a", "10.0.0.1"))
    kube.put_pod(pod("b", "10.0.0.2", ready=False))
    kube.put_pod(pod("c", None))  # scheduled, no IP yet
    kube.put_pod(pod("other", "10.0.0.9", labels={"app": "another"}))  # not selected by the pool
    changes: list[int] = []
    members = PoolMembership("pool", "ns", on_change=lambda: changes.append(1))
    members.start()
    try:
        assert (members.labels, members.port) == ({"app": "srv"}, 8000)
        assert members.endpoints() == {"http://10.0.0.1:8000"}
        kube.put_pod(pod("b", "10.0.0.2"))  # became ready
        assert wait_until(lambda: members.endpoints() == {"http://10.0.0.1:8000", "http://10.0.0.2:8000"})
        kube.put_pod(pod("a", "10.0.0.1", deleting=True))  # terminating: out at once
        assert wait_until(lambda: members.endpoints() == {"http://10.0.0.2:8000"})
        kube.delete_pod("b")
        assert wait_until(lambda: members.endpoints() == set())
        assert changes  # the router's health loop is woken on each change
        assert any("watch=" in r for r in kube.requests)  # watched, not only listed
    finally:
        members.stop()


def test_missing_pool_is_a_clear_error(kube):
    with pytest.raises(RuntimeError, match="InferencePool ns/nope not found"):
        PoolMembership("nope", "ns").start()


def test_endpoint_picker_routes_to_the_pools_pods(kube):
    (fake,) = start_fakes(1)
    try:
        port = int(fake.url.rsplit(":", 1)[1])
        kube.pool = inference_pool(port)
        kube.put_pod(pod("srv-0", "127.0.0.1"))
        cfg = RouterConfig(pool_name="pool", pool_namespace="ns", port=0, endpoint_picker=True, grpc_port=0,
                           health_interval=0.3)
        picker = RouterServer(cfg).start_in_thread()
        try:
            assert wait_until(lambda: picker.router.ready())
            with grpc.insecure_channel(f"127.0.0.1:{picker.grpc_port}") as ch:
                s = Stream(ch)
                s.send(_headers_msg())
                s.recv()
                for m in _body_msgs(_completion("hello")):
                    s.send(m)
                assert _mutation_value(s.recv().request_body.response) == f"127.0.0.1:{port}"
                s.close()
                kube.delete_pod("srv-0")  # scaled down: gone from the pool, so no endpoint
                assert wait_until(lambda: not picker.router.pool.backends)
                s = Stream(ch)
                s.send(_headers_msg())
                s.recv()
                for m in _body_msgs(_completion("hello")):
                    s.send(m)
                assert s.recv().immediate_response.status.code == 503
                s.close()
        finally:
            picker.stop()
    finally:
        fake.kill()
