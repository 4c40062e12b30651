"""The actor update on the check's device: loss on a fixed batch, token-budget micro-batches, MFU, all-gathers.

``update_check`` trains one random model (tests/bench/gpu_models.py) under
FSDP2 with distflow's ``Actor`` on one fixed batch, every response token's
advantage +1, so each update must raise the responses' log-probability:

1. gradients from the same weights (learning rate 0) with fixed micro-batches
   and with ``maxTokensPerMicroBatch``: the global grad norm must agree (the
   loss is normalised by global token counts, so the split must not matter);
2. ``NUM_UPDATES`` updates at the real learning rate: the responses' negative
   log-likelihood after each must be finite and falling; their median time
   gives tokens/s and the update's MFU (tests/bench/gpu_models.py).

``allgather_check`` runs one update on every rank and compares the weight
bytes the runtime counts (``distflow.process_group.collective_bytes``) with
FSDP2's schedule: per micro-batch every decoder layer is gathered for the
forward and again for the backward, the root's parameters once.
"""

from __future__ import annotations

import dataclasses
import time

import torch

from tests.bench import gpu_models

NUM_UPDATES = 3
GRAD_NORM_RTOL = {"cuda": 1e-2, "cpu": 1e-4}
"""Agreement of the grad norm over micro-batch splits: bf16 compute on CUDA, fp32 on CPU."""
ALLGATHER_RTOL = 0.05


@dataclasses.dataclass(frozen=True)
class BatchShape:
    num_samples: int
    prompt_len: int
    max_response_len: int
    micro_batch_size: int
    max_tokens_per_micro_batch: int


BATCHES = {"cuda": BatchShape(16, 256, 768, 4, 8192), "cpu": BatchShape(8, 8, 12, 3, 40)}


