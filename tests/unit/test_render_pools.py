"""Rendering an asynchronous job (async.enable): two pools of node pods, their labels, the rollout
pool's own resources and placement, and one PodGroup per pool."""

from __future__ import annotations

import pytest

from distflow.errors import DistflowConfigError
from distflow.spec import parse_spec
from distflow_operator import render
from distflow_operator.render import JobRef, NodePool

pytestmark = pytest.mark.unit

OWNER = JobRef(name="grpo", namespace="team-a", uid="0b6c-uid")
ROLLOUT_POOL = {"numNodes": 2, "resources": {"requests": {"cpu": "8"}, "limits": {"memory": "64Gi"}},
                "nodeSelector": {"gpu": "l40s"}, "tolerations": [{"key": "inference", "operator": "Exists"}]}


def async_spec(rollout_pool=None, **sections):
    """5 nodes x 2 workers, 2 GPUs each: trainer pool ranks 0-2, rollout pool ranks 3-4."""
    base = {"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 20},
            "cluster": {"numNodes": 5, "procsPerNode": 2, "acceleratorsPerNode": 2},
            "template": {"resources": {"requests": {"cpu": "2"}}, "nodeSelector": {"gpu": "h100"},
                         "tolerations": [{"key": "training", "operator": "Exists"}]},
            "async": {"enable": True, "rolloutPool": ROLLOUT_POOL if rollout_pool is None else rollout_pool}}
    base.update(sections)
    return parse_spec(base)


def test_pools_are_the_trainer_ranks_first_then_the_last_rollout_nodes():
    assert render.node_pools(async_spec()) == (NodePool("trainer", 0, 3), NodePool("rollout", 3, 2))
    assert [render.node_pool(async_spec(), r).name for r in range(5)] == ["trainer"] * 3 + ["rollout"] * 2
    sync = async_spec(**{"async": {"enable": False}})
    assert render.node_pools(sync) == (NodePool(None, 0, 5),)
    assert list(render.node_pools(async_spec())[1].ranks) == [3, 4]


def test_every_node_pod_carries_its_pool_label_and_its_own_rank():
    spec = async_spec()
    for rank, pool in enumerate(["trainer", "trainer", "trainer", "rollout", "rollout"]):
        pod = render.build_node_pod(spec, OWNER, rank, attempt=2)
        labels = pod["metadata"]["labels"]
        assert pod["metadata"]["name"] == f"grpo-node-{rank}"
        assert (labels["distflow.io/pool"], labels["distflow.io/node-rank"], labels["distflow.io/attempt"]) == \
            (pool, str(rank), "2")
        env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"]}
        assert (env["PET_NNODES"], env["PET_NODE_RANK"], env["WORLD_SIZE"]) == ("5", str(rank), "10")
        assert env["MASTER_ADDR"] == "grpo-node-0.grpo.team-a.svc"  # rank 0 trains: the rendezvous


def test_synchronous_pods_have_no_pool_label():
    pod = render.build_node_pod(async_spec(**{"async": {"enable": False}}), OWNER, 4, 1)
    assert "distflow.io/pool" not in pod["metadata"]["labels"]


def test_rollout_pods_take_the_pools_resources_and_placement_and_trainers_the_templates():
    spec = async_spec()
    trainer = render.build_node_pod(spec, OWNER, 2, 1)["spec"]
    rollout = render.build_node_pod(spec, OWNER, 3, 1)["spec"]
    assert trainer["containers"][0]["resources"] == {"requests": {"cpu": "2", "nvidia.com/gpu": "2"},
                                                     "limits": {"nvidia.com/gpu": "2"}}
    assert (trainer["nodeSelector"], trainer["tolerations"]) == (
        {"gpu": "h100"}, [{"key": "training", "operator": "Exists"}])
    assert rollout["containers"][0]["resources"] == {"requests": {"cpu": "8", "nvidia.com/gpu": "2"},
                                                     "limits": {"memory": "64Gi", "nvidia.com/gpu": "2"}}
    assert (rollout["nodeSelector"], rollout["tolerations"]) == (
        {"gpu": "l40s"}, [{"key": "inference", "operator": "Exists"}])


