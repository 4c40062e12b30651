"""ppo and dapo: the defaults each workflow implies, their validation, and their plans."""

from __future__ import annotations

import pytest

from distflow.errors import DistflowConfigError
from distflow.planner import ROLLOUT, TRAIN, build_plan
from distflow.spec import dump_spec, parse_spec

pytestmark = pytest.mark.unit

MINIMAL = {"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 8},
           "cluster": {"numNodes": 2}}


def _spec(workflow="grpo", **over):
    return parse_spec({**MINIMAL, "workflow": {"name": workflow}, **over})


def _chain(spec):
    return [(n.id, n.placement) for n in build_plan(spec).chain]


def test_dapo_implies_clip_higher_no_kl_dynamic_sampling_and_overlong_shaping():
    alg = _spec("dapo").algorithm
    assert (alg.clip_ratio_low, alg.clip_ratio_high, alg.loss_agg_mode) == (0.2, 0.28, "token-mean")
    assert not alg.use_kl_loss and alg.filter_groups.enable and alg.overlong_buffer.enable
    assert _spec().algorithm.clip_ratio_high == 0.2 and not _spec().algorithm.filter_groups.enable


def test_values_set_explicitly_win_over_workflow_defaults_in_either_spelling():
    camel = _spec("dapo", algorithm={"clipRatioHigh": 0.3, "filterGroups": {"maxNumGenBatches": 2}})
    snake = _spec("dapo", algorithm={"clip_ratio_high": 0.3, "filter_groups": {"enable": False}})
    assert camel.algorithm.clip_ratio_high == 0.3 and snake.algorithm.clip_ratio_high == 0.3
    assert camel.algorithm.filter_groups.enable and camel.algorithm.filter_groups.max_num_gen_batches == 2
    assert not snake.algorithm.filter_groups.enable
    # the stored spec shows the effective values, and reads back to the same spec
    assert parse_spec(dump_spec(camel)) == camel


def test_ppo_implies_gae_without_kl_loss_and_rejects_group_estimators():
    alg = _spec("ppo").algorithm
    assert alg.advantage_estimator == "gae" and not alg.use_kl_loss
    with pytest.raises(DistflowConfigError, match="spec.algorithm.advantageEstimator: the ppo workflow"):
        _spec("ppo", algorithm={"advantageEstimator": "grpo"})


@pytest.mark.parametrize("over, path", [
    ({"critic": {"ppoMiniBatchSize": 3}}, "spec.critic.ppoMiniBatchSize"),
    ({"algorithm": {"overlongBuffer": {"enable": True, "length": 100}}}, "spec.algorithm.overlongBuffer.length"),
    ({"algorithm": {"filterGroups": {"enable": True}}, "rollout": {"n": 1}}, "spec.algorithm.filterGroups.enable"),
    ({"algorithm": {"klPenalty": "k4"}}, "spec.algorithm.klPenalty"),
    ({"algorithm": {"klCtrl": {"type": "pid"}}}, "spec.algorithm.klCtrl.type"),
    ({"critic": {"lossAggMode": "sum"}}, "spec.critic.lossAggMode"),
])
def test_bad_ppo_and_dapo_options_name_their_field(over, path):
    with pytest.raises(DistflowConfigError) as info:
        _spec(**over)
    assert any(p.startswith(path + ":") for p in info.value.problems), info.value.problems


def test_ppo_plan_runs_values_gae_and_both_updates_on_the_train_layout():
    assert _chain(_spec("ppo")) == [
        ("rollout", ROLLOUT), ("reward", ROLLOUT), ("values", TRAIN), ("advantage", TRAIN),
        ("critic_update", TRAIN), ("actor_update", TRAIN)]


def test_kl_in_reward_plans_reference_old_log_probs_and_shaping_before_gae():
    plan = build_plan(_spec("ppo", algorithm={"useKlInReward": True}))
    assert [n.id for n in plan.chain] == ["rollout", "reward", "reference", "old_log_prob", "values",
                                          "reward_shaping", "advantage", "critic_update", "actor_update"]
    assert plan.node("reward_shaping").deps == ("reward", "reference", "old_log_prob")
    assert plan.node("advantage").deps == ("reward_shaping", "values")
    # kl in the reward, not in the loss: the actor does not read the reference
    assert "reference" not in plan.node("actor_update").deps


def test_dapo_plan_samples_dynamically_before_any_model_pass():
    assert _chain(_spec("dapo")) == [
        ("rollout", ROLLOUT), ("reward", ROLLOUT), ("dynamic_sampling", ROLLOUT),
        ("reward_shaping", ROLLOUT), ("advantage", ROLLOUT), ("actor_update", TRAIN)]
    plan = build_plan(_spec("dapo", algorithm={"useKlLoss": True}))
    assert plan.node("reference").deps == ("dynamic_sampling",)


def _nodes(*nodes):
    return {"nodes": [dict(zip(("id", "role", "kind", "deps"), n)) for n in nodes]}


def test_a_model_pass_that_could_run_before_dynamic_sampling_is_rejected():
    wf = _nodes(("gen", "rollout", "inference", []), ("score", "reward", "compute", ["gen"]),
                ("ref", "reference", "inference", ["gen"]), ("filter", "filter_groups", "compute", ["score"]),
                ("adv", "advantage", "compute", ["filter"]), ("train", "actor", "train", ["adv", "ref"]))
    with pytest.raises(DistflowConfigError, match="'ref' must depend .* on the filter_groups node 'filter'"):
        build_plan(parse_spec({**MINIMAL, "workflow": wf}))


def test_a_critic_without_values_is_rejected():
    wf = _nodes(("gen", "rollout", "inference", []), ("score", "reward", "compute", ["gen"]),
                ("adv", "advantage", "compute", ["score"]), ("crit", "critic", "train", ["adv"]),
                ("train", "actor", "train", ["adv"]))
    with pytest.raises(DistflowConfigError, match="a critic node needs a values node"):
        build_plan(parse_spec({**MINIMAL, "workflow": wf}))
