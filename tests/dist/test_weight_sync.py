"""The trainer pool's weights reach a rollout replica exactly, and the replica samples from them.

Three gloo ranks, the tiny model: ranks 0 and 1 are a trainer pool (FSDP2
shards over the two), rank 2 a rollout replica filled only by
``WeightSync`` (small buckets, so the parameters span many broadcasts).
Twice: the trainers take an optimizer step and send version v; the replica
receives, generates with behaviour log-probs (``record_log_probs``), and the
trainers recompute the log-probs of the sampled tokens with their sharded
model. Asserted: the replica's parameters equal the trainer's full
parameters bit for bit at each version (and differ between versions, so the
check can fail), the versions arrive in order, and the sampled log-probs
match the trainer model's on every response token.
"""

from __future__ import annotations

import pytest
import torch

from _spawn import run_on_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

PROMPTS = [[5, 17, 33, 2], [9, 41], [12, 7, 88]]


def _params(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {name: (p.data.full_tensor() if isinstance(p.data, DTensor) else p.data).detach().clone()
            for name, p in model.named_parameters()}


def _sync_rounds(rank: int, world: int):
    import torch.distributed as dist

    from distflow import process_group
    from distflow.engines import fsdp, model_ops
    from distflow.engines.loading import load_sharded_causal_lm, rollout_replica
    from distflow.engines.rollout import HfRollout, SamplingParams
    from distflow.models import load_tokenizer, model_cache_dir, resolve_model
    from distflow.pools.weight_sync import WeightSync

    cpu = torch.device("cpu")
    torch.manual_seed(0)
    model_dir = resolve_model("tiny", model_cache_dir())
    mesh = fsdp.pool_mesh(cpu, 2)
    dist.new_group([2])  # the rollout pool's group: every rank creates every group, in order
    sync = WeightSync(dist.new_group([0, 2]), 0, torch.float32, bucket_bytes=256 << 10, device=cpu)
    params = SamplingParams(n=2, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=6, micro_batch_size=8,
                            record_log_probs=True)
    out = []
    if rank < 2:
        process_group.set_pool_group(mesh.get_group())
        model = load_sharded_causal_lm(model_dir, mesh, cpu, torch.float32, torch.float32)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        for version in (1, 2):
            ids = torch.randint(3, 200, (2, 8), generator=torch.Generator().manual_seed(version))
            model(input_ids=ids).logits.float().pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            sync.send(model, version)
            box = [None]
            dist.broadcast_object_list(box, src=2)
            batch = box[0]
            recomputed = model_ops.compute_log_probs(model, batch, 0, 8, params.temperature)
            out.append({"params": _params(model), "trainer_log_probs": recomputed,
                        "rollout_log_probs": batch.token_fields["rollout_log_probs"],
                        "response_mask": batch.token_fields["response_mask"]})
        process_group.set_pool_group(None)
    else:
        replica = rollout_replica(model_dir, cpu, torch.float32)
        rollout = HfRollout(fsdp.RolloutWeights(None, replica), load_tokenizer(model_dir), cpu)
        for _ in range(2):
            version = sync.receive(replica)
            batch = rollout.generate(PROMPTS, [0, 1, 2], params, seed=123)
            dist.broadcast_object_list([batch], src=2)
            out.append({"version": version, "params": _params(replica)})
    return out


def test_rollout_replica_holds_and_samples_from_each_synced_version():
    trainer, _, replica = run_on_ranks(_sync_rounds, 3)
    assert [r["version"] for r in replica] == [1, 2]
    for t, r in zip(trainer, replica):
        assert t["params"].keys() == r["params"].keys()
        for name in t["params"]:
            assert torch.equal(t["params"][name], r["params"][name]), name
        mask = t["response_mask"].bool()
        assert int(mask.sum()) > 0
        torch.testing.assert_close(t["rollout_log_probs"][mask], t["trainer_log_probs"][mask],
                                   atol=1e-5, rtol=1e-5)
        assert torch.all(t["rollout_log_probs"][~mask] == 0)
    changed = [n for n in trainer[0]["params"] if not torch.equal(trainer[0]["params"][n], trainer[1]["params"][n])]
    assert len(changed) > len(trainer[0]["params"]) // 2  # each sync carried new weights
