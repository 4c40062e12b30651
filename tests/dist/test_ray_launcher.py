"""`distflow run --ray`: the workers as actors on a real two-node Ray cluster on this machine.

The cluster is Ray's own ``cluster_utils.Cluster``: a head and one more Ray node,
each a raylet with 2 CPUs, all on 127.0.0.1. A 2 x 2 job reserves all 4 CPUs,
so a run can only be placed if the previous one released its actors and its
placement group. Opt-in (``-m ray``): every run starts 4 actors that import
torch, about a minute each on 2 cores; skipped where Ray is not installed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Before torch: where Ray is missing, the module is skipped without importing anything heavy.
ray_cluster_utils = pytest.importorskip("ray.cluster_utils", reason="Ray is not installed (pip install 'distflow[ray]')")

import torch
import yaml

from distflow.checkpoint import complete_checkpoints
from distflow.metrics import read_jsonl
from tests.dist._jobs import final_checkpoint, initial_params, run_job, tiny_job_spec

pytestmark = [pytest.mark.dist, pytest.mark.ray, pytest.mark.timeout(1200)]

TWO_BY_TWO = {"numNodes": 2, "procsPerNode": 2}
MOVES_SAMPLES = {"data": {"shuffle": True, "trainBatchSize": 8}, "actor": {"sharePromptPrefix": False}}
"""Prompts of varied lengths balanced one sample at a time: the train edge moves samples, within and
across nodes."""
PLACED = re.compile(r"rank (\d+) \(node (\d+)\) on Ray node (\w+) [\d.]+, pid (\d+)")
NODE_ARGS = {"num_cpus": 2, "node_ip_address": "127.0.0.1", "object_store_memory": 80 * 1024**2}


@pytest.fixture(scope="module")
def ray_address():
    """A head and one more Ray node (2 CPUs each), loopback only; its address."""
    with pytest.MonkeyPatch.context() as mp:
        # Ray turns 127.0.0.1 into the host's address unless told it runs on this host alone.
        mp.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
        cluster = ray_cluster_utils.Cluster(initialize_head=True,
                                            head_node_args={**NODE_ARGS, "include_dashboard": False})
        try:
            cluster.add_node(**NODE_ARGS)
            cluster.wait_for_nodes()
            yield cluster.address
        finally:
            cluster.shutdown()


def _config(tmp_path: Path, name: str, **sections) -> tuple[object, Path]:
    spec = tiny_job_spec(tmp_path, name, cluster=TWO_BY_TWO, **sections)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec.model_dump(mode="json", by_alias=True, exclude_none=True)))
    return spec, path


def _start(config: Path, address: str, log: Path) -> subprocess.Popen:
    """`distflow run CONFIG --ray auto`, Ray finding the cluster from RAY_ADDRESS."""
    env = {**os.environ, "RAY_ADDRESS": address, "DISTFLOW_JOB_NAME": "rayjob"}
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "distflow.cli", "run", str(config), "--ray", "auto"],
                                env=env, stdout=out, stderr=subprocess.STDOUT, text=True)


def _placements(text: str) -> dict[int, tuple[int, str, int]]:
    """rank -> (distflow node, Ray node id, pid), from the driver's launch log."""
    return {int(m[1]): (int(m[2]), m[3], int(m[4])) for m in PLACED.finditer(text)}


def _wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.2)
    return value


def test_ray_job_matches_local_bit_for_bit_and_hands_over_within_a_node(tmp_path, ray_address):
    local = tiny_job_spec(tmp_path, "local", cluster=TWO_BY_TWO, **MOVES_SAMPLES)
    local_state, local_log = run_job(local)
    spec, config = _config(tmp_path, "ray", **MOVES_SAMPLES)
    proc = _start(config, ray_address, tmp_path / "ray.log")
    proc.wait(timeout=900)
    text = (tmp_path / "ray.log").read_text()
    assert proc.returncode == 0, text[-4000:]

    places = _placements(text)
    assert sorted(places) == [0, 1, 2, 3]
    assert places[0][:2] == (0, places[1][1]) and places[2][:2] == (1, places[3][1])
    assert places[0][1] != places[2][1], "the two distflow nodes share a Ray node"
    ray_state = final_checkpoint(spec)
    assert sorted(ray_state["model"]) == sorted(local_state["model"])
    for key, tensor in local_state["model"].items():
        assert torch.equal(tensor, ray_state["model"][key]), key
    initial = initial_params()
    assert any(not torch.equal(initial[k], v) for k, v in ray_state["model"].items()), "training changed nothing"
    ray_log = read_jsonl(f"{spec.trainer.log_dir}/metrics.jsonl")
    assert [r["training/step"] for r in ray_log] == [1, 2]
    for name in ("data/bytes_handed_over", "data/intra_node_bytes", "data/cross_node_bytes"):
        assert [r[name] for r in ray_log] == [r[name] for r in local_log], name
    handed = sum(r["data/bytes_handed_over"] for r in ray_log)
    assert handed > 0 and handed == sum(r["data/intra_node_bytes"] for r in ray_log)


def test_lost_actor_fails_the_job_fast_then_ctrl_c_stops_cleanly_and_a_rerun_resumes(tmp_path, ray_address):
    spec, config = _config(tmp_path, "lost", trainer={"totalSteps": 8}, checkpoint={"saveEverySteps": 1})
    log = tmp_path / "first.log"
    proc = _start(config, ray_address, log)
    places = _wait_until(lambda: len(_placements(log.read_text())) == 4 and _placements(log.read_text()),
                         600, "the driver never placed 4 actors")
    _wait_until(lambda: complete_checkpoints(spec.checkpoint.dir), 600, "no checkpoint was written")
    os.kill(places[1][2], signal.SIGKILL)
    killed_at = time.monotonic()
    proc.wait(timeout=60)
    assert time.monotonic() - killed_at < 30
    text = log.read_text()
    assert proc.returncode == 1, text[-4000:]
    assert re.search(rf"rank 1 on Ray node \w+ [\d.]+ \(pid {places[1][2]}\) lost", text), text[-4000:]
    stopped_at = complete_checkpoints(spec.checkpoint.dir)[-1]

    log = tmp_path / "second.log"
    proc = _start(config, ray_address, log)  # placed only if the first run released its 4 CPUs
    _wait_until(lambda: "resumed from the step-" in log.read_text(), 600, "the second run never resumed")
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    assert proc.returncode == 1, log.read_text()[-4000:]

    log = tmp_path / "third.log"
    proc = _start(config, ray_address, log)  # placed only if Ctrl-C released them too
    proc.wait(timeout=900)
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    assert "resumed from the step-" in text
    steps = [r["training/step"] for r in read_jsonl(f"{spec.trainer.log_dir}/metrics.jsonl")]
    assert steps[-1] == 8 and int(stopped_at.name.split("_")[-1]) >= 1
    assert complete_checkpoints(spec.checkpoint.dir)[-1].name == "step_00000008"


def test_unplaceable_job_fails_within_its_timeout_naming_what_is_missing(tmp_path, ray_address):
    _, config = _config(tmp_path, "unplaceable",
                        ray={"resources": {"tpu_pod": 1}, "placementTimeoutSeconds": 2})
    log = tmp_path / "unplaceable.log"
    started = time.monotonic()
    proc = _start(config, ray_address, log)
    proc.wait(timeout=300)
    text = log.read_text()
    assert proc.returncode == 1, text[-4000:]
    assert "did not place the job within 2s" in text
    assert "tpu_pod: needs 2 per node on 2 nodes, 0 have it (the most any Ray node has is 0)" in text
    assert time.monotonic() - started < 120
