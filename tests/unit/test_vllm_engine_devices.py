"""The vLLM engine's GPU, its sleep cycle and its multi-turn session, against a fake ``vllm``
(no GPU, no vLLM needed).

The fake ``vllm.LLM`` records its constructor's environment (vLLM's external launcher takes
``cuda:LOCAL_RANK``), every call the engine makes, in order, and each generate call's requests.
"""

import os
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from distflow import launcher
from distflow.engines.fsdp import select_device
from distflow import models
from distflow.engines.rollout import SamplingParams, sample_seed
from distflow.engines.vllm_rollout import VllmConfig, VllmRollout
from distflow.metrics import StepMetrics
from distflow.multiturn.render import render_delta
from distflow.multiturn.rollout import generate_multi_turn, turn_seed
from distflow.ray_launcher import torchrun_environ, worker_env_from_environ
from distflow.spec import parse_spec
from distflow.worker import DagWorker, WorkerEnv

pytestmark = pytest.mark.unit

LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class FakeLLM:
    """Records ``(call, detail)`` in ``FakeLLM.calls`` and each generate call's (requests, sampling)
    in ``FakeLLM.requests``; answers every request with ``FakeLLM.reply``, each token at log-prob -0.5."""

    calls: list = []
    environ: list = []
    requests: list = []
    reply: list = [7]

    def __init__(self, **kwargs):
        FakeLLM.environ.append({k: os.environ.get(k) for k in LAUNCHER_VARS})
        FakeLLM.calls.append(("init", kwargs["model"]))

    def sleep(self, level=1):
        FakeLLM.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        FakeLLM.calls.append(("wake_up", tuple(tags)))

    def collective_rpc(self, method, args=(), kwargs=None):
        if method == "reload_weights":
            loaded = {name: tensor.clone() for name, tensor in kwargs["weights_iterator"]}
            FakeLLM.calls.append(("reload_weights", sorted(loaded)))
            FakeLLM.loaded = loaded

    def reset_prefix_cache(self):
        FakeLLM.calls.append(("reset_prefix_cache", None))

    def generate(self, requests, sampling, use_tqdm=False):
        FakeLLM.calls.append(("generate", len(requests)))
        FakeLLM.requests.append((requests, sampling))
        reply = list(FakeLLM.reply)
        completion = SimpleNamespace(token_ids=reply, logprobs=[{t: SimpleNamespace(logprob=-0.5)} for t in reply])
        return [SimpleNamespace(prompt_token_ids=r["prompt_token_ids"], outputs=[completion]) for r in requests]


@pytest.fixture
def fake_vllm(monkeypatch):
    """``vllm`` and ``vllm.inputs`` replaced by the fake; the process env restored afterwards."""
    module, inputs = types.ModuleType("vllm"), types.ModuleType("vllm.inputs")
    module.LLM, module.SamplingParams = FakeLLM, lambda **kw: kw
    inputs.TokensPrompt = lambda **kw: kw
    module.inputs = inputs
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    monkeypatch.setattr(os, "environ", dict(os.environ))
    monkeypatch.setattr(FakeLLM, "calls", [])
    monkeypatch.setattr(FakeLLM, "environ", [])
    monkeypatch.setattr(FakeLLM, "requests", [])
    monkeypatch.setattr(FakeLLM, "reply", [7])
    return FakeLLM


@pytest.fixture
def gpus(monkeypatch):
    """A machine showing ``count`` GPUs (set it); ``set_device`` is recorded."""
    state = {"count": 8, "chosen": [0]}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: state["count"] > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: state["count"])
    monkeypatch.setattr(torch.cuda, "set_device", state["chosen"].append)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: state["chosen"][-1])
    return state


def _spec(num_nodes: int, procs_per_node: int):
    return parse_spec({"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 8},
                       "rollout": {"engine": "vllm"},
                       "cluster": {"numNodes": num_nodes, "procsPerNode": procs_per_node, "device": "cuda"}})


def _build_engine_of(spec, env: WorkerEnv) -> None:
    """What ``DagWorker`` does for this worker: pick its GPU, then build its rollout engine."""
    device = select_device(spec.cluster.device, env.device_index).device
    worker = SimpleNamespace(spec=spec, env=env, device=device, tokenizer=SimpleNamespace(eos_token_id=2),
                             actor_model=torch.nn.Linear(2, 2))
    DagWorker._build_rollout(worker, None)