def fixed_batch(shape: BatchShape, vocab_size: int):
    """``num_samples`` random sequences: a prompt, then a response of 1/2 to 1 x ``max_response_len``
    tokens (so token budgets cut differently from fixed counts), advantage +1 on every response token."""
    from distflow.data.batch import PackedBatch

    gen = torch.Generator().manual_seed(0)
    n, p = shape.num_samples, shape.prompt_len
    response = [shape.max_response_len // 2 + (shape.max_response_len // 2) * i // max(1, n - 1) for i in range(n)]
    ids = torch.cat([torch.randint(3, vocab_size, (p + r,), generator=gen) for r in response])
    mask = torch.cat([torch.tensor([0] * p + [1] * r, dtype=torch.int8) for r in response])
    return PackedBatch(torch.tensor([p + r for r in response]),
                       {"input_ids": ids, "response_mask": mask, "advantages": mask.float()},
                       {"response_len": torch.tensor(response), "prompt_len": torch.full((n,), p)})


def actor_spec(shape: BatchShape, device: torch.device, token_budget: bool, lr: float = 1e-4):
    from distflow.spec import parse_spec

    actor = {"lr": lr, "microBatchSize": shape.micro_batch_size}
    if token_budget:
        actor["maxTokensPerMicroBatch"] = shape.max_tokens_per_micro_batch
    return parse_spec({"model": {"path": "tiny", "mixedPrecision": "bfloat16" if device.type == "cuda" else "none"},
                       "data": {"train": {"path": "arithmetic"}, "trainBatchSize": shape.num_samples,
                                "maxPromptLength": shape.prompt_len, "maxResponseLength": shape.max_response_len},
                       "actor": actor, "algorithm": {"useKlLoss": False}})


def _sharded_actor(size: str, device: torch.device, world: int, shape: BatchShape):
    from distflow.engines import fsdp
    from distflow.engines.actor import Actor

    model, tokenizer = gpu_models.build_model(gpu_models.QWEN2_SHAPES[size], device)
    sizes = {"parameters": sum(p.numel() for p in model.parameters()),
             "layer_parameters": sum(p.numel() for p in model.model.layers.parameters())}
    compute = torch.bfloat16 if device.type == "cuda" else None
    model = fsdp.apply_fsdp(model, fsdp.dp_mesh(device, world), compute_dtype=compute)
    actor = Actor.build(actor_spec(shape, device, token_budget=False), model, tokenizer.pad_token_id, world, device)
    return actor, tokenizer, sizes


def _timed_update(actor, batch, device: torch.device) -> tuple[float, dict]:
    from distflow.metrics import StepMetrics

    metrics = StepMetrics()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    actor.update(batch, metrics)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, metrics.reduce(device)


def _response_nll(actor, batch) -> float:
    from distflow.engines import model_ops

    with torch.no_grad():
        log_probs = model_ops.compute_log_probs(actor.model, batch, actor.pad_token_id,
                                                actor.spec.actor.micro_batch_size, 1.0)
    mask = batch.token_fields["response_mask"].bool()
    return float(-log_probs.cpu()[mask].mean())


def update_check(device: torch.device, size: str, device_name: str) -> dict:
    """One process, world size 1: the checks and figures of the module docstring for model ``size``."""
    from distflow.engines import model_ops

    shape = BATCHES[device.type]
    actor, tokenizer, sizes = _sharded_actor(size, device, 1, shape)
    batch = fixed_batch(shape, len(tokenizer))
    budget = dataclasses.replace(actor, spec=actor_spec(shape, device, token_budget=True))
    for group in actor.optimizer.param_groups:
        group["lr"] = 0.0  # gradients from the same weights for both splits
    grad_norms = {name: _timed_update(a, batch, device)[1]["actor/grad_norm"]
                  for name, a in (("fixed", actor), ("token_budget", budget))}
    for group in actor.optimizer.param_groups:
        group["lr"] = budget.spec.actor.lr
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    nll, seconds = [_response_nll(budget, batch)], []
    for _ in range(NUM_UPDATES):
        seconds.append(_timed_update(budget, batch, device)[0])
        nll.append(_response_nll(budget, batch))
    update_s = sorted(seconds)[len(seconds) // 2]
    chunks = {name: len(model_ops.split_micro_batches(batch, shape.micro_batch_size, tokens))
              for name, tokens in (("fixed", None), ("token_budget", shape.max_tokens_per_micro_batch))}
    rel = abs(grad_norms["fixed"] - grad_norms["token_budget"]) / max(abs(grad_norms["fixed"]), 1e-12)
    falling = all(b < a for a, b in zip(nll, nll[1:]))
    finite = bool(torch.isfinite(torch.tensor(nll + list(grad_norms.values()))).all())
    checks = {"loss_finite_and_falling": bool(finite and falling),
              "token_budget_grad_norm_agrees": rel <= GRAD_NORM_RTOL[device.type],
              "token_budget_changes_the_split": chunks["fixed"] != chunks["token_budget"]}
    mfu = gpu_models.update_mfu(sizes["parameters"], batch.num_tokens, update_s,
                                gpu_models.peak_bf16_flops(device_name))
    return {"status": "pass" if all(checks.values()) else "fail", "checks": checks, "size": size, **sizes,
            "tokens_per_update": batch.num_tokens, "micro_batches": chunks, "grad_norms": grad_norms,
            "grad_norm_rel_diff": rel, "grad_norm_rtol": GRAD_NORM_RTOL[device.type], "response_nll": nll,
            "update_seconds": seconds, "tokens_per_s": batch.num_tokens / update_s, "mfu": mfu,
            "peak_device_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None}


def allgather_worker(rank: int, world: int, device: torch.device) -> dict:
    """One update on this rank's half of the fixed batch; counted and expected all-gather bytes."""
    from distflow.engines import model_ops
    from distflow.process_group import collective_bytes

    counter = collective_bytes()
    shape = BATCHES[device.type]
    actor, tokenizer, sizes = _sharded_actor("tiny", device, world, shape)
    full = fixed_batch(shape, len(tokenizer))
    batch = full.select(range(rank, full.num_samples, world))
    before = counter.all_gather
    _timed_update(actor, batch, device)
    itemsize = 2 if device.type == "cuda" else 4
    num_micro = len(model_ops.split_micro_batches(batch, shape.micro_batch_size))
    root = sizes["parameters"] - sizes["layer_parameters"]
    expected = num_micro * (2 * sizes["layer_parameters"] + root) * itemsize
    return {"counted_bytes": counter.all_gather - before, "expected_bytes": expected, "micro_batches": num_micro}


def _allgather_rank(rank: int, world: int, port: int, device_type: str, out_dir: str) -> None:
    import json
    from pathlib import Path

    import torch.distributed as dist

    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=rank, world_size=world)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(allgather_worker(rank, world, device)))
    dist.destroy_process_group()


def allgather_check(device: torch.device, world: int) -> dict:
    """``allgather_worker`` on ``world`` ranks (one per GPU; 2 gloo ranks on CPU): counted bytes
    within ``ALLGATHER_RTOL`` of expected on every rank; not run below 2 ranks."""
    import json
    import tempfile
    from pathlib import Path

    import torch.multiprocessing as mp

    from tests.dist._spawn import free_port

    if world < 2:
        return {"status": "not-run", "why": f"needs >= 2 GPUs ({world} visible): FSDP2 all-gathers nothing "
                                            "at world size 1"}
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_allgather_rank, args=(world, free_port(), device.type, tmp), nprocs=world, join=True)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
    rel = max(abs(r["counted_bytes"] - r["expected_bytes"]) / r["expected_bytes"] for r in ranks)
    return {"status": "pass" if rel <= ALLGATHER_RTOL else "fail", "world_size": world, "ranks": ranks,
            "max_rel_diff": rel, "rtol": ALLGATHER_RTOL}