def test_rollout_pool_without_its_own_fields_falls_back_to_the_template():
    spec = async_spec(rollout_pool={"numNodes": 1})
    trainer = render.build_node_pod(spec, OWNER, 0, 1)["spec"]
    rollout = render.build_node_pod(spec, OWNER, 4, 1)["spec"]
    for key in ("nodeSelector", "tolerations"):
        assert rollout[key] == trainer[key]
    assert rollout["containers"][0]["resources"] == trainer["containers"][0]["resources"]


def test_rollout_pods_never_alias_the_spec():
    spec = async_spec()
    pod = render.build_node_pod(spec, OWNER, 4, 1)["spec"]
    pod["nodeSelector"]["gpu"] = "changed"
    pod["tolerations"][0]["key"] = "changed"
    pod["containers"][0]["resources"]["requests"]["cpu"] = "1"
    assert spec.async_.rollout_pool.node_selector == {"gpu": "l40s"}
    assert spec.async_.rollout_pool.tolerations == [{"key": "inference", "operator": "Exists"}]
    assert spec.async_.rollout_pool.resources["requests"] == {"cpu": "8"}


def test_pool_label_in_the_template_is_rejected():
    spec = async_spec(template={"labels": {"distflow.io/pool": "rollout"}})
    assert render.template_problems(spec)[0].startswith("spec.template.labels.distflow.io/pool: set by the operator")


def test_volcano_gets_one_pod_group_per_pool_and_pods_join_their_pools_group():
    spec = async_spec(scheduling={"batchScheduler": "volcano", "queue": "research"})
    groups = render.build_pod_groups(spec, OWNER)
    assert [(g["metadata"]["name"], g["metadata"]["labels"]["distflow.io/pool"], g["spec"]) for g in groups] == [
        ("grpo-trainer", "trainer", {"minMember": 3, "minResources": {"nvidia.com/gpu": "6"}, "queue": "research"}),
        ("grpo-rollout", "rollout", {"minMember": 2, "minResources": {"nvidia.com/gpu": "4"}, "queue": "research"}),
    ]
    assert all(g["apiVersion"] == "scheduling.volcano.sh/v1beta1" for g in groups)
    assert all(g["metadata"]["ownerReferences"][0]["uid"] == "0b6c-uid" for g in groups)
    groups_of_pods = [render.build_node_pod(spec, OWNER, r, 1)["metadata"]["annotations"]
                      ["scheduling.k8s.io/group-name"] for r in range(5)]
    assert groups_of_pods == ["grpo-trainer"] * 3 + ["grpo-rollout"] * 2


def test_scheduler_plugins_pods_are_labelled_with_their_pools_group():
    spec = async_spec(scheduling={"batchScheduler": "scheduler-plugins"},
                      cluster={"numNodes": 3, "procsPerNode": 1, "acceleratorsPerNode": 0},
                      data={"train": {"path": "arithmetic"}, "trainBatchSize": 4},
                      **{"async": {"enable": True, "rolloutPool": {"numNodes": 1}}})
    assert [(g["metadata"]["name"], g["spec"]) for g in render.build_pod_groups(spec, OWNER)] == [
        ("grpo-trainer", {"minMember": 2}), ("grpo-rollout", {"minMember": 1})]
    assert [render.build_node_pod(spec, OWNER, r, 1)["metadata"]["labels"]["scheduling.x-k8s.io/pod-group"]
            for r in range(3)] == ["grpo-trainer", "grpo-trainer", "grpo-rollout"]


def test_kueue_keeps_one_pod_group_of_both_pools():
    owner = JobRef(name="grpo", namespace="team-a", uid="0b6c-uid", kueue_queue="lq")
    spec = async_spec()
    metas = [render.build_node_pod(spec, owner, r, 3)["metadata"] for r in range(5)]
    assert {m["labels"]["kueue.x-k8s.io/pod-group-name"] for m in metas} == {"grpo-a3"}
    assert {m["annotations"]["kueue.x-k8s.io/pod-group-total-count"] for m in metas} == {"5"}
