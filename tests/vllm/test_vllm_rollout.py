"""The vLLM rollout engine against Hugging Face on SmolLM2 (CPU build of vLLM, float32).

Runs in the venv .ci/setup-vllm builds (tests/test_vllm_tier.py starts it); elsewhere vllm is
not importable and the module skips.

- greedy vLLM responses equal greedy HF ``generate`` token for token on 32 held-out prompts;
- the log-probs vLLM reports for sampled tokens equal the actor's recomputed ones
  (max |diff| <= LOGP_ATOL over every response token, at temperature 0.8);
- the same seed gives the same samples;
- after one optimizer step on the HF model and ``sync``, greedy vLLM output equals HF
  generation with the updated weights, and differs from the output before the update.
"""

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: the vllm tier runs in .ci/setup-vllm's venv")

import torch  # noqa: E402
from distflow.engines import model_ops  # noqa: E402
from distflow.engines.rollout import SamplingParams, generate, render_prompts  # noqa: E402
from distflow.engines.vllm_rollout import VllmConfig, VllmRollout  # noqa: E402
from distflow.models import load_causal_lm, load_tokenizer, resolve_model  # noqa: E402
from distflow.tasks import ArithmeticSource, ArithmeticTask  # noqa: E402
from distflow.models import model_cache_dir  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(2400)]

LOGP_ATOL = 2e-3
"""Max |vLLM - HF| log-prob of a sampled token, in nats (float32 on CPU; measured ~1e-4)."""
MAX_NEW = 16
SYSTEM = "You are a calculator. Reply with the number only."


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(resolve_model("smollm2", model_cache_dir()))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def engine(model_dir, tokenizer) -> VllmRollout:
    config = VllmConfig(model_dir=model_dir, dtype="float32", tensor_parallel_size=1, max_model_len=256,
                        seed=0, device_type="cpu", cpu_kv_cache_bytes=256 << 20)
    return VllmRollout.build(config, tokenizer)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return load_causal_lm(model_dir, "float32").eval()


def _prompts(tokenizer, num: int) -> list[list[int]]:
    source = ArithmeticSource(num_records=num, seed=0, split="eval", task=ArithmeticTask(1, 20))
    return render_prompts(tokenizer, source.read(list(range(num))), 64, SYSTEM)


def _responses(batch) -> list[list[int]]:
    ids, mask = batch.token_fields["input_ids"], batch.token_fields["response_mask"].bool()
    cu = batch.cu_seqlens(dtype=torch.long).tolist()
    return [ids[cu[b]:cu[b + 1]][mask[cu[b]:cu[b + 1]]].tolist() for b in range(batch.num_samples)]


GREEDY = SamplingParams(n=1, temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=MAX_NEW, micro_batch_size=32)


def _greedy_pair(engine, hf_model, tokenizer, prompts):
    vllm_batch = engine.generate(prompts, list(range(len(prompts))), GREEDY, seed=0)
    hf_batch = generate(hf_model, tokenizer, prompts, list(range(len(prompts))), GREEDY, 0, torch.device("cpu"))
    return _responses(vllm_batch), _responses(hf_batch)


def test_greedy_vllm_equals_greedy_hf_on_32_prompts(engine, hf_model, tokenizer):
    prompts = _prompts(tokenizer, 32)
    got, want = _greedy_pair(engine, hf_model, tokenizer, prompts)
    assert len(got) == 32
    mismatched = [i for i in range(32) if got[i] != want[i]]
    assert not mismatched, [(tokenizer.decode(got[i]), tokenizer.decode(want[i])) for i in mismatched]
    eos = tokenizer.eos_token_id
    assert any(r and r[-1] == eos for r in got), "no response stopped at EOS: the stop rule went untested"


