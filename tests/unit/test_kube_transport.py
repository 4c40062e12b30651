"""KubeApi's calls go through the kubernetes client's transport (param_serialize +
call_api, the client generated since kubernetes 37) to a local HTTP stub."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest
from kubernetes import client as k8s

from distflow_operator.kube import KubeApi, KubeApiError, TokenBucket

pytestmark = pytest.mark.unit


class _Stub(BaseHTTPRequestHandler):
    seen: list[dict] = []
    num_pods = 0
    expire_once = False

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
        url = urlsplit(self.path)
        if url.path.startswith("/apis/scheduling.volcano.sh/"):  # a kind not served: plain text, as Go's mux
            raw = b"404 page not found\n"
            self.send_response(404)
            self.send_header("Content-Type", "text/plain; charset=utf-8")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)
            return
        if url.path != "/api/v1/namespaces/ns/pods":
            self._answer(404, {"reason": "NotFound", "message": "configmaps \"x\" not found"})
            return
        query = parse_qs(url.query)
        _Stub.seen.append({"method": "GET", "query": query})
        start = int(query.get("continue", ["0"])[0])
        if start and _Stub.expire_once:
            _Stub.expire_once = False
            self._answer(410, {"reason": "Expired", "message": "continue token expired"})
            return
        end = min(start + int(query["limit"][0]), _Stub.num_pods)
        self._answer(200, {"metadata": {"continue": str(end) if end < _Stub.num_pods else ""},
                           "items": [{"metadata": {"name": f"p{i}"}} for i in range(start, end)]})

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
    _Stub.num_pods, _Stub.expire_once = 0, False
    errors = []
    api = KubeApi(cfg, record_error=errors.append)
    api.errors = errors
    yield api
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


def test_a_plain_text_404_of_a_kind_not_served_raises_with_its_text(api):
    with pytest.raises(KubeApiError) as err:
        api.request("GET", "/apis/scheduling.volcano.sh/v1beta1/namespaces/ns/podgroups/x")
    assert err.value.status == 404 and str(err.value).endswith("404 page not found")


def test_deleting_a_pod_that_is_gone_or_replaced_counts_as_gone(api):
    assert [api.delete_pod("ns", name, "uid-1") for name in ("live", "gone", "reused")] == [False, True, True]
    assert [api.force_delete_pod("ns", name, "uid-1") for name in ("live", "gone")] == [False, True]
    assert _Stub.seen[0]["body"] == {"preconditions": {"uid": "uid-1"}}
    assert _Stub.seen[3]["body"] == {"preconditions": {"uid": "uid-1"}, "gracePeriodSeconds": 0}


def test_pods_are_listed_in_pages_and_an_expired_continue_token_starts_over(api):
    _Stub.num_pods = 7
    names = [p["metadata"]["name"] for p in api.list_pods("ns", "app=x", page_size=3)]
    assert names == [f"p{i}" for i in range(7)]
    assert [(q["query"]["limit"], q["query"].get("continue")) for q in _Stub.seen] == [
        (["3"], None), (["3"], ["3"]), (["3"], ["6"])]
    assert _Stub.seen[0]["query"]["labelSelector"] == ["app=x"]
    _Stub.seen.clear()
    _Stub.expire_once = True
    assert len(api.list_pods("ns", "app=x", page_size=3)) == 7
    assert [q["query"].get("continue") for q in _Stub.seen] == [None, ["3"], None, ["3"], ["6"]]
    assert api.errors == [410]


def test_answers_of_400_and_above_are_reported_by_code(api):
    api.create({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "taken", "namespace": "ns"}})
    api.delete_pod("ns", "gone", "uid-1")
    with pytest.raises(KubeApiError):
        api.request("GET", "/api/v1/namespaces/ns/configmaps/x")
    assert api.errors == [409, 404, 404]


def test_token_bucket_allows_a_burst_then_spaces_calls_at_qps():
    now, slept = [0.0], []

    def sleep(seconds):
        slept.append(seconds)
        now[0] += seconds

    bucket = TokenBucket(qps=10, burst=3, clock=lambda: now[0], sleep=sleep)
    waits = [bucket.take() for _ in range(5)]
    assert waits == [0.0, 0.0, 0.0, pytest.approx(0.1), pytest.approx(0.1)]
    now[0] += 1.0  # idle for a second: the bucket refills to its burst, not beyond
    assert [bucket.take() for _ in range(4)] == [0.0, 0.0, 0.0, pytest.approx(0.1)]
    with pytest.raises(ValueError, match="qps=0"):
        TokenBucket(qps=0, burst=1)
