"""The operator's writes to the Kubernetes API: the only module here that makes them.

Calls are plain JSON over the ``kubernetes`` client's transport (its
authentication, TLS and token refresh), without its typed models: bodies are
the dicts ``render.py`` builds, responses stay dicts, and nothing is
deserialised that the operator does not read. The client is synchronous; the
reconciler runs these calls on a small thread pool.

Credentials: ``$KUBECONFIG`` when set, else the in-cluster ServiceAccount when
present, else ``~/.kube/config``. kopf's own watches log in the same way
(see :func:`kopf_login`), so both halves of the operator act as one identity.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from kubernetes import client as k8s
from kubernetes import config as k8s_config

from distflow_operator import API_GROUP, API_VERSION, KIND, MANAGER, PLURAL
from distflow_operator.observed import format_time
from distflow_operator.render import JobRef

SERVICE_ACCOUNT_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
_PLURALS = {"Pod": "pods", "ConfigMap": "configmaps", "Service": "services", "PodGroup": "podgroups",
            "Event": "events"}
REQUEST_TIMEOUT_S = 30.0
LIST_PAGE_SIZE = 500
"""Objects per LIST page: an answer's size stays bounded however many pods a namespace holds."""


class KubeApiError(RuntimeError):
    """An API call answered with an unexpected status."""

    def __init__(self, method: str, path: str, status: int, body: dict[str, Any]):
        self.status = status
        self.reason = body.get("reason", "")
        super().__init__(f"{method} {path} -> {status} {self.reason}: {body.get('message', body)}")


class StatusConflict(RuntimeError):
    """The job changed since the resourceVersion a status patch was computed from (409)."""


class ChildConflict(RuntimeError):
    """A child's name is taken by an object this job does not control."""


def use_kubeconfig() -> bool:
    """True: authenticate from a kubeconfig; False: from the in-cluster ServiceAccount."""
    in_cluster = bool(os.environ.get("KUBERNETES_SERVICE_HOST")) and SERVICE_ACCOUNT_TOKEN.exists()
    return bool(os.environ.get("KUBECONFIG")) or not in_cluster


def client_configuration() -> k8s.Configuration:
    """Client settings from the credentials :func:`use_kubeconfig` picks.

    The kubeconfig path is read from the environment now, not when the
    ``kubernetes`` package was imported (its default is frozen at import).
    """
    cfg = k8s.Configuration()
    if use_kubeconfig():
        k8s_config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None, client_configuration=cfg)
    else:
        k8s_config.load_incluster_config(client_configuration=cfg)
    return cfg


def kopf_login(**_: Any):
    """kopf login handler: kopf's watches use the same credentials as :class:`KubeApi`
    (kubeconfig exec plugins and client certificates included)."""
    import kopf

    cfg = client_configuration()
    header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix("authorization")
    scheme, _, token = header.rpartition(" ") if header else ("", "", "")
    return kopf.ConnectionInfo(
        server=cfg.host, ca_path=cfg.ssl_ca_cert, insecure=not cfg.verify_ssl,
        scheme=scheme or None, token=token or None,
        certificate_path=cfg.cert_file, private_key_path=cfg.key_file)


def collection_path(api_version: str, kind: str, namespace: str) -> str:
    prefix = "/api/v1" if api_version == "v1" else f"/apis/{api_version}"
    return f"{prefix}/namespaces/{namespace}/{_PLURALS[kind]}"


def job_path(namespace: str, name: str) -> str:
    return f"/apis/{API_GROUP}/{API_VERSION}/namespaces/{namespace}/{PLURAL}/{name}"


POD_GROUP_FIELDS = ("minMember", "minResources", "queue", "priorityClassName")
"""PodGroup spec fields the operator renders (render.build_pod_groups); others belong to the scheduler."""


def pod_group_patch(current: dict[str, Any], wanted: dict[str, Any]) -> dict[str, Any]:
    """Merge patch bringing the operator's fields of a PodGroup spec to ``wanted`` ({} if in line)."""
    patch: dict[str, Any] = {k: None for k in POD_GROUP_FIELDS if k in current and k not in wanted}
    patch.update({k: v for k, v in wanted.items() if current.get(k) != v})
    return patch


def _decode(raw: bytes) -> dict[str, Any]:
    """A JSON answer, or the plain text some answer with (a path the API server does not serve:
    "404 page not found") as its message."""
    try:
        return json.loads(raw) if raw else {}
    except ValueError:
        return {"message": raw.decode(errors="replace").strip()[:1024]}


def _controller_uid(obj: dict[str, Any]) -> str | None:
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return next((r.get("uid") for r in refs if r.get("controller")), None)


