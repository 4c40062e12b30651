"""Node pods under Pod Security admission on the real API server.

A namespace labelled ``pod-security.kubernetes.io/enforce=restricted`` admits a
job's pods as the operator renders them by default; the same pods with one
setting the "restricted" profile forbids are refused (403), which shows the
namespace really enforces the profile.
"""

from __future__ import annotations

import pytest

from distflow.spec import parse_spec
from distflow_operator.render import JobRef, build_node_pod
from tests.operator._helpers import (  # noqa: F401  (fixtures)
    api, crd, example_job, operator, operator_kubeconfig_path,
)

pytestmark = pytest.mark.operator

RESTRICTED = {"pod-security.kubernetes.io/enforce": "restricted",
              "pod-security.kubernetes.io/enforce-version": "latest"}


def enforce_restricted(control_plane, namespace: str) -> None:
    control_plane.request("PATCH", f"/api/v1/namespaces/{namespace}", {"metadata": {"labels": RESTRICTED}},
                          content_type="application/merge-patch+json", expect=(200,))


def dry_run_node_pod(control_plane, namespace: str, template: dict) -> tuple[int, dict]:
    """POST (server-side dry run: admission runs, nothing is stored) the rank-0 pod of a job with `template`."""
    spec = parse_spec({**example_job()["spec"], "template": {**example_job()["spec"]["template"], **template}})
    pod = build_node_pod(spec, JobRef("psa", namespace, "00000000-uid"), rank=0, attempt=1)
    return control_plane.request("POST", f"/api/v1/namespaces/{namespace}/pods?dryRun=All", pod)


def test_restricted_namespace_runs_the_job_with_default_pods(control_plane, k8s_namespace, api, operator):
    enforce_restricted(control_plane, k8s_namespace)
    template = {**example_job()["spec"]["template"], "shmSize": "1Gi",
                "labels": {"team": "rl"}, "imagePullSecrets": ["regcred"]}
    status, body = api.create_job(example_job("psa-job", template=template))
    assert status == 201, body
    pods = api.wait_running_gang("psa-job", attempt=1, num_nodes=2)
    for pod in pods:
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        assert pod["spec"]["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert pod["metadata"]["labels"]["team"] == "rl"
        assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    assert api.wait_phase("psa-job", "Running")["nodes"] == "2/2"


@pytest.mark.parametrize(("template", "violation"), [
    ({"securityContext": {"allowPrivilegeEscalation": True}}, "allowPrivilegeEscalation != false"),
    ({"securityContext": {"runAsNonRoot": False}}, "runAsNonRoot != true"),
    ({"securityContext": {"seccompProfile": "Unconfined"}}, "seccompProfile"),
    ({"securityContext": {"addCapabilities": ["IPC_LOCK"]}}, "unrestricted capabilities"),
    ({"hostNetwork": True}, "host namespaces"),
])
def test_restricted_namespace_refuses_what_the_profile_forbids(control_plane, k8s_namespace, template,
                                                               violation):
    enforce_restricted(control_plane, k8s_namespace)
    assert dry_run_node_pod(control_plane, k8s_namespace, {})[0] == 201  # the default passes
    status, body = dry_run_node_pod(control_plane, k8s_namespace, template)
    assert status == 403, body
    assert 'violates PodSecurity "restricted:latest"' in body["message"] and violation in body["message"], body


@pytest.mark.parametrize(("template", "needle"), [
    ({"labels": {"distflow.io/attempt": "7"}}, "spec.template.labels: the operator sets"),
    ({"securityContext": {"runAsUser": 0}}, "runAsUser: 0 contradicts runAsNonRoot: true"),
])
def test_crd_refuses_owned_labels_and_root_under_run_as_non_root(api, crd, template, needle):
    status, body = api.create_job(example_job("bad", template=template))
    assert status == 422 and needle in body["message"], body
