"""In-place resize of the rollout pool (``distflow.pools.elastic``), with pods played by processes.

Each "pod" is ``distflow node`` started from the environment the operator gives
it (``PET_*``, ``MASTER_*``, ``DISTFLOW_JOIN``) and the rendered spec in a
directory that also holds the resize request (the ConfigMap's key ``resize``);
the test plays the operator: it writes the spec and the request, starts the
joining pod, and reads the pods' exit codes.

Compared with a run at 1 trainer + 1 rollout node throughout (``reference``):

- shrink: 1 + 2 asked for 1 + 1 from the start: after step 1 the last rollout
  pod exits with ``EXIT_LEFT_POOL``, the others re-form the world in place;
- grow then shrink: 1 + 1 asked for 1 + 2, a joining pod started; once it is
  ready the world grows at a step boundary, then it is asked back to 1 + 1 and
  the joiner leaves;
- a grow whose joiner never comes: training goes on at 1 + 1 to the end.

In each, the trainer pod's worker runs from start to end as one process (the
same PID before and after the resize, a clean exit, nothing ever resumed from
a checkpoint), every step is trained once,
on the prompts the reference trains on (none lost or repeated), and the final
parameters and Adam state equal the reference's bit for bit.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from distflow import sample_ids
from distflow.metrics import read_jsonl
from distflow.resize import EXIT_LEFT_POOL
from distflow.spec.loading import render_spec_document
from tests.dist._jobs import final_checkpoint, run_job, tiny_job_spec
from tests.dist._spawn import free_port

pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
STEPS = 8
# Prompts and responses do not depend on the rollout pool's size: the stream is global, sampling is
# seeded per sample, and each prompt's group is generated in a call of its own (``_pooled``), so of the
# same shape whatever the pool; the trainer gets the samples in the same order. The behaviour log-probs
# come from those same calls, so the runs are bit-identical (measured 0 in all three, where 4 prompts
# per call gave up to 1.5e-6 on one machine and 0.0125 on another). Any lost or repeated prompt shows.
TOLERANCE = 0.0


def _pooled(name: str, tmp_path, rollout_nodes: int):
    # One prompt's group per generate call (rollout.microBatchSize = n): every rollout pool size then
    # generates each response in a call of the same shape and padding, so the sampled tokens cannot
    # depend on the pool's size through float rounding of batched matmuls (a sample near a CDF step
    # flips: 0.0125 apart after 8 steps on an AVX-512 machine with 4 prompts per call).
    return tiny_job_spec(tmp_path, name, trainer={"totalSteps": STEPS}, rollout={"n": 2, "temperature": 1.0,
                                                                                "microBatchSize": 2},
                         cluster={"numNodes": 1 + rollout_nodes, "procsPerNode": 1, "device": "cpu"},
                         **{"async": {"enable": True, "maxStaleness": 1, "rolloutPool": {"numNodes": rollout_nodes}}})


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """(final checkpoint, record ids per step) of a run at 1 trainer + 1 rollout node throughout."""
    root = tmp_path_factory.mktemp("reference")
    spec = _pooled("reference", root, 1)
    state, _ = run_job(spec, "reference")
    return state, sample_ids.read(root / "reference")


def _write_spec(spec, spec_dir: Path) -> None:
    spec_dir.mkdir(parents=True, exist_ok=True)
    (spec_dir / "spec.yaml").write_text(json.dumps(render_spec_document(spec)))


def _start_pods(spec_dir: Path, num_nodes: int, port: int, nodes=None, join: bool = False) -> list[subprocess.Popen]:
    """``distflow node`` for each of ``nodes`` (default: all ``num_nodes``), reading ``spec_dir``."""
    env = {**os.environ, "PET_NNODES": str(num_nodes), "PET_NPROC_PER_NODE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port),
           "PYTHONPATH": os.pathsep.join([str(REPO / "worker_image"), str(REPO / "operator"), str(REPO)])}
    if join:
        env["DISTFLOW_JOIN"] = "1"
    pods = []
    for node in range(num_nodes) if nodes is None else nodes:
        log = open(spec_dir / f"node{node}.log", "w")
        pods.append(subprocess.Popen([sys.executable, "-m", "distflow.cli", "node", "--config",
                                      str(spec_dir / "spec.yaml")], cwd=REPO, stdout=log,
                                     stderr=subprocess.STDOUT, env={**env, "PET_NODE_RANK": str(node)}))
    return pods


def _request(spec_dir: Path, num_nodes: int, rollout_nodes: int) -> None:
    (spec_dir / "resize.tmp").write_text(json.dumps({"numNodes": num_nodes, "rolloutNodes": rollout_nodes}))
    (spec_dir / "resize.tmp").rename(spec_dir / "resize")  # whole, as a ConfigMap volume updates


def _wait_for_line(path: Path, text: str, pods, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and all(p.poll() is None for p in pods):
        if text in path.read_text():
            return True
        time.sleep(0.1)
    return False


def _workers(pod: subprocess.Popen) -> set[int]:
    """PIDs of the pod's worker processes (its launcher's children; Linux's /proc)."""
    return {int(pid) for task in Path(f"/proc/{pod.pid}/task").iterdir()
            for pid in (task / "children").read_text().split()}


def _logs(spec_dir: Path, num_nodes: int) -> list[str]:
    return [(spec_dir / f"node{n}.log").read_text() for n in range(num_nodes)]


