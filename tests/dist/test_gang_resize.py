"""In-place resize of the whole gang (``distflow.gang_resize``), with pods played by processes.

Each "pod" is ``distflow node`` started from the environment the operator gives it (``PET_*``,
``MASTER_*``, ``DISTFLOW_JOIN``) and the rendered spec in a directory that also holds the resize
request (the ConfigMap's key ``resize``); the test plays the operator: it writes the request with
``inPlace``, starts the joining pod with its spec at the new size, and reads the exit codes.

A job of 2 nodes grows to 3 once the joiner is ready, then shrinks back to 2 (the joiner leaves
with ``EXIT_LEFT_POOL``). Asserted: the first two pods' worker processes run from start to end
(the same PIDs before and after both resizes, a clean exit), every step is trained once, and the
sample ids and the final parameters and Adam state equal, bit for bit, those of a local run
stopped and resumed by hand at the same steps and sizes.
"""

from __future__ import annotations

import json
import re

import pytest

from distflow import sample_ids
from distflow.metrics import read_jsonl
from distflow.resize import EXIT_LEFT_POOL
from distflow.spec.loading import render_spec_document
from tests.dist._jobs import bit_identical, final_checkpoint, resized_by_hand, tiny_job_spec
from tests.dist._spawn import free_port
from tests.dist.test_rollout_pool_resize import _start_pods, _wait, _wait_for_line, _workers, _write_spec

# long: tests/e2e/test_e2e_resize.py takes the same path in the default run (real operator and API
# server, pods as processes) with the same comparison against a run resized by hand; this one, without
# Kubernetes, also checks that the running pods' worker processes are the ones that started.
pytestmark = [pytest.mark.dist, pytest.mark.long, pytest.mark.timeout(900)]

STEPS = 8
REFORMED = re.compile(r"after step (\d+) the gang re-forms in place at (\d+) nodes")


def _spec(tmp_path, nodes: int):
    # 6 prompts a step: 2 and 3 nodes both divide them
    return tiny_job_spec(tmp_path, "gang", trainer={"totalSteps": STEPS}, data={"trainBatchSize": 6},
                         cluster={"numNodes": nodes, "procsPerNode": 1, "device": "cpu"},
                         checkpoint={"saveEverySteps": 0})


def _request(spec_dir, num_nodes: int) -> None:
    (spec_dir / "resize.tmp").write_text(json.dumps({"numNodes": num_nodes, "inPlace": True}))
    (spec_dir / "resize.tmp").rename(spec_dir / "resize")  # whole, as a ConfigMap volume updates


def test_the_gang_grows_and_shrinks_in_place_and_trains_as_a_run_resized_by_hand(tmp_path):
    spec = _spec(tmp_path, 2)
    pods_dir, new_dir, port = tmp_path / "pods", tmp_path / "new_pod", free_port()
    _write_spec(spec, pods_dir)
    _write_spec(_spec(tmp_path, 3), new_dir)
    (new_dir / "resize").symlink_to(pods_dir / "resize")
    _request(pods_dir, 3)
    # The joiner first, so that it is registered before the first boundary however loaded the machine.
    pods = _start_pods(new_dir, 3, port, nodes=[2], join=True)
    assert _wait_for_line(new_dir / "node2.log", "to join the gang", pods, 300), (new_dir / "node2.log").read_text()
    pods = _start_pods(pods_dir, 2, port) + pods
    assert _wait_for_line(pods_dir / "node0.log", "training starts", pods, 300)
    before = [_workers(p) for p in pods[:2]]
    grown = _wait_for_line(pods_dir / "node0.log", "re-forms in place at 3 nodes", pods, 300)
    _request(pods_dir, 2)
    middle = [_workers(p) for p in pods[:2]] if grown else []
    codes = _wait(pods, 600)
    logs = [(pods_dir / f"node{n}.log").read_text() for n in range(2)] + [(new_dir / "node2.log").read_text()]
    assert grown and codes == [0, 0, EXIT_LEFT_POOL], "\n".join(log[-3000:] for log in logs)
    assert all(before) and middle == before  # the running pods' workers are the processes that started
    stops = [(int(m[1]), int(m[2])) for m in REFORMED.finditer(logs[0])]
    assert [n for _, n in stops] == [3, 2] and 1 <= stops[0][0] < stops[1][0] < STEPS, logs[0][-3000:]
    assert re.search(r"the gang runs at 3 nodes from step \d+; the resize cost [\d.]+ s without training", logs[0])
    assert re.search(r"the gang runs at 2 nodes from step \d+; the resize cost [\d.]+ s without training", logs[0])
    assert "rank 2 joined the gang (world 1, 3 workers)" in logs[2]
    assert f"rank 2 leaves the gang after step {stops[1][0]} (3 -> 2 workers)" in logs[2]

    records = read_jsonl(tmp_path / "gang" / "metrics.jsonl")
    assert [r["training/step"] for r in records] == list(range(1, STEPS + 1))  # every step trained once
    ids = sample_ids.read(tmp_path / "gang")
    prompts = [set(step_ids) for _, step_ids in sorted(ids.items())]
    assert sum(map(len, prompts)) == len(set().union(*prompts)) == STEPS * 6  # none lost, none repeated
    reference = resized_by_hand(render_spec_document(spec)["spec"], tmp_path / "by-hand", stops)
    assert sample_ids.read(reference) == ids
    assert bit_identical(final_checkpoint(spec), final_checkpoint(tmp_path / "by-hand" / "checkpoints")), \
        "the gang resized in place ends with other parameters/optimizer state than the run resized by hand"
