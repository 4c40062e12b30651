"""The asynchronous mode's pure parts: the spec's checks, the pooled plan, the cross-pool
target, and the weight sync's buckets."""

import pytest
import yaml

from distflow.coordinator import even_split, from_pool_view, pool_view
from distflow.errors import DistflowConfigError
from distflow.planner import ROLLOUT, TRAIN, build_plan
from distflow.spec import parse_spec

pytestmark = pytest.mark.unit


def _spec(nodes=3, per_node=2, batch=8, **over):
    doc = {"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": batch},
           "cluster": {"numNodes": nodes, "procsPerNode": per_node},
           "async": {"enable": True, "maxStaleness": 1, "rolloutPool": {"numNodes": 1}}}
    for key, value in over.items():
        doc[key] = {**doc.get(key, {}), **value}
    return parse_spec(doc)


def test_the_trainer_pool_takes_the_first_ranks_and_the_rollout_pool_the_last_nodes():
    plan = build_plan(_spec())
    train, rollout = plan.layouts[TRAIN], plan.layouts[ROLLOUT]
    assert (train.first_rank, train.dp_size, rollout.first_rank, rollout.dp_size) == (0, 4, 4, 2)
    assert [r for r in range(6) if train.holds(r)] == [0, 1, 2, 3]
    assert [rollout.dp_rank(r) for r in (4, 5)] == [0, 1]
    assert plan.pooled and plan.staleness == 1
    # stale samples are corrected with the trainer's own log-probs: an old_log_prob pass is planned
    assert [n.id for n in plan.chain] == ["rollout", "reward", "advantage", "reference", "old_log_prob",
                                          "actor_update"]
    text = plan.describe()
    assert "asynchronous: maxStaleness=1" in text
    assert "layout train    dp=4 tp=1 balanced=yes pool=trainer ranks 0-3 nodes 0-1" in text
    assert "layout rollout  dp=2 tp=1 balanced=no  pool=rollout ranks 4-5 node 2" in text
    layouts = [line for line in text.splitlines() if line.startswith("layout ")]
    assert len({line.index(" pool=") for line in layouts}) == 1, layouts  # one column
    assert len({line.index(" rank") for line in layouts}) == 1, layouts
    assert "advantage -> actor_update: redistribute (cross-pool: rollout ranks -> trainer ranks" in text


def test_a_pool_of_one_rank_reads_rank_n_not_a_range():
    text = build_plan(_spec(per_node=1)).describe()
    assert "pool=rollout rank 2 node 2" in text and "pool=trainer ranks 0-1 nodes 0-1" in text


def test_on_policy_or_uncorrected_plans_no_old_log_prob_pass():
    for change in ({"maxStaleness": 0}, {"offPolicyCorrection": "none"}):
        plan = build_plan(_spec(**{"async": {"enable": True, "rolloutPool": {"numNodes": 1}, **change}}))
        assert "old_log_prob" not in [n.id for n in plan.chain]


def test_sync_mode_keeps_every_rank_in_both_layouts():
    plan = build_plan(parse_spec({"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}},
                                  "cluster": {"numNodes": 2, "procsPerNode": 2}}))
    assert not plan.pooled and plan.layouts[ROLLOUT].first_rank == plan.layouts[TRAIN].first_rank == 0
    assert "pool=" not in plan.describe()


def test_sizes_are_checked_per_pool():
    # 2 prompts over the rollout pool's 2 ranks (sync mode would need a multiple of 6 workers)
    assert _spec(batch=2).data.train_batch_size == 2
    with pytest.raises(ValueError, match=r"data.trainBatchSize: 3 prompts cannot be split evenly over 2 rollout "
                       r"dp ranks \(the rollout pool's workers: async.rolloutPool.numNodes x cluster.procsPerNode\)"):
        _spec(batch=3)
    # HSDP degrees tile the trainer pool's 4 ranks, not the job's 6
    assert _spec(cluster={"dataParallelReplicateDegree": 2}).cluster.data_parallel_replicate_degree == 2
    with pytest.raises(ValueError, match=r"cluster.dataParallelReplicateDegree: 3 does not divide the 4 workers"):
        _spec(cluster={"dataParallelReplicateDegree": 3})


