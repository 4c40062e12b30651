"""Every rank computes the balanced plan on its own (floats included); the next metadata
all-gather carries a digest of it, and a disagreement fails loudly on every rank.

Two gloo ranks run the data coordinator for two steps. On rank 1 the
balancer is patched to return another (still complete) plan: the order of
the samples rank 1 is to hold, reversed. The exchange of step 0 completes
(the same pieces move), but the metadata all-gather of step 1 finds two
digests and both ranks raise, naming the digests; unpatched, both steps run.
"""

import pytest
import torch
from _spawn import run_on_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

LENGTHS = [[30, 5, 5, 5], [6, 7, 25, 4]]


def _batch(rank: int, step: int):
    from distflow.data.batch import PackedBatch

    lens = torch.tensor(LENGTHS[rank], dtype=torch.int64) + step
    ids = torch.arange(int(lens.sum()), dtype=torch.int64) + 1000 * rank
    return PackedBatch(lens, {"input_ids": ids}, {})


def _two_steps(rank: int, world: int, disagree: bool) -> dict:
    from distflow import coordinator as coordinator_module
    from distflow.coordinator import DataCoordinator
    from distflow.data.counters import TransferCounters
    from distflow.planner import build_plan
    from distflow.spec import parse_spec

    spec = parse_spec({"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 4},
                       "rollout": {"n": 2}, "cluster": {"numNodes": 2}, "actor": {"sharePromptPrefix": False}})
    plan = build_plan(spec)
    if disagree and rank == 1:
        real = coordinator_module.balanced_assignment

        def reversed_on_rank_1(*args, **kwargs):
            target = real(*args, **kwargs)
            return [target[0], target[1][::-1]]

        coordinator_module.balanced_assignment = reversed_on_rank_1
    coord = DataCoordinator(spec, plan, rank, TransferCounters())
    actor = next(node for node in plan.chain if node.role == "actor")
    out = {"steps": 0}
    try:
        for step in range(2):
            coord.next_step(step)
            coord.produce("rollout", _batch(rank, step))
            coord.ensure(actor)
            out["steps"] += 1
    except RuntimeError as err:
        out["error"] = str(err)
    return out


def test_ranks_that_agree_run_both_steps():
    assert run_on_ranks(_two_steps, 2, False) == [{"steps": 2}, {"steps": 2}]


def test_a_rank_with_another_plan_fails_every_rank_at_the_next_metadata_gather():
    results = run_on_ranks(_two_steps, 2, True)
    for out in results:
        assert out["steps"] == 1, out  # step 0's exchange ran; step 1's metadata all-gather caught it
        assert "disagree" in out["error"] and "plan" in out["error"]
    assert results[0]["error"] == results[1]["error"]
