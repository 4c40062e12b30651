"""Forward passes over the step's samples, on the train layout (no gradients).

    reference     ref_log_probs [T_total]: the frozen reference policy (KL loss, KL in reward)
    old_log_prob  old_log_probs [T_total]: the policy before this step's updates (the PPO ratio)
    values        values [T_total]: the critic at rollout time (GAE, and the centre of value clipping)
"""

from __future__ import annotations

import torch

from distflow.data.batch import PackedBatch
from distflow.engines import model_ops
from distflow.planner import PlannedNode
from distflow.stages.context import StageContext, StageOutput


def _log_probs(ctx: StageContext, model: torch.nn.Module, batch: PackedBatch, field: str) -> StageOutput:
    actor, temperature = ctx.spec.actor, ctx.spec.rollout.temperature
    with model_ops.eval_mode(model):  # the actor update left the policy in train mode
        lp = model_ops.compute_log_probs(model, batch, ctx.tokenizer.pad_token_id, actor.micro_batch_size,
                                         temperature, actor.share_prompt_prefix, actor.max_tokens_per_micro_batch)
    return StageOutput(token={field: lp})


def run_reference(ctx: StageContext, node: PlannedNode, batch: PackedBatch) -> StageOutput:
    return _log_probs(ctx, ctx.models.reference, batch, "ref_log_probs")


def run_old_log_prob(ctx: StageContext, node: PlannedNode, batch: PackedBatch) -> StageOutput:
    return _log_probs(ctx, ctx.models.policy, batch, "old_log_probs")


def run_values(ctx: StageContext, node: PlannedNode, batch: PackedBatch) -> StageOutput:
    return StageOutput(token={"values": ctx.models.critic.compute_values(batch)})
