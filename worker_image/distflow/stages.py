"""What each workflow node does on one worker: one function per role.

Every function has the signature ``stage(worker, node) -> None``: it reads the
step's local batch from ``worker.coordinator.batch`` (already laid out for the
node's placement by the data coordinator), adds its output fields, and writes
the batch back. Metrics go to ``worker.metrics`` as local sums; the step
reduces them once over all ranks.

Fields added (packed token fields span prompt + response, 0 on prompt tokens):

    rollout        input_ids, response_mask [T_total]; prompt_len, response_len, group_index [B]
    reward         token_level_scores [T_total] (score on the last response token); scores [B]
    advantage      advantages, returns [T_total] (from token_level_rewards when a node shaped them)
    reference      ref_log_probs [T_total]
    old_log_prob   old_log_probs [T_total]
    (vllm rollout) rollout_log_probs [T_total]: the engine's log-probs of the sampled tokens
    actor (train)  updates the actor (then syncs a separate rollout copy, if any)
    values, critic, reward_shaping, filter_groups: see ``distflow.stages_ppo``
"""

from __future__ import annotations

import importlib

import torch

from distflow.algorithms import AdvantageInputs, AdvantageParams, get_advantage_fn
from distflow.data.batch import PackedBatch
from distflow.engines import model_ops
from distflow.engines.rollout import SamplingParams, render_prompts, response_texts, step_seed
from distflow.planner import PlannedNode
from distflow.rewards import compute_scores


def run_rollout(worker, node: PlannedNode) -> None:
    spec = worker.spec
    records = worker.loader.next_batch()
    local = len(records)
    first = worker.rollout_dp_rank * local
    group_index = [worker.step * spec.data.train_batch_size + first + i for i in range(local)]
    worker.step_records = dict(zip(group_index, records))
    prompts = render_prompts(worker.tokenizer, records, spec.data.max_prompt_length, spec.data.system_prompt)
    params = SamplingParams(spec.rollout.n, spec.rollout.temperature, spec.rollout.top_p,
                            spec.rollout.top_k, spec.data.max_response_length,
                            spec.rollout.micro_batch_size, share_prefill=spec.rollout.share_prefill)
    batch = worker.rollout.generate(prompts, group_index, params, step_seed(spec.trainer.seed, worker.step),
                                    worker.metrics)
    worker.coordinator.produce(node.id, batch)
    resp = batch.sample_fields["response_len"].double()
    worker.metrics.add_mean("response_length/mean", resp.sum(), resp.numel())
    worker.metrics.add_max("response_length/max", resp.max())
    clipped = (resp >= spec.data.max_response_length).double()
    worker.metrics.add_mean("response_length/clip_ratio", clipped.sum(), resp.numel())
    prompt = batch.sample_fields["prompt_len"].double()
    worker.metrics.add_mean("prompt_length/mean", prompt.sum(), prompt.numel())


def _score_tokens(batch: PackedBatch, scores: torch.Tensor) -> torch.Tensor:
    """Outcome score on each sample's last token, 0 elsewhere: [T_total]."""
    token_scores = torch.zeros(batch.num_tokens, dtype=torch.float32)
    last = batch.cu_seqlens(dtype=torch.long)[1:] - 1
    token_scores[last] = scores.float()
    return token_scores


def run_reward(worker, node: PlannedNode) -> None:
    batch = worker.coordinator.batch
    texts = response_texts(worker.tokenizer, batch)
    groups = batch.sample_fields["group_index"].tolist()
    records = [worker.step_records[g] for g in groups]
    scores = torch.tensor(compute_scores(texts, records, worker.spec.data.reward_fn), dtype=torch.float32)
    worker.coordinator.produce(node.id, batch.with_fields(
        token={"token_level_scores": _score_tokens(batch, scores)}, sample={"scores": scores}))
    worker.metrics.add_mean("critic/score/mean", scores.double().sum(), scores.numel())
    worker.metrics.add_max("critic/score/max", scores.max())
    worker.metrics.add_min("critic/score/min", scores.min())


def run_advantage(worker, node: PlannedNode) -> None:
    spec = worker.spec
    batch = worker.coordinator.batch
    mb = model_ops.collate(batch, worker.tokenizer.pad_token_id)
    # A reward_shaping node (overlong penalty, KL in reward) sets token_level_rewards; else scores are rewards.
    rewards = "token_level_rewards" if "token_level_rewards" in batch.token_fields else "token_level_scores"
    inputs = AdvantageInputs(
        token_level_rewards=model_ops.window_field(mb, rewards),
        response_mask=mb.response_mask,
        group_index=batch.sample_fields["group_index"],
        values=model_ops.window_field(mb, "values") if "values" in batch.token_fields else None,
    )
    params = AdvantageParams(gamma=spec.algorithm.gamma, lam=spec.algorithm.lam,
                             norm_adv_by_std=spec.algorithm.norm_adv_by_std)
    fn = get_advantage_fn(spec.algorithm.advantage_estimator)
    advantages, returns = fn(inputs, params, worker.global_sum)
    worker.coordinator.produce(node.id, batch.with_fields(
        token={"advantages": model_ops.unwindow(mb, advantages), "returns": model_ops.unwindow(mb, returns)}))
    mask = mb.response_mask
    worker.metrics.add_mean("critic/advantages/mean", (advantages * mask).double().sum(), mask.sum())


def _log_prob_stage(worker, node: PlannedNode, model, field: str) -> None:
    batch = worker.coordinator.batch
    spec = worker.spec
    with model_ops.eval_mode(model):  # the actor update left the policy in train mode
        lp = model_ops.compute_log_probs(model, batch, worker.tokenizer.pad_token_id,
                                         spec.actor.micro_batch_size, spec.rollout.temperature,
                                         spec.actor.share_prompt_prefix, spec.actor.max_tokens_per_micro_batch)
    worker.coordinator.produce(node.id, batch.with_fields(token={field: lp}))


def run_reference(worker, node: PlannedNode) -> None:
    _log_prob_stage(worker, node, worker.ref_model, "ref_log_probs")


def run_old_log_prob(worker, node: PlannedNode) -> None:
    _log_prob_stage(worker, node, worker.actor_model, "old_log_probs")


def run_actor_update(worker, node: PlannedNode) -> None:
    worker.actor.update(worker.coordinator.batch, worker.metrics)
    if not worker.rollout.shared:  # a separate rollout copy or engine: refresh it (part of the actor stage's time)
        with worker.metrics.timer("weight_sync"):
            moved = worker.rollout.sync(worker.actor_model)
        worker.metrics.add_sum("perf/weight_sync_bytes", moved)


def run_custom(worker, node: PlannedNode) -> None:
    """A user node: ``module:function`` taking and returning a PackedBatch."""
    module_name, _, fn_name = (node.function or "").partition(":")
    fn = getattr(importlib.import_module(module_name), fn_name)
    out = fn(worker.coordinator.batch)
    if not isinstance(out, PackedBatch):
        raise TypeError(f"workflow node {node.id}: {node.function} returned {type(out).__name__}, "
                        "expected a PackedBatch")
    worker.coordinator.produce(node.id, out)


STAGES = {
    "rollout": run_rollout,
    "reward": run_reward,
    "advantage": run_advantage,
    "reference": run_reference,
    "old_log_prob": run_old_log_prob,
    "actor": run_actor_update,
    "custom": run_custom,
}

from distflow.stages_ppo import PPO_STAGES  # noqa: E402  (values, critic, reward_shaping, filter_groups)

STAGES.update(PPO_STAGES)
