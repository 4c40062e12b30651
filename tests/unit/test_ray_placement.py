"""The Ray launcher's pure parts: per-worker resources, bundles, the timeout message, the env."""

import pytest

from distflow.errors import DistflowConfigError
from distflow.ray_launcher import (
    RayResources, failure_message, metrics_ports, placement_shortfall, torchrun_environ, worker_env_from_environ,
    worker_resources,
)
from distflow.spec import parse_spec

pytestmark = pytest.mark.unit


def _spec(cluster=None, ray=None, **sections):
    doc = {"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 4},
           "cluster": {"numNodes": 2, "procsPerNode": 2, "device": "cpu", **(cluster or {})},
           "ray": ray or {}, **sections}
    return parse_spec(doc)


def test_cpu_job_reserves_one_cpu_and_no_gpu_per_worker():
    res = worker_resources(_spec())
    assert res == RayResources(num_cpus=1.0, num_gpus=0.0, custom={})
    assert res.bundle(2) == {"CPU": 2.0}


def test_gpus_per_worker_come_from_accelerators_per_node():
    res = worker_resources(_spec(cluster={"device": "cuda", "acceleratorsPerNode": 2},
                                 ray={"cpusPerWorker": 4, "resources": {"a100": 1}}))
    assert res == RayResources(num_cpus=4.0, num_gpus=1.0, custom={"a100": 1.0})
    assert res.bundle(2) == {"CPU": 8.0, "GPU": 2.0, "a100": 2.0}


def test_cuda_without_accelerators_per_node_takes_one_gpu_per_worker():
    assert worker_resources(_spec(cluster={"device": "cuda"})).num_gpus == 1.0


def test_cuda_with_zero_gpus_per_worker_is_a_config_error():
    with pytest.raises(DistflowConfigError, match="spec.ray.gpusPerWorker"):
        worker_resources(_spec(cluster={"device": "cuda"}, ray={"gpusPerWorker": 0}))


def test_shortfall_names_the_missing_resource_and_the_largest_node():
    nodes = [{"resources": {"CPU": 8.0, "GPU": 1.0}}, {"resources": {"CPU": 8.0}}]
    text = placement_shortfall({"CPU": 2.0, "GPU": 2.0}, 2, nodes)
    assert text == ("0 of the 2 Ray nodes it needs can hold one (2 alive Ray nodes): GPU: needs 2 per node "
                    "on 2 nodes, 0 have it (the most any Ray node has is 1)")


def test_shortfall_names_a_custom_resource_no_node_has():
    nodes = [{"resources": {"CPU": 4.0}}, {"resources": {"CPU": 4.0}}]
    text = placement_shortfall({"CPU": 1.0, "tpu_pod": 1.0}, 2, nodes)
    assert text.endswith("tpu_pod: needs 1 per node on 2 nodes, 0 have it (the most any Ray node has is 0)")


def test_shortfall_with_too_few_nodes_says_how_many_fit():
    text = placement_shortfall({"CPU": 2.0}, 3, [{"resources": {"CPU": 4.0}}, {"resources": {"CPU": 4.0}}])
    assert text.startswith("2 of the 3 Ray nodes it needs can hold one (2 alive Ray nodes): CPU: needs 2 per "
                           "node on 3 nodes, 2 have it")


def test_shortfall_when_the_resources_exist_but_are_held():
    text = placement_shortfall({"CPU": 2.0}, 1, [{"resources": {"CPU": 4.0}}])
    assert text.endswith("the resources exist but other work holds them; wait, or free them")


def test_shortfall_names_labels_no_node_carries():
    nodes = [{"resources": {"CPU": 4.0}, "labels": {"pool": "a"}}, {"resources": {"CPU": 4.0}, "labels": {}}]
    text = placement_shortfall({"CPU": 1.0}, 2, nodes, {"pool": "a"})
    assert text == ("1 of the 2 Ray nodes it needs can hold one (2 alive Ray nodes, 1 with labels "
                    "{'pool': 'a'}): too few Ray nodes carry the labels {'pool': 'a'} (ray start --labels)")


@pytest.mark.parametrize("rank, node_rank, local_rank, metrics_port", [(0, 0, 0, 9400), (1, 0, 1, 0),
                                                                        (2, 1, 0, 9401), (3, 1, 1, 0)])
def test_each_actor_env_reads_back_as_its_worker_env(rank, node_rank, local_rank, metrics_port):
    spec = _spec()
    ports = metrics_ports(9400, ["10.0.0.7", "10.0.0.7"])
    environ = torchrun_environ(spec, rank, ("10.0.0.7", 29500), "/models/tiny", resume=False,
                               metrics_port=ports[node_rank])
    env = worker_env_from_environ(spec, "job", environ)
    assert (env.rank, env.world_size, env.node_rank, env.num_nodes) == (rank, 4, node_rank, 2)
    assert (env.local_rank, env.local_world_size, env.device_index) == (local_rank, 2, 0)
    assert (env.master_addr, env.master_port, env.model_dir) == ("10.0.0.7", 29500, "/models/tiny")
    assert env.resume is False and env.metrics_port == metrics_port


def test_ray_address_is_a_spec_field():
    assert _spec(ray={"address": "auto"}).ray.address == "auto"
    assert _spec().ray.address is None


