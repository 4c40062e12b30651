"""The pure parts of the in-place resize of the whole gang (``distflow.gang_resize``) and its store protocol."""

from __future__ import annotations

import json
import threading
from datetime import timedelta

import pytest
import yaml
import torch.distributed as dist

from distflow import process_group
from distflow.exporter import NodeExporter
from distflow.gang_resize import GangResize, agree, resized_spec
from distflow.resize import ResizeRequest, ResizeWatch, read_request
from distflow.spec import parse_spec
from tests.dist._spawn import free_port

pytestmark = pytest.mark.unit


def _spec(**sections):
    doc = {"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 6},
           "cluster": {"numNodes": 2}, **sections}
    return parse_spec(doc)


def test_the_request_says_in_place_only_for_a_literal_true(tmp_path):
    path = tmp_path / "resize"
    for raw, want in (({"numNodes": 3, "inPlace": True}, ResizeRequest(3, None, True)),
                      ({"numNodes": 3}, ResizeRequest(3)),
                      ({"numNodes": 3, "inPlace": "yes"}, ResizeRequest(3)),
                      ({"numNodes": 3, "inPlace": 1}, ResizeRequest(3))):
        path.write_text(json.dumps(raw))
        assert read_request(path) == want


def test_the_lowest_ranks_in_place_read_of_another_size_wins():
    up, down, stop = ResizeRequest(3, in_place=True), ResizeRequest(1, in_place=True), ResizeRequest(4)
    assert agree([None, up, down], 2) == 3
    assert agree([down, up], 2) == 1
    assert agree([stop, None], 2) is None  # a stop is no in-place request
    assert agree([ResizeRequest(2, in_place=True), up], 2) == 3  # the running size asks for nothing
    assert agree([None, None], 2) is None


def test_a_size_the_spec_cannot_take_comes_with_its_problems():
    spec = _spec(cluster={"numNodes": 2, "maxNodes": 3})
    resized, problems = resized_spec(spec, 3)
    assert resized.cluster.num_nodes == 3 and problems == []
    _, problems = resized_spec(spec, 4)
    assert problems[0] == "cluster.numNodes: 4 is above cluster.maxNodes=3; use at most 3 or raise maxNodes"
    assert problems[1].startswith("data.trainBatchSize: 6 prompts cannot be split evenly over 4 rollout dp ranks")
    assert spec.cluster.num_nodes == 2  # the spec itself is left as it was


def test_only_a_job_without_pools_on_the_hf_engine_resizes_in_place():
    assert GangResize.takes(_spec())
    assert not GangResize.takes(_spec(rollout={"engine": "vllm"}))
    assert not GangResize.takes(_spec(**{"async": {"enable": True, "rolloutPool": {"numNodes": 1}}}))


def test_an_in_place_request_stops_only_a_gang_that_cannot_resize_in_place(tmp_path):
    path = tmp_path / "resize"
    path.write_text(json.dumps({"numNodes": 3, "inPlace": True}))
    assert not ResizeWatch(path, 2, gang_in_place=True).should_stop()
    assert ResizeWatch(path, 2, gang_in_place=False).should_stop()  # a vLLM engine's gang stops instead
    path.write_text(json.dumps({"numNodes": 3}))
    assert ResizeWatch(path, 2, gang_in_place=True).should_stop()


def test_a_worker_built_again_in_its_process_keeps_the_exporter_and_its_port():
    port = free_port()
    first = NodeExporter.serving("job-a", 0, port)
    assert NodeExporter.serving("job-a", 0, port) is first  # a second server could not bind the port
    assert NodeExporter.serving("job-a", 1, 0) is not first


def test_a_joiner_waits_for_a_world_of_its_size_and_registers_again_after_one_without_it():
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30))
    server.set(process_group.GENERATION_KEY, "0")
    client = process_group.join_store("127.0.0.1", port, timeout_s=30)
    got = {}
    joiner = threading.Thread(target=lambda: got.update(
        generation=process_group.wait_to_join(client, 4, 2, "the gang", timeout_s=30)))
    joiner.start()
    _wait_until(lambda: int(server.add(process_group.world_key(1, "ready"), 0)) == 1)
    process_group.announce_world(server, 1, 0)  # world 1 formed without it (a shrink came first)
    _wait_until(lambda: int(server.add(process_group.world_key(2, "ready"), 0)) == 1)
    assert joiner.is_alive()
    process_group.announce_world(server, 2, 4)
    joiner.join(10)
    assert got == {"generation": 2} and server.get(process_group.GENERATION_KEY) == b"2"


