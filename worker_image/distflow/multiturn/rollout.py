"""The turn loop: trajectories generated turn by turn from their own token ids.

Turn 0 samples ``n`` responses per prompt exactly as a single-turn rollout
does (same seeds, so a trajectory that calls no tool is the single-turn
response). Turn ``t >= 1`` continues each live trajectory alone (``n = 1``)
from ``prompt + every id so far``, sampled from
``sample_seed(turn_seed(seed, t), group * n + j, 0)``: a pure function of the
step's seed, the sample and the turn, so the trajectories do not depend on the
rank, the chunk or which other samples are still live.

Output (the rollout's ``PackedBatch``, as documented in ``engines.rollout``):
``input_ids`` [T_total] = prompt ids, then every post-prompt id as sampled or
appended; ``response_mask`` [T_total] int8, 1 only on ids the model sampled;
``response_len`` [B] = post-prompt ids (model and tool); ``rollout_log_probs``
(when recorded) 0 off the model's ids; ``env_reward`` [B] float32 with an environment.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

import torch

from distflow.data.batch import PackedBatch
from distflow.engines.rollout import SamplingParams, pack_responses
from distflow.multiturn.calls import parse_hermes_calls
from distflow.multiturn.loading import Tool, load_environment, load_tools
from distflow.multiturn.pool import ERROR_KINDS, CallResult, run_concurrently
from distflow.multiturn.render import render_delta, render_tool_prompt
from distflow.spec import JobSpec
from distflow.spec.multiturn import MultiTurnSpec

GenerateFn = Callable[[list[list[int]], list[int], SamplingParams, int], PackedBatch]
"""An engine's generate on token ids: (prompts, group_index, params, seed) -> PackedBatch."""


def turn_seed(seed: int, turn: int) -> int:
    """The seed of turn ``turn`` >= 1 of a round whose seed is ``seed`` (turn 0 uses ``seed``)."""
    return hash((seed, -1, turn)) & 0x7FFFFFFF


@dataclass
class Trajectory:
    """One sample's ids so far."""

    prompt: list[int]
    group: int
    """The prompt's global index (``group_index``)."""
    uid: int
    """``group * n + j``: the sample's seed index from turn 1 on."""
    ids: list[int] = field(default_factory=list)
    """Post-prompt ids: model turns as sampled, observations as rendered."""
    mask: list[int] = field(default_factory=list)
    """1 on the model's ids, 0 on appended ones."""
    log_probs: list[float] = field(default_factory=list)
    turn_start: int = 0
    """Where the last model turn starts in ``ids``."""
    num_turns: int = 0
    num_tool_calls: int = 0
    env: Any = None
    env_reward: float = 0.0
    done: bool = False


@dataclass
class TurnStats:
    """Counts of a round on this rank, reported as ``multiturn/*`` metrics."""

    tool_calls: int = 0
    tool_seconds: float = 0.0
    errors: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ERROR_KINDS, 0))

    def count(self, result: CallResult) -> None:
        self.tool_calls += 1
        self.tool_seconds += result.seconds
        if result.error is not None:
            self.errors[result.error] += 1