def test_sampled_log_probs_match_the_actors_recomputed_ones(engine, hf_model, tokenizer):
    params = SamplingParams(n=4, temperature=0.8, top_p=1.0, top_k=0, max_new_tokens=MAX_NEW, micro_batch_size=32)
    batch = engine.generate(_prompts(tokenizer, 8), list(range(8)), params, seed=3)
    assert batch.num_samples == 32
    assert batch.sample_fields["group_index"].tolist() == [g for g in range(8) for _ in range(4)]
    actor = model_ops.compute_log_probs(hf_model, batch, tokenizer.pad_token_id, 16, 0.8)
    mask = batch.token_fields["response_mask"].bool()
    rollout = batch.token_fields["rollout_log_probs"]
    diff = (actor[mask] - rollout[mask]).abs()
    assert float(diff.max()) <= LOGP_ATOL, f"max |diff| {float(diff.max()):.2e}, mean {float(diff.mean()):.2e}"
    assert torch.all(rollout[~mask] == 0)
    assert len({tuple(r) for r in _responses(batch)}) > 8, "samples of a group should differ"


def test_same_seed_same_samples_other_seed_other_samples(engine, tokenizer):
    params = SamplingParams(n=2, temperature=1.0, top_p=0.9, top_k=50, max_new_tokens=MAX_NEW, micro_batch_size=8)
    prompts = _prompts(tokenizer, 4)
    first = _responses(engine.generate(prompts, [0, 1, 2, 3], params, seed=7))
    again = _responses(engine.generate(prompts, [0, 1, 2, 3], params, seed=7))
    other = _responses(engine.generate(prompts, [0, 1, 2, 3], params, seed=8))
    assert first == again
    assert first != other


def _one_update(model, tokenizer, prompts) -> None:
    """One AdamW step on the NLL of the prompts (a real optimizer update of every weight)."""
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    ids = torch.tensor([p[-16:] for p in prompts])
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    model.eval()


def test_after_an_actor_update_sync_makes_vllm_follow_the_new_weights(engine, hf_model, tokenizer, model_dir):
    prompts = _prompts(tokenizer, 8)
    before, _ = _greedy_pair(engine, hf_model, tokenizer, prompts)
    updated = load_causal_lm(model_dir, "float32")
    _one_update(updated, tokenizer, prompts)
    moved = engine.sync(updated)
    assert moved == sum(p.numel() * 4 for p in updated.parameters())
    got, want = _greedy_pair(engine, updated, tokenizer, prompts)
    assert got == want
    assert got != before, "the update changed no greedy response: the test cannot tell a sync from none"
    # every weight followed, not only enough of them to move the greedy tokens: the sampled
    # tokens' log-probs equal the updated model's as closely as before any update
    params = SamplingParams(n=4, temperature=0.8, top_p=1.0, top_k=0, max_new_tokens=MAX_NEW, micro_batch_size=32)
    batch = engine.generate(prompts, list(range(len(prompts))), params, seed=5)
    mask = batch.token_fields["response_mask"].bool()
    diff = (model_ops.compute_log_probs(updated.eval(), batch, tokenizer.pad_token_id, 16, 0.8)[mask]
            - batch.token_fields["rollout_log_probs"][mask]).abs()
    assert float(diff.max()) <= LOGP_ATOL, f"max |diff| {float(diff.max()):.2e}, mean {float(diff.mean()):.2e}"
    engine.sync(hf_model)  # back to the original weights for any later test
    assert _greedy_pair(engine, hf_model, tokenizer, prompts)[0] == before


def test_preflight_names_the_field_for_a_model_vllm_cannot_run_on_cpu(model_dir, tmp_path):
    from distflow.engines.vllm_rollout import engine_problems
    from distflow.spec import JobSpec

    spec = JobSpec.model_validate({"model": {"path": "smollm2"}, "data": {"train": {"path": "arithmetic"}},
                                   "rollout": {"engine": "vllm"}})
    assert engine_problems(spec, model_dir, "cpu") == []
    tiny = Path(resolve_model("tiny:smollm2", model_cache_dir()))
    problems = engine_problems(spec, str(tiny), "cpu")
    assert len(problems) == 1 and problems[0].startswith("model.path: vLLM's CPU attention"), problems
