"""Agreement on an in-place resize of the rollout pool (``distflow.pools.elastic``): pure functions."""

from __future__ import annotations

import pytest

from distflow.data.loader import ShardedPromptLoader
from distflow.pools.elastic import PoolSize, agree_on_resize, resized_spec
from distflow.resize import ResizeRequest
from distflow.spec import parse_spec

pytestmark = pytest.mark.unit

NOW = PoolSize(num_nodes=3, rollout_nodes=2)  # 1 trainer node + 2 rollout nodes


def agree(reads, current=NOW, procs=1, batch=4):
    return agree_on_resize(reads, current, procs, batch)


def test_no_request_or_the_running_sizes_change_nothing():
    assert agree([None, None, None]) is None
    assert agree([ResizeRequest(3, 2)] * 3) is None


def test_a_rank_that_saw_the_request_moves_every_rank():
    # the ConfigMap reached only rank 2's node: every rank computes the same target from the gather
    assert agree([None, None, ResizeRequest(2, 1)]) == PoolSize(2, 1)
    assert agree([ResizeRequest(3, 2), None, ResizeRequest(4, 3)], batch=12) == PoolSize(4, 3)


def test_the_lowest_rank_wins_when_reads_differ():
    assert agree([None, ResizeRequest(2, 1), ResizeRequest(4, 3)]) == PoolSize(2, 1)


def test_requests_that_are_not_in_place_are_left_to_the_gang_restart():
    assert agree([ResizeRequest(4, 2)] * 3) is None  # the trainer nodes change
    assert agree([ResizeRequest(2, None)] * 3) is None  # no rollout pool size named


def test_a_size_the_batch_does_not_divide_over_is_no_request():
    # 4 prompts over 3 rollout dp ranks cannot be; over 4 they can
    assert agree([ResizeRequest(4, 3)] * 3, batch=4) is None
    assert agree([ResizeRequest(5, 4)] * 3, batch=4) == PoolSize(5, 4)
    assert agree([ResizeRequest(4, 3)] * 3, procs=2, batch=12) == PoolSize(4, 3)


def test_resized_spec_changes_only_the_two_sizes():
    spec = parse_spec({"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}},
                       "cluster": {"numNodes": 3, "procsPerNode": 2},
                       "async": {"enable": True, "maxStaleness": 2, "rolloutPool": {"numNodes": 2}}})
    out = resized_spec(spec, PoolSize(2, 1))
    assert (out.cluster.num_nodes, out.async_.rollout_pool.num_nodes, out.world_size) == (2, 1, 4)
    assert out.async_.max_staleness == 2 and out.cluster.procs_per_node == 2
    assert out.model_dump(exclude={"cluster", "async_"}) == spec.model_dump(exclude={"cluster", "async_"})


def test_a_resharded_loader_continues_the_stream_at_the_new_dp_size(tmp_path):
    """Two ranks read a step each at dp 2, then the survivor reads the next steps alone: the union of
    what was read is what one rank at dp 1 reads, in order."""
    path = tmp_path / "p.jsonl"
    path.write_text("".join(f'{{"question": "q{i}", "answer": "#### {i}"}}\n' for i in range(16)))
    whole = ShardedPromptLoader(str(path), 4, 0, 1, seed=1)
    expected = [[r.uid for r in whole.next_batch()] for _ in range(3)]
    ranks = [ShardedPromptLoader(str(path), 4, r, 2, seed=1) for r in range(2)]
    first = [r.uid for loader in ranks for r in loader.next_batch()]
    survivor = ranks[0]
    survivor.reshard(0, 1)
    later = [[r.uid for r in survivor.next_batch()] for _ in range(2)]
    assert [first, *later] == expected
    with pytest.raises(ValueError, match="not divisible by dp_size=3"):
        survivor.reshard(0, 3)
