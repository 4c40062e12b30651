"""A CUDA run's process group serves CPU tensors too, and every group is created in one place.

No GPU here: the CUDA machine is faked (``torch.cuda`` queries), and the rest
is a scan of every torch.distributed call site of the runtime.
"""

import ast
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.unit

RUNTIME = Path(__file__).resolve().parents[2] / "worker_image" / "distflow"


@pytest.fixture
def fake_cuda_machine(monkeypatch):
    """torch reports 8 GPUs; ``set_device`` records the index."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: chosen[-1])
    return chosen


def test_cuda_run_backend_serves_cpu_tensors_with_gloo_and_cuda_tensors_with_nccl(fake_cuda_machine):
    from distflow.engines.fsdp import select_device
    from distflow.process_group import device_backends

    info = select_device("cuda", 3)
    assert info.device == torch.device("cuda", 3)
    assert device_backends(info.backend) == {"cpu": "gloo", "cuda": "nccl"}


def test_cpu_run_uses_gloo():
    from distflow.engines.fsdp import select_device

    info = select_device("cpu", 0)
    assert (info.device, info.backend) == (torch.device("cpu"), "gloo")


@pytest.mark.parametrize("backend, wire", [("gloo", "cpu"), ("nccl", "cuda"), ("cpu:gloo,cuda:nccl", "cuda")])
def test_data_plane_moves_its_bulk_on_the_device_backend(backend, wire):
    from distflow.process_group import wire_device_type

    assert wire_device_type(backend) == wire


GROUP_CREATION = {"init_process_group", "new_group", "new_subgroups", "new_subgroups_by_enumeration",
                  "split_group"}
BACKEND_QUERIES = {"get_backend", "get_backend_config"}


def _distributed_calls(path: Path) -> list[tuple[str, int]]:
    """(function, line) of every call to a torch.distributed function in ``path``."""
    tree = ast.parse(path.read_text())
    aliases = {"torch.distributed"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name == "torch.distributed"}
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = ast.unparse(node.func.value)
            if owner in aliases:
                calls.append((node.func.attr, node.lineno))
        if isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            calls += [(a.name, node.lineno) for a in node.names if a.name in GROUP_CREATION | BACKEND_QUERIES]
    return calls


def test_process_groups_are_created_and_their_backends_read_only_in_process_group_module():
    """Every collective runs on the world group (or the FSDP mesh built on it), whose backend
    ``process_group.backend_for`` chose; the wire device is derived from it in one place."""
    offenders = []
    for path in sorted(RUNTIME.rglob("*.py")):
        if path.name == "process_group.py":
            continue
        for name, line in _distributed_calls(path):
            if name in GROUP_CREATION | BACKEND_QUERIES:
                offenders.append(f"{path.relative_to(RUNTIME)}:{line} dist.{name}")
    assert offenders == [], "create groups / read backends through distflow.process_group:\n" + "\n".join(offenders)


def test_the_scan_sees_the_runtime_collectives():
    """The scan is not vacuous: it finds the collectives of the data plane and the worker."""
    found = {name for path in RUNTIME.rglob("*.py") for name, _ in _distributed_calls(path)}
    assert {"all_gather", "all_to_all_single", "all_reduce", "barrier"} <= found


def test_joiners_that_waited_long_for_the_store_connect_within_two_seconds_of_it_coming_up():
    """A joining rollout worker loads before the running pool's store is served (it waits at
    ``join_store``); torch's client alone backs off exponentially with jitter and connected
    0.2-5.8 s after a store that came up 12 s late, while the pool trains steps of 0.2 s (the grow
    never happened before the tiny job ended, CI of 3d7c579). Three joiners, so that torch's
    jitter alone rarely passes: each must connect within 2 s, with attempts of 0.25 s (with 0.5 s
    attempts and a 1.5 s bound, one connected 1.51 s after on 2 busy cores: three threads start
    their clients under one GIL)."""
    import threading
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from distflow.process_group import join_store
    from tests.dist._spawn import free_port

    port, connected = free_port(), {}

    def joiner(n):
        store = join_store("127.0.0.1", port, timeout_s=120.0, attempt_s=0.25)
        value = store.get("distflow/generation")  # waits for the key, as join() does
        connected[n] = (time.monotonic(), value)

    threads = [threading.Thread(target=joiner, args=(n,), daemon=True) for n in range(3)]
    for thread in threads:
        thread.start()
    time.sleep(12.0)
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=30))
    up = time.monotonic()
    server.set("distflow/generation", "0")
    for thread in threads:
        thread.join(30.0)
    assert sorted(connected) == [0, 1, 2] and {value for _, value in connected.values()} == {b"0"}
    delays = sorted(at - up for at, _ in connected.values())
    assert delays[-1] < 2.0, f"connected {delays} s after the store came up"
