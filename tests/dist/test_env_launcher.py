"""`distflow node`: what a pod runs — two nodes from torchrun-style env train together."""

import os
import subprocess
import sys

import pytest
import yaml

from distflow.checkpoint import complete_checkpoints
from distflow.launcher import EXIT_INVALID_CONFIG, free_port
from distflow.metrics import read_jsonl
from distflow.resize import EXIT_RESIZE, RESIZE_KEY

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


def _config(tmp_path, **cluster):
    spec = {"model": {"path": "tiny"},
            "data": {"train": {"path": "arithmetic", "size": 64}, "trainBatchSize": 2,
                     "maxPromptLength": 48, "maxResponseLength": 4},
            "rollout": {"n": 2}, "actor": {"microBatchSize": 4},
            "cluster": {"numNodes": 2, "procsPerNode": 1, "device": "cpu", **cluster},
            "trainer": {"totalSteps": 2, "logDir": str(tmp_path / "logs"), "numThreads": 1}}
    manifest = {"apiVersion": "distflow.io/v1alpha1", "kind": "RLPostTrainJob",
                "metadata": {"name": "envjob"}, "spec": spec}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


def _node(config, rank, port, nnodes=2):
    env = {**os.environ, "PET_NNODES": str(nnodes), "PET_NODE_RANK": str(rank), "PET_NPROC_PER_NODE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "DISTFLOW_JOB_NAME": "envjob"}
    return subprocess.Popen([sys.executable, "-m", "distflow.cli", "node", "--config", str(config)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_two_nodes_from_env_train(tmp_path):
    config = _config(tmp_path)
    port = free_port()
    procs = [_node(config, r, port) for r in range(2)]
    outs = [p.communicate(timeout=280)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
    steps = [r["training/step"] for r in read_jsonl(tmp_path / "logs" / "metrics.jsonl")]
    assert steps == [1, 2]


def test_env_disagreeing_with_spec_exits_invalid_config(tmp_path):
    config = _config(tmp_path)
    proc = _node(config, 0, free_port(), nnodes=3)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == EXIT_INVALID_CONFIG
    assert "PET_NNODES=3" in out and "numNodes=2" in out


@pytest.mark.parametrize("pools", [None, {"enable": True, "maxStaleness": 1, "rolloutPool": {"numNodes": 1}}],
                         ids=["sync", "pools"])
def test_a_resize_request_seen_by_one_node_stops_every_node_at_the_same_step_with_a_checkpoint(tmp_path, pools):
    seen, unseen = tmp_path / "node0", tmp_path / "node1"
    for directory in (seen, unseen):  # each pod mounts its own copy of the ConfigMap
        directory.mkdir()
    ckpt = tmp_path / "ckpt"
    spec = yaml.safe_load(_config(tmp_path).read_text())
    spec["spec"]["trainer"]["totalSteps"] = 4
    spec["spec"]["checkpoint"] = {"dir": str(ckpt), "saveEverySteps": 0}  # no interval: the resize saves
    if pools:  # node 0 trains, node 1 generates (the rollout pool, which sees the request here)
        spec["spec"]["async"] = pools
        seen, unseen = unseen, seen
    for directory in (seen, unseen):
        (directory / "job.yaml").write_text(yaml.safe_dump(spec))
    (seen / RESIZE_KEY).write_text('{"numNodes": 3}')
    port = free_port()
    procs = [_node(tmp_path / f"node{r}" / "job.yaml", r, port) for r in range(2)]
    outs = [p.communicate(timeout=280)[0] for p in procs]
    assert [p.returncode for p in procs] == [EXIT_RESIZE, EXIT_RESIZE], outs[0][-3000:] + outs[1][-3000:]
    # Rank 0 says so, whether or not its own copy had the request.
    size = 3 if not pools else "another number of"
    assert f"stopping after step 1 for a resize to {size} nodes (checkpoint saved)" in outs[0]
    assert [r["training/step"] for r in read_jsonl(tmp_path / "logs" / "metrics.jsonl")] == [1]
    assert [p.name for p in complete_checkpoints(ckpt)] == ["step_00000001"]
