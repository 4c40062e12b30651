"""The vLLM engine in the asynchronous mode's rollout pool (SmolLM2, CPU build of vLLM, float32).

- Weight sync into an isolated engine: two gloo ranks, rank 0 a trainer pool of one (FSDP2),
  rank 1 a rollout worker whose vLLM engine core runs in its own process, outside the job's
  world. Twice: the trainer takes an AdamW step and sends version v over the job's collective
  (``WeightSync``, buckets of 16 MiB); the rollout rank forwards each bucket into the engine
  (``load_weight_buckets``) and samples. The engine's log-probs of the sampled tokens equal the
  trainer model's recomputed ones (max |diff| <= LOGP_ATOL), and are far from the initial
  weights' (so the check can fail), at versions 1 and 2.
- A short asynchronous GRPO run (the quickstart, 1 trainer + 1 rollout worker, maxStaleness 1,
  3 steps) with ``rollout.engine: vllm``: every step's prompts are trained once, each sample's
  policy version lags the trainer by exactly min(step - 1, 1), and the engine's behaviour
  log-probs reach the trainer's truncated-IS correction (on-policy step 1: close to the
  trainer's; the stale steps after: farther).
"""

import json
from collections import Counter

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed here: the vllm tier runs in .ci/setup-vllm's venv")

import torch  # noqa: E402
from distflow import sample_ids  # noqa: E402

from _quickstart import run_quickstart  # noqa: E402
from tests.dist._spawn import run_on_ranks  # noqa: E402
from test_vllm_rollout import LOGP_ATOL, SYSTEM  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]

NUM_PROMPTS = 8


def _prompts(tokenizer) -> list[list[int]]:
    from distflow.engines.rollout import render_prompts
    from distflow.tasks import ArithmeticSource, ArithmeticTask

    source = ArithmeticSource(num_records=NUM_PROMPTS, seed=0, split="eval", task=ArithmeticTask(1, 20))
    return render_prompts(tokenizer, source.read(list(range(NUM_PROMPTS))), 64, SYSTEM)


def _trainer(model_dir, mesh, sync, params, tokenizer) -> list[dict]:
    """Rank 0: two AdamW steps, each sent as the next version; log-probs of what the engine sampled."""
    from distflow import process_group
    import torch.distributed as dist

    from distflow.engines import model_ops
    from distflow.engines.loading import load_sharded_causal_lm
    from distflow.models import load_causal_lm

    process_group.set_pool_group(mesh.get_group())
    model = load_sharded_causal_lm(model_dir, mesh, torch.device("cpu"), torch.float32, torch.float32)
    initial = load_causal_lm(model_dir, "float32").eval()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    ids = torch.tensor([p[-16:] for p in _prompts(tokenizer)])
    out = []
    for version in (1, 2):
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
        model.eval()
        sent = sync.send(model, version)
        box = [None]
        dist.broadcast_object_list(box, src=1)
        batch, moved = box[0]
        pad = tokenizer.pad_token_id
        out.append({"sent": sent, "loaded": moved, "batch": batch,
                    "trainer": model_ops.compute_log_probs(model, batch, pad, 16, params.temperature),
                    "initial": model_ops.compute_log_probs(initial, batch, pad, 16, params.temperature)})
    process_group.set_pool_group(None)
    return out


def _rollout(model_dir, mesh, sync, params, tokenizer) -> list[dict]:
    """Rank 1: an isolated engine, fed by the weight sync; samples after each version."""
    import torch.distributed as dist

    from distflow.engines.loading import empty_causal_lm
    from distflow.engines.vllm_rollout import VllmConfig, VllmRollout

    config = VllmConfig(model_dir=model_dir, dtype="float32", tensor_parallel_size=1, max_model_len=256,
                        seed=0, device_type="cpu", cpu_kv_cache_bytes=256 << 20)
    engine = VllmRollout.build_isolated(config, tokenizer)
    replica = empty_causal_lm(model_dir, torch.float32)  # names and shapes only: the engine holds the weights
    out = []
    try:
        for round_ in range(2):
            loaded = []
            version = sync.receive(replica, lambda buckets: loaded.append(engine.load_weight_buckets(buckets)))
            batch = engine.generate(_prompts(tokenizer), list(range(NUM_PROMPTS)), params, seed=11 + round_)
            dist.broadcast_object_list([(batch, loaded[0])], src=1)
            out.append({"version": version, "meta": all(p.is_meta for p in replica.parameters())})
    finally:
        engine.close()
    return out


