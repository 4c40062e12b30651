"""Generating responses: one generate round, used by the rollout stage, DAPO's refill rounds
(``stages.group_filter``) and evaluation (``DagWorker.evaluate``).

A round renders the prompts (chat template, system prompt, maxPromptLength),
samples ``n`` responses per prompt and returns them packed, the ``n`` of a
prompt adjacent. Response ``j`` of the prompt with id ``k`` samples from
``sample_seed(seed, k, j)``: the same on every rank, so responses depend on
neither the world size nor on which rank generated them.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from distflow.data.batch import PackedBatch
from distflow.data.model_tokens import model_token_counts
from distflow.data.records import PromptRecord
from distflow.engines.rollout import SamplingParams, render_prompt, render_prompts, step_seed
from distflow.metrics import StepMetrics
from distflow.multiturn.loading import tool_schemas
from distflow.multiturn.render import render_tool_prompt
from distflow.multiturn.rollout import generate_multi_turn
from distflow.planner import PlannedNode
from distflow.spec import JobSpec
from distflow.stages.context import StageContext, StageOutput


def sampling_params(spec: JobSpec, held_out: bool = False) -> SamplingParams:
    """How a round samples: ``rollout`` for training, ``rollout.val`` for the held-out set."""
    r, data = spec.rollout, spec.data
    s = r.val if held_out else r
    stale = spec.async_.enable and spec.async_.max_staleness > 0 and spec.async_.off_policy_correction == "tis"
    return SamplingParams(s.n, s.temperature, s.top_p, s.top_k, data.max_response_length,
                          r.micro_batch_size, share_prefill=r.share_prefill,
                          record_log_probs=stale and not held_out)


def prompt_length(tokenizer, spec: JobSpec) -> Callable[[PromptRecord], int]:
    """Tokens of a record's prompt as the rollout renders it (with ``rollout.multiTurn``, the tools
    shown too): what ``data.truncation`` holds to ``data.maxPromptLength``."""
    system = spec.data.system_prompt
    if spec.rollout.multi_turn.enable:
        schemas = tool_schemas(spec.rollout.multi_turn)
        return lambda record: len(render_tool_prompt(tokenizer, record, system, schemas))
    return lambda record: len(render_prompt(tokenizer, record, system))


def generate_round(rollout, tokenizer, spec: JobSpec, records: Sequence[PromptRecord], group_index: list[int],
                   params: SamplingParams, seed: int, metrics: StepMetrics | None = None) -> PackedBatch:
    """Responses to ``records``: len(records) * params.n samples, the n of a prompt adjacent;
    with ``rollout.multiTurn`` trajectories of several turns (``distflow.multiturn``).

    Args:
        rollout: the rollout engine.
        group_index: [len(records)] each prompt's id, unique within the run.
        seed: the round's seed (``step_seed``), the same on every rank.
        metrics: where the engine reports its timings (None: nowhere).
    """
    if spec.rollout.multi_turn.enable:
        return generate_multi_turn(rollout, tokenizer, spec, records, group_index, params, seed, metrics)
    prompts = render_prompts(tokenizer, records, spec.data.max_prompt_length, spec.data.system_prompt)
    return rollout.generate(prompts, group_index, params, seed, metrics)


def run_rollout(ctx: StageContext, node: PlannedNode, batch: None) -> StageOutput:
    """The step's first round: this rank's share of the loader's next batch of prompts."""
    spec = ctx.spec
    records = ctx.loader.next_batch()
    first = ctx.rollout_dp_rank * len(records)
    group_index = [ctx.step * spec.data.train_batch_size + first + i for i in range(len(records))]
    ctx.prompts.update(zip(group_index, records))
    generated = generate_round(ctx.models.rollout, ctx.tokenizer, spec, records, group_index,
                               sampling_params(spec), step_seed(spec.trainer.seed, ctx.step), ctx.metrics)
    # Length is the model's own tokens (tool outputs of a multi-turn sample excluded); clipped means
    # the sample used the whole token budget, which tool tokens spend too.
    resp = model_token_counts(generated).double()
    ctx.metrics.add_mean("response_length/mean", resp.sum(), resp.numel())
    ctx.metrics.add_max("response_length/max", resp.max())
    clipped = (generated.sample_fields["response_len"] >= spec.data.max_response_length).double()
    ctx.metrics.add_mean("response_length/clip_ratio", clipped.sum(), resp.numel())
    prompt = generated.sample_fields["prompt_len"].double()
    ctx.metrics.add_mean("prompt_length/mean", prompt.sum(), prompt.numel())
    if ctx.policy_version is not None:
        version = torch.full((generated.num_samples,), ctx.policy_version, dtype=torch.long, device=generated.device)
        generated = generated.with_fields(sample={"policy_version": version})
    return StageOutput(batch=generated)
