"""e2e: the rollout pool of an asynchronous job grows 1 -> 2 nodes and shrinks back, in place, on pods
that run the real runtime (``LocalKubelet``), driven by spec patches as a user would.

The operator writes the request and the spec at the new size into the job's ConfigMap, creates the
joining pod (grow) and deletes the pod that left with exit code 4 (shrink). Asserted: the trainer
pod's container ran once, from start to the end of training (one exit, code 0, same pod), no
attempt or restart was counted, and every step was trained once.
"""

from __future__ import annotations

import pytest

from tests.e2e.harness import JOB_TIMEOUT_S, apply_job, job_doc, trained_past, trained_steps, wait_finished
from tests.e2e.kubelet import LocalKubelet
from tests.e2e.test_e2e_job import cluster, namespace  # noqa: F401  (fixtures)
from tests.operator._helpers import Api, dump, operator_kubeconfig, operator_running, wait_for
from tests.operator.test_operator_pool_resize import _patch

# long (~2 min on 2 cores): the default run covers the in-place resize with `distflow node` processes
# (tests/dist/test_rollout_pool_resize.py) and the operator's side of it (tests/operator/test_operator_pool_resize.py).
pytestmark = [pytest.mark.e2e, pytest.mark.long, pytest.mark.timeout(1500)]

TOTAL_STEPS = 400
"""Enough steps (about 0.2 s each here) that the joiner (torch imports, model load on a shared host) joins
and leaves again before the end."""
GROWN = "the rollout pool is 2 nodes"
SHRUNK = "the rollout pool is 1 nodes"


def test_rollout_pool_grows_and_shrinks_in_place_while_the_trainer_pod_keeps_training(cluster, namespace,
                                                                                     tmp_path):
    name = "e2e-pool"
    api = Api(cluster, namespace)
    doc = job_doc(name, tmp_path, TOTAL_STEPS)
    doc["spec"]["async"] = {"enable": True, "maxStaleness": 1, "rolloutPool": {"numNodes": 1}}
    doc["spec"]["checkpoint"]["saveEverySteps"] = 0
    doc["spec"]["data"]["maxResponseLength"] = 16
    logs = tmp_path / "logs"
    kubeconfig = operator_kubeconfig(cluster, namespace, tmp_path)
    with (operator_running(kubeconfig, namespace, PROGRESS_INTERVAL="0.3"),
          LocalKubelet(cluster, namespace, tmp_path / "kubelet") as kubelet):
        apply_job(cluster, namespace, doc)
        wait_for(trained_past(logs, 0), JOB_TIMEOUT_S, what=lambda: f"step 1 at 1 + 1 ({kubelet.log_tails()})")
        trainer_uid = api.get("pods", f"{name}-node-0")["metadata"]["uid"]
        _patch(cluster, namespace, name, 3, 2)
        wait_for(lambda: GROWN in kubelet.log_tails(5000), JOB_TIMEOUT_S,
                 what=lambda: f"grown to 1 + 2 ({dump(api.status(name))}\n{kubelet.log_tails()})")
        grown = api.status(name)
        _patch(cluster, namespace, name, 2, 1)
        wait_for(lambda: (api.status(name).get("lastResize") or {}).get("to") == 2, JOB_TIMEOUT_S,
                 what=lambda: f"shrunk to 1 + 1 ({dump(api.status(name))}\n{kubelet.log_tails()})")
        status = wait_finished(api, name, kubelet, timeout_s=2 * JOB_TIMEOUT_S)
        node_logs = kubelet.log_tails(5000)

    assert grown["lastResize"]["inPlace"] is True and grown["lastResize"]["to"] == 3, dump(grown)
    assert SHRUNK in node_logs, node_logs
    assert (status["attempt"], status["restarts"], status["disruptions"]) == (1, 0, 0), dump(status)
    assert status["lastResize"]["inPlace"] is True and status["lastResize"]["from"] == 3, dump(status)
    exits = sorted((e.attempt, e.pod, e.exit_code) for e in kubelet.exits)
    assert exits == [("1", f"{name}-node-0", 0), ("1", f"{name}-node-1", 0), ("1", f"{name}-node-2", 4)], exits
    trainer = [e for e in kubelet.exits if e.pod == f"{name}-node-0"]
    assert [e.uid for e in trainer] == [trainer_uid]
    assert not [e for e in api.events(name) if e["reason"] == "NodeFailed"]
    assert trained_steps(logs) == list(range(1, TOTAL_STEPS + 1)), trained_steps(logs)
