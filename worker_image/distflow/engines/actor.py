"""The actor update: PPO-style clipped policy loss + KL loss - entropy bonus.

The loss of one optimizer step is the loss of the whole global mini-batch,
however it is split over dp ranks and micro-batches: each micro-batch adds
``aggregate_loss(..., LossNormalizer(global counts))``, and since FSDP2
averages gradients over the dp ranks, the backward loss is multiplied by the
dp size (verl's scaling). Hence a 2-rank run takes the same step as a 1-rank
run on the same samples.

When the actor takes one optimizer step per batch (one epoch, one
mini-batch), the sampling policy *is* the current policy: ``old_log_probs``
are the current log-probs detached (the ratio is exactly 1) and no separate
old-log-prob pass is planned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from distflow.algorithms import (
    LossNormalizer, PolicyLossParams, aggregate_loss, get_kl_estimator, get_policy_loss_fn,
)
from distflow.data.batch import PackedBatch
from distflow.engines import fsdp, model_ops
from distflow.metrics import DeviceMetrics
from distflow.spec import JobSpec


# Aggregated losses are each micro-batch's share of the global mean: summed, not averaged.
_LOSS_SHARES = frozenset({"actor/pg_loss", "actor/kl_loss", "actor/entropy"})


def truncated_is_weights(old_log_probs: torch.Tensor, rollout_log_probs: torch.Tensor, cap: float) -> torch.Tensor:
    """Truncated importance sampling weights min(pi_old / pi_rollout, cap), no gradient.

    Corrects the policy loss for sampling with an engine whose probabilities differ slightly
    from the actor's (Yao et al. 2025, "Your efficient RL framework secretly brings you
    off-policy RL training"; verl's ``tis_imp_ratio_cap``). Shapes: [b, R] -> [b, R].
    """
    return torch.exp(old_log_probs - rollout_log_probs).clamp(max=cap).detach()


@dataclass
class Actor:
    spec: JobSpec
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    pad_token_id: int
    dp_size: int
    device: torch.device

    @classmethod
    def build(cls, spec: JobSpec, model, pad_token_id: int, dp_size: int, device) -> "Actor":
        a = spec.actor
        opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=a.weight_decay,
                                betas=(0.9, 0.999), eps=1e-8)
        return cls(spec, model, opt, pad_token_id, dp_size, device)

    def _global_counts(self, batch: PackedBatch) -> LossNormalizer:
        """Sizes of the global mini-batch: the model's own tokens (``response_mask`` 1s, not a multi-turn
        sample's tool tokens) and the sequences, summed over the dp ranks."""
        tokens = float(batch.token_fields["response_mask"].sum())
        sums = fsdp.all_reduce_sum(torch.tensor([tokens, float(batch.num_samples)], device=self.device), self.device)
        return LossNormalizer(global_num_tokens=max(float(sums[0]), 1.0),
                              global_num_seqs=max(float(sums[1]), 1.0),
                              max_response_length=self.spec.data.max_response_length)

    def _micro_loss(self, mb: model_ops.MicroBatch, norm: LossNormalizer, on_policy: bool):
        alg = self.spec.algorithm
        log_probs, entropy = model_ops.forward_log_probs(
            self.model, mb, self.spec.rollout.temperature, True, entropy_grad=alg.entropy_coeff > 0)
        mask = mb.response_mask.to(log_probs.device)
        old = log_probs.detach() if on_policy else model_ops.window_field(mb, "old_log_probs")
        adv = model_ops.window_field(mb, "advantages")
        out = get_policy_loss_fn(alg.policy_loss)(
            old.to(log_probs.device), log_probs, adv.to(log_probs.device), mask,
            PolicyLossParams(alg.clip_ratio_low, alg.clip_ratio_high, alg.clip_ratio_c))
        pg_losses, rollout_stats = self._rollout_correction(mb, old.to(log_probs.device), out.pg_losses, mask)
        pg_loss = aggregate_loss(pg_losses, mask, alg.loss_agg_mode, norm)
        loss = pg_loss
        stats = {"actor/pg_loss": pg_loss.detach(), "actor/pg_clipfrac": out.clipfrac,
                 "actor/ppo_kl": out.approx_kl, "actor/pg_clipfrac_lower": out.clipfrac_lower, **rollout_stats}
        ent = aggregate_loss(entropy, mask, alg.loss_agg_mode, norm)
        stats["actor/entropy"] = ent.detach()
        if alg.entropy_coeff > 0:
            loss = loss - alg.entropy_coeff * ent
        if alg.use_kl_loss:
            ref = model_ops.window_field(mb, "ref_log_probs").to(log_probs.device)
            kl = get_kl_estimator(alg.kl_loss_type)(log_probs, ref)
            kl_loss = aggregate_loss(kl, mask, alg.loss_agg_mode, norm)
            loss = loss + alg.kl_loss_coef * kl_loss
            stats["actor/kl_loss"] = kl_loss.detach()
        return loss, stats, mask.sum()

    def _rollout_correction(self, mb: model_ops.MicroBatch, old: torch.Tensor, pg_losses: torch.Tensor,
                            mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Mismatch of the rollout engine's log-probs with the actor's, and its optional correction.

        With ``rollout_log_probs`` (vllm engine): |old - rollout| over response tokens as
        ``rollout/actor_logp_diff/{mean,max}``; with ``rollout.tisImpRatioCap``, truncated
        importance sampling (Yao et al. 2025, verl's tis_imp_ratio_cap): each token's loss
        times min(exp(old - rollout), cap), a constant (no gradient).

        Args:
            old: [b, R] the actor's log-probs of the sampling policy; pg_losses, mask: [b, R].
        """
        if "rollout_log_probs" not in mb.source.token_fields:
            return pg_losses, {}
        rollout = model_ops.window_field(mb, "rollout_log_probs").to(old.device)
        diff = torch.where(mask.bool(), (old - rollout).abs(), 0.0)
        stats = {"rollout/actor_logp_diff/mean": diff.sum() / mask.sum().clamp(min=1),
                 "rollout/actor_logp_diff/max": diff.max()}
        cap = self.spec.rollout.tis_imp_ratio_cap
        stale = self.spec.async_
        if cap is None and stale.enable and stale.max_staleness > 0 and stale.off_policy_correction == "tis":
            cap = stale.tis_cap  # the rollout pool's stale weights are the behaviour policy
        if cap is not None:
            pg_losses = pg_losses * truncated_is_weights(old, rollout, cap)
        return pg_losses, stats

    def update(self, batch: PackedBatch, metrics) -> None:
        """Train on this rank's part of the step's batch; record metrics into ``metrics``.

        Loss metrics are shares of each mini-batch's global loss (summed over
        ranks, averaged over mini-batches); the rest are token-weighted means.
        """
        a = self.spec.actor
        mini = a.ppo_mini_batch_size or self.spec.data.train_batch_size
        num_minis = self.spec.data.train_batch_size // mini
        on_policy = a.ppo_epochs == 1 and num_minis == 1
        per_mini = -(-batch.num_samples // num_minis)
        num_steps = a.ppo_epochs * num_minis
        self.model.train()
        hold = not a.reshard_after_forward
        for _ in range(a.ppo_epochs):
            for m in range(num_minis):
                part = batch.select(range(m * per_mini, min(batch.num_samples, (m + 1) * per_mini)))
                self._optimizer_step(part, on_policy, metrics, num_steps, hold)

    def _optimizer_step(self, part: PackedBatch, on_policy: bool, metrics, num_steps: int, hold: bool) -> None:
        """Forward/backward over ``part``'s micro-batches, then one clipped AdamW step.

        With ``hold`` (``actor.reshardAfterForward: false``) the full parameters are gathered
        once (or kept from the rollout, which generated with these same weights) for all the
        micro-batches' forwards and backwards and released before the step: one all-gather per
        optimizer step instead of two per micro-batch. Same gradients, bit for bit.
        """
        norm = self._global_counts(part)
        a = self.spec.actor
        if hold:
            fsdp.hold_unsharded(self.model)
        stats = DeviceMetrics()
        for chunk, host in model_ops.dp_micro_batches(part, a.micro_batch_size, a.max_tokens_per_micro_batch,
                                                      a.share_prompt_prefix):
            mb = model_ops.collate(chunk, self.pad_token_id, a.share_prompt_prefix, host)
            if chunk.num_samples == 0:  # padding to the ranks' common count: collectives only, no gradient
                log_probs, _ = model_ops.forward_log_probs(self.model, mb, self.spec.rollout.temperature, False)
                (log_probs.sum() * 0).backward()
                continue
            loss, micro_stats, ntok = self._micro_loss(mb, norm, on_policy)
            (loss * self.dp_size).backward()
            for k, v in micro_stats.items():
                if k in _LOSS_SHARES:
                    stats.add_sum(k, v)
                elif k.endswith("/max"):
                    stats.add_max(k, v)
                else:
                    stats.add_mean(k, v * ntok, ntok)
        stats.flush(metrics, scale=1 / num_steps)
        if hold:
            fsdp.release_unsharded(self.model)  # the step and the clip read the sharded parameters
        grad_norm = fsdp.grad_norm_and_clip(self.model, a.grad_clip)
        if math.isfinite(grad_norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        # Same value on every rank: average it, do not sum it.
        metrics.add_mean("actor/grad_norm", grad_norm, 1.0)
        metrics.add_mean("actor/lr", self.optimizer.param_groups[0]["lr"], 1.0)