@dataclass(frozen=True)
class TurnLoop:
    """What a multi-turn round needs besides the engine: built once per worker (``for_spec``)."""

    tokenizer: Any
    spec: MultiTurnSpec
    tools: dict[str, Tool]
    environment: type | None
    budget: int
    """Post-prompt tokens of a trajectory at most (``data.maxResponseLength``)."""
    max_prompt_length: int
    """Prompt tokens kept (the last ones), a first observation included (``data.maxPromptLength``)."""
    system_prompt: str | None = None
    """``data.systemPrompt``."""

    @classmethod
    def for_spec(cls, tokenizer, spec: JobSpec) -> "TurnLoop":
        """Raises ValueError: a tool or the environment does not load (``loading``)."""
        turns, data = spec.rollout.multi_turn, spec.data
        return cls(tokenizer, turns, load_tools(turns), load_environment(turns), data.max_response_length,
                   data.max_prompt_length, data.system_prompt)

    def render(self, record, observation: str | None = None) -> list[int]:
        """The prompt ids of ``record`` with the tools shown (and a first observation): [<= max_prompt_length]."""
        schemas = [t.schema for t in self.tools.values()]
        return render_tool_prompt(self.tokenizer, record, self.system_prompt, schemas,
                                  observation)[-self.max_prompt_length:]

    def run(self, generate_fn: GenerateFn, end_ids: Sequence[int], records: Sequence[Any],
            group_index: list[int], params: SamplingParams, seed: int) -> tuple[list[Trajectory], TurnStats]:
        """Roll out ``len(records) * params.n`` trajectories, the n of a prompt adjacent.

        Args:
            end_ids: ids that end a model turn (``eos_token_ids``).
            group_index: [len(records)] each prompt's global index.
            seed: the round's seed (``step_seed``), the same on every rank.
        Returns:
            The trajectories (batch order; ``pack_trajectories`` packs them) and the round's counts.
        """
        stats = TurnStats()
        trajectories = self._first_turn(generate_fn, records, group_index, params, seed, stats)
        ends = set(end_ids)
        for turn in range(1, self.spec.max_turns + 1):
            self._observe(trajectories, ends, turn, stats)
            live = [tr for tr in trajectories if not tr.done]
            if not live:
                break
            self._generate(generate_fn, live, replace(params, n=1), turn_seed(seed, turn))
        return trajectories, stats

    def _turn_tokens(self, live: list[Trajectory]) -> int:
        per_turn = self.spec.max_tokens_per_turn or self.budget
        return min(per_turn, max(self.budget - len(tr.ids) for tr in live))

    def _first_turn(self, generate_fn, records, group_index, params, seed, stats) -> list[Trajectory]:
        n = params.n
        if self.environment is None:
            prompts = [self.render(rec) for rec in records]
            trajectories = [Trajectory(p, g, g * n + j) for p, g in zip(prompts, group_index) for j in range(n)]
            self._generate(generate_fn, trajectories, params, seed, prompts=prompts, group_index=group_index)
            return trajectories
        # An environment's first observation is per sample: every sample is its own prompt from turn 0.
        per_sample = [rec for rec in records for _ in range(n)]
        trajectories = [Trajectory([], g, g * n + j, env=self.environment()) for g in group_index for j in range(n)]
        firsts = self._pool([functools.partial(tr.env.reset, rec) for tr, rec in zip(trajectories, per_sample)],
                            stats, count=False)
        for tr, rec, first in zip(trajectories, per_sample, firsts):
            error = first.error or (None if first.value is None or isinstance(first.value, str) else "bad_output")
            if error is not None:  # a broken environment: one turn, no steps
                stats.errors[error] += 1
                tr.done = True
            tr.prompt = self.render(rec, first.value if error is None else None)
        self._generate(generate_fn, trajectories, replace(params, n=1), seed)
        return trajectories

    def _generate(self, generate_fn: GenerateFn, live: list[Trajectory], params: SamplingParams, seed: int,
                  prompts: list[list[int]] | None = None, group_index: list[int] | None = None) -> None:
        """One model turn of ``live``: from their own ids (``prompt + ids``), or from ``prompts``
        with ``params.n`` samples each (turn 0, as a single-turn rollout)."""
        if prompts is None:
            prompts, group_index = [tr.prompt + tr.ids for tr in live], [tr.uid for tr in live]
        out = generate_fn(prompts, group_index, replace(params, max_new_tokens=self._turn_tokens(live)), seed)
        self._append_turns(live, out)

    def _append_turns(self, live: list[Trajectory], out: PackedBatch) -> None:
        """Each trajectory's sampled ids of this turn, as sampled, cut to its budget."""
        ids = out.token_fields["input_ids"].cpu()
        log_probs = out.token_fields.get("rollout_log_probs")
        log_probs = log_probs.cpu() if log_probs is not None else None
        offsets = out.cu_seqlens(dtype=torch.long, device="cpu").tolist()
        prompt_lens = out.sample_fields["prompt_len"].cpu().tolist()
        assert out.num_samples == len(live), (out.num_samples, len(live))
        for b, tr in enumerate(live):
            start, stop = offsets[b] + prompt_lens[b], offsets[b + 1]
            keep = min(stop - start, self.budget - len(tr.ids))
            tr.turn_start = len(tr.ids)
            tr.ids += ids[start:start + keep].tolist()
            tr.mask += [1] * keep
            tr.log_probs += (log_probs[start:start + keep].tolist() if log_probs is not None else [0.0] * keep)
            tr.num_turns += 1

    def _observe(self, trajectories: list[Trajectory], ends: set[int], turn: int, stats: TurnStats) -> None:
        """After model turn ``turn - 1``: run the calls (or environment steps) of every live
        trajectory at once, append their rendered observations, and end what is over."""
        live = [tr for tr in trajectories if not tr.done]
        closed = {id(tr): bool(tr.ids) and tr.ids[-1] in ends for tr in live}
        over = {id(tr) for tr in live if turn >= self.spec.max_turns or len(tr.ids) >= self.budget}
        if self.environment is not None:  # stepped after every turn, the last too: its reward counts
            messages = self._step_environments(live, stats)
        else:
            messages = self._call_tools([tr for tr in live if closed[id(tr)] and id(tr) not in over], stats)
        for tr in live:
            if tr.done or id(tr) in over or id(tr) not in messages:
                tr.done = True
                continue
            delta = render_delta(self.tokenizer, messages[id(tr)], ends, closed[id(tr)])
            keep = min(len(delta), self.budget - len(tr.ids))
            tr.ids += delta[:keep]
            tr.mask += [0] * keep
            tr.log_probs += [0.0] * keep
            tr.done = len(tr.ids) >= self.budget

    def _turn_text(self, tr: Trajectory) -> str:
        """The last model turn's text: its ids alone are decoded, to read the calls."""
        return self.tokenizer.decode(tr.ids[tr.turn_start:], skip_special_tokens=True)

    def _call_tools(self, live: list[Trajectory], stats: TurnStats) -> dict[int, list[dict[str, Any]]]:
        """id(trajectory) -> its tool messages, for the trajectories whose last turn called tools."""
        known = set(self.tools)
        asked = {id(tr): parse_hermes_calls(self._turn_text(tr), known) for tr in live}
        runnable = [(tr, c) for tr in live for c in asked[id(tr)] if c.error is None]
        results = iter(self._pool([functools.partial(self.tools[c.name].function, **c.arguments)
                                   for _, c in runnable], stats))
        messages: dict[int, list[dict[str, Any]]] = {}
        for tr in live:
            for call in asked[id(tr)]:
                tr.num_tool_calls += 1
                if call.error is not None:
                    stats.count(CallResult(None, "parse", call.error, 0.0))
                    content = f"Error: {call.error}"
                else:
                    content = _tool_output(next(results), stats)
                messages.setdefault(id(tr), []).append({"role": "tool", "name": call.name, "content": content})
        return messages

    def _step_environments(self, live: list[Trajectory], stats: TurnStats) -> dict[int, list[dict[str, Any]]]:
        """id(trajectory) -> [user message of the observation], for the environments not done."""
        steps = [functools.partial(tr.env.step, self._turn_text(tr)) for tr in live if not tr.done]
        results = iter(self._pool(steps, stats))
        messages = {}
        for tr in (tr for tr in live if not tr.done):
            result = next(results)
            value = result.value
            if result.error is None and not _is_step(value):
                stats.errors["bad_output"] += 1
                result = CallResult(None, "bad_output", "", result.seconds)
            if result.error is not None:
                tr.done = True
                continue
            observation, reward, done = value
            tr.env_reward += float(reward)
            if not done and observation:
                messages[id(tr)] = [{"role": "user", "content": observation}]
        return messages

    def _pool(self, calls: list[Callable[[], Any]], stats: TurnStats, count: bool = True) -> list[CallResult]:
        results = run_concurrently(calls, self.spec.tool_timeout_seconds, self.spec.max_tool_workers)
        if count:
            for r in results:
                stats.count(r)
        return results