def _pool_sync_rounds(rank: int, world: int, model_dir: str):
    import torch.distributed as dist

    from distflow.engines import fsdp
    from distflow.engines.rollout import SamplingParams
    from distflow.models import load_tokenizer
    from distflow.pools.weight_sync import WeightSync

    torch.manual_seed(0)
    cpu = torch.device("cpu")
    mesh = fsdp.pool_mesh(cpu, 1)  # the trainer pool's; every rank creates every group, in the same order
    dist.new_group([1])  # the rollout pool's
    sync = WeightSync(dist.new_group([0, 1]), 0, torch.float32, bucket_bytes=16 << 20, device=cpu)
    params = SamplingParams(n=4, temperature=0.8, top_p=1.0, top_k=0, max_new_tokens=16, micro_batch_size=32)
    tokenizer = load_tokenizer(model_dir)
    return (_trainer if rank == 0 else _rollout)(model_dir, mesh, sync, params, tokenizer)


# long (~2.2 min of the default run's 35 on 2 AVX2 cores, 133 s of its vllm tier's 406): the colocated
# engine's syncs (test_vllm_rollout, test_vllm_grpo) and the weight sync's buckets on the hf engine
# (tests/dist/test_async_pools.py) stay in the default run.
@pytest.mark.long
def test_an_isolated_vllm_engine_samples_from_each_synced_version():
    from distflow.models import model_cache_dir, resolve_model

    model_dir = str(resolve_model("smollm2", model_cache_dir()))
    trainer, rollout = run_on_ranks(_pool_sync_rounds, 2, model_dir, timeout_s=1200, daemon=False)
    assert [r["version"] for r in rollout] == [1, 2]
    assert all(r["meta"] for r in rollout), "the rollout rank materialised a second copy of the model"
    for t in trainer:
        assert t["loaded"] == t["sent"] > 4 * 100e6  # every parameter (>= 100M, float32) reached the engine
        batch = t["batch"]
        assert batch.num_samples == 4 * NUM_PROMPTS
        mask = batch.token_fields["response_mask"].bool()
        rollout_lp = batch.token_fields["rollout_log_probs"]
        assert int(mask.sum()) > NUM_PROMPTS and torch.all(rollout_lp[~mask] == 0)
        diff = (t["trainer"][mask] - rollout_lp[mask]).abs()
        assert float(diff.max()) <= LOGP_ATOL, f"max |diff| {float(diff.max()):.2e}, mean {float(diff.mean()):.2e}"
        stale = (t["initial"][mask] - rollout_lp[mask]).abs()
        assert float(stale.max()) > 50 * LOGP_ATOL, "the update moved no log-prob: a missed sync would pass"


STEPS = 3


# long (~3 min): in the default run the isolated engine's syncs above, and tests/dist/test_async_pools.py
# (the staleness bound and every prompt trained once, with the hf engine), check what it combines.
@pytest.mark.long
def test_asynchronous_grpo_with_vllm_in_the_rollout_pool_trains_every_prompt_once(tmp_path):
    log_dir = tmp_path / "async"
    rows = run_quickstart(log_dir, [
        "rollout.engine=vllm", f"trainer.totalSteps={STEPS}", "data.eval=null",
        "model.mixedPrecision=none", "async.enable=true", "async.maxStaleness=1",
        "async.rolloutPool.numNodes=1"])
    steps = [r for r in rows if r.get("training/step", 0) >= 1]
    assert [r["training/step"] for r in steps] == [1, 2, 3]
    assert [r["async/staleness_max"] for r in steps] == [0.0, 1.0, 1.0]
    lines = [json.loads(line) for line in (log_dir / sample_ids.FILE).read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]
    # 4 prompts a step, each trained once: its 8 samples, in one step
    counts = Counter(i for line in lines for i in line["ids"])
    assert len(counts) == STEPS * 4 and set(counts.values()) == {8}, counts
    for line in lines:
        assert line["trainer_version"] == line["step"] - 1
        assert set(line["policy_versions"]) == {max(0, line["step"] - 2)}, line
    assert all(r["async/weight_sync_bytes"] > 4 * 100e6 for r in steps)
    # the engine's behaviour log-probs are what the correction reads: on-policy at step 1 (version 0
    # on both sides), one version stale after
    diffs = [r["rollout/actor_logp_diff/mean"] for r in steps]
    assert diffs[0] < 0.01 and all(d > diffs[0] for d in diffs[1:]), diffs
