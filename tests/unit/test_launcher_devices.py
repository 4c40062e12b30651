"""Which GPU each worker takes, and the device-count check before any worker starts (no GPU needed)."""

from dataclasses import replace

import pytest
import torch

from distflow import launcher
from distflow.errors import DistflowConfigError
from distflow.spec import parse_spec
from distflow.worker import WorkerEnv

pytestmark = pytest.mark.unit


def _spec(num_nodes: int, procs_per_node: int, device: str = "cuda"):
    return parse_spec({"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}},
                       "cluster": {"numNodes": num_nodes, "procsPerNode": procs_per_node, "device": device}})


def _base(spec) -> WorkerEnv:
    return WorkerEnv(rank=0, world_size=spec.world_size, local_rank=0, local_world_size=spec.world_size,
                     node_rank=0, num_nodes=spec.cluster.num_nodes, master_addr="127.0.0.1", master_port=0,
                     job_name="job", model_dir="", device_index=0)


def _local_envs(monkeypatch, spec) -> list[WorkerEnv]:
    """The WorkerEnv of each local worker, as ``launch_local``'s processes build them."""
    import distflow.entry

    seen = []
    monkeypatch.setattr(distflow.entry, "run_worker", lambda spec, env, progress: seen.append(env))
    monkeypatch.setattr(launcher, "_die_with_parent", lambda: None)
    for index in range(spec.world_size):
        launcher._local_worker_main(index, spec, _base(spec), False)
    return seen


def test_two_local_nodes_of_four_take_gpus_0_to_7(monkeypatch):
    envs = _local_envs(monkeypatch, _spec(2, 4))
    assert [(e.rank, e.node_rank, e.local_rank) for e in envs] == [
        (0, 0, 0), (1, 0, 1), (2, 0, 2), (3, 0, 3), (4, 1, 0), (5, 1, 1), (6, 1, 2), (7, 1, 3)]
    assert [e.device_index for e in envs] == list(range(8))


def test_pod_workers_take_gpus_by_local_rank(monkeypatch):
    import distflow.entry

    seen = []
    monkeypatch.setattr(distflow.entry, "run_worker", lambda spec, env, progress: seen.append(env))
    spec = _spec(2, 4)
    base = replace(_base(spec), rank=4, node_rank=1, local_world_size=4)
    for local_rank in range(4):
        launcher._node_worker_main(local_rank, spec, base, 4, 0)
    assert [(e.rank, e.device_index) for e in seen] == [(4, 0), (5, 1), (6, 2), (7, 3)]


@pytest.fixture
def gpus(monkeypatch):
    """A machine with a settable number of GPUs; ``set_device`` records the index."""
    state = {"count": 8, "chosen": []}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: state["count"] > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: state["count"])
    monkeypatch.setattr(torch.cuda, "set_device", state["chosen"].append)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["chosen"][-1])
    return state


def test_worker_five_of_eight_runs_on_gpu_five(gpus):
    from distflow.engines.fsdp import select_device

    assert select_device("cuda", 5).device == torch.device("cuda", 5)


def test_a_worker_past_the_last_gpu_is_an_error_not_a_shared_gpu(gpus):
    from distflow.engines.fsdp import select_device

    gpus["count"] = 4
    with pytest.raises(ValueError, match="cluster.procsPerNode"):
        select_device("cuda", 5)


@pytest.mark.parametrize("nodes, procs, device, count, ok", [
    (2, 4, "cuda", 8, True),
    (2, 4, "cuda", 4, False),   # the 8 local workers of 2 "nodes" share one machine's 4 GPUs
    (2, 4, "auto", 4, False),   # auto would pick cuda, and 4 GPUs are too few
    (2, 4, "auto", 0, True),    # auto without GPUs: CPU
    (2, 4, "cpu", 0, True),
])
def test_local_launch_checks_the_machine_has_a_gpu_per_worker(nodes, procs, device, count, ok):
    spec = _spec(nodes, procs, device)
    if ok:
        launcher.check_local_devices(spec, count)
        return
    with pytest.raises(DistflowConfigError) as err:
        launcher.check_local_devices(spec, count)
    message = str(err.value)
    assert "cluster.numNodes" in message and "cluster.procsPerNode" in message
    assert f"{nodes * procs} " in message and f"{count} " in message


def test_local_cuda_run_without_gpus_says_so():
    with pytest.raises(DistflowConfigError, match="cuda requested but torch sees no GPU"):
        launcher.check_local_devices(_spec(1, 2), 0)


def test_pod_launch_checks_its_gpus_against_procs_per_node():
    launcher.check_node_devices(_spec(2, 4), 4)
    with pytest.raises(DistflowConfigError, match="cluster.procsPerNode=4"):
        launcher.check_node_devices(_spec(2, 4), 2)