def _check_against_reference(spec, reference, logs) -> None:
    records = read_jsonl(Path(spec.trainer.log_dir) / "metrics.jsonl")
    assert [r["training/step"] for r in records] == list(range(1, STEPS + 1))  # every step trained once
    assert not any("resumed from" in log for log in logs)  # no checkpoint was read back
    state, ids = reference
    assert sample_ids.read(spec.trainer.log_dir) == ids  # the same prompts, each n times, in the same steps
    assert len({i for step in ids.values() for i in step}) == STEPS * 4  # none trained twice
    diff = _max_difference(final_checkpoint(spec), state)
    print(f"{spec.trainer.log_dir}: max |difference| of parameters and Adam state vs a run at 1 rollout "
          f"node throughout: {diff:.3g}")
    assert diff <= TOLERANCE


def _wait(pods: list[subprocess.Popen], timeout_s: float) -> list[int | None]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(p.poll() is None for p in pods):
        time.sleep(0.5)
    codes = [p.poll() for p in pods]
    for p in pods:
        if p.poll() is None:
            p.kill()
            p.wait()
    return codes


def _max_difference(a: dict, b: dict) -> float:
    out = max((a["model"][k] - b["model"][k]).abs().max().item() for k in a["model"])
    for key, value in a["optim"]["state"].items():
        for name, tensor in value.items():
            if isinstance(tensor, torch.Tensor) and tensor.dtype.is_floating_point:
                out = max(out, (tensor - b["optim"]["state"][key][name]).abs().max().item())
    return out


def test_rollout_pool_shrinks_in_place_while_the_trainer_keeps_training(tmp_path, reference):
    spec = _pooled("shrink", tmp_path, 2)
    pods_dir = tmp_path / "pods"
    _write_spec(spec, pods_dir)
    _request(pods_dir, 2, 1)
    pods = _start_pods(pods_dir, 3, free_port())
    assert _wait_for_line(pods_dir / "node0.log", "training starts", pods, 300)
    before = _workers(pods[0])
    reformed = _wait_for_line(pods_dir / "node0.log", "re-formed in place", pods, 300)
    after = _workers(pods[0]) if reformed else set()
    codes = _wait(pods, 600)
    logs = _logs(pods_dir, 3)
    assert codes == [0, 0, EXIT_LEFT_POOL], "\n".join(log[-3000:] for log in logs)
    assert before and after == before  # the trainer's worker process is the one that started
    assert "rank 2 leaves the rollout pool after step 1 (3 -> 2 workers)" in logs[2]
    assert "after step 1 the rollout pool is 1 nodes; it generates step 3 on (3 -> 2 workers, re-formed in place)" \
        in logs[0]
    _check_against_reference(spec, reference, logs)


def test_rollout_pool_grows_when_the_joiner_is_ready_then_shrinks_back(tmp_path, reference):
    spec = _pooled("grow", tmp_path, 1)
    pods_dir, new_dir, port = tmp_path / "pods", tmp_path / "new_pod", free_port()
    _write_spec(spec, pods_dir)
    # the operator: the request, and the new rollout pod with the spec at the new size (its own
    # directory here; the request is shared). The new pod starts first and the running ones once it
    # has loaded (it then waits for the job's store), so that it registers before the first step
    # boundary however loaded the machine: the steps of this tiny job take a fraction of a second.
    _write_spec(_pooled("grow", tmp_path, 2), new_dir)
    (new_dir / "resize").symlink_to(pods_dir / "resize")
    _request(pods_dir, 3, 2)
    pods = _start_pods(new_dir, 3, port, nodes=[2], join=True)
    assert _wait_for_line(new_dir / "node2.log", "waits for the job's store", pods, 300), \
        (new_dir / "node2.log").read_text()[-3000:]
    pods = _start_pods(pods_dir, 2, port) + pods
    assert _wait_for_line(pods_dir / "node0.log", "training starts", pods, 300)
    before = _workers(pods[0])
    grown = _wait_for_line(pods_dir / "node0.log", "(2 -> 3 workers, re-formed in place)", pods, 400)
    _request(pods_dir, 2, 1)
    after = _workers(pods[0]) if grown else set()
    codes = _wait(pods, 600)
    logs = _logs(pods_dir, 2) + [(new_dir / "node2.log").read_text()]
    assert grown and codes == [0, 0, EXIT_LEFT_POOL], "\n".join(log[-3000:] for log in logs)
    assert before and after == before  # the trainer's worker process is the one that started
    joined = re.search(r"rank 2 joined the rollout pool after step (\d+); it generates step (\d+) on", logs[2])
    left = re.search(r"rank 2 leaves the rollout pool after step (\d+)", logs[2])
    assert joined and left, logs[2][-3000:]
    assert int(left[1]) > int(joined[1])  # it generated steps joined[2] .. left + 1 (its share of their prompts)
    assert f"after step {joined[1]} the rollout pool is 2 nodes; it generates step {joined[2]} on " \
           "(2 -> 3 workers, re-formed in place)" in logs[0]
    assert f"after step {left[1]} the rollout pool is 1 nodes" in logs[0]
    _check_against_reference(spec, reference, logs)


def test_a_joiner_that_never_comes_does_not_stall_training(tmp_path, reference):
    spec = _pooled("no_joiner", tmp_path, 1)
    pods_dir = tmp_path / "pods"
    _write_spec(spec, pods_dir)
    _request(pods_dir, 3, 2)  # asked, but its pod never starts
    pods = _start_pods(pods_dir, 2, free_port())
    codes = _wait(pods, 400)
    logs = _logs(pods_dir, 2)
    assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)
    assert logs[0].count("the rollout pool grows to 2 nodes once its 1 new workers are ready (0 so far); "
                         "training goes on at 2 workers") == 1
    assert "re-formed in place" not in logs[0]
    _check_against_reference(spec, reference, logs)
