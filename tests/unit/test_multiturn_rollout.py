"""Multi-turn rollouts keep the sampled token ids exactly, and tools cannot break a step.

A scripted engine samples each turn from the tiny random model (byte tokenizer)
and then writes a hostile tail the script controls: an invalid UTF-8 byte,
the bytes that spell ``<|im_end|>``, trailing spaces, a hermes tool call and
EOS. Decoding such a turn and encoding it again (or re-applying the chat
template, which trims contents) gives other ids, so a loop that rebuilt the
conversation from text would train on ids the model never sampled; the
tests check that the trained ids are the sampled ones bit for bit and that
the loss mask is 1 on exactly those.
"""

from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from distflow import models
from distflow.engines.rollout import SamplingParams, generate, pack_responses
from distflow.metrics import StepMetrics
from distflow.multiturn.render import render_delta
from distflow.multiturn.rollout import TurnLoop, pack_trajectories, report
from distflow.spec.multiturn import MultiTurnSpec

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")
TOOLS = "tests.unit.multiturn_tools"
TRIMMING_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] | trim) "
    "+ '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
EOS = 2  # <|im_end|> of the byte tokenizer


def schema(name, properties=None):
    return {"type": "function", "function": {"name": name, "description": name,
                                             "parameters": {"type": "object", "properties": properties or {}}}}


@pytest.fixture(scope="module")
def tokenizer():
    tok = models.build_byte_tokenizer()
    tok.chat_template = TRIMMING_TEMPLATE
    return tok


