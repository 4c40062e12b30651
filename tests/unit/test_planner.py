"""The planner: validation of workflows, linearisation, layouts and edge classification."""

import pytest

from distflow.errors import DistflowConfigError
from distflow.planner import ROLLOUT, TRAIN, build_plan
from distflow.spec import parse_spec

pytestmark = pytest.mark.unit


def _spec(**over):
    doc = {"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 8},
           "cluster": {"numNodes": 2, "procsPerNode": 2}}
    doc.update(over)
    return parse_spec(doc)


def _nodes(*nodes):
    return {"nodes": [dict(zip(("id", "role", "kind", "deps"), n)) for n in nodes]}


def test_grpo_chain_keeps_rollout_placement_together():
    plan = build_plan(_spec())
    assert [n.id for n in plan.chain] == ["rollout", "reward", "advantage", "reference", "actor_update"]
    assert [n.placement for n in plan.chain] == [ROLLOUT, ROLLOUT, ROLLOUT, TRAIN, TRAIN]
    edges = {(e.src, e.dst): e.local_cache for e in plan.edges}
    assert edges == {("rollout", "reward"): True, ("reward", "advantage"): True,
                     ("rollout", "reference"): False, ("advantage", "actor_update"): False,
                     ("reference", "actor_update"): True}
    assert plan.layouts[TRAIN].dp_size == 4 and plan.layouts[TRAIN].balanced


def test_unchanged_layout_without_balancing_is_all_local_cache():
    plan = build_plan(_spec(dataPlane={"balance": False}))
    assert all(e.local_cache for e in plan.edges)


def test_plan_is_deterministic():
    assert build_plan(_spec()).describe() == build_plan(_spec()).describe()


def test_old_log_prob_only_with_several_optimizer_steps():
    assert "old_log_prob" not in [n.id for n in build_plan(_spec()).chain]
    plan = build_plan(_spec(actor={"ppoMiniBatchSize": 4}))
    assert "old_log_prob" in [n.id for n in plan.chain]
    assert "old_log_prob" in plan.node("actor_update").deps


def test_no_reference_without_kl_loss():
    plan = build_plan(_spec(algorithm={"useKlLoss": False}))
    assert [n.id for n in plan.chain] == ["rollout", "reward", "advantage", "actor_update"]


def test_node_of_rank_groups_contiguous_ranks():
    plan = build_plan(_spec())
    assert [plan.node_of_rank(r) for r in range(4)] == [0, 0, 1, 1]


def test_user_workflow_in_declaration_order():
    wf = _nodes(("gen", "rollout", "inference", []), ("score", "reward", "compute", ["gen"]),
                ("adv", "advantage", "compute", ["score"]), ("train", "actor", "train", ["adv"]))
    plan = build_plan(_spec(workflow=wf, algorithm={"useKlLoss": False}))
    assert [n.id for n in plan.chain] == ["gen", "score", "adv", "train"]


NO_KL = {"useKlLoss": False}


@pytest.mark.parametrize("wf, algorithm, message", [
    (_nodes(("gen", "rollout", "inference", []), ("train", "actor", "train", ["gen"])), NO_KL,
     r"nodes\[1\] \(train\)\.deps: role actor reads advantages, which no node it depends on produces; "
     "add a node with role advantage"),
    (_nodes(("gen", "rollout", "inference", []), ("score", "reward", "compute", ["gen"]),
            ("adv", "advantage", "compute", ["score"]), ("train", "actor", "train", ["adv"])), {},
     "role actor reads ref_log_probs.*add a node with role reference"),
    (_nodes(("gen", "rollout", "inference", []), ("score", "reward", "compute", []),
            ("adv", "advantage", "compute", ["score"]), ("train", "actor", "train", ["adv"])), NO_KL,
     r"nodes\[1\] \(score\)\.deps: nothing it depends on leads to the rollout node"),
    (_nodes(("gen", "rollout", "inference", []), ("score", "reward", "compute", ["gen"]),
            ("adv", "advantage", "compute", ["score"]), ("train", "actor", "train", ["adv"])),
     {**NO_KL, "advantageEstimator": "gae"}, "role advantage reads values.*role values"),
    (_nodes(("gen", "rollout", "inference", []), ("adv", "advantage", "compute", ["gen"]),
            ("train", "actor", "train", ["adv"])), NO_KL,
     "role advantage reads token_level_scores.*role reward or reward_shaping"),
])
def test_a_node_reading_a_field_nothing_upstream_produces_is_rejected(wf, algorithm, message):
    with pytest.raises(DistflowConfigError, match=message):
        build_plan(_spec(workflow=wf, algorithm=algorithm))


def test_below_a_custom_node_any_field_may_exist():
    wf = {"nodes": [{"id": "gen", "role": "rollout", "kind": "inference"},
                    {"id": "mine", "role": "custom", "kind": "compute", "deps": ["gen"], "function": "m:f"},
                    {"id": "train", "role": "actor", "kind": "train", "deps": ["mine"]}]}
    plan = build_plan(_spec(workflow=wf, algorithm=NO_KL))
    assert [n.id for n in plan.chain] == ["gen", "mine", "train"]


@pytest.mark.parametrize("wf, message", [
    (_nodes(("gen", "rollout", "inference", ["train"]), ("train", "actor", "train", ["gen"])),
     "cycle gen -> train -> gen"),
    (_nodes(("gen", "rollout", "inference", []), ("train", "actor", "train", ["adv"])),
     "'adv' is not a node id"),
    (_nodes(("gen", "rollout", "inference", []), ("judge", "critic2", "compute", ["gen"]),
            ("train", "actor", "train", ["gen"])), "unknown role 'critic2'"),
    (_nodes(("gen", "rollout", "inference", []), ("score", "reward", "compute", ["gen"])),
     "no node trains the actor"),
    (_nodes(("gen", "rollout", "inference", []), ("gen", "actor", "train", [])), "used twice"),
    (_nodes(("train", "actor", "train", [])), "exactly one node must have role rollout"),
])
def test_bad_workflows_are_rejected_with_reason(wf, message):
    with pytest.raises(DistflowConfigError, match=message):
        build_plan(_spec(workflow=wf))


def test_unknown_builtin_workflow():
    with pytest.raises(DistflowConfigError, match="spec.workflow.name: unknown workflow 'grpo2'"):
        build_plan(_spec(workflow={"name": "grpo2"}))


def test_describe_aligns_the_chain_columns_for_long_names():
    """DAPO's node and role names are longer than GRPO's: every row's columns still line up."""
    plan = build_plan(_spec(workflow={"name": "dapo"}))
    text = plan.describe()
    rows = [line for line in text.splitlines() if " role=" in line]
    assert any("dynamic_sampling" in row for row in rows)
    for column in ("role=", "kind=", "placement=", "deps="):
        assert len({row.index(column) for row in rows}) == 1, (column, rows)