def test_two_local_nodes_of_four_give_each_engine_its_workers_gpu(fake_vllm, gpus):
    spec = _spec(2, 4)
    # what a parent launcher (torchrun) would leave in every worker's environment
    os.environ.update(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2")
    base = WorkerEnv(rank=0, world_size=8, local_rank=0, local_world_size=8, node_rank=0, num_nodes=2,
                     master_addr="127.0.0.1", master_port=29511, job_name="job", model_dir="m", device_index=0)
    for index in range(8):
        _build_engine_of(spec, launcher.local_worker_env(index, 4, base))
    # rank 5 is node 1's local rank 1, on the machine's GPU 5
    assert [e["LOCAL_RANK"] for e in fake_vllm.environ] == [str(i) for i in range(8)]
    assert [e["RANK"] for e in fake_vllm.environ] == [str(i) for i in range(8)]
    assert {(e["WORLD_SIZE"], e["MASTER_ADDR"], e["MASTER_PORT"]) for e in fake_vllm.environ} == {
        ("8", "127.0.0.1", "29511")}


def test_every_ray_actor_engine_takes_the_one_gpu_its_actor_sees(fake_vllm, gpus):
    spec = _spec(2, 4)
    gpus["count"] = 1  # Ray sets CUDA_VISIBLE_DEVICES to the actor's one GPU
    for rank in range(8):
        os.environ.update(torchrun_environ(spec, rank, ("10.0.0.7", 29500), "m", resume=True))
        _build_engine_of(spec, worker_env_from_environ(spec, "job", os.environ))
    assert [e["LOCAL_RANK"] for e in fake_vllm.environ] == ["0"] * 8
    assert [e["RANK"] for e in fake_vllm.environ] == [str(r) for r in range(8)]


def _cuda_engine(policy, tokenizer=None, model_dir="m"):
    config = VllmConfig(model_dir=model_dir, dtype="float32", tensor_parallel_size=1, max_model_len=32, seed=0,
                        device_type="cuda")
    engine = VllmRollout.build(config, tokenizer or SimpleNamespace(eos_token_id=2), policy=policy)
    engine.device = torch.device("cpu")  # its batches go to the host: there is no GPU here
    return engine


def _generate(engine):
    return engine.generate([[1, 2, 3]], [0], SamplingParams(n=2, temperature=1.0, top_p=1.0, top_k=0,
                                                            max_new_tokens=4, micro_batch_size=8), seed=0)


def test_the_engine_sleeps_at_level_2_and_reloads_the_policy_before_it_generates(fake_vllm):
    policy = torch.nn.Linear(2, 2)
    engine = _cuda_engine(policy)
    _generate(engine)  # the first rollout: the weights loaded at start were discarded by the sleep
    with torch.no_grad():
        policy.weight.add_(1.0)  # an update, then the actor stage's sync
    engine.sync(policy)
    _generate(engine)
    _generate(engine)  # a second round without an update in between (DAPO refill, evaluation)
    weights, kv = ("wake_up", ("weights",)), ("wake_up", ("kv_cache", "scheduling"))
    load = [weights, ("reload_weights", ["bias", "weight"]), ("reset_prefix_cache", None)]
    assert fake_vllm.calls == [
        ("init", "m"), ("sleep", 2),
        *load, kv, ("generate", 2), ("sleep", 2),
        *load,
        kv, ("generate", 2), ("sleep", 2),
        *load, kv, ("generate", 2), ("sleep", 2)]
    assert torch.equal(fake_vllm.loaded["weight"], policy.weight)  # the updated policy, not the start


def test_a_cuda_engine_without_the_policy_to_reload_from_is_refused(fake_vllm):
    with pytest.raises(ValueError, match="policy="):
        _cuda_engine(None)


def test_a_cpu_engine_never_sleeps_nor_reloads_before_generating(fake_vllm):
    config = VllmConfig(model_dir="m", dtype="float32", tensor_parallel_size=1, max_model_len=32, seed=0,
                        device_type="cpu")
    engine = VllmRollout.build(config, SimpleNamespace(eos_token_id=2))
    batch = _generate(engine)
    assert fake_vllm.calls == [("init", "m"), ("generate", 2)]
    assert batch.token_fields["rollout_log_probs"].tolist() == [0.0, 0.0, 0.0, -0.5] * 2


WEIGHTS, KV = ("wake_up", ("weights",)), ("wake_up", ("kv_cache", "scheduling"))
LOAD = [WEIGHTS, ("reload_weights", ["bias", "weight"]), ("reset_prefix_cache", None)]


def test_a_session_wakes_and_loads_once_for_all_its_turns_and_sleeps_when_it_closes(fake_vllm, tmp_path):
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 9]}')
    engine = _cuda_engine(torch.nn.Linear(2, 2), model_dir=str(tmp_path))
    params = SamplingParams(n=2, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=4, micro_batch_size=8)
    prompts = [[1, 2, 3], [4, 5]]
    with engine.session() as (generate_fn, end_ids):
        batches = [generate_fn(prompts, [10, 11], params, seed=s) for s in (5, 6, 7)]
        assert fake_vllm.calls[-1] == ("generate", 4), "the engine slept inside the session"
    assert fake_vllm.calls == [("init", str(tmp_path)), ("sleep", 2), *LOAD, KV,
                               ("generate", 4), ("generate", 4), ("generate", 4), ("sleep", 2)]
    # the generation config's end-of-turn id ends a turn, as the tokenizer's EOS does, in vLLM too
    assert end_ids == [2, 9]
    for seed, batch, (requests, sampling) in zip((5, 6, 7), batches, fake_vllm.requests):
        # token ids in, exactly (one TokensPrompt per sample); one seed per sample, whatever the batch
        assert [r["prompt_token_ids"] for r in requests] == [[1, 2, 3]] * 2 + [[4, 5]] * 2
        assert [s["seed"] for s in sampling] == [sample_seed(seed, g, j) for g in (10, 11) for j in range(2)]
        assert all(s["stop_token_ids"] == [2, 9] and s["n"] == 1 for s in sampling)
        assert batch.token_fields["input_ids"].tolist() == [1, 2, 3, 7] * 2 + [4, 5, 7] * 2
        assert batch.token_fields["rollout_log_probs"].tolist() == [0.0] * 3 + [-0.5] + [0.0] * 3 + [-0.5] \
            + [0.0, 0.0, -0.5] * 2


