"""`kubectl scale rljob`: the CRD's scale subresource on the real API server (spec replicas =
``cluster.numNodes``, status replicas and selector from the operator). Sizes out of
``cluster.minNodes``/``cluster.maxNodes`` or not dividing the batch are refused with the
field's reason and the running job keeps its size."""

from __future__ import annotations

import pytest

from tests.operator._helpers import (  # noqa: F401  (fixtures)
    api, crd, example_job, operator, operator_kubeconfig_path,
)

pytestmark = pytest.mark.operator


def test_scale_subresource_reports_the_gang_and_refuses_sizes_out_of_bounds(control_plane, k8s_namespace, api,
                                                                            operator):
    name = "grpo-scale"
    code, body = api.create_job(example_job(name, cluster={"numNodes": 2, "minNodes": 2, "maxNodes": 4}))
    assert code == 201, body
    api.wait_running_gang(name, attempt=1, num_nodes=2)
    status = api.wait_phase(name, "Running", replicas=2)
    assert status["selector"] == f"app.kubernetes.io/managed-by=distflow-operator,distflow.io/job-name={name}"

    scale = f"{api.jobs}/{name}/scale"
    code, body = control_plane.request("GET", scale)
    assert code == 200, body
    assert (body["kind"], body["spec"]["replicas"], body["status"]["replicas"], body["status"]["selector"]) == \
        ("Scale", 2, 2, status["selector"])

    # trainBatchSize 4 over 3 rollout dp ranks; below minNodes; above maxNodes.
    for replicas, reason in [(3, "data.trainBatchSize"), (1, "cluster.minNodes"), (5, "cluster.maxNodes")]:
        out = control_plane.kubectl("scale", "-n", k8s_namespace, "rljob", name, f"--replicas={replicas}")
        assert out.returncode != 0 and reason in out.stderr, (replicas, out.stderr)
        assert api.job(name)["spec"]["cluster"]["numNodes"] == 2
    assert api.status(name)["phase"] == "Running" and len(api.live_pods(name, attempt=1)) == 2

    # A size within the bounds is the one change spec.cluster accepts; its other fields stay fixed.
    code, body = api.patch_job(name, {"spec": {"cluster": {"procsPerNode": 2}}})
    assert code == 422 and "only cluster.numNodes may" in body["message"], body
    code, body = control_plane.request("PATCH", scale, {"spec": {"replicas": 4}},
                                       content_type="application/merge-patch+json")
    assert code == 200 and body["spec"]["replicas"] == 4, body
    assert api.job(name)["spec"]["cluster"]["numNodes"] == 4
