"""In-place resize of the rollout pool (``distflow.pools.elastic``), with pods played by processes.

Each "pod" is ``distflow node`` started from the environment the operator gives
it (``PET_*``, ``MASTER_*``) and the rendered spec in a directory that also
holds the resize request (the ConfigMap's key ``resize``); the test plays the
operator: it writes the request and reads the pods' exit codes.

- 1 trainer + 2 rollout nodes, asked for 1 + 1 (``{"numNodes": 2, "rolloutNodes": 1}``)
  from the start: after step 1 the last rollout pod exits with ``EXIT_LEFT_POOL``
  and the other two re-form the world in place: the trainer pod runs from
  start to end in one process (its exit is clean, no checkpoint is ever
  read back), every step is trained once on the prompts an unresized run
  trains on, and the final parameters and Adam state equal those of a run at
  1 + 1 throughout (``TOLERANCE``).
"""

from __future__ import annotations

import json
import os
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
STEPS = 4
# Step 1 at 1 + 2 rollout workers sends the trainer the same samples as at 1 + 1 (the prompts are
# the stream's, the responses seeded per sample), in the same order: the trainer's sums run in the
# same order and the runs are expected to agree exactly; a tolerance of float rounding (Adam moves a
# parameter by about lr = 1e-3 a step) still tells a repeated or lost prompt apart.
TOLERANCE = 1e-6


def _pooled(name: str, tmp_path, rollout_nodes: int):
    return tiny_job_spec(tmp_path, name, trainer={"totalSteps": STEPS},
                         cluster={"numNodes": 1 + rollout_nodes, "procsPerNode": 1, "device": "cpu"},
                         **{"async": {"enable": True, "maxStaleness": 1, "rolloutPool": {"numNodes": rollout_nodes}}})


def _start_pods(spec, spec_dir: Path, num_nodes: int, port: int) -> list[subprocess.Popen]:
    spec_dir.mkdir(parents=True, exist_ok=True)
    (spec_dir / "spec.yaml").write_text(json.dumps(render_spec_document(spec)))
    env = {**os.environ, "PET_NNODES": str(num_nodes), "PET_NPROC_PER_NODE": "1", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port),
           "PYTHONPATH": os.pathsep.join([str(REPO / "worker_image"), str(REPO / "operator"), str(REPO)])}
    pods = []
    for node in range(num_nodes):
        log = open(spec_dir / f"node{node}.log", "w")
        pods.append(subprocess.Popen([sys.executable, "-m", "distflow.cli", "node", "--config",
                                      str(spec_dir / "spec.yaml")], cwd=REPO, stdout=log,
                                     stderr=subprocess.STDOUT, env={**env, "PET_NODE_RANK": str(node)}))
    return pods


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


def test_rollout_pool_shrinks_in_place_while_the_trainer_keeps_training(tmp_path):
    reference = _pooled("reference", tmp_path, 1)
    reference_state, _ = run_job(reference, "reference")

    spec = _pooled("shrink", tmp_path, 2)
    pods_dir = tmp_path / "pods"
    pods_dir.mkdir()
    (pods_dir / "resize").write_text(json.dumps({"numNodes": 2, "rolloutNodes": 1}))
    pods = _start_pods(spec, pods_dir, 3, free_port())
    trainer_pid = pods[0].pid
    codes = _wait(pods, 600)
    logs = [(pods_dir / f"node{n}.log").read_text() for n in range(3)]
    assert codes == [0, 0, EXIT_LEFT_POOL], "\n".join(log[-3000:] for log in logs)
    assert pods[0].pid == trainer_pid
    assert "rank 2 leaves the rollout pool after step 1 (3 -> 2 workers)" in logs[2]
    assert "the rollout pool is 1 nodes from step 2 (3 -> 2 workers, re-formed in place)" in logs[0]
    assert not any("resumed from" in log for log in logs)  # no checkpoint was read back

    records = read_jsonl(tmp_path / "shrink" / "metrics.jsonl")
    assert [r["training/step"] for r in records] == [1, 2, 3, 4]  # every step trained once
    assert sample_ids.read(tmp_path / "shrink") == sample_ids.read(tmp_path / "reference")
    ids = sample_ids.read(tmp_path / "shrink")
    assert all(len(ids[s]) == 4 * 2 for s in ids)
    # the stream goes on: 4 steps x 4 distinct prompts, none trained twice
    assert len({i for s in ids for i in ids[s]}) == STEPS * 4

    diff = _max_difference(final_checkpoint(spec), reference_state)
    print(f"rollout pool 2 -> 1 nodes in place after step 1: max |difference| of parameters and Adam "
          f"state vs a run at 1 rollout node throughout: {diff:.3g}")
    assert diff <= TOLERANCE
