"""The declared step fields: stages' outputs are checked against them, the planner reads its producers from them."""

from __future__ import annotations

import pytest
import torch

from distflow.fields import FIELDS, check_stage_output, producers
from distflow.names import NODE_ROLES

pytestmark = pytest.mark.unit


def test_every_producer_is_a_workflow_role():
    assert {role for f in FIELDS.values() for role in f.producers} <= set(NODE_ROLES)
    assert FIELDS["advantages"].shape == "[T_total]" and FIELDS["scores"].shape == "[B]"


def test_producers_of_alternative_fields_are_listed_in_order():
    assert producers("token_level_scores", "token_level_rewards") == ("reward", "reward_shaping")


def test_a_declared_output_passes():
    check_stage_output("reward", "reward", {"token_level_scores": torch.zeros(7)}, {"scores": torch.zeros(2)})
    check_stage_output("rollout", "rollout", {"input_ids": torch.zeros(7, dtype=torch.long),
                                              "response_mask": torch.ones(7, dtype=torch.int8)}, {})


@pytest.mark.parametrize("role, token, sample, message", [
    ("reward", {"advantages": torch.zeros(3)}, {}, "role reward added 'advantages', which distflow.fields"),
    ("reward", {"bonus": torch.zeros(3)}, {}, "role reward added 'bonus'"),
    ("reward", {}, {"token_level_scores": torch.zeros(3)}, "token_level_scores is a sample field"),
    ("reward", {"token_level_scores": torch.zeros(3, dtype=torch.long)}, {}, "is a token field of int"),
    ("values", {"values": torch.zeros(3, 2)}, {}, r"declares float \[T_total\]"),
])
def test_an_undeclared_or_mistyped_output_names_the_field(role, token, sample, message):
    with pytest.raises(TypeError, match=message):
        check_stage_output(role, "node", token, sample)


def test_a_custom_node_may_add_anything():
    check_stage_output("custom", "mine", {"bonus": torch.zeros(3)}, {"flag": torch.zeros(1, dtype=torch.bool)})
