"""vLLM rollout + weight sync on CUDA, for the GPU check script (tests/bench/gpu_check.py calls ``measure``).

One engine (``distflow.engines.vllm_rollout.VllmRollout``, single process, sleep mode on) on
SmolLM2: wake + greedy and sampled generation (tokens/s), then a weight sync from an HF copy of
the model that took one optimizer step (seconds, bytes, and whether greedy output then equals HF
generation with those weights), and the sleep/wake costs. When vLLM cannot be imported (the
`vllm` extra is not installed on the box) it says so and returns without failing, so the rest of
the GPU check still runs.
"""

from __future__ import annotations

import time


def _prompts(tokenizer, num: int) -> list[list[int]]:
    from distflow.engines.rollout import render_prompts
    from distflow.tasks import ArithmeticSource, ArithmeticTask

    source = ArithmeticSource(num_records=num, seed=0, split="eval", task=ArithmeticTask(1, 20))
    return render_prompts(tokenizer, source.read(list(range(num))), 64,
                          "You are a calculator. Reply with the number only.")


def _generated_tokens(batch) -> int:
    return int(batch.sample_fields["response_len"].sum())


def measure(num_prompts: int = 64, n: int = 8, max_new_tokens: int = 128, dtype: str = "bfloat16") -> dict:
    """Rollout tokens/s and weight-sync seconds of the vLLM engine on the current CUDA device.

    Returns:
        {"vllm": "not installed: ..."} without vLLM; else vllm version, start_s, rollout_tokens_per_s
        (sampled, n per prompt), greedy_tokens_per_s, weight_sync_s, weight_sync_bytes,
        greedy_equals_hf_after_sync, sleep_s, wake_s.
    """
    try:
        import vllm
    except Exception as err:  # noqa: BLE001 - any import failure means: no vLLM on this box
        return {"vllm": f"not installed: {type(err).__name__}: {err}"}
    import torch

    from distflow.engines.rollout import SamplingParams
    from distflow.engines.vllm_rollout import VllmConfig, VllmRollout
    from distflow.models import load_tokenizer, resolve_model
    from distflow.models import model_cache_dir

    model_dir = str(resolve_model("smollm2", model_cache_dir()))
    tokenizer = load_tokenizer(model_dir)
    out: dict = {"vllm": vllm.__version__, "device": torch.cuda.get_device_name()}
    start = time.perf_counter()
    engine = VllmRollout.build(VllmConfig(model_dir=model_dir, dtype=dtype, tensor_parallel_size=1,
                                          max_model_len=64 + max_new_tokens, seed=0, device_type="cuda",
                                          gpu_memory_utilization=0.3), tokenizer)
    out["start_s"] = time.perf_counter() - start
    prompts = _prompts(tokenizer, num_prompts)
    groups = list(range(num_prompts))
    sampled = SamplingParams(n, 1.0, 1.0, 0, max_new_tokens, num_prompts * n)
    greedy = SamplingParams(1, 0.0, 1.0, 0, max_new_tokens, num_prompts)
    engine.generate(prompts[:4], groups[:4], greedy, seed=0)  # first call: allocations, kernels
    start = time.perf_counter()
    batch = engine.generate(prompts, groups, sampled, seed=1)
    out["rollout_tokens_per_s"] = _generated_tokens(batch) / (time.perf_counter() - start)
    start = time.perf_counter()
    batch = engine.generate(prompts, groups, greedy, seed=0)
    out["greedy_tokens_per_s"] = _generated_tokens(batch) / (time.perf_counter() - start)
    out.update(_sync_figures(engine, model_dir, tokenizer, prompts[:16], greedy, dtype))
    start = time.perf_counter()
    engine.wake_up()
    out["wake_s"] = time.perf_counter() - start
    start = time.perf_counter()
    engine.sleep()
    out["sleep_s"] = time.perf_counter() - start
    return out


def _sync_figures(engine, model_dir, tokenizer, prompts, greedy, dtype) -> dict:
    import torch

    from distflow.engines.rollout import generate
    from distflow.models import load_causal_lm

    model = load_causal_lm(model_dir, dtype).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    ids = torch.tensor([p[-16:] for p in prompts], device="cuda")
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    model.eval()
    torch.cuda.synchronize()
    start = time.perf_counter()
    moved = engine.sync(model)
    torch.cuda.synchronize()
    sync_s = time.perf_counter() - start
    got = engine.generate(prompts, list(range(len(prompts))), greedy, seed=0)
    want = generate(model, tokenizer, prompts, list(range(len(prompts))), greedy, 0, torch.device("cuda"))
    same = torch.equal(got.token_fields["input_ids"], want.token_fields["input_ids"])
    return {"weight_sync_s": sync_s, "weight_sync_bytes": moved, "greedy_equals_hf_after_sync": same}


if __name__ == "__main__":
    import json

    print(json.dumps(measure(), indent=2))