def test_a_joiner_taken_by_a_world_of_another_size_says_so():
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30))
    server.set(process_group.GENERATION_KEY, "3")
    server.set(process_group.world_key(4, "go"), "3")  # world 4 took 3 workers: a request for another size
    with pytest.raises(RuntimeError, match="world 4 formed with 3 workers, not the 4 this worker was started for"):
        process_group.wait_to_join(process_group.join_store("127.0.0.1", port, timeout_s=30), 4, 2, "the gang", 10)


def _wait_until(predicate, timeout_s: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "not met in time"
        time.sleep(0.05)


def test_a_joiner_whose_gang_finished_first_has_nothing_to_train(tmp_path, capsys):
    from distflow.gang_resize import join
    from distflow.worker import WorkerEnv

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30))
    server.set(process_group.GENERATION_KEY, "0")
    from distflow.models import model_cache_dir, resolve_model

    model_dir = str(resolve_model("tiny", model_cache_dir()))
    env = WorkerEnv(rank=2, world_size=3, local_rank=0, local_world_size=1, node_rank=2, num_nodes=3,
                    master_addr="127.0.0.1", master_port=port, job_name="finished", model_dir=model_dir,
                    device_index=0, join=True)
    got = {}
    joiner = threading.Thread(target=lambda: got.update(env=join(_spec(), env, timeout_s=30)))
    joiner.start()
    _wait_until(lambda: int(server.add(process_group.world_key(1, "ready"), 0)) == 1)
    del server  # rank 0's process ended: its store with it
    joiner.join(20)
    assert not joiner.is_alive() and got == {"env": None}
    assert "the gang finished its last step first" in capsys.readouterr().out


def test_the_pause_of_a_resize_is_said_once_and_exported(capsys, monkeypatch):
    import time
    from types import SimpleNamespace

    from distflow import gang_resize

    exporter = NodeExporter.serving("paused", 0, 0)
    worker = SimpleNamespace(is_logger=True, step=4, env=SimpleNamespace(num_nodes=3), exporter=exporter)
    assert gang_resize.resumed(worker) is None  # no resize in this process
    monkeypatch.setattr(gang_resize, "_PAUSED_AT", time.monotonic() - 2.5)
    pause = gang_resize.resumed(worker)
    assert 2.5 <= pause < 5.0 and gang_resize.resumed(worker) is None
    assert "the gang runs at 3 nodes from step 5; the resize cost 2.5 s without training" in capsys.readouterr().out
    value = exporter.registry.get_sample_value("distflow_resize_pause_seconds", {"job_name": "paused", "node": "0"})
    assert value == pause


def test_a_joiner_takes_the_place_of_a_registration_that_is_gone():
    # A joiner registered for world 1 and was deleted (a withdrawn grow); the gang, counting it, formed
    # world 1 at 3 workers when the next grow asked for it: the new pod of that rank joins world 1.
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30))
    server.set(process_group.GENERATION_KEY, "0")
    server.add(process_group.world_key(1, "ready"), 1)
    process_group.announce_world(server, 1, 3)
    client = process_group.join_store("127.0.0.1", port, timeout_s=30)
    assert process_group.wait_to_join(client, 3, 2, "the gang", 10) == 1
    # one of another size does not (a shrink formed world 2 without joiners: the next registers for 3)
    process_group.announce_world(server, 2, 0)
    got = {}
    joiner = threading.Thread(target=lambda: got.update(g=process_group.wait_to_join(client, 3, 2, "the gang", 10)))
    joiner.start()
    _wait_until(lambda: int(server.add(process_group.world_key(3, "ready"), 0)) == 1)
    process_group.announce_world(server, 3, 3)
    joiner.join(10)
    assert got == {"g": 3}


def test_a_joiner_whose_resize_was_set_back_takes_its_registration_back_and_leaves():
    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, timeout=timedelta(seconds=30))
    server.set(process_group.GENERATION_KEY, "0")
    client = process_group.join_store("127.0.0.1", port, timeout_s=30)
    wanted = threading.Event()
    wanted.set()
    got = {}
    joiner = threading.Thread(target=lambda: got.update(
        g=process_group.wait_to_join(client, 3, 2, "the gang", 30, wanted.is_set)))
    joiner.start()
    _wait_until(lambda: int(server.add(process_group.world_key(1, "ready"), 0)) == 1)
    wanted.clear()  # the request no longer asks for 3 nodes
    joiner.join(10)
    assert got == {"g": None} and int(server.add(process_group.world_key(1, "ready"), 0)) == 0


