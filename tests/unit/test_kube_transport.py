"""KubeApi's calls go through the kubernetes client's transport (param_serialize +
call_api, the client generated since kubernetes 37) to a local HTTP stub."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from kubernetes import client as k8s

from distflow_operator.kube import KubeApi, KubeApiError

pytestmark = pytest.mark.unit


class _Stub(BaseHTTPRequestHandler):
    seen: list[dict] = []

    def do_POST(self):  # noqa: N802 (http.server's naming)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Stub.seen.append({"method": "POST", "path": self.path, "auth": self.headers["Authorization"],
                           "type": self.headers["Content-Type"], "body": body})
        self._answer(409 if body["metadata"]["name"] == "taken" else 201, {"kind": "ConfigMap"})

    def do_DELETE(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Stub.seen.append({"method": "DELETE", "path": self.path, "body": body})
        name = self.path.rsplit("/", 1)[1]
        status = {"gone": 404, "reused": 409}.get(name, 200)  # reused: the name holds another uid
        self._answer(status, {"kind": "Status" if status != 200 else "Pod"})

    def do_GET(self):  # noqa: N802
        self._answer(404, {"reason": "NotFound", "message": "configmaps \"x\" not found"})

    def _answer(self, status: int, payload: dict) -> None:
        raw = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *_):
        pass


@pytest.fixture
def api():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    cfg = k8s.Configuration(host=f"http://127.0.0.1:{server.server_port}", api_key={"BearerToken": "t0k"},
                            api_key_prefix={"BearerToken": "Bearer"})
    _Stub.seen.clear()
    yield KubeApi(cfg)
    server.shutdown()
    server.server_close()


def test_create_posts_the_body_with_token_and_field_manager(api):
    obj = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cm", "namespace": "ns"}}
    assert api.create(obj) is True
    assert api.create({**obj, "metadata": {"name": "taken", "namespace": "ns"}}) is False
    first = _Stub.seen[0]
    assert first == {"method": "POST", "path": "/api/v1/namespaces/ns/configmaps?fieldManager=distflow-operator",
                     "auth": "Bearer t0k", "type": "application/json", "body": obj}


def test_an_unexpected_status_raises_with_the_servers_reason(api):
    with pytest.raises(KubeApiError) as err:
        api.request("GET", "/api/v1/namespaces/ns/configmaps/x")
    assert (err.value.status, err.value.reason) == (404, "NotFound")


def test_deleting_a_pod_that_is_gone_or_replaced_counts_as_gone(api):
    assert [api.delete_pod("ns", name, "uid-1") for name in ("live", "gone", "reused")] == [False, True, True]
    assert [api.force_delete_pod("ns", name, "uid-1") for name in ("live", "gone")] == [False, True]
    assert _Stub.seen[0]["body"] == {"preconditions": {"uid": "uid-1"}}
    assert _Stub.seen[3]["body"] == {"preconditions": {"uid": "uid-1"}, "gracePeriodSeconds": 0}
