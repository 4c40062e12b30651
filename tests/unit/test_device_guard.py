"""The device guard on CPU: what it records, and DAPO's group filter held to it."""

import pytest
import torch

from distflow.algorithms import groups_with_signal
from distflow.data.batch import PackedBatch
from distflow.device_guard import DEVICE, HOST, DeviceGuard, tag_of
from distflow.engines.rollout import pack_responses

pytestmark = pytest.mark.unit


def _in_module(module: str, source: str):
    """A function ``probe`` defined as if in distflow module ``module``."""
    namespace = {"__name__": module, "torch": torch}
    exec(compile(source, f"<{module}>", "exec"), namespace)
    return namespace["probe"]


def _rules(guard: DeviceGuard) -> list[tuple[str, str]]:
    return [(v["rule"], v["where"].split(" <- ")[0].rsplit(":", 1)[0]) for v in guard.violations]


def test_a_factory_without_device_is_recorded_in_stages_algorithms_and_engines_only():
    source = "def probe(x):\n    return torch.zeros(3), torch.zeros(3, device=x.device), torch.zeros_like(x)\n"
    guard = DeviceGuard(torch.device("cpu"))
    with guard:
        x = torch.ones(3, device=guard.step_device)
        for module in ("distflow.algorithms.probe", "distflow.stages.probe", "distflow.engines.probe",
                       "distflow.data.probe", "transformers.probe"):
            _in_module(module, source)(x)
    assert _rules(guard) == [("factory", "distflow.algorithms.probe:probe"), ("factory", "distflow.stages.probe:probe"),
                             ("factory", "distflow.engines.probe:probe")]
    assert "torch.zeros without device=" in guard.violations[0]["message"]


def test_residency_follows_the_device_a_tensor_was_made_or_moved_with():
    probe = _in_module("distflow.data.probe", (
        "def probe(x):\n"
        "    host = torch.arange(3)\n"
        "    return host, torch.zeros(3, device=host.device), x.cpu(), host.to(x.device), x + 1, "
        "torch.zeros(2, device='cpu')\n"))
    guard = DeviceGuard(torch.device("cpu"))
    with guard:
        x = torch.ones(3, device=guard.step_device)
        outs = probe(x)
    assert [tag_of(t) for t in outs] == [HOST, HOST, HOST, DEVICE, DEVICE, HOST]
    assert tag_of(x) == DEVICE  # x.cpu() returned a view: the caller's x is still on the device
    assert guard.violations == []


def test_an_op_mixing_device_and_host_tensors_is_recorded_and_a_host_scalar_is_not():
    probe = _in_module("distflow.data.probe", (
        "def probe(x):\n"
        "    return x * torch.tensor(2.0), torch.cat([x, torch.arange(3.0)])\n"))
    guard = DeviceGuard(torch.device("cpu"))
    with guard:
        probe(torch.ones(3, device=guard.step_device))
    assert _rules(guard) == [("mix", "distflow.data.probe:probe")]
    assert guard.violations[0]["message"].startswith("torch.cat mixes device tensors with host tensors of shapes (3,)")


def test_dapo_group_signal_builds_nothing_on_the_host_from_device_scores():
    guard = DeviceGuard(torch.device("cpu"))
    with guard:
        scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.5, 0.5], device=guard.step_device)
        groups = torch.tensor([0, 0, 1, 1, 2, 2], device=guard.step_device)
        signal = groups_with_signal(scores, groups)
    assert signal.tolist() == [True, True, False, False, False, False]
    assert tag_of(signal) == DEVICE and guard.violations == []


def test_a_refill_round_is_packed_on_the_device_of_the_round_it_joins():
    """DAPO concatenates round 0 (step data, on the device) with refill rounds the engine packs."""
    guard = DeviceGuard(torch.device("cpu"))
    with guard:
        first = pack_responses([([1, 2], [3])], [0], guard.step_device)
        refill = pack_responses([([4], [5, 6])], [1], guard.step_device)
        both = PackedBatch.concat([first, refill])
    assert both.token_fields["input_ids"].tolist() == [1, 2, 3, 4, 5, 6]
    assert tag_of(both.token_fields["input_ids"]) == DEVICE and guard.violations == []


def test_the_guard_is_off_without_the_variable_and_appends_each_violation_once_with_it(tmp_path):
    from contextlib import nullcontext

    from distflow.device_guard import guard_from_environ

    assert isinstance(guard_from_environ(torch.device("cpu"), {}), nullcontext)
    report = tmp_path / "guard.jsonl"
    guard = guard_from_environ(torch.device("cpu"), {"DISTFLOW_DEVICE_GUARD": str(report)})
    probe = _in_module("distflow.stages.probe", "def probe():\n    return torch.ones(2)\n")
    for _ in range(2):  # the worker re-enters its guard every step
        with guard:
            for _ in range(2):
                probe()
    lines = report.read_text().splitlines()
    assert len(lines) == 1 and '"rule": "factory"' in lines[0] and "distflow.stages.probe:probe:2" in lines[0]