def test_a_session_sleeps_when_a_turn_fails(fake_vllm):
    engine = _cuda_engine(torch.nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match="tool broke"):
        with engine.session():
            raise RuntimeError("tool broke")
    assert fake_vllm.calls[-1] == ("sleep", 2) and not engine.resident


def test_a_tensor_parallel_engine_refuses_a_session(fake_vllm):
    config = VllmConfig(model_dir="m", dtype="float32", tensor_parallel_size=2, max_model_len=32, seed=0,
                        device_type="cpu")
    engine = VllmRollout.build(config, SimpleNamespace(eos_token_id=2), world_size=2)
    with pytest.raises(ValueError, match="rollout.tensorParallelSize: 1"):
        with engine.session():
            pass


def test_a_multi_turn_round_on_vllm_continues_each_trajectory_from_its_own_ids(fake_vllm):
    tokenizer = models.build_byte_tokenizer()
    call = '<tool_call>{"name": "lookup", "arguments": {}}</tool_call>'
    fake_vllm.reply = tokenizer.encode(call, add_special_tokens=False) + [tokenizer.eos_token_id]
    spec = parse_spec({
        "model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, "maxResponseLength": 400,
                                            "maxPromptLength": 400},
        "rollout": {"engine": "vllm", "multiTurn": {"enable": True, "maxTurns": 2, "tools": [{
            "function": "tests.unit.multiturn_tools:lookup",
            "toolSchema": {"type": "function", "function": {"name": "lookup", "description": "lookup"}}}]}}})
    engine = _cuda_engine(torch.nn.Linear(2, 2), tokenizer)
    records = [SimpleNamespace(messages=({"role": "user", "content": "question"},))]
    params = SamplingParams(n=2, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=400, micro_batch_size=8)
    metrics = StepMetrics()
    batch = generate_multi_turn(engine, tokenizer, spec, records, [3], params, seed=5, metrics=metrics)

    assert fake_vllm.calls[1:] == [("sleep", 2), *LOAD, KV, ("generate", 2), ("generate", 2), ("sleep", 2)]
    (first, first_sampling), (second, second_sampling) = fake_vllm.requests
    prompt = first[0]["prompt_token_ids"]
    delta = render_delta(tokenizer, [{"role": "tool", "name": "lookup", "content": "  result: 42  "}],
                         set(engine.end_ids), True)
    reply = fake_vllm.reply
    assert [r["prompt_token_ids"] for r in second] == [prompt + reply + delta] * 2
    # turn 1 samples each trajectory alone, seeded by its turn and its index in the step (3 * n + j)
    assert [s["seed"] for s in second_sampling] == [sample_seed(turn_seed(5, 1), 3 * 2 + j, 0) for j in range(2)]
    ids, mask = batch.token_fields["input_ids"].tolist(), batch.token_fields["response_mask"].tolist()
    assert ids == (prompt + reply + delta + reply) * 2
    assert mask == ([0] * len(prompt) + [1] * len(reply) + [0] * len(delta) + [1] * len(reply)) * 2
    # the engine's log-probs are packed without record_log_probs (tisImpRatioCap reads them), 0 off the model's ids
    assert batch.token_fields["rollout_log_probs"].tolist() == [-0.5 * m for m in mask]
    assert metrics.reduce(torch.device("cpu"))["multiturn/tool_calls"] == 2
