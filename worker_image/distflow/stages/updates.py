"""The train stages: they update a model on the step's samples and hand no fields on.

    actor   the policy loss on advantages (+ KL loss, entropy), then the rollout engine's weights refreshed
            when it keeps its own copy
    critic  the value loss on returns; critic/vf_explained_var_rollout scores the rollout-time values
            (out of sample), critic/vf_explained_var the update's predictions
"""

from __future__ import annotations

import torch

from distflow.algorithms import explained_variance
from distflow.data.batch import PackedBatch
from distflow.planner import PlannedNode
from distflow.stages.context import StageContext, StageOutput


def run_actor_update(ctx: StageContext, node: PlannedNode, batch: PackedBatch) -> StageOutput:
    models = ctx.models
    models.actor.update(batch, ctx.metrics)
    if not models.rollout.shared:  # a separate rollout copy or engine: refresh it (part of the actor stage's time)
        with ctx.metrics.timer("weight_sync"):
            moved = models.rollout.sync(models.policy)
        ctx.metrics.add_sum("perf/weight_sync_bytes", moved)
    return StageOutput()


def run_critic_update(ctx: StageContext, node: PlannedNode, batch: PackedBatch) -> StageOutput:
    """Train the critic; also score its rollout-time values against the returns they never saw."""
    mask = batch.token_fields["response_mask"].double()
    values, returns = batch.token_fields["values"].double(), batch.token_fields["returns"].double()
    ctx.metrics.add_mean("critic/values/mean", (values * mask).sum(), mask.sum())
    ctx.metrics.add_mean("critic/returns/mean", (returns * mask).sum(), mask.sum())
    ev = explained_variance(values[None], returns[None], mask[None], ctx.reduce)
    if torch.isfinite(ev):  # NaN (equal returns) is NaN on every rank: the metric keys stay aligned
        ctx.metrics.add_mean("critic/vf_explained_var_rollout", float(ev), 1.0)
    ctx.models.critic.update(batch, ctx.metrics)
    return StageOutput()