def test_nodes_on_their_own_hosts_share_the_metrics_port_and_nodes_on_one_host_take_the_next():
    assert metrics_ports(9400, ["10.0.0.1", "10.0.0.2", "10.0.0.1"]) == [9400, 9400, 9401]
    assert metrics_ports(0, ["10.0.0.1", "10.0.0.1"]) == [0, 0]


def test_failure_message_puts_the_lost_actor_first_and_shortens_its_peers_errors():
    class ActorDied(Exception):
        pass

    places = [{"node_id": "a" * 28, "ip": "10.0.0.1", "pid": 100 + r} for r in range(4)]
    peer = RuntimeError("\x1b[36mray::RayWorker.run()\x1b[39m\n  File ...\nRuntimeError: Connection closed by peer")
    text = failure_message([(2, peer), (1, ActorDied("The actor died unexpectedly"))], places, ActorDied)
    assert text.splitlines() == [
        "2 worker(s) stopped; the job was stopped and its actors released.",
        "rank 1 on Ray node aaaaaaaaaaaa 10.0.0.1 (pid 101) lost (its process or Ray node died): "
        "The actor died unexpectedly",
        "rank 2 on Ray node aaaaaaaaaaaa 10.0.0.1 (pid 102) failed: RuntimeError: Connection closed by peer"]


def test_a_dead_gcs_address_is_reported_at_once_not_retried(tmp_path, monkeypatch):
    import socket

    from distflow.ray_launcher import gcs_unreachable

    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        assert gcs_unreachable(f"127.0.0.1:{port}") is None
    # closed now: refused at once (Ray would retry it for minutes)
    assert "nothing answers at 127.0.0.1:" in gcs_unreachable(f"127.0.0.1:{port}", timeout_s=2)
    # auto: RAY_ADDRESS, else the address file a killed `ray start` left behind
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    # no file: distflow's own words, not Ray's text about an --address flag
    assert "no Ray cluster was started on this machine" in gcs_unreachable("auto")
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{port}\n")
    assert "nothing answers" in gcs_unreachable("auto", timeout_s=2)
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    assert "nothing answers" in gcs_unreachable("auto", timeout_s=2)
    for not_checked in ("ray://127.0.0.1:1", "not-a-host", "host:port"):
        assert gcs_unreachable(not_checked) is None


@pytest.mark.parametrize("cluster, ray, setting", [
    ({"device": "cuda"}, {"gpusPerWorker": 0.5}, "spec.ray.gpusPerWorker: 0.5 GPUs per worker: "),
    ({"device": "auto"}, {"gpusPerWorker": 0.25}, "spec.ray.gpusPerWorker: 0.25 GPUs per worker: "),
    ({"device": "cuda", "acceleratorsPerNode": 1}, {},
     "spec.cluster.acceleratorsPerNode: 1 GPUs for procsPerNode=2 workers give each 0.5 "),
    ({"device": "cuda", "acceleratorsPerNode": 3}, {},
     "spec.cluster.acceleratorsPerNode: 3 GPUs for procsPerNode=2 workers give each 1.5 "),
])
def test_a_fraction_of_a_gpu_per_worker_is_refused_naming_the_setting(cluster, ray, setting):
    with pytest.raises(DistflowConfigError) as err:
        worker_resources(_spec(cluster=cluster, ray=ray))
    message = str(err.value)
    assert setting in message and "each worker needs whole GPUs of its own" in message
    assert "ray.gpusPerWorker: 1, or cluster.acceleratorsPerNode: 2" in str(err.value)


def test_whole_gpus_per_worker_and_cpu_jobs_are_accepted():
    assert worker_resources(_spec(cluster={"device": "cuda"}, ray={"gpusPerWorker": 2})).num_gpus == 2.0
    assert worker_resources(_spec(cluster={"device": "cuda", "acceleratorsPerNode": 4})).num_gpus == 2.0
    # a CPU job's workers never touch the GPUs it reserves, so sharing one harms nothing
    assert worker_resources(_spec(ray={"gpusPerWorker": 0.5})).num_gpus == 0.5


def test_ray_auto_without_a_cluster_fails_with_distflows_message(tmp_path, monkeypatch):
    from distflow.errors import LaunchError
    from distflow.ray_launcher import launch_ray

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    with pytest.raises(LaunchError) as err:
        launch_ray(_spec(), "job", "auto")
    assert str(err.value).startswith("no Ray cluster at 'auto': no Ray cluster was started on this machine")
    assert "ray start --head" in str(err.value) and "--address" not in str(err.value)


def test_a_user_function_raising_in_an_actor_fails_the_job_with_its_own_message():
    from types import SimpleNamespace

    from distflow.errors import UserFunctionError
    from distflow.ray_launcher import user_function_failure

    raised = UserFunctionError("data.rewardFn 'r.py:score' raised KeyError: 'x' at step 2 on sample train-3")
    lost, failed = SimpleNamespace(cause=None), SimpleNamespace(cause=raised)
    assert str(user_function_failure([(0, lost), (1, failed)])) == str(raised)
    assert user_function_failure([(0, lost), (1, SimpleNamespace(cause=RuntimeError("peer gone")))]) is None
