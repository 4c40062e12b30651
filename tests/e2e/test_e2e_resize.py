"""e2e: `kubectl scale rljob` 2 -> 3 -> 2 on a job whose pods run the real runtime (``LocalKubelet``).

At each resize the operator writes the in-place request into the job's ConfigMap (and,
to grow, creates the new rank's pod, which joins), the kubelet syncs it into the pods'
volume, and at a step boundary the workers save a checkpoint and re-form the world at the
new size in the same processes (``distflow.gang_resize``); to shrink, the last rank exits 4
and its pod is deleted. Asserted: one attempt throughout (no pod of nodes 0 and 1 is
replaced), every step trained once, the same sample ids as a local run that changed size
at the same steps by hand (so none lost, none repeated), and that run's final parameters
and optimizer state bit for bit.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from distflow import sample_ids
from tests.dist._jobs import bit_identical, final_checkpoint, resized_by_hand
from tests.e2e.harness import (
    JOB_TIMEOUT_S, REFORMED, apply_job, job_doc, trained_past, trained_steps, wait_finished,
)
from tests.e2e.kubelet import LocalKubelet
from tests.e2e.test_e2e_job import cluster, namespace  # noqa: F401  (fixtures)
from tests.operator._helpers import Api, dump, operator_kubeconfig, operator_running, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1500)]

TOTAL_STEPS = 10


def _manifest(name: str, tmp_path: Path) -> dict:
    """The e2e job with a batch that 2 and 3 nodes both divide, resizable up to 3 nodes."""
    doc = job_doc(name, tmp_path, TOTAL_STEPS)
    doc["spec"]["data"]["trainBatchSize"] = 6
    doc["spec"]["cluster"]["maxNodes"] = 3
    doc["spec"]["checkpoint"]["saveEverySteps"] = 0  # only the resizes (and the last step) save
    return doc


def _scale(cluster, namespace: str, name: str, replicas: int) -> None:
    out = cluster.kubectl("scale", "-n", namespace, "rljob", name, f"--replicas={replicas}")
    assert out.returncode == 0, out.stderr


def test_scale_2_3_2_mid_run_loses_and_repeats_nothing_and_ends_as_a_run_resized_by_hand(cluster, namespace,
                                                                                          tmp_path, report_figure):
    name = "e2e-resize"
    api = Api(cluster, namespace)
    doc = _manifest(name, tmp_path)
    logs = tmp_path / "logs"
    kubeconfig = operator_kubeconfig(cluster, namespace, tmp_path)
    with (operator_running(kubeconfig, namespace, PROGRESS_INTERVAL="0.3"),
          LocalKubelet(cluster, namespace, tmp_path / "kubelet") as kubelet):
        apply_job(cluster, namespace, doc)
        # Scaled once the gang runs, before its first step: the new pod starts while the others load,
        # so it is ready to join within the run's few steps of about a second each.
        api.wait_running_gang(name, 1, 2, timeout_s=JOB_TIMEOUT_S)
        asked = time.monotonic()
        _scale(cluster, namespace, name, 3)
        up = wait_for(lambda: (api.status(name).get("lastResize") or {}).get("to") == 3 and api.status(name),
                      JOB_TIMEOUT_S, what=lambda: f"resized to 3 ({dump(api.status(name))}\n{kubelet.log_tails()})")
        # The joiner's pod runs (the operator's resize is done) before the gang takes it at a boundary.
        first = wait_for(lambda: [int(m[1]) for m in REFORMED.finditer(kubelet.log_tails(5000))], JOB_TIMEOUT_S,
                         what=lambda: f"the gang re-formed at 3 nodes ({kubelet.log_tails()})")
        assert len(first) == 1, kubelet.log_tails()
        wait_for(trained_past(logs, first[0]), JOB_TIMEOUT_S, what="a step at 3 nodes")
        up_s, asked = time.monotonic() - asked, time.monotonic()
        _scale(cluster, namespace, name, 2)
        wait_for(lambda: (api.status(name).get("lastResize") or {}).get("to") == 2, JOB_TIMEOUT_S, what="resized to 2")
        second = max(int(m[1]) for m in REFORMED.finditer(kubelet.log_tails(5000)))
        wait_for(trained_past(logs, second), JOB_TIMEOUT_S, what="a step at 2 nodes")
        down_s = time.monotonic() - asked
        status = wait_finished(api, name, kubelet, timeout_s=2 * JOB_TIMEOUT_S)
        node_logs = kubelet.log_tails(5000)
    report_figure(f"resize on the e2e kubelet (tiny model, CPU): 2 -> 3 nodes {up_s:.1f} s from kubectl scale to "
                  f"the next step done ({up['lastResize']['costSeconds']:g} s request -> all pods running), 3 -> 2 "
                  f"{down_s:.1f} s ({status['lastResize']['costSeconds']:g} s)")

    stops = sorted({(int(m[1]), int(m[2])) for m in REFORMED.finditer(node_logs)})  # logs are not in time order
    assert [nodes for _, nodes in stops] == [3, 2] and 1 <= stops[0][0] < stops[1][0] < TOTAL_STEPS, node_logs
    assert (status["attempt"], status["restarts"], status["disruptions"]) == (1, 0, 0), dump(status)
    assert (status["lastResize"]["from"], status["lastResize"]["to"]) == (3, 2) and \
        status["lastResize"]["costSeconds"] >= 0 and status["lastResize"]["inPlace"], dump(status)
    exits = sorted((e.attempt, e.pod, e.exit_code) for e in kubelet.exits)
    # Nodes 0 and 1 ran from start to end; node 2 joined and left (exit 4, EXIT_LEFT_POOL).
    assert exits == [("1", f"{name}-node-0", 0), ("1", f"{name}-node-1", 0), ("1", f"{name}-node-2", 4)], exits
    events = api.events(name)
    resized = [e["message"] for e in events if e["reason"] == "Resized"]
    assert len(resized) == 2 and not [e for e in events if e["reason"] == "NodeFailed"], dump(events)

    # Every step trained once (each resize's checkpoint is of the step it stopped after) ...
    assert trained_steps(logs) == list(range(1, TOTAL_STEPS + 1)), trained_steps(logs)
    ids = sample_ids.read(logs)
    # ... on prompts never trained before (10 steps x 6 prompts fit in one epoch of 64) ...
    prompts = [set(step_ids) for _, step_ids in sorted(ids.items())]
    assert sum(map(len, prompts)) == len(set().union(*prompts)) == TOTAL_STEPS * 6
    # ... and exactly as a local run that changed size after the same steps by hand.
    reference = resized_by_hand(doc["spec"], tmp_path / "by-hand", stops)
    assert sample_ids.read(reference) == ids
    resized, by_hand = (final_checkpoint(path / "checkpoints") for path in (tmp_path, tmp_path / "by-hand"))
    assert bit_identical(resized, by_hand), \
        "the resized job's final parameters/optimizer state differ from the run resized by hand"
