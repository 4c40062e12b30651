"""What each workflow node does on one worker: one function per role, grouped by meaning.

    rollout        stages.rollout        generate_round: the prompts -> n responses each (also DAPO's
                                         refill rounds and evaluation)
    reward         stages.scoring        + scores, token_level_scores
    filter_groups  stages.group_filter   replaces the samples: groups with signal, refilled, regrouped
    reward_shaping stages.scoring        + token_level_rewards
    reference      stages.model_passes   + ref_log_probs
    old_log_prob   stages.model_passes   + old_log_probs
    values         stages.model_passes   + values
    advantage      stages.scoring        + advantages, returns
    critic, actor  stages.updates        update the model; hand nothing on
    custom         (here)                a user's ``module:function``, PackedBatch -> PackedBatch

Every stage is ``stage(ctx, node, batch) -> StageOutput``: it reads the
step's batch, already laid out for the node's placement by the data
coordinator, and the ``StageContext`` (spec, models, tokenizer, loader,
metrics sink, reducer), and returns the fields it adds, or new samples.
``DagWorker`` checks the output against ``distflow.fields`` and hands it on.
The fields themselves, their shapes and who produces each, are declared in
``distflow.fields``.
"""

from __future__ import annotations

from distflow.data.batch import PackedBatch
from distflow.errors import UserFunctionError
from distflow.names import NODE_ROLES, registry
from distflow.planner import PlannedNode
from distflow.stages.context import StageContext, StageModels, StageOutput
from distflow.stages.group_filter import run_filter_groups
from distflow.stages.model_passes import run_old_log_prob, run_reference, run_values
from distflow.stages.rollout import run_rollout
from distflow.stages.scoring import build_kl_controller, run_advantage, run_reward, run_reward_shaping
from distflow.stages.updates import run_actor_update, run_critic_update
from distflow.user_functions import load_user_function


def run_custom(ctx: StageContext, node: PlannedNode, batch: PackedBatch) -> StageOutput:
    """A user node: ``module:function`` taking and returning a PackedBatch."""
    fn = load_user_function(node.function or "", f"workflow node {node.id!r} function")
    try:
        out = fn(batch)
    except Exception as err:  # noqa: BLE001 - whatever the user's code raises, say where
        raise UserFunctionError(f"workflow node {node.id!r}: {node.function} raised {type(err).__name__}: {err} "
                                f"at step {ctx.step + 1}; fix the function, then run again: training resumes "
                                "from the last checkpoint") from err
    if not isinstance(out, PackedBatch):
        raise TypeError(f"workflow node {node.id}: {node.function} returned {type(out).__name__}, "
                        "expected a PackedBatch")
    return StageOutput(batch=out)


STAGES = registry(NODE_ROLES, {
    "rollout": run_rollout,
    "reward": run_reward,
    "filter_groups": run_filter_groups,
    "reward_shaping": run_reward_shaping,
    "reference": run_reference,
    "old_log_prob": run_old_log_prob,
    "values": run_values,
    "advantage": run_advantage,
    "critic": run_critic_update,
    "actor": run_actor_update,
    "custom": run_custom,
}, "workflow.nodes[].role")

__all__ = ["STAGES", "StageContext", "StageModels", "StageOutput", "build_kl_controller", "run_custom"]
