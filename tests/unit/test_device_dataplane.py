"""Step data stays on its device through the data coordinator's edges.

No accelerator here: the ``meta`` device stands in for one. A meta tensor
cannot be copied to the host (``.cpu()`` raises), so any host round trip of
the batch in the coordinator's edge path fails these tests; the exchange is
replaced by a recorder (gloo moves CPU tensors only). Which pieces go through
the node buffer on CUDA is checked in test_planning_at_scale.py
(``rank_wire_sizes``): none.
"""

import pytest
import torch

from distflow import coordinator as coordinator_module
from distflow.coordinator import DataCoordinator
from distflow.data.batch import PackedBatch
from distflow.data.counters import TransferCounters
from distflow.planner import build_plan
from distflow.spec import parse_spec

pytestmark = pytest.mark.unit

META = torch.device("meta")


def _batch(device: torch.device) -> PackedBatch:
    """Three samples of 2, 3 and 1 tokens."""
    return PackedBatch(torch.tensor([2, 3, 1]),
                       {"input_ids": torch.arange(6, device=device),
                        "response_mask": torch.ones(6, dtype=torch.int8, device=device)},
                       {"group_index": torch.tensor([0, 0, 1], device=device)})


@pytest.fixture
def recorded_exchange(monkeypatch):
    """Replace the collective with a recorder that returns the batch it was given."""
    seen = []

    def fake_exchange(batch, plan, group, counters, edge, **kwargs):
        seen.append((batch.device, plan.rank, edge))
        return batch

    monkeypatch.setattr(coordinator_module, "exchange", fake_exchange)
    return seen


def _coordinator(device=None) -> DataCoordinator:
    spec = parse_spec({"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 4},
                       "rollout": {"n": 2}, "cluster": {"numNodes": 1}})
    kwargs = {} if device is None else {"device": device}
    return DataCoordinator(spec, build_plan(spec), 0, TransferCounters(), **kwargs)


def test_a_batch_produced_on_a_device_stays_there_through_an_edge(recorded_exchange):
    coordinator = _coordinator()
    coordinator.produce("rollout", _batch(META))
    coordinator.regroup([[2, 0, 1]], "rollout->actor")
    assert recorded_exchange == [(META, 0, "rollout->actor")]
    assert coordinator.batch.device == META
    assert all(v.device == META for v in coordinator.batch.sample_fields.values())


def test_produce_moves_host_output_to_the_step_device_once(recorded_exchange):
    coordinator = _coordinator(device=META)
    coordinator.produce("rollout", _batch(torch.device("cpu")))
    assert coordinator.batch.device == META  # origin_rank / origin_index made there too
    coordinator.regroup([[1, 2, 0]], "rollout->reward")
    assert recorded_exchange[0][0] == META and coordinator.batch.device == META


def test_fields_a_stage_computes_on_the_host_join_the_batch_device():
    scores = torch.tensor([1.0, 0.0, 0.5])
    out = _batch(META).with_fields(token={"token_level_scores": torch.zeros(6)}, sample={"scores": scores})
    assert out.token_fields["token_level_scores"].device == META
    assert out.sample_fields["scores"].device == META
    host = _batch(torch.device("cpu")).with_fields(sample={"scores": scores})
    assert host.sample_fields["scores"] is scores  # already there: no copy
