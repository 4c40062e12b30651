"""``rollout.engine: vllm`` settings: spec validation, the preflight without vLLM, TIS weights."""

import math

import pytest
import torch

from distflow.errors import DistflowConfigError
from distflow.spec import JobSpec

pytestmark = pytest.mark.unit


def _spec(**rollout):
    return JobSpec.model_validate({"model": {"path": "smollm2"}, "cluster": {"numNodes": 2, "procsPerNode": 2},
                                   "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 4}, "rollout": rollout})


def test_vllm_engine_with_tp_within_a_node_is_accepted():
    spec = _spec(engine="vllm", tensorParallelSize=2, tisImpRatioCap=2.0)  # 2 replicas of 2 prompts, 1 per tp rank
    assert (spec.rollout.engine, spec.rollout.tensor_parallel_size) == ("vllm", 2)
    assert spec.rollout.tis_imp_ratio_cap == 2.0 and spec.rollout.weight_sync_bucket_mb == 64


def test_the_engine_generates_in_the_compute_dtype():
    from distflow.engines.vllm_rollout import vllm_config

    mixed = JobSpec.model_validate({"model": {"path": "smollm2", "mixedPrecision": "bfloat16"},
                                    "data": {"train": {"path": "arithmetic"}}, "rollout": {"engine": "vllm"}})
    assert vllm_config(mixed, "m", "cuda").dtype == "bfloat16"  # master weights stay float32
    assert vllm_config(_spec(engine="vllm"), "m", "cpu").dtype == "float32"


def test_tp_that_does_not_divide_a_nodes_workers_is_rejected_naming_the_field():
    # 4 workers in all (tp 4 divides them) but 2 per node: a replica would span nodes.
    with pytest.raises(ValueError, match=r"rollout.tensorParallelSize: 4 does not divide the 2 workers of a node"):
        _spec(engine="vllm", tensorParallelSize=4)


def test_tis_cap_needs_the_vllm_engine():
    with pytest.raises(ValueError, match=r"rollout.tisImpRatioCap: only the vllm engine"):
        _spec(tisImpRatioCap=2.0)


def test_preflight_rejects_vllm_when_it_is_not_installed(monkeypatch, tmp_path):
    import importlib.util

    from distflow.launcher import check_rollout_engine

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real(name, *a))
    with pytest.raises(DistflowConfigError, match=r"spec.rollout.engine: vllm is not installed"):
        check_rollout_engine(_spec(engine="vllm"), str(tmp_path))
    check_rollout_engine(_spec(), str(tmp_path))  # hf: nothing to check


def test_truncated_is_weights_cap_the_ratio_of_actor_to_rollout_probabilities():
    from distflow.engines.actor import truncated_is_weights

    old = torch.tensor([[math.log(0.5), math.log(0.9), math.log(0.2)]])
    rollout = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.4)]])
    weights = truncated_is_weights(old, rollout, cap=2.0)
    assert torch.allclose(weights, torch.tensor([[1.0, 2.0, 0.5]]))  # 0.9/0.3 = 3 is capped at 2


def test_prompts_a_replica_cannot_share_over_its_tp_ranks_are_rejected():
    # 4 workers, tp 2: 2 replicas of 2 prompts each would be fine; 6 prompts give 3 per replica.
    with pytest.raises(ValueError, match=r"data.trainBatchSize: 6 prompts give each of the 2 vLLM replicas 3"):
        JobSpec.model_validate({"model": {"path": "smollm2"}, "cluster": {"numNodes": 2, "procsPerNode": 2},
                                "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 6},
                                "rollout": {"engine": "vllm", "tensorParallelSize": 2}})
