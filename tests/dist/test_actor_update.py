"""The actor update moves probability toward positive advantages (FSDP2 on gloo); the rollout
generates with the unsharded actor as with a synced copy."""

from types import SimpleNamespace

import pytest
import torch

from _spawn import run_on_ranks

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]


def _update_once(rank, world, kl_coef):
    from distflow.data.batch import PackedBatch
    from distflow.engines import fsdp, model_ops
    from distflow.engines.actor import Actor
    from distflow.metrics import StepMetrics
    from distflow.models import load_causal_lm, resolve_model
    from distflow.spec import parse_spec
    from distflow.models import model_cache_dir

    spec = parse_spec({"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 2},
                       "actor": {"lr": 1e-2, "microBatchSize": 1},
                       "algorithm": {"useKlLoss": kl_coef > 0, "klLossCoef": kl_coef}})
    torch.manual_seed(0)
    model = fsdp.apply_fsdp(load_causal_lm(resolve_model("tiny", model_cache_dir())), fsdp.dp_mesh(torch.device("cpu"), world))
    actor = Actor.build(spec, model, pad_token_id=0, dp_size=world, device=torch.device("cpu"))
    # Two samples: prompt of 3 tokens + response of 2; advantages +1 and -1 on the response.
    ids = torch.tensor([5, 6, 7, 8, 9, 5, 6, 7, 10, 11])
    rmask = torch.tensor([0, 0, 0, 1, 1] * 2, dtype=torch.int8)
    adv = torch.tensor([0, 0, 0, 1.0, 1.0, 0, 0, 0, -1.0, -1.0])
    batch = PackedBatch(torch.tensor([5, 5]), {"input_ids": ids, "response_mask": rmask, "advantages": adv,
                                              "ref_log_probs": torch.zeros(10)},
                        {"response_len": torch.tensor([2, 2]), "prompt_len": torch.tensor([3, 3])})
    before = model_ops.compute_log_probs(model, batch, 0, 2, 1.0)
    actor.update(batch, StepMetrics())
    after = model_ops.compute_log_probs(model, batch, 0, 2, 1.0)
    return (after - before)[rmask.bool()].tolist()


def test_positive_advantage_gains_probability():
    delta = run_on_ranks(_update_once, 1, 0.0)[0]
    assert delta[0] > 0 and delta[1] > 0, delta  # sample with advantage +1
    assert delta[2] < 0 and delta[3] < 0, delta  # sample with advantage -1


def _shared_vs_copy(rank, world):
    """Update once, then generate with the unsharded actor and with a synced copy."""
    from torch.distributed.tensor import DTensor

    from distflow.engines import fsdp
    from distflow.engines.actor import Actor
    from distflow.engines.rollout import SamplingParams, generate
    from distflow.metrics import StepMetrics
    from distflow.models import load_causal_lm, resolve_model
    from distflow.spec import parse_spec
    from distflow.models import model_cache_dir

    spec = parse_spec({"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 2},
                       "actor": {"lr": 1e-2, "microBatchSize": 2}, "algorithm": {"useKlLoss": False}})
    torch.manual_seed(0)
    path = resolve_model("tiny", model_cache_dir())
    model = fsdp.apply_fsdp(load_causal_lm(path), fsdp.dp_mesh(torch.device("cpu"), world))
    copy = load_causal_lm(path).eval()
    shared, copied = fsdp.RolloutWeights(model), fsdp.RolloutWeights(model, copy)
    actor = Actor.build(spec, model, pad_token_id=0, dp_size=world, device=torch.device("cpu"))
    batch = _two_samples()
    actor.update(batch, StepMetrics())
    synced = copied.sync()
    params = SamplingParams(n=2, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=6, micro_batch_size=4)
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    out = {"synced_bytes": synced, "nbytes": fsdp.unsharded_nbytes(model)}
    metrics = StepMetrics()
    for name, weights in (("shared", shared), ("copy", copied)):
        with weights.policy(metrics if name == "shared" else None) as policy:
            gen = generate(policy, SimpleNamespace(pad_token_id=0, eos_token_id=2), prompts, [0, 1], params,
                           seed=3, device=torch.device("cpu"))
        out[name] = gen.token_fields["input_ids"].clone()
    out["sharded_after"] = all(isinstance(p.data, DTensor) for p in model.parameters())
    actor.update(batch, StepMetrics())  # training still works after the rollout
    out["metrics"] = metrics.reduce(torch.device("cpu"))
    return out


def _two_samples():
    from distflow.data.batch import PackedBatch

    ids = torch.tensor([5, 6, 7, 8, 9, 5, 6, 7, 10, 11])
    rmask = torch.tensor([0, 0, 0, 1, 1] * 2, dtype=torch.int8)
    adv = torch.tensor([0, 0, 0, 1.0, 1.0, 0, 0, 0, -1.0, -1.0])
    return PackedBatch(torch.tensor([5, 5]), {"input_ids": ids, "response_mask": rmask, "advantages": adv},
                       {"response_len": torch.tensor([2, 2]), "prompt_len": torch.tensor([3, 3])})


