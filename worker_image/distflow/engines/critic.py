"""The critic: a value model under FSDP2, its forward pass and its PPO update.

The value model is a transformers backbone (``AutoModel``: the causal LM
without its LM head, so any decoder the actor can load works) plus a scalar
head on the last hidden state. The value of response token t is the head's
output at the position *before* t, the state the policy was in when it chose
t, so values line up with log-probs (verl's ``output[:, -R - 1 : -1]``).

The update mirrors the actor's: PPO epochs x mini-batches, micro-batches
with gradient accumulation, and a clipped value loss reduced against the
global token/sequence counts (``LossNormalizer``) and scaled by the dp size
for FSDP's gradient averaging, so a step does not depend on how samples are
split over ranks and micro-batches.

Deliberately simplified: the head is a single ``Linear(hidden, 1)`` started
at zero (the first values are 0, so early GAE advantages are plain
rewards-to-go instead of noise from a random head); no separate value-head
learning rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from distflow.algorithms import LossNormalizer, aggregate_loss, clipped_value_loss, explained_variance
from distflow.data.batch import PackedBatch
from distflow.engines import fsdp, model_ops
from distflow.engines.loading import empty_causal_lm, load_sharded
from distflow.metrics import DeviceMetrics
from distflow.models import DTYPES
from distflow.spec import JobSpec


class ValueModel(torch.nn.Module):
    """Backbone + scalar head. ``model`` keeps the backbone where ``fsdp.apply_fsdp`` looks for layers."""

    def __init__(self, backbone: torch.nn.Module):
        super().__init__()
        self.model = backbone
        dtype = next(backbone.parameters()).dtype
        self.value_head = torch.nn.Linear(backbone.config.hidden_size, 1, dtype=dtype)
        self.zero_head()

    @torch.no_grad()
    def zero_head(self) -> None:
        """The head's start: V = 0 everywhere (on its FSDP shards too)."""
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, attention_mask, position_ids, num_positions: int) -> torch.Tensor:
        """Values of the last ``num_positions`` positions: [b, num_positions], float32."""
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            use_cache=False).last_hidden_state
        # A fresh tensor, not a view: FSDP2 hooks its root module's output for backward.
        return self.value_head(hidden[:, -num_positions:]).squeeze(-1).float().clone()


def load_value_model(local_dir: str, dtype: str = "float32") -> ValueModel:
    """A value model whose backbone is the (causal LM) model in ``local_dir``, on CPU.

    Raises:
        ValueError: unknown dtype name.
    """
    from transformers import AutoModel

    if dtype not in DTYPES:
        raise ValueError(f"model.dtype {dtype!r}: choose one of {list(DTYPES)}")
    return ValueModel(AutoModel.from_pretrained(str(local_dir), dtype=DTYPES[dtype]))


def forward_values(model, mb: model_ops.MicroBatch) -> torch.Tensor:
    """V(s_t) for every response token of the micro-batch: [b, R] float32 (garbage outside the mask)."""
    device = next(model.parameters()).device
    values = model(mb.input_ids.to(device), mb.attention_mask.to(device), mb.position_ids.to(device),
                   num_positions=mb.window + 1)
    return values[:, :-1].float()