def test_a_pod_that_reads_its_spec_after_an_in_place_resize_starts_at_its_own_size():
    from distflow.launcher import spec_at_pod_size

    spec = _spec(cluster={"numNodes": 3, "maxNodes": 4})  # the ConfigMap's spec, rewritten for a grow 2 -> 3
    started = spec_at_pod_size(spec, 2, ResizeRequest(3, in_place=True))
    assert started.cluster.num_nodes == 2 and started.cluster.max_nodes == 4  # re-forms at 3 at a boundary
    assert spec_at_pod_size(spec, 3, ResizeRequest(3, in_place=True)) is spec  # a pod of the new size
    assert spec_at_pod_size(spec, 2, ResizeRequest(3)) is spec  # a stop request: env and spec disagree
    assert spec_at_pod_size(spec, 2, None) is spec
    assert spec_at_pod_size(spec, 2, ResizeRequest(4, in_place=True)) is spec  # a request for another size


NO_CHECKPOINT = ("cluster.minNodes/maxNodes let the job be resized (kubectl scale, an autoscaler), but without "
                 "checkpoint.dir a resize starts the training over at step 0; set checkpoint.dir (a volume every "
                 "node pod mounts)")
NOT_SHARED = "is on no volume of template.persistentVolumeClaims or template.volumeMounts"
PVC = {"persistentVolumeClaims": [{"name": "ckpt", "claimName": "shared", "mountPath": "/shared"}]}


@pytest.mark.parametrize("cluster, checkpoint, template, warned", [
    ({"numNodes": 2, "minNodes": 2, "maxNodes": 4}, None, {}, [NO_CHECKPOINT]),
    ({"numNodes": 2, "minNodes": 2, "maxNodes": 4}, "@TMP@/ckpt", {}, [NOT_SHARED]),  # each pod its own
    ({"numNodes": 2, "minNodes": 2, "maxNodes": 4}, "/shared/run1", PVC, []),
    ({"numNodes": 2, "minNodes": 2, "maxNodes": 4}, "/data/ckpt", {"volumeMounts": [{"name": "d", "mountPath": "/data"}]},
     []),
    ({"numNodes": 2, "minNodes": 2, "maxNodes": 4}, "/sharedx/run1", PVC, [NOT_SHARED]),  # not under /shared
    ({"numNodes": 2, "minNodes": 2, "maxNodes": 4}, "/shared/../etc", PVC, [NOT_SHARED]),
    ({"numNodes": 2, "minNodes": 2, "maxNodes": 4}, "file:///shared/run1", PVC, []),
    ({"numNodes": 2, "minNodes": 2, "maxNodes": 4}, "ckpt", {"persistentVolumeClaims": [  # the image's workdir
        {"name": "home", "claimName": "shared", "mountPath": "/home/distflow/"}]}, []),
    ({"numNodes": 2, "minNodes": 2, "maxNodes": 4}, "/scratch/x", {  # each pod's own emptyDir
        "volumes": [{"name": "s", "emptyDir": {}}], "volumeMounts": [{"name": "s", "mountPath": "/scratch"}]},
     [NOT_SHARED]),
    ({"numNodes": 2, "minNodes": 2, "maxNodes": 4}, "/data/x", {"volumeMounts": [{"name": "d", "mountPath": 5}]},
     [NOT_SHARED]),
    ({"numNodes": 2, "minNodes": 2, "maxNodes": 2}, None, {}, []),  # the bounds pin the size
    # 5 and 7 nodes cannot split 12 prompts: an autoscaler asking for them would be refused
    ({"numNodes": 2, "minNodes": 2, "maxNodes": 7}, "/shared/run1", PVC,
     ["cluster.minNodes/maxNodes allow sizes the spec refuses, so kubectl scale or an autoscaler asking for them "
      "is refused: 5 (data.trainBatchSize), 7 (data.trainBatchSize); narrow the bounds or change those fields"]),
])
def test_validate_warns_of_what_a_resizable_job_would_lose(cluster, checkpoint, template, warned, tmp_path, capsys):
    from distflow import cli

    config = tmp_path / "job.yaml"
    doc = {"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 12},
           "cluster": cluster, "template": template}
    if checkpoint:
        doc["checkpoint"] = {"dir": checkpoint.replace("@TMP@", str(tmp_path))}
    config.write_text(yaml.safe_dump(doc))
    assert cli.main(["validate", str(config)]) == 0
    lines = [line.removeprefix("distflow: warning: ") for line in capsys.readouterr().err.splitlines()]
    assert len(lines) == len(warned) and all(w in line for w, line in zip(warned, lines)), lines


def test_an_async_job_with_default_fields_is_not_told_its_sizes_are_refused(tmp_path, capsys):
    from distflow import cli

    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 4},
        "cluster": {"numNodes": 3, "minNodes": 2, "maxNodes": 5}, "checkpoint": {"dir": "s3://bucket/run"},
        "async": {"enable": True, "offPolicyCorrection": "none", "rolloutPool": {"numNodes": 1}}}))
    assert cli.main(["validate", str(config)]) == 0
    err = capsys.readouterr().err  # 2 nodes leave one trainer: valid; none of 2..5 is refused
    assert err == "", err
