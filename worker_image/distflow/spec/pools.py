"""The ``async`` section: asynchronous RL on a rollout pool and a trainer pool.

    cluster.numNodes = trainer nodes + async.rolloutPool.numNodes
    ranks [0, T)  trainer pool: reference, old log-probs, critic, actor update (FSDP2 over T)
    ranks [T, W)  rollout pool: generation, rewards, group advantages (a full policy copy each)

The rollout pool generates step k+1 .. k+s while the trainer pool trains
step k (s = ``maxStaleness``); every sample carries the policy version that
generated it, and the trainer never trains a sample more than ``maxStaleness``
versions old: the rollout waits instead (verl's one-step off-policy mode for
s = 1, prime-rl's ``max_off_policy_steps``, AReaL's ``max_head_offpolicyness``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from distflow.spec.base import SpecBase


class RolloutPoolSpec(SpecBase):
    num_nodes: int = Field(default=1, ge=1, le=4096)
    """Nodes (pods) of `cluster.numNodes` that generate; the other nodes train. Each has
    `cluster.procsPerNode` workers, and each worker a full copy of the policy to generate with."""
    resources: dict[str, Any] = Field(default_factory=dict)
    """Container resources of the rollout pods (Kubernetes); empty: `template.resources`."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """nodeSelector of the rollout pods (Kubernetes); empty: `template.nodeSelector`."""
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    """Tolerations of the rollout pods (Kubernetes); empty: `template.tolerations`."""


class AsyncSpec(SpecBase):
    enable: bool = False
    """Train asynchronously on two pools (off: every worker generates and trains, in turn)."""
    max_staleness: int = Field(default=1, ge=0, le=64)
    """Policy versions a trained sample may lag the trainer (0: on-policy, no overlap). The
    rollout pool runs this many steps ahead of the trainer pool."""
    off_policy_correction: Literal["tis", "none"] = "tis"
    """tis: weight each token's policy loss by min(pi_old / pi_behaviour, `tisCap`), where
    pi_old is the trainer's policy before the update (recomputed, an old_log_prob pass) and
    pi_behaviour the rollout's stale policy that sampled the token (Yao et al. 2025, truncated
    importance sampling; AReaL's decoupled PPO objective). none: train on the stale samples as
    if on-policy."""
    tis_cap: float = Field(default=2.0, ge=1.0, allow_inf_nan=False)
    """Cap of the truncated importance weight (`offPolicyCorrection: tis`), at least 1: below 1
    it would scale down every on-policy token's weight (a smaller learning rate, not a cap)."""
    rollout_pool: RolloutPoolSpec = Field(default_factory=RolloutPoolSpec)
    """The rollout pool's size and pods."""