@dataclass
class Critic:
    spec: JobSpec
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    pad_token_id: int
    dp_size: int
    device: torch.device

    @classmethod
    def build(cls, spec: JobSpec, model, pad_token_id: int, dp_size: int, device) -> "Critic":
        c = spec.critic
        opt = torch.optim.AdamW(model.parameters(), lr=c.lr, weight_decay=c.weight_decay,
                                betas=(0.9, 0.999), eps=1e-8)
        return cls(spec, model, opt, pad_token_id, dp_size, device)

    @torch.no_grad()
    def compute_values(self, batch: PackedBatch) -> torch.Tensor:
        """Values of this rank's samples, packed ``[T_total]`` (0 on prompt tokens)."""
        self.model.eval()
        pieces = []
        for chunk, host in model_ops.dp_micro_batches(batch, self.spec.critic.micro_batch_size):
            mb = model_ops.collate(chunk, self.pad_token_id, host=host)
            values = forward_values(self.model, mb)
            if chunk.num_samples:
                pieces.append(model_ops.unwindow(mb, values.to(mb.source.device)))
        return torch.cat(pieces) if pieces else torch.zeros(0, device=self.device)

    def update(self, batch: PackedBatch, metrics) -> None:
        """Fit the values to ``returns`` on this rank's part of the batch; metrics into ``metrics``.

        Needs token fields ``values`` (rollout-time, the clip centre) and ``returns``.
        ``critic/vf_loss`` is summed over ranks and averaged over optimizer steps;
        ``critic/vf_explained_var`` is computed over the global mini-batch from
        the predictions before each optimizer step (so with one epoch and one
        mini-batch it scores the rollout-time values against returns they never saw).
        """
        c, a = self.spec.critic, self.spec.actor
        batch_size = self.spec.data.train_batch_size
        mini = c.ppo_mini_batch_size or a.ppo_mini_batch_size or batch_size
        num_minis = batch_size // mini
        epochs = c.ppo_epochs or a.ppo_epochs
        per_mini = -(-batch.num_samples // num_minis)
        self.model.train()
        for _ in range(epochs):
            for m in range(num_minis):
                part = batch.select(range(m * per_mini, min(batch.num_samples, (m + 1) * per_mini)))
                self._optimizer_step(part, metrics, epochs * num_minis)

    def _global_sum(self, values: torch.Tensor) -> torch.Tensor:
        """All-reduce SUM of a small vector over the dp ranks (the algorithms' reducer)."""
        return fsdp.all_reduce_sum(values, self.device).to(values.dtype)

    def _optimizer_step(self, part: PackedBatch, metrics, num_steps: int) -> None:
        c = self.spec.critic
        # The model's own tokens: a multi-turn sample's tool tokens (response_mask 0) are not fitted.
        sums = self._global_sum(torch.tensor([float(part.token_fields["response_mask"].sum()),
                                              float(part.num_samples)], dtype=torch.float64, device=self.device))
        norm = LossNormalizer(global_num_tokens=max(float(sums[0]), 1.0), global_num_seqs=max(float(sums[1]), 1.0),
                              max_response_length=self.spec.data.max_response_length)
        predictions, stats = [], DeviceMetrics()
        for chunk, host in model_ops.dp_micro_batches(part, c.micro_batch_size):
            mb = model_ops.collate(chunk, self.pad_token_id, host=host)
            values = forward_values(self.model, mb)
            if chunk.num_samples == 0:  # padding to the ranks' common count: collectives only, no gradient
                (values.sum() * 0).backward()
                continue
            mask = mb.response_mask.to(values.device)
            old = model_ops.window_field(mb, "values").to(values.device)
            returns = model_ops.window_field(mb, "returns").to(values.device)
            vf_losses, clipfrac = clipped_value_loss(values, old, returns, mask, c.cliprange_value)
            loss = aggregate_loss(vf_losses, mask, c.loss_agg_mode, norm)
            (loss * self.dp_size).backward()
            stats.add_sum("critic/vf_loss", loss)
            stats.add_mean("critic/vf_clipfrac", clipfrac * mask.sum(), mask.sum())
            predictions.append(model_ops.unwindow(mb, values.detach().to(mb.source.device)))
        stats.flush(metrics, scale=1 / num_steps)
        grad_norm = fsdp.grad_norm_and_clip(self.model, c.grad_clip)
        if math.isfinite(grad_norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._explained_variance(part, predictions, metrics)
        metrics.add_mean("critic/grad_norm", grad_norm, 1.0)
        metrics.add_mean("critic/lr", self.optimizer.param_groups[0]["lr"], 1.0)

    def _explained_variance(self, part: PackedBatch, predictions: list[torch.Tensor], metrics) -> None:
        """Global explained variance of the pre-step predictions (one all-reduce, same on every rank)."""
        values = torch.cat(predictions) if predictions else torch.zeros(0, device=self.device)
        ev = explained_variance(values[None], part.token_fields["returns"].float()[None],
                                part.token_fields["response_mask"].float()[None], self._global_sum)
        # NaN (all returns equal) is the same on every rank, so skipping it keeps metric keys aligned.
        if torch.isfinite(ev):
            metrics.add_mean("critic/vf_explained_var", float(ev), 1.0)


def build_critic(spec: JobSpec, model_dir: str, pad_token_id: int, mesh, dp_size: int, device,
                 fill: bool = True) -> Critic:
    """Load the value model from ``model_dir`` sharded over ``mesh`` (FSDP2: each rank reads only
    its rows, ``loading.load_sharded``) and give it an optimizer.

    Its master weights are float32 whatever ``model.dtype`` says; it computes in model.mixedPrecision
    (none: model.dtype). ``fill`` False: the backbone is allocated, not read, for a checkpoint
    to fill (a resumed run).

    Raises:
        ValueError: (``fill``) ``model_dir`` has no safetensors weights, or they lack a backbone parameter.
    """
    model = ValueModel(empty_causal_lm(model_dir, torch.float32, auto_class="AutoModel"))
    if spec.model.gradient_checkpointing:
        model.model.gradient_checkpointing_enable()
    head = frozenset(f"value_head.{name}" for name, _ in model.value_head.named_parameters())
    # The checkpoint of a causal LM holds the backbone under its base_model_prefix (model., transformer.).
    saved_as = (f"{model.model.base_model_prefix}." if model.model.base_model_prefix else "")
    load_sharded(model, model_dir, mesh, device, DTYPES[spec.model.compute_dtype], fresh=head,
                 prefix=("model.", saved_as), fill=fill)
    model.zero_head()
    return Critic.build(spec, model, pad_token_id, dp_size, device)