def _tool_output(result: CallResult, stats: TurnStats) -> str:
    """The observation of a tool call; a non-string return counts as ``bad_output``."""
    if result.error is not None:
        return f"Error: {result.message}"
    if not isinstance(result.value, str):
        stats.errors["bad_output"] += 1
        return f"Error: the tool returned a {type(result.value).__name__}, not a string"
    return result.value


def _is_step(value: Any) -> bool:
    return (isinstance(value, tuple) and len(value) == 3 and (value[0] is None or isinstance(value[0], str))
            and isinstance(value[1], (int, float)) and isinstance(value[2], bool))


def pack_trajectories(trajectories: list[Trajectory], log_probs: bool, env_reward: bool,
                      device: torch.device | str = "cpu") -> PackedBatch:
    """Trajectories -> the rollout's ``PackedBatch``, fields on ``device`` (``seq_lens`` on the host).

    Args:
        log_probs: add ``rollout_log_probs`` [T_total] float32 (0 off the model's ids).
        env_reward: add ``env_reward`` [B] float32, the summed environment rewards.
    """
    batch = pack_responses([(tr.prompt, tr.ids) for tr in trajectories], [tr.group for tr in trajectories], device,
                           masks=[tr.mask for tr in trajectories])
    token, sample = {}, {}
    if log_probs:
        token["rollout_log_probs"] = torch.tensor(
            [x for tr in trajectories for x in [0.0] * len(tr.prompt) + tr.log_probs], dtype=torch.float32, device=device)
    if env_reward:
        sample["env_reward"] = torch.tensor([tr.env_reward for tr in trajectories], dtype=torch.float32, device=device)
    return batch.with_fields(token=token, sample=sample)