def test_rollout_on_the_unsharded_actor_matches_a_synced_copy():
    results = run_on_ranks(_shared_vs_copy, 2)
    for out in results:
        assert torch.equal(out["shared"], out["copy"])  # same tokens after an update
        assert out["sharded_after"]  # resharded on exit
        assert out["synced_bytes"] == out["nbytes"] > 0
        assert out["metrics"]["perf/weight_sync_bytes"] == 2 * out["nbytes"]  # summed over 2 ranks
        assert out["metrics"]["timing_s/weight_sync"] > 0


def _rollout_then_update(rank, world):
    """For each actor.reshardAfterForward: a rollout on the shared actor weights, then one
    update (both samples on each rank, a micro-batch each); the bytes each all-gathers, the
    tokens generated and the parameters after the step."""
    from torch.distributed.tensor import DTensor

    from _collectives import counted_all_gathers
    from distflow.engines import fsdp
    from distflow.engines.actor import Actor
    from distflow.engines.rollout import SamplingParams, generate
    from distflow.metrics import StepMetrics
    from distflow.models import load_causal_lm, resolve_model
    from distflow.process_group import collective_bytes
    from distflow.spec import parse_spec
    from distflow.models import model_cache_dir

    out = {}
    counter = collective_bytes()  # the runtime's own count, beside the test's
    for reshard in (True, False):
        spec = parse_spec({"model": {"path": "tiny"}, "data": {"train": {"path": "arithmetic"}, "trainBatchSize": 2},
                           "actor": {"lr": 1e-2, "microBatchSize": 1, "reshardAfterForward": reshard},
                           "algorithm": {"useKlLoss": False}})
        torch.manual_seed(0)
        model = fsdp.apply_fsdp(load_causal_lm(resolve_model("tiny", model_cache_dir())),
                                fsdp.dp_mesh(torch.device("cpu"), world), reshard_after_forward=reshard)
        weights = fsdp.RolloutWeights(model, keep_gathered=not reshard)
        actor = Actor.build(spec, model, pad_token_id=0, dp_size=world, device=torch.device("cpu"))
        params = SamplingParams(n=2, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=4, micro_batch_size=4)
        with counted_all_gathers() as rollout_calls:
            with weights.policy() as policy:
                gen = generate(policy, SimpleNamespace(pad_token_id=0, eos_token_id=2), [[5, 6, 7], [8, 9]],
                               [0, 1], params, seed=3, device=torch.device("cpu"))
        gathered, reduced = counter.all_gather, counter.reduce_scatter
        with counted_all_gathers() as update_calls:
            actor.update(_two_samples(), StepMetrics())
        out[reshard] = {"counted_gather": counter.all_gather - gathered,
                        "counted_reduce": counter.reduce_scatter - reduced,"tokens": gen.token_fields["input_ids"].clone(), "rollout_bytes": sum(rollout_calls),
                        "update_bytes": sum(update_calls), "full_bytes": fsdp.unsharded_nbytes(model),
                        "sharded_after": all(isinstance(p, DTensor) for p in model.parameters()),
                        "params": {n: p.to_local().clone() for n, p in model.named_parameters()}}
    return out


@pytest.mark.timeout(600)
def test_reshard_after_forward_false_gathers_once_per_step_with_identical_results():
    """ZeRO-2 layout (actor.reshardAfterForward: false): the rollout's all-gather serves the
    update; the step's parameters equal the default layout's bit for bit."""
    for out in run_on_ranks(_rollout_then_update, 2, timeout_s=500):
        base, kept = out[True], out[False]
        assert torch.equal(base["tokens"], kept["tokens"])
        assert base["params"].keys() == kept["params"].keys()
        for name, value in base["params"].items():
            assert torch.equal(value, kept["params"][name]), name
        assert kept["sharded_after"] and base["sharded_after"]
        full = kept["full_bytes"] // 2  # each rank sends its half of the full parameters
        assert base["rollout_bytes"] == kept["rollout_bytes"] == full
        assert kept["update_bytes"] == 0  # the rollout's gather is reused until the step
        # default: each micro-batch gathers the layers for its forward and again for its backward
        assert base["update_bytes"] > 1.9 * full, (base["update_bytes"], full)
        # the runtime's counter: full gathered outputs (the world's inputs); the full fp32 gradients
        # reduced once per micro-batch (each rank trains both samples: 2 micro-batches of 1)
        assert base["counted_gather"] == 2 * base["update_bytes"] and kept["counted_gather"] == 0
        assert base["counted_reduce"] == kept["counted_reduce"] == 2 * kept["full_bytes"]