class TokenBucket:
    """Client-side rate limit as client-go's ``flowcontrol`` token bucket: ``qps`` calls per second
    sustained, ``burst`` at once. Thread-safe; :meth:`take` blocks until a token is free."""

    def __init__(self, qps: float, burst: int, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        if qps <= 0 or burst < 1:
            raise ValueError(f"api qps={qps}, burst={burst}: need qps > 0 and burst >= 1")
        self._qps, self._burst, self._clock, self._sleep = qps, burst, clock, sleep
        self._tokens, self._at = float(burst), clock()
        self._lock = threading.Lock()

    def take(self) -> float:
        """Take one token; returns the seconds waited for it."""
        with self._lock:
            now = self._clock()
            self._tokens = min(self._burst, self._tokens + (now - self._at) * self._qps)
            self._at = now
            self._tokens -= 1  # reserved now, so concurrent callers queue behind it
            wait = max(0.0, -self._tokens / self._qps)
        if wait:
            self._sleep(wait)
        return wait


class KubeApi:
    """Synchronous JSON calls against one API server.

    Args:
        rate_limit: shared by every call (None: unlimited).
        record_error: called with the status of every answer >= 400, or None when no answer came.
    """

    def __init__(self, configuration: k8s.Configuration, pool_size: int = 16, *,
                 rate_limit: TokenBucket | None = None,
                 record_error: Callable[[int | None], None] = lambda code: None):
        configuration.connection_pool_maxsize = pool_size
        self._client = k8s.ApiClient(configuration)
        self._rate_limit, self._record_error = rate_limit, record_error

    def close(self) -> None:
        self._client.close()

    def request(self, method: str, path: str, body: Any = None, *, query: list[tuple[str, str]] | None = None,
                content_type: str = "application/json",
                ok: tuple[int, ...] = (200, 201, 202)) -> tuple[int, dict[str, Any]]:
        """One call; returns (status, decoded body).

        Raises:
            KubeApiError: the status is not in ``ok``.
        """
        method_, url, headers, payload, _ = self._client.param_serialize(
            method, path, query_params=query or [], body=body, auth_settings=["BearerToken"],
            header_params={"Content-Type": content_type, "Accept": "application/json"})
        if self._rate_limit is not None:
            self._rate_limit.take()
        try:
            response = self._client.call_api(method_, url, header_params=headers, body=payload,
                                             _request_timeout=REQUEST_TIMEOUT_S)
        except Exception:
            self._record_error(None)
            raise
        if response.status >= 400:
            self._record_error(response.status)
        decoded = _decode(response.read())
        if response.status not in ok:
            raise KubeApiError(method, path, response.status, decoded)
        return response.status, decoded

    def create(self, obj: dict[str, Any]) -> bool:
        """Create ``obj``; True if created, False if the name already exists (409)."""
        meta = obj["metadata"]
        status, _ = self.request("POST", collection_path(obj["apiVersion"], obj["kind"], meta["namespace"]),
                                 obj, query=[("fieldManager", MANAGER)], ok=(201, 409))
        return status == 201

    def ensure(self, obj: dict[str, Any], owner: JobRef) -> None:
        """Create ``obj`` or, if it exists and belongs to ``owner``, bring a ConfigMap's data up to date.

        Raises:
            ChildConflict: an object of that name exists that ``owner`` does not control.
        """
        if self.create(obj):
            return
        meta = obj["metadata"]
        path = f"{collection_path(obj['apiVersion'], obj['kind'], meta['namespace'])}/{meta['name']}"
        _, current = self.request("GET", path)
        if _controller_uid(current) != owner.uid:
            raise ChildConflict(f"{obj['kind']} {meta['name']} exists and is not controlled by "
                                f"{KIND} {owner.name}; delete or rename it")
        if obj["kind"] == "ConfigMap" and (current.get("data") or {}) != obj["data"]:
            # Exactly the rendered keys: a resize request of the attempt before goes (set_config_map_key).
            stale = {key: None for key in current.get("data") or {} if key not in obj["data"]}
            self.request("PATCH", path, {"data": {**stale, **obj["data"]}},
                         content_type="application/merge-patch+json", query=[("fieldManager", MANAGER)])
        if obj["kind"] == "PodGroup" and (patch := pod_group_patch(current.get("spec") or {}, obj["spec"])):
            # spec.scheduling may change while the job is suspended; the gang must follow.
            self.request("PATCH", path, {"spec": patch}, content_type="application/merge-patch+json",
                         query=[("fieldManager", MANAGER)])

    def set_config_map_key(self, namespace: str, name: str, key: str, value: str | None) -> None:
        """Set (or, with None, remove) one key of ConfigMap ``name``, leaving the others as they are.

        Raises:
            KubeApiError: the ConfigMap is missing (404) or the API server refuses the patch.
        """
        self.request("PATCH", f"{collection_path('v1', 'ConfigMap', namespace)}/{name}", {"data": {key: value}},
                     content_type="application/merge-patch+json", query=[("fieldManager", MANAGER)])

    def delete_pod(self, namespace: str, name: str, uid: str) -> bool:
        """Delete one pod, only if it is still the object ``uid``; True if it is gone already (404/409:
        no pod of that name, or another object than ``uid`` holds it)."""
        status, _ = self.request("DELETE", f"{collection_path('v1', 'Pod', namespace)}/{name}",
                                 {"preconditions": {"uid": uid}}, ok=(200, 202, 404, 409))
        return status in (404, 409)

    def force_delete_pod(self, namespace: str, name: str, uid: str) -> bool:
        """Delete with grace period 0: for a pod whose node will never confirm (as `kubectl delete
        --force`); True if it is gone already."""
        status, _ = self.request("DELETE", f"{collection_path('v1', 'Pod', namespace)}/{name}",
                                 {"preconditions": {"uid": uid}, "gracePeriodSeconds": 0},
                                 ok=(200, 202, 404, 409))
        return status in (404, 409)

    def list_pods(self, namespace: str, selector: str, page_size: int = LIST_PAGE_SIZE) -> list[dict[str, Any]]:
        """Every pod in ``namespace`` matching the label ``selector``."""
        return self.list_objects(collection_path("v1", "Pod", namespace), selector, page_size)[0]

    def list_jobs(self, namespace: str, page_size: int = LIST_PAGE_SIZE) -> tuple[list[dict[str, Any]], str]:
        """Every RLPostTrainJob in ``namespace``, and the resourceVersion the LIST answered at."""
        return self.list_objects(job_path(namespace, "").rstrip("/"), "", page_size)

    def list_objects(self, path: str, selector: str = "",
                     page_size: int = LIST_PAGE_SIZE) -> tuple[list[dict[str, Any]], str]:
        """A collection read in pages of ``page_size`` (limit/continue), and the resourceVersion of
        the last page. A continue token that expired mid-list (410) starts the LIST over."""
        items: list[dict[str, Any]] = []
        token = ""
        while True:
            query = [("limit", str(page_size))] + [(k, v) for k, v in (("labelSelector", selector),
                                                                       ("continue", token)) if v]
            status, body = self.request("GET", path, query=query, ok=(200, 410) if token else (200,))
            if status == 410:
                items, token = [], ""
                continue
            items += body.get("items") or []
            meta = body.get("metadata") or {}
            token = meta.get("continue") or ""
            if not token:
                return items, meta.get("resourceVersion", "")

    def delete_job(self, namespace: str, name: str, uid: str) -> None:
        """Delete the job; the garbage collector removes its children."""
        self.request("DELETE", job_path(namespace, name),
                     {"preconditions": {"uid": uid}, "propagationPolicy": "Background"},
                     ok=(200, 202, 404, 409))

    def patch_job_status(self, namespace: str, name: str, patch: dict[str, Any],
                         resource_version: str | None = None) -> str | None:
        """Merge-patch the status subresource, only if the job is still at ``resource_version``
        (when given); returns the job's new resourceVersion, None if the job is gone.

        Raises:
            StatusConflict: the job was changed by someone else since ``resource_version``.
        """
        body: dict[str, Any] = {"status": patch}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        status, answer = self.request("PATCH", f"{job_path(namespace, name)}/status", body,
                                      content_type="application/merge-patch+json",
                                      query=[("fieldManager", MANAGER)], ok=(200, 404, 409))
        if status == 409:
            raise StatusConflict(f"{KIND} {namespace}/{name} changed since resourceVersion {resource_version}")
        return (answer.get("metadata") or {}).get("resourceVersion", "") if status == 200 else None

    def post_event(self, job: JobRef, event_type: str, reason: str, message: str) -> None:
        """Record a core/v1 Event on the job (what `kubectl describe rljob` shows)."""
        now = format_time(datetime.now(timezone.utc))
        event = {
            "apiVersion": "v1", "kind": "Event",
            "metadata": {"generateName": f"{job.name}.", "namespace": job.namespace},
            "involvedObject": {"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": KIND, "name": job.name,
                               "namespace": job.namespace, "uid": job.uid},
            "type": event_type, "reason": reason, "message": message[:1024],
            "source": {"component": MANAGER}, "reportingComponent": MANAGER,
            "reportingInstance": socket.gethostname()[:128],
            "firstTimestamp": now, "lastTimestamp": now, "count": 1,
        }
        self.request("POST", collection_path("v1", "Event", job.namespace), event)