@pytest.mark.parametrize("change, message", [
    ({"async": {"enable": True, "rolloutPool": {"numNodes": 3}}},
     "async.rolloutPool.numNodes: 3 of the job's 3 nodes (cluster.numNodes) leaves none to train; use at most 2"),
    ({"rollout": {"engine": "vllm", "tensorParallelSize": 2}},
     "rollout.tensorParallelSize: 2; in the asynchronous mode each rollout worker runs its own vLLM engine with "
     "tensor parallelism 1; set it to 1"),
    ({"dataPlane": {"mode": "centralized"}}, "dataPlane.mode: centralized routes every edge through rank 0"),
    ({"rollout": {"tisImpRatioCap": 2.0}}, "rollout.tisImpRatioCap: the asynchronous mode's correction has its own"),
])
def test_what_the_asynchronous_mode_refuses_names_the_field(change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _spec(**change)


def test_a_one_node_job_is_told_the_asynchronous_mode_needs_two_nodes_not_at_most_zero():
    with pytest.raises(ValueError) as err:
        parse_spec({"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}},
                    "async": {"enable": True}})
    text = str(err.value)
    assert ("async.rolloutPool.numNodes: 1 of the job's 1 nodes (cluster.numNodes) leaves none to train; the "
            "asynchronous mode needs at least 2 nodes (one trains, one generates): set cluster.numNodes >= 2, "
            "or async.enable: false") in text, text
    assert "at most 0" not in text


def test_the_vllm_engine_generates_in_the_rollout_pool_with_tensor_parallelism_one():
    spec = _spec(rollout={"engine": "vllm"})
    assert spec.rollout.engine == "vllm" and spec.rollout.tensor_parallel_size == 1
    assert build_plan(spec).pooled


def test_dynamic_sampling_and_nodes_after_the_crossing_are_refused_by_the_planner():
    with pytest.raises(ValueError, match=r"spec.async.enable: dynamic sampling \(algorithm.filterGroups\)"):
        _spec(algorithm={"filterGroups": {"enable": True}})
    nodes = [{"id": "gen", "role": "rollout", "kind": "inference"},
             {"id": "score", "role": "reward", "kind": "compute", "deps": ["gen"]},
             {"id": "ref", "role": "reference", "kind": "inference", "deps": ["score"]},
             {"id": "adv", "role": "advantage", "kind": "compute", "deps": ["ref"]},
             {"id": "act", "role": "actor", "kind": "train", "deps": ["adv"]}]
    with pytest.raises(DistflowConfigError, match="spec.async.enable: node 'adv' \\(role advantage\\) needs the "
                                                   "rollout placement after 'ref'"):
        build_plan(_spec(workflow={"nodes": nodes}, algorithm={"useKlLoss": False},
                         **{"async": {"enable": True, "offPolicyCorrection": "none",
                                      "rolloutPool": {"numNodes": 1}}}))


def test_cross_pool_targets_are_planned_as_if_the_rollout_ranks_were_the_trainers():
    plan = build_plan(_spec())
    train, rollout = plan.layouts[TRAIN], plan.layouts[ROLLOUT]
    holdings = [[], [], [], [], [0, 1, 2], [3, 4, 5]]
    assert pool_view(holdings, rollout, train) == [[0, 1, 2], [3, 4, 5], [], []]
    assert from_pool_view([[0, 1], [2, 3], [4], [5]], train, 6) == [[0, 1], [2, 3], [4], [5], [], []]
    with pytest.raises(ValueError, match="beyond the 4 of pool train"):
        from_pool_view([[0], [1], [2], [3], [4]], train, 6)
    assert even_split([0, 1, 2, 3, 4, 5, 6], 3) == [[0, 1, 2], [3, 4], [5, 6]]


def test_weight_sync_buckets_group_consecutive_parameters_under_the_bound():
    from distflow.pools.weight_sync import Bucket, plan_buckets

    assert plan_buckets([10, 20, 5, 100, 1], element_size=4, bucket_bytes=120) == [
        Bucket((0, 1), 30), Bucket((2,), 5), Bucket((3,), 100), Bucket((4,), 1)]
    assert plan_buckets([3, 3], element_size=2, bucket_bytes=1 << 20) == [Bucket((0, 1), 6)]
    with pytest.raises(ValueError):
        plan_buckets([1], element_size=4, bucket_bytes=0)


def test_validate_says_how_the_asynchronous_mode_splits_the_workers(tmp_path, capsys):
    from distflow import cli

    config = tmp_path / "job.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 4},
        "cluster": {"numNodes": 3, "procsPerNode": 2},
        "async": {"enable": True, "maxStaleness": 2, "rolloutPool": {"numNodes": 1}}}))
    assert cli.main(["validate", str(config)]) == 0
    assert capsys.readouterr().out == (f"{config}: valid (6 workers: 4 train, 2 generate in the rollout pool, "
                                       "async.maxStaleness 2; workflow grpo)\n")


def test_a_tis_cap_without_tis_is_refused_rather_than_ignored():
    with pytest.raises(ValueError) as err:
        _spec(**{"async": {"enable": True, "offPolicyCorrection": "none", "tisCap": 5,
                           "rolloutPool": {"numNodes": 1}}})
    assert ("spec.async.tisCap: only async.offPolicyCorrection: tis uses it (it is none); remove async.tisCap "
            "or set async.offPolicyCorrection: tis") in str(err.value), str(err.value)