@pytest.fixture(scope="module")
def model(tokenizer):
    from transformers import AutoModelForCausalLM

    config = models.tiny_llama_config(len(tokenizer), bos_token_id=1, eos_token_id=EOS, pad_token_id=EOS)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def byte_ids(tokenizer, data: bytes) -> list[int]:
    """The byte tokens of ``data`` (never the special tokens the same text would encode to)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    chars = {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}  # GPT-2's byte-level map
    return [tokenizer.convert_tokens_to_ids(chars[b]) for b in data]


class ScriptedEngine:
    """Turn ``t`` of every sample: up to 3 ids the tiny model samples, then ``tails(t, sample)``, then EOS.
    Records each call's prompts and what it returned."""

    def __init__(self, model, tokenizer, tails):
        self.model, self.tokenizer, self.tails = model, tokenizer, tails
        self.calls: list[dict] = []

    def __call__(self, prompts, group_index, params, seed):
        free = generate(self.model, self.tokenizer, prompts, group_index, replace(params, max_new_tokens=3),
                        seed, CPU, independent=True)
        offsets = free.cu_seqlens(dtype=torch.long).tolist()
        ids, plen = free.token_fields["input_ids"], free.sample_fields["prompt_len"].tolist()
        turn = len(self.calls)
        seqs, returned = [], []
        for b in range(free.num_samples):
            sampled = [t for t in ids[offsets[b] + plen[b]:offsets[b + 1]].tolist() if t != EOS]
            response = (sampled + self.tails(turn, b) + [EOS])[:params.max_new_tokens]
            seqs.append((prompts[b // params.n], response))
            returned.append(response)
        self.calls.append({"prompts": [list(p) for p in prompts], "group_index": list(group_index),
                           "returned": returned, "seed": seed, "n": params.n})
        return pack_responses(seqs, [group_index[b // params.n] for b in range(len(seqs))], CPU)


def hostile_call(tokenizer, name: str, arguments: str = "{}") -> list[int]:
    text = f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>  '.encode()
    return byte_ids(tokenizer, b"\xff<|im_end|> ") + byte_ids(tokenizer, text)


def records(k):
    return [SimpleNamespace(messages=({"role": "user", "content": f"question {i}"},)) for i in range(k)]


def params(n=2, budget=400, log_probs=False):
    return SamplingParams(n, 1.0, 1.0, 0, budget, 8, share_prefill=False, record_log_probs=log_probs)


def loop(tokenizer, tools, budget=400, **turns):
    spec = MultiTurnSpec(enable=True, tools=[{"function": f"{TOOLS}:{fn}", "toolSchema": schema(name, props)}
                                             for name, fn, props in tools], **turns)
    from distflow.multiturn.loading import load_environment, load_tools

    return TurnLoop(tokenizer, spec, load_tools(spec), load_environment(spec), budget, max_prompt_length=200)


def test_trained_ids_are_the_sampled_ids_bit_for_bit(model, tokenizer):
    turns = loop(tokenizer, [("lookup", "lookup", None)], maxTurns=3)
    engine = ScriptedEngine(model, tokenizer, lambda t, b: hostile_call(tokenizer, "lookup") if t < 2 else [])
    trajectories, stats = turns.run(engine, [EOS], records(2), [10, 11], params(), seed=5)
    batch = pack_trajectories(trajectories, False, False)

    assert [c["n"] for c in engine.calls] == [2, 1, 1] and len(trajectories) == 4
    assert [tr.num_turns for tr in trajectories] == [3] * 4 and stats.tool_calls == 8
    offsets = batch.cu_seqlens(dtype=torch.long).tolist()
    delta = render_delta(tokenizer, [{"role": "tool", "name": "lookup", "content": "  result: 42  "}], {EOS}, True)
    for b, tr in enumerate(trajectories):
        sampled = [engine.calls[t]["returned"][b] for t in range(3)]
        ids = batch.token_fields["input_ids"][offsets[b]:offsets[b + 1]].tolist()
        mask = batch.token_fields["response_mask"][offsets[b]:offsets[b + 1]].tolist()
        prompt = engine.calls[0]["prompts"][b // 2]
        # input_ids = prompt, turn 0, delta, turn 1, delta, turn 2: every model id as sampled.
        assert ids == prompt + sampled[0] + delta + sampled[1] + delta + sampled[2]
        assert mask == [0] * len(prompt) + [1] * len(sampled[0]) + [0] * len(delta) + [1] * len(sampled[1]) \
            + [0] * len(delta) + [1] * len(sampled[2])
        assert batch.sample_fields["response_len"][b] == len(ids) - len(prompt)
        # Each turn generated from exactly the ids before it, never from a re-encoding.
        assert engine.calls[1]["prompts"][b] == prompt + sampled[0] + delta
        assert engine.calls[2]["prompts"][b] == prompt + sampled[0] + delta + sampled[1] + delta
        assert engine.calls[1]["group_index"][b] == tr.uid == [10, 11][b // 2] * 2 + b % 2
    # The trap is real: decode + encode, or re-templating the conversation, changes the ids.
    turn0 = engine.calls[0]["returned"][0]
    assert tokenizer.encode(tokenizer.decode(turn0), add_special_tokens=False) != turn0
    text = [{"role": "user", "content": "question 0"},
            {"role": "assistant", "content": tokenizer.decode(turn0, skip_special_tokens=True)}]
    rendered = tokenizer.apply_chat_template(text, tokenize=True)
    rendered = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    assert rendered != engine.calls[0]["prompts"][0] + turn0 + delta[:1]


def test_turn_zero_is_the_single_turn_rollout_and_turns_are_seeded_per_sample(model, tokenizer):
    """A trajectory depends on its own seed only: the same on one call or split in halves."""
    def run(recs, groups, micro):
        turns = loop(tokenizer, [("lookup", "lookup", None)], maxTurns=3, maxTokensPerTurn=100)
        engine = ScriptedEngine(model, tokenizer, lambda t, b: hostile_call(tokenizer, "lookup") if t < 2 else [])
        trajectories, _ = turns.run(engine, [EOS], recs, groups, replace(params(), micro_batch_size=micro), 9)
        return [(tr.uid, tr.ids) for tr in trajectories], engine

    whole, engine = run(records(4), [0, 1, 2, 3], 8)
    halves = run(records(4)[:2], [0, 1], 2)[0] + run(records(4)[2:], [2, 3], 4)[0]
    assert whole == halves
    single = generate(model, tokenizer, engine.calls[0]["prompts"], [0, 1, 2, 3], replace(params(), max_new_tokens=3),
                      9, CPU)
    assert single.token_fields["input_ids"].tolist()[:len(engine.calls[0]["prompts"][0]) + 1] == \
        engine.calls[0]["prompts"][0] + engine.calls[0]["returned"][0][:1]
    assert engine.calls[1]["seed"] != engine.calls[2]["seed"] != 9


def test_the_budget_cuts_the_last_turn_and_the_mask_follows(model, tokenizer):
    turns = loop(tokenizer, [("lookup", "lookup", None)], budget=150, maxTurns=5)
    engine = ScriptedEngine(model, tokenizer, lambda t, b: hostile_call(tokenizer, "lookup"))
    trajectories, _ = turns.run(engine, [EOS], records(1), [0], params(n=1, log_probs=True), 1)
    (tr,) = trajectories
    assert len(tr.ids) == len(tr.mask) == len(tr.log_probs) == 150
    batch = pack_trajectories(trajectories, True, False)
    assert batch.sample_fields["response_len"].tolist() == [150]
    assert batch.token_fields["rollout_log_probs"][batch.token_fields["response_mask"] == 0].abs().sum() == 0
    assert tr.num_turns < 5


def test_failing_tools_end_their_turn_with_an_error_and_are_counted(model, tokenizer):
    tools = [("explode", "explode", {"query": {"type": "string"}}), ("sleepy", "sleepy", None),
             ("not_text", "not_text", None), ("lookup", "lookup", None)]
    turns = loop(tokenizer, tools, maxTurns=2, toolTimeoutSeconds=0.5, maxToolWorkers=8)
    calls = [hostile_call(tokenizer, "explode", '{"query": "x"}'), hostile_call(tokenizer, "sleepy"),
             hostile_call(tokenizer, "not_text"), byte_ids(tokenizer, b"<tool_call>{not json</tool_call>"),
             hostile_call(tokenizer, "lookup")]
    engine = ScriptedEngine(model, tokenizer, lambda t, b: calls[b] if t == 0 else [])
    start = time.perf_counter()
    trajectories, stats = turns.run(engine, [EOS], records(5), list(range(5)), params(n=1), 3)
    assert time.perf_counter() - start < 20  # the sleeping tool (30 s) did not hold the step
    assert stats.errors == {"exception": 1, "timeout": 1, "bad_output": 1, "parse": 1}
    assert stats.tool_calls == 5 and [tr.num_turns for tr in trajectories] == [2] * 5
    observations = [tokenizer.decode([t for t, m in zip(tr.ids, tr.mask) if m == 0]) for tr in trajectories]
    assert "RuntimeError: the tool broke" in observations[0]
    assert "timeout of 0.5 s" in observations[1]
    assert "returned a int, not a string" in observations[2]
    assert "not JSON" in observations[3]
    assert "result: 42" in observations[4] and "Error" not in observations[4]
    metrics = StepMetrics()
    report(metrics, trajectories, stats)
    out = metrics.reduce(CPU)
    assert out["multiturn/tool_errors/timeout"] == 1 and out["multiturn/tool_errors/parse"] == 1
    assert out["multiturn/tool_calls"] == 5 and out["multiturn/num_turns/max"] == 2
    assert out["multiturn/tool_call_rate"] == 1.0 and out["multiturn/tool_time_s"] >= 0.5


def test_an_environment_steps_every_turn_and_its_rewards_are_summed(model, tokenizer):
    spec = MultiTurnSpec(enable=True, environment=f"{TOOLS}:Countdown", maxTurns=5, maxTokensPerTurn=4)
    from distflow.multiturn.loading import load_environment

    turns = TurnLoop(tokenizer, spec, {}, load_environment(spec), 400, max_prompt_length=200)
    engine = ScriptedEngine(model, tokenizer, lambda t, b: [])
    trajectories, stats = turns.run(engine, [EOS], records(2), [0, 1], params(), 4)
    assert [tr.num_turns for tr in trajectories] == [3] * 4  # done after the third step
    assert stats.tool_calls == 12 and sum(stats.errors.values()) == 0
    assert all(tr.env_reward == sum(1.0 for _ in range(3)) for tr in trajectories)
    batch = pack_trajectories(trajectories, False, True)
    assert batch.sample_fields["env_reward"].tolist() == [3.0] * 4


def test_prompts_are_checked_against_max_prompt_length_with_the_tools_shown(tokenizer):
    """A template that ignores ``tools=`` gets hermes instructions in the system prompt, and
    ``data.truncation`` measures that prompt, not the plain one."""
    from distflow.multiturn.tools import calculator
    from distflow.spec import parse_spec
    from distflow.stages.rollout import prompt_length

    tool = {"function": "distflow.multiturn.tools.calculator:calculate", "toolSchema": calculator.SCHEMA}
    doc = {"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, "systemPrompt": "Be brief.",
                                               "maxPromptLength": 1024},
           "rollout": {"multiTurn": {"enable": True, "tools": [tool]}}}
    spec = parse_spec(doc)
    (record,) = records(1)
    turns = TurnLoop.for_spec(tokenizer, spec)
    text = tokenizer.decode(turns.render(record))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and '"name": "calculate"' in text
    assert prompt_length(tokenizer, spec)(record) == len(tokenizer.encode(text)) == len(turns.render(record))
    plain = parse_spec({**doc, "rollout": {}})
    assert prompt_length(tokenizer, plain)(record) < prompt_length(tokenizer, spec)(record) - 100


def test_an_environment_that_fails_to_reset_leaves_one_plain_turn(model, tokenizer):
    spec = MultiTurnSpec(enable=True, environment=f"{TOOLS}:BrokenReset", maxTurns=5, maxTokensPerTurn=4)
    from distflow.multiturn.loading import load_environment

    turns = TurnLoop(tokenizer, spec, {}, load_environment(spec), 400, max_prompt_length=200)
    engine = ScriptedEngine(model, tokenizer, lambda t, b: [])
    trajectories, stats = turns.run(engine, [EOS], records(1), [0], params(), 4)
    assert [tr.num_turns for tr in trajectories] == [1, 1] and len(engine.calls) == 1
    assert stats.errors["exception"] == 2 and all(m == 1 for tr in trajectories for m in tr.mask)