def generate_multi_turn(engine, tokenizer, spec: JobSpec, records: Sequence[Any], group_index: list[int],
                        params: SamplingParams, seed: int, metrics=None) -> PackedBatch:
    """The multi-turn round ``stages.rollout.generate_round`` runs when ``rollout.multiTurn.enable``.

    Args:
        engine: a rollout engine (``HfRollout``, ``VllmRollout``) with ``session(metrics)``: a
            context that yields ``(generate_fn, end_ids)`` whose calls need no other rank; with
            ``records_log_probs`` its turns' ``rollout_log_probs`` are packed (truncated importance
            sampling, ``rollout.tisImpRatioCap``) even when ``params`` does not ask for them.
        metrics: where the ``multiturn/*`` counts go (None: nowhere).
    Returns:
        ``len(records) * params.n`` samples, the n of a prompt adjacent, on the engine's device.
    """
    loop = TurnLoop.for_spec(tokenizer, spec)
    with engine.session(metrics) as (generate_fn, end_ids):
        trajectories, stats = loop.run(generate_fn, end_ids, records, group_index, params, seed)
    if metrics is not None:
        report(metrics, trajectories, stats)
    return pack_trajectories(trajectories, params.record_log_probs or engine.records_log_probs,
                             loop.environment is not None, engine.device)


def report(metrics, trajectories: list[Trajectory], stats: TurnStats) -> None:
    """``multiturn/*``: turns per sample (mean, max), tool calls (and the share of samples that
    made one), errors by kind, tool seconds (summed over calls), environment reward. Every key on
    every rank, zeros included (``StepMetrics`` reduces the same keys everywhere)."""
    turns = [tr.num_turns for tr in trajectories]
    metrics.add_mean("multiturn/num_turns/mean", sum(turns), len(turns))
    metrics.add_max("multiturn/num_turns/max", max(turns, default=0))
    metrics.add_sum("multiturn/tool_calls", stats.tool_calls)
    metrics.add_mean("multiturn/tool_call_rate", sum(tr.num_tool_calls > 0 for tr in trajectories), len(turns))
    for kind, count in stats.errors.items():
        metrics.add_sum(f"multiturn/tool_errors/{kind}", count)
    metrics.add_sum("multiturn/tool_time_s", stats.tool_seconds)
    if any(tr.env is not None for tr in trajectories):  # the same on every rank: the spec decides
        metrics.add_mean("multiturn/env_reward/mean", sum(tr.env_reward for tr in trajectories), len(turns))
