"""What a stage is given (``StageContext``) and what it hands back (``StageOutput``).

A stage never sees the worker: it reads the step's batch it is passed and
the few things named here, and returns the fields it adds. The worker checks
them against ``distflow.fields`` and hands the batch on to the next node.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from distflow.algorithms import AdaptiveKLController, FixedKLController, Reducer
from distflow.data.batch import PackedBatch
from distflow.data.loader import ShardedPromptLoader
from distflow.data.records import PromptRecord
from distflow.engines.actor import Actor
from distflow.engines.critic import Critic
from distflow.metrics import StepMetrics
from distflow.spec import JobSpec


@dataclass(frozen=True)
class StageModels:
    """The worker's models, built once (``DagWorker._build_models``)."""

    rollout: Any
    """The rollout engine (``HfRollout`` or ``VllmRollout``): ``generate``, ``session``, ``sync``, ``shared``."""
    actor: Actor
    """The actor update (optimizer, micro-batching) around ``policy``."""
    policy: torch.nn.Module
    """The actor's FSDP module (old log-probs are computed with it)."""
    reference: torch.nn.Module | None = None
    """The frozen reference policy, when the plan has a reference node."""
    critic: Critic | None = None
    """The value model, when the plan has values or critic nodes."""


Regroup = Callable[[str, PackedBatch, list[list[int]], str], PackedBatch]
"""(node id, this rank's batch, target sample ids per rank, edge) -> this rank's batch after the move."""


@dataclass(frozen=True)
class StageContext:
    """What every stage of one step may use."""

    spec: JobSpec
    step: int
    """The training step (0-based)."""
    rank: int
    rollout_dp_rank: int
    tokenizer: Any
    models: StageModels
    loader: ShardedPromptLoader
    """This rank's prompts; the rollout (and DAPO's refill rounds) take the next batch."""
    metrics: StepMetrics
    """This step's metrics, local sums; the step reduces them once over all ranks."""
    reduce: Reducer
    """All-reduce (sum) of a small vector over all ranks."""
    kl_ctrl: FixedKLController | AdaptiveKLController
    """The in-reward KL coefficient (stepped by reward shaping)."""
    regroup: Regroup
    """Moves samples between ranks mid-step (DAPO dynamic sampling; collective)."""
    device: torch.device
    """The worker's device: where the step's data lives and the stages build their tensors."""
    policy_version: int | None = None
    """Asynchronous mode (``distflow.pools``): the version of the weights the rollout generates
    with (optimizer steps taken); the rollout stamps it on every sample. None: sync mode."""
    prompts: dict[int, PromptRecord] = field(default_factory=dict)
    """This step's prompt records by group index: the rollout fills it, scoring reads it."""


@dataclass(frozen=True)
class StageOutput:
    """What a stage hands on: fields added to the batch it was given, or a new batch.

    Train stages (actor, critic) return an empty output: they hand nothing on,
    and the next node reads the batch of the node before them.
    """

    token: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """Added token fields, [T_total] each (``distflow.fields`` declares them)."""
    sample: Mapping[str, torch.Tensor] = field(default_factory=dict)
    """Added sample fields, [B] each."""
    batch: PackedBatch | None = None
    """New samples (rollout) or replaced ones (filter_groups, custom); None: the batch given."""

    @property
    def empty(self) -> bool:
        return self.batch is None and not self.token and not self.sample
